"""The real Whisper tiny.en (builtin:whisper-tiny.en, from its pinned PyPI package) through the runtime's own code.

- Offline greedy tokens of our loader and decoding loop equal CTranslate2's own `Whisper.generate` (the engine
  faster-whisper runs) over the same files, on the demo sample and real people reading (../shared/speech/dev).
- The block-causal stream equals its offline computation with these weights (encoder states to 1e-4 in fp32,
  and the transcript token for token), so nothing in the exact streaming path depended on toy weight scales.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch
from speech_dev import dev_clips, has_dev_clips
from weights_common import packaged_or_skip

from runtime.chunks import SAMPLE_RATE, AudioChunk
from runtime.config import ASRConfig

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "runtime" / "io" / "assets" / "demo_speech.flac"
TOL = 1e-4


@pytest.fixture(scope="module")
def ct2_folder() -> Path:
    return packaged_or_skip("whisper-tiny.en")


@pytest.fixture(scope="module")
def buffered(ct2_folder):
    from runtime.models.asr.registry import load_asr

    cfg = ASRConfig(backend="whisper-buffered", model="builtin:whisper-tiny.en", max_new_tokens=200)
    return load_asr(cfg, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def causal(ct2_folder):
    from runtime.models.asr.registry import load_asr

    cfg = ASRConfig(backend="causal-whisper", model="builtin:whisper-tiny.en", chunk_ms=300, max_new_tokens=96)
    return load_asr(cfg, device="cpu", dtype="float32")


GREEDY: dict[str, list[int]] = {}  # `buffered`'s greedy tokens by clip: the two tests that read them compute each once


def greedy_tokens(buffered, name: str, audio: np.ndarray) -> list[int]:
    if name not in GREEDY:
        GREEDY[name] = buffered.hypothesis(audio)
    return GREEDY[name]


def test_the_english_only_prompt(buffered) -> None:
    tok = buffered.tokenizer
    assert buffered.prompt_ids == tok.convert_tokens_to_ids(["<|startoftranscript|>", "<|notimestamps|>"])


def test_offline_greedy_tokens_equal_ctranslate2(ct2_folder, buffered) -> None:
    ctranslate2 = pytest.importorskip("ctranslate2")
    engine = ctranslate2.models.Whisper(str(ct2_folder), device="cpu", compute_type="float32", intra_threads=1)
    demo, rate = soundfile.read(DEMO, dtype="float32")
    assert rate == SAMPLE_RATE
    clips = [("demo", demo[: 30 * SAMPLE_RATE], "")] + (dev_clips() if has_dev_clips() else [])
    texts = {}
    for name, audio, _ in clips:
        features = buffered.feature_extractor(audio, sampling_rate=SAMPLE_RATE, return_tensors="np").input_features
        theirs = engine.generate(ctranslate2.StorageView.from_array(features), [buffered.prompt_ids], beam_size=1,
                                 max_length=448, suppress_blank=False,
                                 suppress_tokens=buffered.suppress)[0].sequences_ids[0]
        ours = greedy_tokens(buffered, name, audio)
        assert ours == theirs, name
        texts[name] = buffered.text(ours)
    if not has_dev_clips():
        return
    # the README of the dev set: offline tiny.en transcribes every clip without a word error
    assert texts["beckett"].strip() == "Ever tried, ever failed. No matter, try again. Fail again. Fail better."
    assert texts["new_home_stars"].strip() == "We must find a new home in the stars."


@pytest.mark.parametrize("chunk_ms", [100, 300])
def test_encoder_stream_equals_offline_on_real_weights(causal, chunk_ms) -> None:
    from runtime.models.asr.causal_whisper.encoder import CausalWhisperEncoder, block_frames_for

    _, audio, _ = dev_clips()[0]
    encoder = CausalWhisperEncoder(causal.model, block_frames=block_frames_for(chunk_ms))
    with torch.inference_mode():
        offline = encoder.encode_audio(audio)
        stream, outs, pos = encoder.open_audio(), [], 0
        for size in np.random.default_rng(chunk_ms).integers(200, 9000, 200):
            outs.append(stream.accept(audio[pos : pos + size]))
            pos += size
            if pos >= len(audio):
                break
        outs.append(stream.flush())
    streamed = torch.cat(outs)
    assert streamed.shape == offline.shape
    assert (streamed - offline).abs().max().item() <= TOL


def stream_unevenly(asr, audio: np.ndarray) -> list:
    """Every update of a stream of `audio` fed in uneven chunks (0.1, 0.25, 0.02, 0.5 and 0.15 s over and over)."""
    stream, updates, pos = asr.open_stream(), [], 0
    for size in [1600, 4000, 333, 8000, 2400] * 20:
        if pos >= len(audio):
            break
        updates += stream.accept(AudioChunk(audio[pos : pos + size], pos))
        pos += size
    return updates + stream.finish()


def test_transcript_stream_equals_offline_on_real_weights(causal) -> None:
    from runtime.models.asr.causal_whisper.reference import offline_transcript

    name, audio, _ = next(c for c in dev_clips() if c[0] == "new_home_stars")
    offline = offline_transcript(causal, audio)
    updates = stream_unevenly(causal, audio)
    assert updates[-1].completed
    assert "".join(u.delta for u in updates) == offline
    assert offline.strip(), name


def test_previews_equal_their_reference_on_real_weights(causal) -> None:
    from runtime.models.asr.causal_whisper.asr import CausalWhisperASR
    from runtime.models.asr.causal_whisper.reference import offline_run, offline_transcript

    name, audio, _ = next(c for c in dev_clips() if c[0] == "new_home_stars")
    asr = CausalWhisperASR(causal.model, causal.tokenizer, replace(causal.cfg, preview_ms=100), name=causal.name)
    ref = offline_run(asr, audio)
    assert ref.text == offline_transcript(causal, audio)
    stream, item, shown, tail, pos = asr.open_stream(), None, "", "", 0
    for size in [1600, 4000, 333, 8000, 2400] * 20:
        if pos >= len(audio):
            break
        for u in stream.accept(AudioChunk(audio[pos : pos + size], pos)):
            item, shown = u.item_id, (shown if u.item_id == item else "")
            shown, tail = shown + u.delta, u.unstable
        pos += size
        events = [e.text for e in ref.shown if e.sample <= pos]
        assert (shown + tail if item else "") == (events[-1] if events else ""), (name, pos)
    assert "".join(u.transcript for u in stream.finish() if u.completed) == ref.text


def test_offline_final_pass_is_the_offline_transcript(ct2_folder, buffered) -> None:
    """With the shipped adapter and `asr.final_pass = "offline"`, a committed clip's transcript is what the
    full-context tiny.en says of it (the streamed deltas before it may differ)."""
    from runtime.models.asr.registry import load_asr

    cfg = ASRConfig(backend="causal-whisper", model="builtin:whisper-tiny.en", adapter="builtin:causal-whisper-tiny.en",
                    chunk_ms=300, max_new_tokens=96, final_pass="offline")
    asr = load_asr(cfg, device="cpu", dtype="float32")
    for name, audio, _ in dev_clips():
        stream = asr.open_stream()
        updates = []
        for pos in range(0, len(audio), 1600):
            updates += stream.accept(AudioChunk(audio[pos : pos + 1600], pos))
        updates += stream.finish()
        done = [u for u in updates if u.completed]
        assert len(done) == 1, name
        assert done[0].transcript == buffered.text(greedy_tokens(buffered, name, audio)), name


class UncachedRows:
    """`whisper_beam.BeamDecoder` without self-attention caches: every step runs the whole decoder over each row's
    whole sequence, the reference the cached beam rows (`whisper_buffered._BeamRows`) must match. The encoder states'
    cross-attention keys and values, which no row changes, are projected once by transformers' own decoder at the
    first step (not by the runtime's `cache`, whose silence rows are under test) and read by every step after:
    projecting the 1,500 frames again for every row at every step was most of this test's minute."""

    def __init__(self, whisper, states) -> None:
        self.whisper, self.states, self.rows = whisper, states, []
        self.cross: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer, for one row

    def _logprobs(self) -> torch.Tensor:
        from transformers import DynamicCache, EncoderDecoderCache

        ids = torch.tensor(self.rows)
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())  # self-attention: empty, so computed whole
        for i, (keys, values) in enumerate(self.cross):
            rows = (len(ids), -1, -1, -1)
            cache.cross_attention_cache.update(keys.expand(rows), values.expand(rows), i)
            cache.is_updated[i] = True
        logits = self.whisper._next_logits(ids, self.states.expand(len(ids), -1, -1), cache)
        if not self.cross:
            self.cross = [(layer.keys[:1], layer.values[:1]) for layer in cache.cross_attention_cache.layers]
        return torch.log_softmax(logits.float(), dim=-1)

    def start(self, prefix) -> torch.Tensor:
        self.rows = [list(prefix)]
        return self._logprobs()

    def extend(self, sources, tokens) -> torch.Tensor:
        self.rows = [self.rows[int(s)] + [int(t)] for s, t in zip(sources, tokens, strict=True)]
        return self._logprobs()


@pytest.mark.slow
def test_beam_search_with_caches_equals_it_without(buffered) -> None:
    """Five beams over the cached decoder (self-attention rows reordered as beams are kept, one cross-attention row
    that every beam reads) give the tokens of the same search re-running the decoder over whole sequences."""
    from runtime.models.asr.whisper_beam import beam_search
    from runtime.models.asr.whisper_buffered import WhisperBuffered

    demo, _ = soundfile.read(DEMO, dtype="float32")
    # The demo's first 6 s (its first two sentences), where beams and greedy decoding part ways as on the whole
    # recording ("Red ball" against "The red ball"), at 30 s, where the decoder projects the cross-attention keys
    # itself, and at 5 s windows (the final pass: two windows, the second partial), where the cache arrives with
    # silence's keys projected once and every beam reads that one row; a human clip (two windows) at 5 s. At 30 s
    # the human clips' cached beams are held to CTranslate2's own beam search by the test below. The uncached search
    # grows with the square of a clip's tokens: the whole demo and every human clip at both took over twice as long.
    clips = [("demo 6 s", demo[: 6 * SAMPLE_RATE])]
    clips += [(n, a) for n, a, _ in (dev_clips() if has_dev_clips() else []) if n == "beckett"]
    hypotheses = {}
    for window_s in (30.0, 5.0):
        beamed = WhisperBuffered(buffered.model, buffered.tokenizer, buffered.feature_extractor, buffered.cfg,
                                 beams=5, window_s=window_s)
        for name, audio in clips[: 1 if window_s == 30.0 else None]:
            with torch.inference_mode():
                reference = beam_search(UncachedRows(beamed, beamed.encode(audio).states), beamed.prompt_ids,
                                        beams=5, eos=beamed.eos_id, max_tokens=beamed.max_tokens)
            hypotheses[name, window_s] = beamed.hypothesis(audio)
            assert hypotheses[name, window_s] == reference, (name, window_s)
    # a clip where beams and greedy decoding part ways: this test must exercise the search
    assert hypotheses["demo 6 s", 30.0] != buffered.hypothesis(demo[: 6 * SAMPLE_RATE])


def test_beam_search_equals_ctranslate2s_on_human_speech(ct2_folder, buffered) -> None:
    """An independent beam search, CTranslate2's (faster-whisper's engine), gives the same tokens on real people
    reading. Its rules are not exactly openai-whisper's (it pools 2 x beams candidates and stops on its own terms), so
    on other audio the two may part: on the demo recording CTranslate2 writes "The red ball", we "Red ball"."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    from runtime.models.asr.whisper_buffered import WhisperBuffered

    clips = dev_clips()  # skips without the human clips
    engine = ctranslate2.models.Whisper(str(ct2_folder), device="cpu", compute_type="float32", intra_threads=1)
    beamed = WhisperBuffered(buffered.model, buffered.tokenizer, buffered.feature_extractor, buffered.cfg, beams=5)
    for name, audio, _ in clips:
        features = buffered.feature_extractor(audio, sampling_rate=SAMPLE_RATE, return_tensors="np").input_features
        theirs = engine.generate(ctranslate2.StorageView.from_array(features), [buffered.prompt_ids], beam_size=5,
                                 max_length=448, suppress_blank=False,
                                 suppress_tokens=buffered.suppress)[0].sequences_ids[0]
        assert beamed.hypothesis(audio) == theirs, name


def test_refresh_keeps_the_100ms_stream_going_and_equals_its_reference(causal) -> None:
    """Under 100 ms blocks with the shipped adapter, the decoder's prompt fed on the first 100 ms makes the model
    predict end-of-text after "Ever tried." for the rest of the clip; re-fed (`asr.refresh_ms`), it goes on. The
    re-fed stream still equals its offline reference, token for token, over uneven chunks."""
    from runtime.models.asr.causal_whisper.asr import CausalWhisperASR
    from runtime.models.asr.causal_whisper.lora import load_adapter
    from runtime.models.asr.causal_whisper.reference import offline_transcript
    from runtime.train.text_norm import wer

    name, audio, text = next(c for c in dev_clips() if c[0] == "beckett")
    # its first 6 s (to "Try again."): unrefreshed, the stream stops after "Ever tried." there as on the whole clip;
    # every 100 ms block costs each of the three computations below a step, so 4 s less is 40 % less time
    audio = audio[: 6 * SAMPLE_RATE]
    model = load_adapter(copy.deepcopy(causal.model), "builtin:causal-whisper-tiny.en").merge_and_unload()
    plain, fresh = (CausalWhisperASR(model, causal.tokenizer, replace(causal.cfg, chunk_ms=100, refresh_ms=ms),
                                     name=causal.name) for ms in (0, 300))
    stopped, going = offline_transcript(plain, audio), offline_transcript(fresh, audio)
    assert wer([text], [going]) < wer([text], [stopped]), (stopped, going)
    assert len(going.split()) >= 2 * len(stopped.split()), (stopped, going)
    assert "".join(u.transcript for u in stream_unevenly(fresh, audio) if u.completed) == going, name


def same_words(ours, theirs) -> None:
    """`ours` writes `theirs`' completed words on the demo sample and (where ../shared is beside the clone) the human
    clips: within 10 % WER of them, and no further from a clip's transcript than they are, plus 10 points."""
    from runtime.train.text_norm import wer

    demo, _ = soundfile.read(DEMO, dtype="float32")
    humans = dev_clips() if has_dev_clips() else []  # a clone without ../shared still checks the demo sample
    words = 0
    for name, audio, text in [("demo", demo[: SAMPLE_RATE * 12], "")] + humans:
        got, want = ("".join(u.transcript for u in stream_unevenly(asr, audio) if u.completed)
                     for asr in (ours, theirs))
        words += len(want.split())
        assert wer([want], [got]) <= 0.1, (name, want, got)
        if text:
            assert wer([text], [got]) <= wer([text], [want]) + 0.1, (name, text, got)
    assert words >= 20  # the demo sample's four sentences at least: a stream that stops early fails above


@pytest.fixture(scope="module")
def profile_graphs(ct2_folder):
    """The whisper-tiny-en profile's ASR on ONNX Runtime graphs (the stream's 8-bit encoder layers, decoder step and
    cross-attention projections; the final pass's greedy search), loaded once for the two tests below."""
    from runtime.models.asr.registry import load_asr
    from runtime.profile_files import load_profile

    cfg = replace(load_profile("whisper-tiny-en").asr, final_pass="offline", graph_runtime="onnxruntime")
    return load_asr(cfg, device="cpu", dtype="float32")


def test_the_int8_graphs_stream_the_words_of_the_int8_torch_decoder(profile_graphs) -> None:
    """The whisper-tiny-en profile's stream (its adapter, 300 ms blocks, 8-bit graphs for the encoder layers, the
    decoder step and the cross-attention projections; no final pass, which would hide the stream's words), previewed
    every 100 ms: the words of torch's int8 stream (loaded by itself, `asr.graph_runtime = "torch"`)."""
    from runtime.models.asr.causal_whisper.asr import CausalWhisperASR
    from runtime.models.asr.causal_whisper.onnx_decoder import OnnxDecoder
    from runtime.models.asr.registry import load_asr

    graphs = profile_graphs
    cfg = replace(graphs.cfg, final_pass="none", preview_ms=100)
    ours = CausalWhisperASR(graphs.model, graphs.tokenizer, cfg, name=graphs.name, onnx_step=graphs.onnx_step,
                            encoder_graph=graphs.encoder_graph)  # the loaded graphs, without their final pass
    theirs = load_asr(replace(cfg, graph_runtime="torch"), device="cpu", dtype="float32")
    assert isinstance(ours.scorer(), OnnxDecoder) and cfg.encoder_weights == "int8"
    assert theirs.onnx_step is None and theirs.encoder_graph is None and theirs.final_pass is None
    same_words(ours, theirs)


def test_the_offline_pass_on_the_int8_graph_writes_the_torch_passs_words(profile_graphs) -> None:
    """The whisper-tiny-en profile's final pass (offline, int8 decoder) with its greedy search on the ONNX Runtime
    graph (onnx_pass.py) against torch's (the pass's own model in the profile's dtype, the stream's words as draft):
    the same completed transcripts. Both revise the items of one stream, the graphs' (held to torch's stream by the
    test above), so only the pass's search differs; torch's pass is built as `load` builds it without the graph."""
    from runtime.models.asr.causal_whisper.asr import CausalWhisperASR
    from runtime.models.asr.causal_whisper.final_pass import OfflinePass

    ours = profile_graphs
    theirs = CausalWhisperASR(ours.model, ours.tokenizer, ours.cfg, name=ours.name,
                              final_pass=OfflinePass(ours.final_pass.offline, read_on=ours.cfg.final_pass_read_on),
                              onnx_step=ours.onnx_step, encoder_graph=ours.encoder_graph)
    assert ours.final_pass.search is not None and theirs.final_pass.search is None
    same_words(ours, theirs)
