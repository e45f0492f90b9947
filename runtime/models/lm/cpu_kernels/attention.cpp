// Attention over a KV cache for x86 CPUs, one query token at a time in one call: `runtime_kernels::attend`.
//
// Why: a verified draft must get exactly the logits plain decoding gets, so each of its tokens must attend as a
// one-token decode step would. torch's SDPA rounds with the shape of its call (the other queries, the masked
// keys), so the engine called it once per token (attention.py, `attention_by_token`): 28 calls a token on the
// 1.5B, about 32 us each whatever their size, most of the cost a verification adds over a plain step on two cores.
// Here every (token, K/V head) pair is computed alone, from the keys its own mask row lets it see, in slot order,
// so a token's output depends on nothing but its own query and the keys it sees: the same in a one-token step, a
// verification of many tokens, or a prefill chunk, in one call for all of them.
//
// Arithmetic, per token i and query head h (K/V head h / group): the seen slots s_1 < s_2 < ... < s_L (all of
// [0, S) without a mask); score_j = scale * dot(q, k_{s_j}) in float32 (8 lanes over d, then a fixed pairwise
// sum); p_j = exp(score_j - max) (a polynomial, the same in every lane); out = sum_j p_j v_{s_j} / sum_j p_j,
// summed in j order. Inputs float32 or bfloat16 (the cache's dtype), output in q's dtype.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define RA_X86 1
#define RA_AVX2 __attribute__((target("avx2,fma")))
#else
#define RA_X86 0
#endif

namespace ra {

constexpr int64_t kMaxGroup = 16;  // query heads per K/V head
constexpr int64_t kMaxDim = 256;   // head size

// A row of d values as float32.
template <typename T>
static inline void row_to_float(const T* src, float* dst, int64_t d) {
  for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]);
}

// exp(x) for x <= 0 (scores less their maximum), Cephes' single-precision polynomial, written so that the
// vector and the scalar form round alike; exactly 0 below -87 (where the result would be subnormal).
static inline float exp_scalar(float x) {
  if (x < -87.0f) return 0.0f;
  const float fx = std::nearbyint(x * 1.44269504088896341f);
  float r = std::fma(fx, -0.693359375f, x);
  r = std::fma(fx, 2.12194440e-4f, r);
  float y = 1.9875691500e-4f;
  y = std::fma(y, r, 1.3981999507e-3f);
  y = std::fma(y, r, 8.3334519073e-3f);
  y = std::fma(y, r, 4.1665795894e-2f);
  y = std::fma(y, r, 1.6666665459e-1f);
  y = std::fma(y, r, 5.0000001201e-1f);
  y = std::fma(y, r * r, r + 1.0f);
  int32_t bits = (static_cast<int32_t>(fx) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

// The per-(token, K/V head) work: `group` query rows (float32, d each) over the `count` key slots `slots`.
struct Job {
  const float* q;   // [group][d]
  int64_t group, d;
  const uint8_t* k; // slot s's key at k + s * k_stride bytes
  const uint8_t* v;
  int64_t k_stride, v_stride;
  bool bf16;        // the cache's dtype: bfloat16 (else float32)
  const int32_t* slots;
  int64_t count;
  float scale;
  float* out;       // [group][d]
};

static void attend_scalar(const Job& job, std::vector<float>& scores) {
  const int64_t G = job.group, d = job.d, L = job.count;
  scores.resize(G * L);
  float row[kMaxDim];
  for (int64_t j = 0; j < L; ++j) {
    const uint8_t* k = job.k + job.slots[j] * job.k_stride;
    if (job.bf16) row_to_float(reinterpret_cast<const c10::BFloat16*>(k), row, d);
    else std::memcpy(row, k, d * sizeof(float));
    for (int64_t h = 0; h < G; ++h) {
      float acc = 0.0f;
      for (int64_t i = 0; i < d; ++i) acc = std::fma(job.q[h * d + i], row[i], acc);
      scores[h * L + j] = acc * job.scale;
    }
  }
  std::vector<float> sums(G);
  for (int64_t h = 0; h < G; ++h) {
    float* s = scores.data() + h * L;
    const float top = *std::max_element(s, s + L);
    float total = 0.0f;
    for (int64_t j = 0; j < L; ++j) total += (s[j] = exp_scalar(s[j] - top));
    sums[h] = total;
  }
  std::fill(job.out, job.out + G * d, 0.0f);
  for (int64_t j = 0; j < L; ++j) {
    const uint8_t* v = job.v + job.slots[j] * job.v_stride;
    if (job.bf16) row_to_float(reinterpret_cast<const c10::BFloat16*>(v), row, d);
    else std::memcpy(row, v, d * sizeof(float));
    for (int64_t h = 0; h < G; ++h) {
      const float p = scores[h * L + j];
      for (int64_t i = 0; i < d; ++i) job.out[h * d + i] = std::fma(p, row[i], job.out[h * d + i]);
    }
  }
  for (int64_t h = 0; h < G; ++h)
    for (int64_t i = 0; i < d; ++i) job.out[h * d + i] /= sums[h];
}

#if RA_X86
RA_AVX2 static inline __m256 load8(const uint8_t* p, bool bf16) {
  if (!bf16) return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// The lanes' sum in a fixed order: (0+4, 1+5, 2+6, 3+7), then pairs.
RA_AVX2 static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

RA_AVX2 static inline __m256 exp8(__m256 x) {
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(fx, _mm256_set1_ps(-0.693359375f), x);
  r = _mm256_fmadd_ps(fx, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // fx may be far below -127 for x below -87 (zeroed next), so clamp before building the power of two
  const __m256i e = _mm256_cvtps_epi32(_mm256_max_ps(fx, _mm256_set1_ps(-126.0f)));
  const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
  return _mm256_and_ps(_mm256_mul_ps(y, scale), keep);
}

// G query heads per K/V head, a compile-time count so that their accumulators stay in registers: scores key by
// key (each key's chunk loaded once for all G heads), then the weighted values chunk by chunk (CB chunks of 8 at a
// time for all G heads, over every key).
template <int G>
RA_AVX2 static void attend_avx2(const Job& job, std::vector<float>& scores) {
  constexpr int CB = G <= 6 ? 2 : 1;
  const int64_t d = job.d, L = job.count, C = d / 8, width = job.bf16 ? 16 : 32;  // width: bytes of 8 values
  const int64_t padded = (L + 7) / 8 * 8;
  scores.resize(G * padded);
  float* sc = scores.data();
  for (int64_t j = 0; j < L; ++j) {
    const uint8_t* k = job.k + job.slots[j] * job.k_stride;
    __m256 acc[G];
    for (int h = 0; h < G; ++h) acc[h] = _mm256_setzero_ps();
    for (int64_t c = 0; c < C; ++c) {
      const __m256 kc = load8(k + c * width, job.bf16);
      for (int h = 0; h < G; ++h) acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(job.q + h * d + 8 * c), kc, acc[h]);
    }
    for (int h = 0; h < G; ++h) sc[h * padded + j] = hsum(acc[h]) * job.scale;
  }
  __m256 inv[G];
  for (int h = 0; h < G; ++h) {
    float* s = sc + h * padded;
    const float top = *std::max_element(s, s + L);
    std::fill(s + L, s + padded, -1e30f);  // exp gives 0 there
    __m256 total = _mm256_setzero_ps();
    for (int64_t j = 0; j < padded; j += 8) {
      const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(top)));
      _mm256_storeu_ps(s + j, p);
      total = _mm256_add_ps(total, p);
    }
    inv[h] = _mm256_set1_ps(hsum(total));
  }
  for (int64_t c = 0; c < C; c += CB) {
    __m256 o[G][CB];
    for (int h = 0; h < G; ++h)
      for (int b = 0; b < CB; ++b) o[h][b] = _mm256_setzero_ps();
    for (int64_t j = 0; j < L; ++j) {
      const uint8_t* v = job.v + job.slots[j] * job.v_stride + c * width;
      __m256 vc[CB];
      for (int b = 0; b < CB; ++b) vc[b] = load8(v + b * width, job.bf16);
      for (int h = 0; h < G; ++h) {
        const __m256 p = _mm256_broadcast_ss(sc + h * padded + j);
        for (int b = 0; b < CB; ++b) o[h][b] = _mm256_fmadd_ps(p, vc[b], o[h][b]);
      }
    }
    for (int h = 0; h < G; ++h)
      for (int b = 0; b < CB; ++b) _mm256_storeu_ps(job.out + h * d + 8 * (c + b), _mm256_div_ps(o[h][b], inv[h]));
  }
}

using AvxFn = void (*)(const Job&, std::vector<float>&);
static const AvxFn kAvx2ByGroup[] = {nullptr, attend_avx2<1>, attend_avx2<2>, attend_avx2<3>, attend_avx2<4>,
                                     attend_avx2<5>, attend_avx2<6>, attend_avx2<7>, attend_avx2<8>};

static bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}
#endif

// q [n, H, d]; k, v [KV, S, d] (a layer's cache, each row contiguous); mask: bool [n, S] (True: token i sees slot
// s), none: every token sees all of [0, S). Out [n, H, d] contiguous, in q's dtype.
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask,
                  double scale) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "attend: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "attend: q [n, H, d], k and v [KV, S, d]");
  const int64_t n = q.size(0), H = q.size(1), d = q.size(2), KV = k.size(0), S = k.size(1);
  TORCH_CHECK(v.size(0) == KV && v.size(1) == S && k.size(2) == d && v.size(2) == d, "attend: k ", k.sizes(),
              " and v ", v.sizes(), " do not match q ", q.sizes());
  TORCH_CHECK(KV > 0 && H % KV == 0 && H / KV <= kMaxGroup && d <= kMaxDim, "attend: ", H, " query heads over ", KV,
              " K/V heads of size ", d, " are not supported");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() &&
                  (k.scalar_type() == at::kBFloat16 || k.scalar_type() == at::kFloat),
              "attend: the cache must be float32 or bfloat16");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "attend: each cache row must be contiguous");
  const at::Tensor qf = q.to(at::kFloat).contiguous();
  at::Tensor m;
  if (mask.has_value()) {
    m = mask->to(at::kBool).contiguous();
    TORCH_CHECK(m.dim() == 2 && m.size(0) == n && m.size(1) == S, "attend: mask must be [", n, ", ", S, "], got ",
                m.sizes());
  }
  const int64_t G = H / KV, elem = k.element_size();
  const bool bf16 = k.scalar_type() == at::kBFloat16;
  at::Tensor out = at::empty({n, H, d}, q.options().dtype(at::kFloat));
  const float* qp = qf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool* mp = m.defined() ? m.data_ptr<bool>() : nullptr;
  const auto* kp = static_cast<const uint8_t*>(k.data_ptr());
  const auto* vp = static_cast<const uint8_t*>(v.data_ptr());
#if RA_X86
  // d a multiple of 16: the value loop takes chunks of 8 two at a time
  const bool vector = has_avx2() && d % 16 == 0 && H / KV <= 8;
#else
  const bool vector = false;
#endif
  at::parallel_for(0, n * KV, 1, [&](int64_t w0, int64_t w1) {
    std::vector<int32_t> slots;
    std::vector<float> scores;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t i = w / KV, g = w % KV;
      slots.clear();
      for (int64_t s = 0; s < S; ++s)
        if (mp == nullptr || mp[i * S + s]) slots.push_back(static_cast<int32_t>(s));
      if (slots.empty()) {  // a token that sees nothing attends to nothing: zeros, as no key adds anything
        std::fill(op + (i * H + g * G) * d, op + (i * H + g * G + G) * d, 0.0f);
        continue;
      }
      const Job job{qp + (i * H + g * G) * d, G, d, kp + g * k.stride(0) * elem, vp + g * v.stride(0) * elem,
                    k.stride(1) * elem, v.stride(1) * elem, bf16, slots.data(),
                    static_cast<int64_t>(slots.size()), static_cast<float>(scale), op + (i * H + g * G) * d};
#if RA_X86
      if (vector) {
        kAvx2ByGroup[G](job, scores);
        continue;
      }
#endif
      attend_scalar(job, scores);
    }
  });
  return q.scalar_type() == at::kFloat ? out : out.to(q.scalar_type());
}

}  // namespace ra

TORCH_LIBRARY_FRAGMENT(runtime_kernels, m) {
  m.def("attend(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(runtime_kernels, CPU, m) { m.impl("attend", &ra::attend); }
