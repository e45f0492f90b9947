// Weight-only quantised linear layers for x86 CPUs: 4-bit (q4) and 8-bit (q8) weights in groups of 32 inputs,
// activations quantised to int8 per row and group, integer dot products per group, float32 accumulation.
//
// Why: torch's int4/int8 CPU kernels dequantise the weights to float and multiply in float, which costs more
// instructions per byte than memory delivers (about 8.6 GB/s read at one thread, where a plain sum reads 15), and
// on AVX2-only CPUs about half of llama.cpp's speed. Integer dot products on int8 activations (llama.cpp's method)
// cost a few instructions per 32 weights, so a decode step stays bound by reading the weights.
//
// Layout (built by packing.py): output rows in tiles of 16, each tile a run of K/32 blocks, one per group of 32
// inputs. The lanes of a vector are the 16 rows of a tile, so a group's dot product for every row comes out of
// a few integer multiply-adds with one broadcast activation word each, and no horizontal sums:
//   q4 block (320 bytes): 4 chunks of 64 bytes; chunk c holds, for row r, bytes 4c..4c+3 of that row's GGUF
//     Q4_0/Q4_1 nibbles at bytes 4r..4r+3 (low nibble = input i, high nibble = input i + 16, i = 4c + b);
//     then 16 fp16 scales d, then 16 fp16 offsets m: w = q * d + m, q in 0..15.
//   q8 block (544 bytes): 8 chunks of 64 bytes; chunk j holds row r's int8 inputs 4j..4j+3 at bytes 4r..4r+3;
//     then 16 fp16 scales d: w = q * d.
//
// Arithmetic, the same in every path (scalar, AVX2, AVX-512 VNNI), so that the paths agree bitwise: per row of x
// and group of 32, amax = max |x|, dx = amax / 127, qx = round-half-even(x * (1 / dx)) clamped to [-127, 127] (0 when
// amax is 0), sx = dx * sum(qx). Per output element, in order over the groups:
//   q4: acc = fma(float(sum q * qx), d * dx, acc); acc = fma(m, sx, acc)
//   q8: acc = fma(float(sum q * qx), d * dx, acc)
// The integer sums are exact in every path, so each output element's value depends on nothing but its own row of
// x and of the weights: not on how many rows are batched, nor on the thread count (each element is computed by one
// thread), nor on the instruction set.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define RK_X86 1
#define RK_AVX2 __attribute__((target("avx2,fma,f16c")))
#define RK_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#else
#define RK_X86 0
#endif

namespace rk {

constexpr int64_t kGroup = 32;
constexpr int64_t kTile = 16;
constexpr int64_t kQ4Block = 320;
constexpr int64_t kQ8Block = 544;

enum Isa : int64_t { kScalar = 0, kAvx2 = 1, kAvx512Vnni = 2 };

// ---------------------------------------------------------------------------------------------------------------
// CPU features and the chosen path

#if RK_X86
static uint64_t xcr0() {
  uint32_t eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}
#endif

// The best path this CPU (and its OS, which must save the wider registers) runs.
static int64_t best_isa() {
#if RK_X86
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return kScalar;
  const bool fma = c & (1u << 12), osxsave = c & (1u << 27), avx = c & (1u << 28), f16c = c & (1u << 29);
  if (!(osxsave && avx && fma && f16c)) return kScalar;
  const uint64_t xcr = xcr0();
  if ((xcr & 0x6) != 0x6) return kScalar;
  unsigned a7 = 0, b7 = 0, c7 = 0, d7 = 0;
  if (!__get_cpuid_count(7, 0, &a7, &b7, &c7, &d7)) return kScalar;
  const bool avx2 = b7 & (1u << 5);
  if (!avx2) return kScalar;
  const bool avx512 = (b7 & (1u << 16)) && (b7 & (1u << 30)) && (b7 & (1u << 31)) && (c7 & (1u << 11));
  if (avx512 && (xcr & 0xE6) == 0xE6) return kAvx512Vnni;
  return kAvx2;
#else
  return kScalar;
#endif
}

static std::atomic<int64_t> g_isa{-1};

static int64_t current_isa() {
  int64_t isa = g_isa.load(std::memory_order_relaxed);
  if (isa < 0) {
    isa = best_isa();
    g_isa.store(isa, std::memory_order_relaxed);
  }
  return isa;
}

// ---------------------------------------------------------------------------------------------------------------
// Activations quantised per row and group

// A block of up to MR rows of x, quantised and interleaved by group, so that a kernel finds row i's group g at a
// fixed offset from the group's start: q [G][rows][32], d, s and sum [G][rows]. d = dx, s = dx * sum(qx).
struct Rows {
  const int8_t* q;
  const float* d;
  const float* s;
  const int32_t* sum;
  int64_t G;
};

static inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

static void quantize_group_scalar(const float* x, int8_t* q, float* d, float* s, int32_t* sum) {
  float amax = 0.0f;
  for (int i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float dg = amax / 127.0f;
  const float id = dg != 0.0f ? 1.0f / dg : 0.0f;
  int32_t total = 0;
  for (int i = 0; i < kGroup; ++i) {
    float v = std::nearbyint(x[i] * id);
    v = std::min(std::max(v, -127.0f), 127.0f);
    q[i] = static_cast<int8_t>(v);
    total += q[i];
  }
  *d = dg;
  *sum = total;
  *s = dg * static_cast<float>(total);
}

#if RK_X86
RK_AVX2 static void quantize_group_avx2(const float* x, int8_t* q, float* d, float* s, int32_t* sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i);
  __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                           _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float amax = _mm_cvtss_f32(h);
  const float dg = amax / 127.0f;
  const float id = dg != 0.0f ? 1.0f / dg : 0.0f;
  const __m256 vid = _mm256_set1_ps(id), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  __m256i n[4];
  for (int i = 0; i < 4; ++i) {
    __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    n[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
  }
  // packs interleave the 128-bit lanes: dwords come out as inputs 0-3, 8-11, 16-19, 24-27, 4-7, ...
  __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
  p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), p);
  __m256i t = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
  __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
  u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4E));
  u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0xB1));
  const int32_t total = _mm_cvtsi128_si32(u);
  *d = dg;
  *sum = total;
  *s = dg * static_cast<float>(total);
}

RK_AVX2 static void bf16_to_float_avx2(const c10::BFloat16* x, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i));
    _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
  }
  for (; i < n; ++i) out[i] = static_cast<float>(x[i]);
}
#endif

// Quantise rows [m0, m1) of x [M, K] (float32 or bfloat16) into blocks of `mr` rows (`Rows`): the block of row m
// starts at row (m / mr) * mr, and a last block holds what remains.
static void quantize_rows(const at::Tensor& x, int64_t m0, int64_t m1, int64_t mr, int8_t* q, float* d, float* s,
                          int32_t* sum, int64_t isa) {
  const int64_t M = x.size(0), K = x.size(1), G = K / kGroup;
  std::vector<float> row(x.scalar_type() == at::kFloat ? 0 : K);
  for (int64_t m = m0; m < m1; ++m) {
    const float* xf;
    if (x.scalar_type() == at::kFloat) {
      xf = x.data_ptr<float>() + m * K;
    } else {
      const c10::BFloat16* xb = x.data_ptr<c10::BFloat16>() + m * K;
#if RK_X86
      if (isa != kScalar) {
        bf16_to_float_avx2(xb, row.data(), K);
      } else
#endif
      {
        for (int64_t k = 0; k < K; ++k) row[k] = static_cast<float>(xb[k]);
      }
      xf = row.data();
    }
    const int64_t start = m / mr * mr, rows = std::min(mr, M - start), i = m - start;
    for (int64_t g = 0; g < G; ++g) {
      int8_t* qg = q + start * K + (g * rows + i) * kGroup;
      const int64_t at = start * G + g * rows + i;
#if RK_X86
      if (isa != kScalar) {
        quantize_group_avx2(xf + g * kGroup, qg, d + at, s + at, sum + at);
        continue;
      }
#endif
      quantize_group_scalar(xf + g * kGroup, qg, d + at, s + at, sum + at);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Kernels: one tile of 16 output rows against a block of MR rows of x; out [MR][16] float32.

template <int MR>
static void q4_tile_scalar(const uint8_t* tile, const Rows& a, float* out) {
  for (int r = 0; r < kTile; ++r) {
    for (int i = 0; i < MR; ++i) {
      float acc = 0.0f;
      for (int64_t g = 0; g < a.G; ++g) {
        const uint8_t* b = tile + g * kQ4Block;
        const int8_t* xq = a.q + (g * MR + i) * kGroup;
        int32_t dot = 0;
        for (int c = 0; c < 4; ++c) {
          for (int j = 0; j < 4; ++j) {
            const uint8_t byte = b[64 * c + 4 * r + j];
            dot += (byte & 0xF) * xq[4 * c + j] + (byte >> 4) * xq[16 + 4 * c + j];
          }
        }
        uint16_t dh, mh;
        std::memcpy(&dh, b + 256 + 2 * r, 2);
        std::memcpy(&mh, b + 288 + 2 * r, 2);
        const float dw = c10::detail::fp16_ieee_to_fp32_value(dh);
        const float mw = c10::detail::fp16_ieee_to_fp32_value(mh);
        acc = std::fma(static_cast<float>(dot), dw * a.d[g * MR + i], acc);
        acc = std::fma(mw, a.s[g * MR + i], acc);
      }
      out[i * kTile + r] = acc;
    }
  }
}

template <int MR>
static void q8_tile_scalar(const uint8_t* tile, const Rows& a, float* out) {
  for (int r = 0; r < kTile; ++r) {
    for (int i = 0; i < MR; ++i) {
      float acc = 0.0f;
      for (int64_t g = 0; g < a.G; ++g) {
        const uint8_t* b = tile + g * kQ8Block;
        const int8_t* xq = a.q + (g * MR + i) * kGroup;
        int32_t dot = 0;
        for (int j = 0; j < 8; ++j) {
          for (int e = 0; e < 4; ++e) dot += static_cast<int8_t>(b[64 * j + 4 * r + e]) * xq[4 * j + e];
        }
        uint16_t dh;
        std::memcpy(&dh, b + 512 + 2 * r, 2);
        const float dw = c10::detail::fp16_ieee_to_fp32_value(dh);
        acc = std::fma(static_cast<float>(dot), dw * a.d[g * MR + i], acc);
      }
      out[i * kTile + r] = acc;
    }
  }
}

#if RK_X86
// The weights stream from memory once a token; asking for the blocks a few ahead (about 1.2 KB) kept more reads in
// flight than the hardware's prefetcher alone: the 1.5B's head read 10-11 GB/s at one thread against 8 without.
template <int64_t Bytes>
RK_AVX2 static inline void prefetch(const uint8_t* p) {
  for (int64_t o = 0; o < Bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T0);
}

// AVX2: 8 rows a vector, so a tile is two halves, both taken from a block while it is in cache. maddubs multiplies
// the unsigned nibbles by the signed activations into pairs of int16 (at most 2 * 15 * 127), and the 8 products of
// a group add up in int16 (at most 30,480) before one madd widens them to a row's int32 sum.
template <int MR>
RK_AVX2 static void q4_tile_avx2(const uint8_t* tile, const Rows& a, float* out) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[2][MR];
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < MR; ++i) acc[h][i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g) {
    const uint8_t* b = tile + g * kQ4Block;
    prefetch<kQ4Block>(b + 4 * kQ4Block);
    for (int h = 0; h < 2; ++h) {
      __m256i w[8];  // the half's 8 rows unpacked once, for every row of x: w[j] holds inputs 4j..4j+3
      for (int c = 0; c < 4; ++c) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * c + 32 * h));
        w[c] = _mm256_and_si256(v, low4);
        w[c + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      }
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 256 + 16 * h)));
      const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 288 + 16 * h)));
      for (int i = 0; i < MR; ++i) {
        const int8_t* xq = a.q + (g * MR + i) * kGroup;
        __m256i s0 = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(load_i32(xq)));
        __m256i s1 = _mm256_maddubs_epi16(w[1], _mm256_set1_epi32(load_i32(xq + 4)));
        for (int j = 2; j < 8; j += 2) {
          s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(w[j], _mm256_set1_epi32(load_i32(xq + 4 * j))));
          s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(w[j + 1], _mm256_set1_epi32(load_i32(xq + 4 * j + 4))));
        }
        const int64_t at = g * MR + i;
        const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_add_epi16(s0, s1), ones));
        acc[h][i] = _mm256_fmadd_ps(p, _mm256_mul_ps(dv, _mm256_set1_ps(a.d[at])), acc[h][i]);
        acc[h][i] = _mm256_fmadd_ps(mv, _mm256_set1_ps(a.s[at]), acc[h][i]);
      }
    }
  }
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < MR; ++i) _mm256_storeu_ps(out + i * kTile + 8 * h, acc[h][i]);
}

// AVX2, 8-bit: maddubs needs one unsigned operand, so it takes |w| and x with w's sign (at most 2 * 128 * 127 a
// pair, within int16), then madd widens each pair to int32 at once (two pairs could overflow int16).
template <int MR>
RK_AVX2 static void q8_tile_avx2(const uint8_t* tile, const Rows& a, float* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[2][MR];
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < MR; ++i) acc[h][i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g) {
    const uint8_t* b = tile + g * kQ8Block;
    prefetch<kQ8Block>(b + 2 * kQ8Block);
    for (int h = 0; h < 2; ++h) {
      __m256i s[MR];
      for (int i = 0; i < MR; ++i) s[i] = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * j + 32 * h));
        const __m256i av = _mm256_abs_epi8(v);
        for (int i = 0; i < MR; ++i) {
          const int8_t* xq = a.q + (g * MR + i) * kGroup;
          const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(load_i32(xq + 4 * j)), v);
          s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(_mm256_maddubs_epi16(av, xs), ones));
        }
      }
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 512 + 16 * h)));
      for (int i = 0; i < MR; ++i) {
        const int64_t at = g * MR + i;
        acc[h][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i]), _mm256_mul_ps(dv, _mm256_set1_ps(a.d[at])), acc[h][i]);
      }
    }
  }
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < MR; ++i) _mm256_storeu_ps(out + i * kTile + 8 * h, acc[h][i]);
}

// AVX-512 VNNI: 16 rows a vector; dpbusd multiplies unsigned by signed bytes and adds each row's 4 products into
// its int32 lane. Two chains (the low and the high nibbles) halve the dependent latency at one row of x.
template <int MR>
RK_AVX512 static void q4_tile_avx512(const uint8_t* tile, const Rows& a, float* out) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g) {
    const uint8_t* b = tile + g * kQ4Block;
    prefetch<kQ4Block>(b + 4 * kQ4Block);
    __m512i sl[MR], sh[MR];
    for (int i = 0; i < MR; ++i) sl[i] = sh[i] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(b + 64 * c);
      const __m512i lo = _mm512_and_si512(v, low4);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      for (int i = 0; i < MR; ++i) {
        const int8_t* xq = a.q + (g * MR + i) * kGroup;
        sl[i] = _mm512_dpbusd_epi32(sl[i], lo, _mm512_set1_epi32(load_i32(xq + 4 * c)));
        sh[i] = _mm512_dpbusd_epi32(sh[i], hi, _mm512_set1_epi32(load_i32(xq + 16 + 4 * c)));
      }
    }
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 256)));
    const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 288)));
    for (int i = 0; i < MR; ++i) {
      const int64_t at = g * MR + i;
      const __m512 p = _mm512_cvtepi32_ps(_mm512_add_epi32(sl[i], sh[i]));
      acc[i] = _mm512_fmadd_ps(p, _mm512_mul_ps(dv, _mm512_set1_ps(a.d[at])), acc[i]);
      acc[i] = _mm512_fmadd_ps(mv, _mm512_set1_ps(a.s[at]), acc[i]);
    }
  }
  for (int i = 0; i < MR; ++i) _mm512_storeu_ps(out + i * kTile, acc[i]);
}

// AVX-512 VNNI, 8-bit: dpbusd's unsigned operand is the weight plus 128 (a flipped sign bit), so the sum is the dot
// product plus 128 * sum(qx), which the activations' own sum takes away exactly.
template <int MR>
RK_AVX512 static void q8_tile_avx512(const uint8_t* tile, const Rows& a, float* out) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.G; ++g) {
    const uint8_t* b = tile + g * kQ8Block;
    prefetch<kQ8Block>(b + 2 * kQ8Block);
    __m512i s0[MR], s1[MR];
    for (int i = 0; i < MR; ++i) s0[i] = s1[i] = _mm512_setzero_si512();
    for (int j = 0; j < 8; j += 2) {
      const __m512i w0 = _mm512_xor_si512(_mm512_loadu_si512(b + 64 * j), flip);
      const __m512i w1 = _mm512_xor_si512(_mm512_loadu_si512(b + 64 * j + 64), flip);
      for (int i = 0; i < MR; ++i) {
        const int8_t* xq = a.q + (g * MR + i) * kGroup;
        s0[i] = _mm512_dpbusd_epi32(s0[i], w0, _mm512_set1_epi32(load_i32(xq + 4 * j)));
        s1[i] = _mm512_dpbusd_epi32(s1[i], w1, _mm512_set1_epi32(load_i32(xq + 4 * j + 4)));
      }
    }
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 512)));
    for (int i = 0; i < MR; ++i) {
      const int64_t at = g * MR + i;
      const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(s0[i], s1[i]), _mm512_set1_epi32(128 * a.sum[at]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dv, _mm512_set1_ps(a.d[at])), acc[i]);
    }
  }
  for (int i = 0; i < MR; ++i) _mm512_storeu_ps(out + i * kTile, acc[i]);
}
#endif

// ---------------------------------------------------------------------------------------------------------------
// Driver

using TileFn = void (*)(const uint8_t*, const Rows&, float*);
constexpr int kMaxMR = 8;

struct Kernels {
  TileFn fn[kMaxMR + 1];  // fn[r]: r rows of x at once
  int mr;                 // the widest block this path uses
};

template <template <int> class F>
static Kernels make_kernels(int mr) {
  return Kernels{{nullptr, F<1>::fn, F<2>::fn, F<3>::fn, F<4>::fn, F<5>::fn, F<6>::fn, F<7>::fn, F<8>::fn}, mr};
}

#define RK_WRAP(name, kernel)           \
  template <int MR>                     \
  struct name {                         \
    static constexpr TileFn fn = kernel<MR>; \
  };
RK_WRAP(Q4Scalar, q4_tile_scalar)
RK_WRAP(Q8Scalar, q8_tile_scalar)
#if RK_X86
RK_WRAP(Q4Avx2, q4_tile_avx2)
RK_WRAP(Q8Avx2, q8_tile_avx2)
RK_WRAP(Q4Avx512, q4_tile_avx512)
RK_WRAP(Q8Avx512, q8_tile_avx512)
#endif

static Kernels kernels_for(bool q4, int64_t isa) {
#if RK_X86
  if (isa == kAvx512Vnni) return q4 ? make_kernels<Q4Avx512>(8) : make_kernels<Q8Avx512>(8);
  if (isa == kAvx2) return q4 ? make_kernels<Q4Avx2>(4) : make_kernels<Q8Avx2>(4);
#endif
  return q4 ? make_kernels<Q4Scalar>(4) : make_kernels<Q8Scalar>(4);
}

template <typename T>
static void store_block(T* out, int64_t N, int64_t m0, int mr, int64_t n0, const float* vals) {
  const int64_t cols = std::min<int64_t>(kTile, N - n0);
  for (int i = 0; i < mr; ++i) {
    T* o = out + (m0 + i) * N + n0;
    for (int64_t r = 0; r < cols; ++r) o[r] = static_cast<T>(vals[i * kTile + r]);
  }
}

static at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                         std::optional<at::ScalarType> out_dtype, bool q4) {
  const char* op = q4 ? "q4_linear" : "q8_linear";
  const int64_t block = q4 ? kQ4Block : kQ8Block;
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == block, op,
              ": packed weights must be uint8 [tiles, K / 32, ", block, "], got ", packed.sizes(), " ",
              packed.scalar_type());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
  const int64_t G = packed.size(1), K = G * kGroup, tiles = packed.size(0);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, op, ": x's last size must be ", K, ", got ", x.sizes());
  TORCH_CHECK(n > (tiles - 1) * kTile && n <= tiles * kTile, op, ": n = ", n, " does not fit ", tiles,
              " tiles of 16 rows");
  const at::ScalarType odt = out_dtype.value_or(x.scalar_type());
  TORCH_CHECK(odt == at::kFloat || odt == at::kBFloat16 || odt == at::kHalf, op,
              ": out_dtype must be float32, bfloat16 or float16");
  const at::Tensor pk = packed.contiguous();
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, x.options().dtype(odt));
  if (M == 0) return out;

  const int64_t isa = current_isa();
  const Kernels kern = kernels_for(q4, isa);
  std::vector<int8_t> q(M * K);
  std::vector<float> d(M * G), s(M * G);
  std::vector<int32_t> sum(M * G);
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t m0, int64_t m1) {
    quantize_rows(x2, m0, m1, kern.mr, q.data(), d.data(), s.data(), sum.data(), isa);
  });
  const uint8_t* base = pk.data_ptr<uint8_t>();
  void* optr = out.data_ptr();
  // Whole tiles per thread, and at least ~64 KB of weights each, so a small layer does not wake idle threads.
  const int64_t grain = std::max<int64_t>(1, 65536 / (G * block));
  // With many rows of x, a thread takes its tiles a chunk (about 256 KB of weights) at a time and runs every block of
  // rows over the chunk, so the weights come from memory once and the rows from cache, not all rows once per tile.
  const int64_t chunk = std::max<int64_t>(1, (256 << 10) / (G * block));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    float vals[kMaxMR * kTile];
    for (int64_t c0 = t0; c0 < t1; c0 += chunk) {
      const int64_t c1 = std::min(t1, c0 + chunk);
      for (int64_t m0 = 0; m0 < M; m0 += kern.mr) {
        const int mr = static_cast<int>(std::min<int64_t>(kern.mr, M - m0));
        const Rows rows{q.data() + m0 * K, d.data() + m0 * G, s.data() + m0 * G, sum.data() + m0 * G, G};
        for (int64_t t = c0; t < c1; ++t) {
          kern.fn[mr](base + t * G * block, rows, vals);
          if (odt == at::kFloat) {
            store_block(static_cast<float*>(optr), n, m0, mr, t * kTile, vals);
          } else if (odt == at::kBFloat16) {
            store_block(static_cast<c10::BFloat16*>(optr), n, m0, mr, t * kTile, vals);
          } else {
            store_block(static_cast<c10::Half*>(optr), n, m0, mr, t * kTile, vals);
          }
        }
      }
    }
  });
  return out;
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                     std::optional<at::ScalarType> out_dtype) {
  return linear(x, packed, n, out_dtype, true);
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                     std::optional<at::ScalarType> out_dtype) {
  return linear(x, packed, n, out_dtype, false);
}

int64_t isa() { return current_isa(); }

int64_t cpu_best_isa() { return best_isa(); }

// Choose the path (tests, and a CPU's user forcing AVX2); one this CPU cannot run is refused.
int64_t set_isa(int64_t wanted) {
  TORCH_CHECK(wanted >= kScalar && wanted <= kAvx512Vnni, "set_isa: unknown path ", wanted);
  TORCH_CHECK(wanted <= best_isa(), "set_isa: this CPU cannot run path ", wanted, " (best: ", best_isa(), ")");
  g_isa.store(wanted, std::memory_order_relaxed);
  return wanted;
}

}  // namespace rk

TORCH_LIBRARY(runtime_kernels, m) {
  m.def("q4_linear(Tensor x, Tensor packed, int n, ScalarType? out_dtype=None) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor packed, int n, ScalarType? out_dtype=None) -> Tensor");
  m.def("isa() -> int", &rk::isa);
  m.def("best_isa() -> int", &rk::cpu_best_isa);
  m.def("set_isa(int wanted) -> int", &rk::set_isa);
}

TORCH_LIBRARY_IMPL(runtime_kernels, CPU, m) {
  m.impl("q4_linear", &rk::q4_linear);
  m.impl("q8_linear", &rk::q8_linear);
}
