"""The settings: one frozen dataclass per table of a profile (`asr`, `lm`, `video`, `screen`, `pipeline`,
`serve`) and `Profile` holding them, with the values each may take (`validate`), the machine's device
(`require_device`) and the video memory's sizes (`memory_sizes`, `check_memory_fits`).

Profiles are TOML files read into these dataclasses by `runtime/profile_files.py` (search path, `extends`,
`--set` overrides, unknown keys as errors); `with_overrides` changes a loaded profile in code.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from runtime.errors import ConfigError

if TYPE_CHECKING:
    from runtime.memory.sizes import MemorySizes

DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class ASRConfig:
    backend: str = "whisper-buffered"  # whisper-buffered (the reference peer) | causal-whisper | fastconformer
    model: str = "tiny:whisper"  # a hub id, a local directory (or .nemo file), or tiny:<name> (random)
    # Whisper: the language spoken ("" detects it from the audio: multilingual Whisper only) and the task: transcribe
    # (captions in that language) | translate (captions in English); English-only Whisper takes only "en"/"" and
    # transcribe (models/asr/whisper_language.py)
    language: str = "en"
    task: str = "transcribe"
    max_new_tokens: int = 48  # decoder tokens per transcript item (Whisper backends)
    # whisper-buffered: re-decode the buffer every step_s; complete an item and cut the buffer at segment_s.
    step_s: float = 1.0
    segment_s: float = 8.0
    # causal-whisper: block (chunk) size, tokens re-checked per chunk, cache reset point, LoRA adapter dir.
    chunk_ms: int = 300  # 40 | 100 | 200 | 300 | 1000
    lookback_tokens: int = 2
    reset_s: float = 30.0
    adapter: str = ""
    # causal-whisper: every preview_ms inside a block, show the words the block would add if it ended there (its
    # partial block encoded, decoded on from the tail, then taken back; the block re-checks the tail): long blocks'
    # words at a short cadence (0: off)
    preview_ms: int = 0
    loop_repeats: int = 3  # a phrase said this many times running is a decoding loop and ends the block (0: off)
    # causal-whisper: a block that stops on eos or a loop with the item's decoder positions fed this long ago is
    # decoded once more on all of them re-fed with every frame heard (emission.py: stale positions stop short
    # blocks) (0: off)
    refresh_ms: int = 0
    # causal-whisper: decode a committed item once more with all it heard (final_pass.py): none | decoder (its
    # own decoder over all its block-causal frames) | offline (the checkpoint without adapter, full context).
    final_pass: str = "none"
    # the offline pass's weights: float32 | bfloat16 | float16 | auto (bfloat16 where the device computes it natively:
    # AVX-512 BF16 or AMX; float32 elsewhere, where bfloat16 ran 7.5x slower) ("": the profile's dtype)
    final_pass_dtype: str = ""
    # the offline pass encodes the item padded to the next multiple of this many seconds, the rest of Whisper's 30 s
    # window being silence's states (whisper_window.py); 30: Whisper's own window for every item
    final_pass_window_s: float = 30.0
    # the offline pass's search: beams of openai-whisper's beam search (whisper_beam.py); 1 = greedy
    final_pass_beam: int = 1
    # in a captions session the offline pass also reads the turn before with the turn (final_pass.py, "Reading on")
    final_pass_read_on: bool = True
    # causal-whisper: the decoders' vocabulary projection (stream and final pass): "" (the model's dtype) | int8
    # (weight-only, bfloat16 activations, on CPU: whisper_head.py)
    head_weights: str = ""
    # causal-whisper: the decoders' other linears (self-attention, cross-attention q/out, fc1/fc2): float (the
    # model's dtype) | int8 (weight-only, bfloat16 activations, on CPU: whisper_head.py)
    decoder_weights: str = "float"
    # causal-whisper: what runs the stream's encoder layers and decoder step: torch | onnxruntime (each exported once
    # to an ONNX graph, cached; the encoder's as encoder_weights says, the decoder's, head included, in 8-bit weights
    # and activations when decoder_weights is int8, whatever head_weights says; CPU, float32 models; the `onnx` extra
    # exports: causal_whisper/onnx_export.py) | auto (onnxruntime for a float32 model on the CPU, torch elsewhere or
    # where a graph cannot be built). The offline final pass's greedy search runs on a graph of the checkpoint's
    # decoder too (causal_whisper/onnx_pass.py); its encoder and beam search stay torch's.
    graph_runtime: str = "torch"
    # causal-whisper: the stream's encoder layers when graph_runtime runs them: float (float32, the states of the
    # offline block-causal encoder to float rounding) | int8 (8-bit weights and activations in blocks of 32, as the
    # decoder's graph: onnx_export.py). Torch's encoder is float either way.
    encoder_weights: str = "float"
    # fastconformer: right attention context (look-ahead) in milliseconds: 0 | 80 | 480 | 1040.
    lookahead_ms: int = 1040
    # fastconformer CTC decoding: greedy (each frame's argmax) | beam (prefix beam search scored with a word
    # n-gram: `lm`, an ARPA file, else the checkpoint's own lm.arpa, else none; models/asr/ctc_beam.py).
    decoder: str = "greedy"
    lm: str = ""
    beam: int = 32  # hypotheses kept per frame
    lm_weight: float = 0.5  # ranking = ln P_ctc + lm_weight * ln P_lm + word_bonus * words - oov_penalty * OOV words
    word_bonus: float = 1.0
    oov_penalty: float = 20.0
    # beam: a word the best hypothesis has kept this long is final even while weaker hypotheses still doubt
    # it, so captions never wait on a doubt the audio will not settle (0 = final only once all agree).
    commit_after_s: float = 0.5


@dataclass(frozen=True)
class LMConfig:
    # generate (plain transformers, the slice) | engine (sink KV, streaming prefill) | openai (any server speaking
    # /v1/chat/completions: vLLM, SGLang, llama.cpp's server; models/lm/remote_answerer.py)
    backend: str = "generate"
    model: str = "tiny:qwen2"  # openai: the name the server knows the model by
    # openai: the server's base URL (http://host:port/v1) and the environment variable holding its API key ("": none)
    base_url: str = ""
    api_key_env: str = ""
    # openai: while the context grows, send a prefill-only request (max_tokens 1) at most this often, so the
    # server's prefix cache holds the transcript when a question comes (0: never)
    warm_interval_s: float = 2.0
    connect_deadline_s: float = 10.0  # openai: connect errors are retried with backoff until this deadline
    request_timeout_s: float = 60.0  # openai: no answer chunk for this long fails the answer
    max_new_tokens: int = 64
    stop_repeats: bool = False  # end an answer that says the same phrase again and again (sampling.repeats_itself)
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    # engine: fp32 | bf16 | int8 | int4 | native (weight-only, CPU kernels) | auto (the profile's dtype); see
    # models/lm/weight_formats.py. int4 takes a GGUF file's own 4-bit blocks as they are; native keeps those as int4
    # and every finer-stored weight (Q5_0, Q6_K, Q8_0) as int8.
    weights: str = "auto"
    # engine, int8/int4/native weights: auto | runtime | torch. runtime: the runtime's own CPU kernels
    # (models/lm/cpu_kernels: int8 activations, integer dot products on AVX-512 VNNI or AVX2, chosen from the CPU's
    # features; built once per machine); torch: torch's kernels; auto: runtime's where they build here.
    kernels: str = "auto"
    max_context_tokens: int = 2048  # generate: the transcript is cut from the front to fit
    system_prompt: str = (
        "You are a live assistant. Answer the question about what was said, using the transcript."
    )
    # engine: the reply `system_prompt` asks for when the context does not hold the answer ("": none). An answer
    # that would open with it is checked first: the model is asked `not_known_check` on the same context, and on
    # "yes" it answers instead (models/lm/refusal_check.py). The check never turns an answer into a refusal.
    not_known_reply: str = ""
    not_known_check: str = ('Do the transcript and the screen text say the answer to this question: "{question}"? '
                            "Reply yes or no.")
    # answer "not known yet" without asking the model when none of a question's words was heard, shown or written
    # in the session (memory/grounding.py); for answerers that know the stream and little else. Off: every question
    # goes to the model. Questions that may call functions always do.
    grounded: bool = False
    # whether answers read the assistant's earlier answers in the context (memory/conversation.py). A small model
    # copies them into answers to other questions; without them a follow-up about an answer ("why?") loses it.
    answers_in_context: bool = True
    # engine: attention-sink KV window (StreamingLLM), sized per session and never grown.
    sink_tokens: int = 4
    window_tokens: int = 2048
    prefill_chunk_tokens: int = 256  # streamed context is prefilled in jobs of at most this many tokens
    # engine: lossless speculative decoding. drafter: none | ngram | recycling | trigram | draft-model | dyspec
    # (the draft model's tree grown where it is sure) | swift (the model through a subset of its layers) | auto
    drafter: str = "auto"
    draft_model: str = ""  # a smaller model sharing the tokenizer, for drafter = draft-model or dyspec
    max_draft_tokens: int = 8  # the upper bound; the engine adapts below it from measured acceptance and cost
    # engine on CUDA: one-token decode steps replayed as a CUDA graph per session (models/lm/cuda_graph.py)
    cuda_graphs: bool = True
    # engine on CPU: one-token decode steps compiled by torch.compile (models/lm/compiled_step.py), once per model
    # at load (about a minute cold, 14 s from inductor's disk cache), and with a drafter its verifications too (int8
    # and int4 weights on the runtime's kernels): on | off | auto (int8 and int4 weights decoded plainly, drafter =
    # none; a drafter's steps then run eagerly: `on` decodes drafted answers fastest, for a longer load)
    compile: str = "auto"


@dataclass(frozen=True)
class VideoConfig:
    fps: float = 1.0  # frames per second of media time kept for the vision path
    max_side: int = 640  # frames are downscaled so their longer side is at most this
    # Video memory: on when lm.model is a vision-language model run by the engine backend (else frames are only
    # counted). Sizes follow Flash-VStream's STAR memory (defaults: 64 + 400 + 25 + 192 = 681 tokens).
    memory: bool = True
    spatial_frames: int = 1  # latest frames at grid x grid tokens
    grid: int = 8
    temporal_slots: int = 25  # older frames consolidated by weighted k-means into slots of temporal_grid^2
    temporal_grid: int = 4
    abstract_tokens: int = 25  # updated by semantic attention at abstract_ratio
    abstract_ratio: float = 0.2
    retrieved_frames: int = 3  # full-resolution frames: near the largest clusters, or chosen by the question
    buffer_frames: int = 300  # recent frames kept as retrieval candidates
    segment_s: float = 10.0  # memory segments (time spans) for notes and question-aware selection
    max_segments: int = 64
    kmeans_iters: int = 10
    notes: bool = True  # when idle, write a one-line note per closed segment (a `video.note` event)
    note_tokens: int = 24


@dataclass(frozen=True)
class ScreenConfig:
    """Text on screen read into the session (runtime/pipeline/screen.py): slides, titles, shared screens."""

    read: bool = False  # run PP-OCRv4 on the frames worth reading (needs video.max_side >= ~960 for small text)
    model: str = "builtin:pp-ocrv4"
    threshold: float = 0.004  # share of a 96x54 thumbnail's pixels that must change for a new read
    min_interval_s: float = 2.0  # media seconds between reads at most (the bound under load)
    refresh_s: float = 30.0  # a settled picture is read again after this long
    min_confidence: float = 0.6  # lines read less surely are left out
    max_screens: int = 64
    # The screens' lines in the conversation stay within this many tokens however long the stream: older screens
    # are cut to their title line, then to a one-line index (memory/screen_notes.py); 0: no budget.
    max_note_tokens: int = 256
    # A question that points at screens no longer whole in the context gets their full text, within this many
    # tokens (the engine takes at most 256 question tokens, instructions included).
    selected_tokens: int = 128


@dataclass(frozen=True)
class PipelineConfig:
    audio_chunk_ms: int = 100  # sources cut audio into chunks of this length
    audio_queue_chunks: int = 20  # bounded; a full queue slows the source (audio is never dropped)
    video_queue_frames: int = 2  # bounded; a full queue drops the oldest frame (counted)
    question_queue: int = 8  # bounded; a full queue rejects the question with an error event
    event_queue: int = 1024  # bounded; a full queue slows the processors (events are never dropped)
    worker_queue: int = 64  # bounded per process; submitters wait for a slot
    # The device worker's threads (worker.py): 1 runs every model job in turn; 2 runs ASR and turn detection on a
    # second thread beside the language model's prefill and decode steps and the voice.
    worker_threads: int = 2
    metrics_interval_s: float = 1.0  # wall seconds between metrics events (0 = only at the end)
    # Turn detection a session starts with (a client's session.update may change it): "server_vad" (Silero VAD),
    # "semantic_vad" (Smart Turn judges each pause) or "none" (one item until the client commits). It splits live
    # captions into utterances everywhere; a websocket session also answers each turn (the API's default).
    turn_detection: str = "server_vad"
    # With turn detection on, a buffer's transcript waits until the VAD hears speech in it, and a buffer without
    # speech holds no words (pipeline/transcript_gate.py): Whisper writes "you" over silence. On in the Whisper
    # profiles.
    speech_gate: bool = False


@dataclass(frozen=True)
class ServeConfig:
    """Per-session bounds of `runtime serve` (web/limits.py): a frame past its bound is dropped and answered
    with a `rate_limited` error (at most one a second, counting the drops); audio past its bound waits (it is
    never dropped); neither closes the session."""

    max_frames_per_s: float = 30.0  # video frames a client may send per wall second (bursts of 1 s allowed)
    max_audio_speed: float = 100.0  # audio a client may send, in multiples of real time, sustained
    audio_burst_s: float = 120.0  # media seconds of audio a client may send at once above that pace
    webrtc_audio_buffer_s: float = 5.0  # WebRTC audio waiting for the pipeline; past it the oldest is dropped


@dataclass(frozen=True)
class Profile:
    name: str = "tiny"
    description: str = ""  # what it loads, in a line (`runtime profiles`)
    cost: str = ""  # what it costs to load and run, measured where it says so (`runtime profiles`)
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    threads: int = 0  # torch intra-op threads on CPU; 0 = one per core but one, both of two (`session_threads`)
    asr: ASRConfig = field(default_factory=ASRConfig)
    lm: LMConfig = field(default_factory=LMConfig)
    video: VideoConfig = field(default_factory=VideoConfig)
    screen: ScreenConfig = field(default_factory=ScreenConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)

    @property
    def random_weights(self) -> bool:
        """True when any model is built from a config with random weights (the `tiny:` models)."""
        return any(m.startswith("tiny:") for m in (self.asr.model, self.lm.model))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def validate(profile: Profile) -> Profile:
    """`profile` itself, or a ConfigError naming the first setting out of its range."""
    if profile.dtype not in DTYPES:
        raise ConfigError(f"dtype {profile.dtype!r} is not one of {', '.join(DTYPES)}")
    if not (profile.device == "cpu" or profile.device.startswith("cuda") or profile.device == "mps"):
        raise ConfigError(f"device {profile.device!r} is not cpu, cuda[:N] or mps")
    if profile.threads < 0:
        raise ConfigError("threads must be >= 0 (0 = one per core but one, both of two)")
    if profile.pipeline.worker_threads not in (1, 2):
        raise ConfigError(f"pipeline.worker_threads must be 1 or 2, not {profile.pipeline.worker_threads}")
    if profile.video.fps <= 0:
        raise ConfigError("video.fps must be > 0")
    if profile.video.memory:
        sizes = memory_sizes(profile)
        try:
            sizes.validate()
        except ValueError as err:
            raise ConfigError(f"video: {err}") from None

    if profile.pipeline.audio_chunk_ms <= 0 or profile.pipeline.audio_queue_chunks <= 0:
        raise ConfigError("pipeline.audio_chunk_ms and pipeline.audio_queue_chunks must be > 0")
    asr = profile.asr
    if asr.final_pass_dtype and asr.final_pass_dtype not in (*DTYPES, "auto"):
        raise ConfigError(f"asr.final_pass_dtype {asr.final_pass_dtype!r} is not one of {', '.join(DTYPES)}, auto")
    if asr.final_pass_beam < 1:
        raise ConfigError(f"asr.final_pass_beam must be >= 1 (1: greedy), got {asr.final_pass_beam}")
    if asr.decoder not in ("greedy", "beam"):
        raise ConfigError(f"asr.decoder={asr.decoder!r} is not greedy or beam")
    if asr.beam < 1 or min(asr.lm_weight, asr.oov_penalty, asr.commit_after_s) < 0:
        raise ConfigError("asr.beam must be >= 1, asr.lm_weight, asr.oov_penalty and asr.commit_after_s >= 0")
    if profile.lm.max_new_tokens <= 0 or profile.asr.max_new_tokens <= 0:
        raise ConfigError("max_new_tokens must be > 0")
    lm = profile.lm
    if lm.backend == "openai" and not lm.base_url.startswith(("http://", "https://")):
        raise ConfigError(f"lm.backend = openai needs lm.base_url, the server's http(s)://host:port/v1 (got "
                          f"{lm.base_url!r})")
    if lm.drafter in ("draft-model", "dyspec") and not lm.draft_model:  # else a tokenizer error from an empty path
        raise ConfigError(f"lm.drafter = {lm.drafter} needs lm.draft_model: a smaller model sharing the tokenizer "
                          "(e.g. builtin:qwen2.5-coder-0.5b-instruct for the 1.5B)")
    if lm.not_known_reply and "{question}" not in lm.not_known_check:  # models/lm/refusal_check.py
        raise ConfigError(f"lm.not_known_check must hold {{question}} where the user's question goes (got "
                          f"{lm.not_known_check!r})")
    if min(lm.warm_interval_s, lm.connect_deadline_s) < 0 or lm.request_timeout_s <= 0:
        raise ConfigError("lm.warm_interval_s and lm.connect_deadline_s must be >= 0, lm.request_timeout_s > 0")
    serve = profile.serve
    if min(serve.max_frames_per_s, serve.max_audio_speed, serve.audio_burst_s, serve.webrtc_audio_buffer_s) <= 0:
        raise ConfigError("serve.* bounds must be > 0")
    return profile


def require_device(device: str) -> None:
    """A ConfigError unless `device` is cpu, cuda[:N] or mps and this machine has it (checked before models
    load, so a missing GPU is one line, not torch's assertion from deep inside the first `.to()`)."""
    import torch  # lazy: profiles load without torch

    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda", "mps") or (index and not (kind == "cuda" and index.isdigit())):
        raise ConfigError(f"device {device!r} is not cpu, cuda, cuda:N or mps")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device} requested but no CUDA GPU is visible to torch; use --device cpu")
    if kind == "cuda" and index and int(index) >= torch.cuda.device_count():
        raise ConfigError(f"device {device} requested but torch sees {torch.cuda.device_count()} CUDA GPU(s)")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("device mps requested but this torch has no MPS backend; use --device cpu")


def check_memory_fits(profile: Profile) -> None:
    """The video memory and its labels must fit in the engine's window (checked once the model can see)."""
    budget = memory_sizes(profile).budget()
    if budget + 160 > profile.lm.window_tokens:
        raise ConfigError(f"video memory needs {budget} tokens (+ ~160 for its labels) inside lm.window_tokens = "
                          f"{profile.lm.window_tokens}; raise the window or shrink the video memory")


def memory_sizes(profile: Profile) -> MemorySizes:
    """The profile's `runtime.memory.video.MemorySizes` (its fields are VideoConfig's of the same names)."""
    from runtime.memory.sizes import MemorySizes

    names = {f.name for f in fields(MemorySizes)}
    return MemorySizes(**{n: getattr(profile.video, n) for n in names if hasattr(profile.video, n)},
                       seed=profile.seed)


def with_overrides(profile: Profile, **sections: dict[str, Any]) -> Profile:
    """Programmatic overrides, e.g. `with_overrides(p, lm={"max_new_tokens": 8})`."""
    changes = {name: replace(getattr(profile, name), **values) for name, values in sections.items()}
    return validate(replace(profile, **changes))
