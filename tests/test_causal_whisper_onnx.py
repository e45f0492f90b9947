"""The stream's layers as ONNX Runtime graphs (`asr.graph_runtime = "onnxruntime"`: onnx_decoder.py, onnx_encoder.py).

The float graphs are the torch computations written as graphs, so the decoder's must give `IncrementalDecoder`'s
log-probabilities (to float rounding) through every cache operation the stream uses, the encoder's the states of
`forward_full` (blocks, several blocks at once, previews), and a whole stream over them torch's updates. The int8
decoder graph is held to the real checkpoint's words in tests/test_whisper_tiny_en.py.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import replace

import onnx
import pytest
import torch
from test_causal_whisper_decoder import chunk_sizes, make_audio, run_stream

from runtime.config import ASRConfig
from runtime.errors import ConfigError
from runtime.models.asr.causal_whisper import onnx_decoder
from runtime.models.asr.causal_whisper.asr import CausalWhisperASR
from runtime.models.asr.causal_whisper.decoder import IncrementalDecoder
from runtime.models.asr.causal_whisper.onnx_decoder import OnnxDecoder, OnnxStep

TOL = 1e-4


def load(**kw) -> CausalWhisperASR:
    return CausalWhisperASR.load(ASRConfig(**kw), device="cpu", dtype="float32")


# test_causal_whisper_decoder's asr300 (the random model loops at once: the loop rule is off so transcripts are long
# enough to cross resets), previewed every 100 ms
STREAM = {"chunk_ms": 300, "reset_s": 3.0, "max_new_tokens": 60, "loop_repeats": 0, "preview_ms": 100}


@pytest.fixture(scope="module")
def torch_asr() -> CausalWhisperASR:
    return load(**STREAM)


@pytest.fixture(scope="module")
def onnx_asr() -> CausalWhisperASR:
    """The int8 graph, as the Whisper profiles run it."""
    return load(**STREAM, graph_runtime="onnxruntime", head_weights="int8", decoder_weights="int8")


def test_the_float_graph_gives_the_torch_decoders_log_probabilities(torch_asr) -> None:
    model = torch_asr.model
    enc = torch.randn(150, model.config.d_model, generator=torch.Generator().manual_seed(0))
    ids = [*torch_asr.sot, *range(20, 40)]
    ours, ref = OnnxDecoder(OnnxStep(model, quantize=False)), IncrementalDecoder(model)
    # frames and positions past the buffers' first room (16 rows) and past later growths (64 rows each), rolled back
    # and fed again, a preview's frames added and dropped, only the last rows asked for
    script = [("frames", enc[:10]), ("feed", ids[:5], None), ("frames", enc[10:27]), ("feed", ids[5:7], 1),
              ("truncate", 4), ("feed", ids[7:20], None), ("frames", enc[27:35]), ("feed", [5], None),
              ("drop", 27), ("truncate", 10), ("feed", [7, 8, 9], 2), ("frames", enc[27:]),
              ("feed", list(range(200, 215)), None), ("feed", list(range(300, 360)), 3)]
    fed = 0
    for op, arg, *last in script:
        outs = []
        for d in (ours, ref):
            if op == "frames":
                d.add_frames(arg)
            elif op == "truncate":
                d.truncate(arg)
            elif op == "drop":
                d.drop_frames(arg)
            else:
                outs.append(d.feed(arg, last[0]))
        if outs:
            fed += 1
            assert outs[0].shape == outs[1].shape
            torch.testing.assert_close(outs[0], outs[1], atol=TOL, rtol=0)
        assert (ours.length, ours.n_frames) == (ref.length, ref.n_frames)
    assert fed == 7 and ours.length > 64 and ours.n_frames > 128
    with pytest.raises(RuntimeError, match="before any encoder frame"):
        OnnxDecoder(OnnxStep(model, quantize=False)).feed([1])


@pytest.mark.parametrize("kind", ["ragged", "big"])
def test_a_stream_over_the_graph_gives_the_torch_streams_updates(torch_asr, kind) -> None:
    """Greedy decisions, rollbacks, previews and resets all read the scorer: the float graph changes none."""
    assert isinstance(load(graph_runtime="onnxruntime").scorer(), OnnxDecoder)
    audio = make_audio(4.0, seed=3)  # past the 3 s reset
    sizes = chunk_sizes(len(audio), kind)
    onnx = load(**STREAM, graph_runtime="onnxruntime", decoder_weights="float")
    ours, ref = run_stream(onnx.open_stream(), audio, sizes), run_stream(torch_asr.open_stream(), audio, sizes)
    assert [(u.delta, u.unstable, u.completed, u.transcript) for u in ours] == \
        [(u.delta, u.unstable, u.completed, u.transcript) for u in ref]
    assert sum(bool(u.delta) for u in ref) > 5 and sum(u.completed for u in ref) >= 2  # words, and a reset


def test_the_graph_is_exported_once_and_read_from_the_cache(torch_asr, monkeypatch, tmp_path) -> None:
    # a cache of its own: the file is spoilt below, and another worker's test reads the shared cache's copy
    # (it once loaded b"not a graph" from there)
    monkeypatch.setenv("RUNTIME_CACHE", str(tmp_path))
    first = onnx_decoder.export_step(torch_asr.model, quantize=True)
    assert first.exists() and first.name.endswith("-int8.onnx") and first.is_relative_to(tmp_path)

    def no_export(*args, **kwargs):
        raise AssertionError("exported again")

    with monkeypatch.context() as patched:
        patched.setattr(torch.onnx, "export", no_export)
        assert onnx_decoder.export_step(torch_asr.model, quantize=True) == first
        # other weights are another file (a changed adapter is a changed decoder), and so is another config
        bias = torch_asr.model.model.decoder.layers[0].fc1.bias
        kept = bias.detach().clone()
        with torch.no_grad():
            bias.add_(1.0)
        try:
            with pytest.raises(AssertionError, match="exported again"):
                onnx_decoder.export_step(torch_asr.model, quantize=True)
        finally:
            with torch.no_grad():
                bias.copy_(kept)
        other = copy.deepcopy(torch_asr.model)
        other.config.activation_function = "relu"
        with pytest.raises(AssertionError, match="exported again"):
            onnx_decoder.export_step(other, quantize=True)
    # a cached file that does not load is exported again
    first.write_bytes(b"not a graph")
    step = OnnxStep(torch_asr.model, quantize=True)
    assert first.stat().st_size > 1000 and step.session.get_inputs()[0].name == "ids"


def test_the_cache_keeps_the_most_recently_used_files_of_each_graph(torch_asr, tmp_path) -> None:
    import os

    from runtime.models.asr.causal_whisper import onnx_export

    path = onnx_decoder.export_step(torch_asr.model, quantize=True)
    os.utime(path, (1e9, 1e9))
    assert onnx_decoder.export_step(torch_asr.model, quantize=True) == path and path.stat().st_mtime > 1e9  # used
    folder = tmp_path
    names = [f"graph-{i:024x}-int8.onnx" for i in range(7)]
    others = ["graph-" + "a" * 24 + ".onnx", "graph-x-" + "b" * 24 + "-int8.onnx", "graphs-" + "c" * 24 + "-int8.onnx"]
    for i, name in enumerate(names + others):
        (folder / name).write_bytes(b"x")
        os.utime(folder / name, (1e9 + i, 1e9 + i))
    os.utime(folder / names[0], (2e9, 2e9))  # the oldest file, used last
    onnx_export._prune(folder, "graph", "-int8")
    kept = sorted(p.name for p in folder.iterdir())
    assert kept == sorted([names[0], *names[4:], *others])  # KEEP = 4 of graph's int8 files; other graphs untouched


def test_the_int8_graph_keeps_the_float_decoders_choices(onnx_asr, torch_asr) -> None:
    """On the random model only the argmax is compared: int8 rounding moves log-probabilities, rarely the best."""
    enc = torch.randn(30, torch_asr.model.config.d_model, generator=torch.Generator().manual_seed(1))
    ids = [*torch_asr.sot, *range(50, 70)]
    ours, ref = onnx_asr.scorer(), IncrementalDecoder(torch_asr.model)
    for d in (ours, ref):
        d.add_frames(enc)
    a, b = ours.feed(ids), ref.feed(ids)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9
    graph = onnx.load(str(onnx_decoder.export_step(onnx_asr.model, quantize=True)))
    layers = len(onnx_asr.model.model.decoder.layers)  # 8 linears each (cross-attention's k/v are the other graph's)
    assert sum(node.op_type == "MatMulNBits" for node in graph.graph.node) == 8 * layers + 1  # and the head
    cross = onnx.load(str(onnx_decoder.export_cross_kv(onnx_asr.model, quantize=True)))
    assert sum(node.op_type == "MatMulNBits" for node in cross.graph.node) == 2 * layers
    frames = enc[:7]
    k, v = onnx_asr.onnx_step.cross_kv(frames)
    for i, layer in enumerate(torch_asr.model.model.decoder.layers):  # 8-bit: near torch's float projections
        want_k = layer.encoder_attn.k_proj(frames).view(7, k.shape[1], -1).transpose(0, 1)
        want_v = layer.encoder_attn.v_proj(frames).view(7, k.shape[1], -1).transpose(0, 1)
        for got, want in ((k[i], want_k), (v[i], want_v)):
            cosine = torch.nn.functional.cosine_similarity(torch.from_numpy(got).flatten(), want.flatten(), dim=0)
            assert cosine > 0.99, cosine


def test_settings_and_a_missing_exporter_are_one_line_errors(torch_asr, monkeypatch, tmp_path) -> None:
    with pytest.raises(ConfigError, match="graph_runtime='tensorrt' is not one of 'auto', 'torch', 'onnxruntime'"):
        load(graph_runtime="tensorrt")
    monkeypatch.setenv("RUNTIME_CACHE", str(tmp_path))  # nothing cached: it must export
    monkeypatch.setitem(sys.modules, "onnx", None)
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[onnx\]'"):
        OnnxStep(torch_asr.model)
    with pytest.raises(ConfigError, match="CPU in float32"):
        OnnxStep(copy.deepcopy(torch_asr.model).to(torch.bfloat16))
    # auto: torch where the graphs cannot be exported, saying why; and for a model that is not float32
    said: list[str] = []
    fallback = CausalWhisperASR.load(ASRConfig(graph_runtime="auto"), device="cpu", dtype="float32",
                                     progress=said.append)
    assert fallback.onnx_step is None and isinstance(fallback.scorer(), IncrementalDecoder)
    assert any("asr.graph_runtime=auto: torch runs the stream" in line and ".[onnx]" in line for line in said), said
    with pytest.raises(ConfigError, match=r"\.\[onnx\]"):
        load(graph_runtime="onnxruntime")
    monkeypatch.undo()
    assert CausalWhisperASR.load(ASRConfig(graph_runtime="auto"), device="cpu", dtype="bfloat16").onnx_step is None
    assert isinstance(load(graph_runtime="auto").scorer(), OnnxDecoder)


@pytest.mark.parametrize("gran", [2, 15])
def test_the_encoder_graph_streams_forward_fulls_states(gran, monkeypatch) -> None:
    """Blocks one at a time, several in one call (block-causal among themselves) and previews of a partial block:
    the graph's states are `forward_full`'s, and torch's packed layers never run."""
    from transformers import WhisperForConditionalGeneration

    from runtime.io.sample import demo_speech
    from runtime.models.asr.causal_whisper import encoder as encoder_module
    from runtime.models.asr.causal_whisper.encoder import CausalWhisperEncoder
    from runtime.models.asr.causal_whisper.features import log_mel
    from runtime.models.asr.causal_whisper.onnx_encoder import OnnxEncoderLayers
    from runtime.models.loading import resolve_checkpoint

    model = WhisperForConditionalGeneration.from_pretrained(resolve_checkpoint("tiny:whisper", role="asr")).eval()
    encoder = CausalWhisperEncoder(model, block_frames=gran, graph=OnnxEncoderLayers(model.get_encoder()))
    monkeypatch.setattr(encoder_module, "packed_layer", lambda *a, **k: pytest.fail("torch's layers ran"))
    mel = log_mel(demo_speech()[: 3 * 16000 + 77])
    total = mel.shape[1]
    with torch.no_grad():
        ref = encoder.forward_full(mel[None])[0]
    for sizes in ([3] * (total // 3) + [total % 3], [total], [7 * gran + 1] * (total // (7 * gran + 1) + 1)):
        stream, outs, at, previews = encoder.open(), [], 0, 0
        for n in sizes:
            part = mel[:, at : at + n]
            if n and at + n < total:
                shown = stream.preview(part)
                if shown.shape[0]:
                    previews += 1
                    with torch.no_grad():
                        want = encoder.forward_full(mel[None, :, : at + n], stream.layer_frames + shown.shape[0])[0]
                    torch.testing.assert_close(shown, want[stream.layer_frames :], atol=TOL, rtol=0)
            outs.append(stream.accept(part))
            at += n
        out = torch.cat([*outs, stream.flush()])
        assert out.shape == ref.shape
        torch.testing.assert_close(out, ref, atol=TOL, rtol=0)
        assert previews or sizes == [total]


def test_graphs_beside_an_offline_pass_that_shares_the_checkpoint() -> None:
    """Without an adapter the offline pass would read the stream's own model, and quantise it in place before the
    graphs are exported from it: the pass gets its own copy."""
    asr = load(**STREAM, graph_runtime="onnxruntime", final_pass="offline", head_weights="int8",
               decoder_weights="int8")
    assert asr.onnx_step is not None and asr.encoder_graph is not None and asr.final_pass.search is not None
    audio = make_audio(2.0, seed=5)
    updates = run_stream(asr.open_stream(), audio, chunk_sizes(len(audio), "ragged"))
    assert updates[-1].completed


def test_auto_runs_torch_when_a_graph_cannot_be_built_and_onnxruntime_says_why(monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("the exporter met an operator it does not know")

    monkeypatch.setattr(onnx_decoder, "export_graph", broken)
    said: list[str] = []
    asr = CausalWhisperASR.load(ASRConfig(graph_runtime="auto", final_pass="offline"), device="cpu", dtype="float32",
                                progress=said.append)
    assert asr.onnx_step is None and any("RuntimeError: the exporter met" in line for line in said), said
    assert asr.final_pass.search is None and any("torch runs the offline pass" in line for line in said), said
    with pytest.raises(ConfigError, match="cannot be built .*RuntimeError.*asr.graph_runtime=torch"):
        load(graph_runtime="onnxruntime")


@pytest.mark.parametrize("window_s", [5.0, 30.0])
def test_the_offline_pass_on_the_float_graph_gives_torchs_greedy_transcript(window_s) -> None:
    """The pass's search on the graph (onnx_pass.py) against torch's greedy search over the same encoder states, in
    float32: on short windows (the turn's K/V, then silence's projected once) and on Whisper's 30 s."""
    asr = load(**STREAM, graph_runtime="onnxruntime", final_pass="offline", final_pass_window_s=window_s,
               final_pass_dtype="float32", decoder_weights="float", head_weights="")
    search, offline = asr.final_pass.search, asr.final_pass.offline
    assert search is not None and (offline.silence_kv is None) == (window_s == 30.0)
    for seconds, seed in ((1.0, 2), (2.6, 3), (4.0, 4)):
        encoded = offline.encode(make_audio(seconds, seed=seed))
        ours = search(encoded)
        assert ours == offline.decode(encoded)
        assert len(set(ours)) >= 3, ours  # a varied transcript, or equality means little


def test_the_int8_encoder_graph_quantises_every_linear_and_stays_near_the_float_states() -> None:
    from runtime.models.asr.causal_whisper.encoder import CausalWhisperEncoder
    from runtime.models.asr.causal_whisper.features import log_mel
    from runtime.models.asr.causal_whisper.onnx_encoder import OnnxEncoderLayers, export_layers

    with pytest.raises(ConfigError, match="asr.encoder_weights='int4' is not one of 'float', 'int8'"):
        load(encoder_weights="int4")
    asr = load(**STREAM, graph_runtime="onnxruntime", encoder_weights="int8")
    encoder = asr.model.get_encoder()
    graph = onnx.load(str(export_layers(encoder, quantize=True)))
    assert sum(node.op_type == "MatMulNBits" for node in graph.graph.node) == 6 * len(encoder.layers)  # q k v o fc1 fc2
    mel = log_mel(make_audio(2.0, seed=7))
    states = {}
    for quantize in (False, True):
        stream = CausalWhisperEncoder(asr.model, block_frames=asr.block_frames,
                                      graph=OnnxEncoderLayers(encoder, quantize=quantize)).open()
        states[quantize] = torch.cat([stream.accept(mel), stream.flush()])
    cosine = torch.nn.functional.cosine_similarity(states[False], states[True], dim=-1)
    assert states[True].shape == states[False].shape and cosine.min() > 0.99, cosine.min()
    assert not torch.equal(states[True], states[False])  # the int8 graph did run


def test_the_pass_graph_is_built_for_greedy_cpu_searches_only(monkeypatch) -> None:
    from runtime.models.asr.causal_whisper.graph_choice import pass_graph

    beams = load(**STREAM, graph_runtime="onnxruntime", final_pass="offline", final_pass_beam=5)
    assert beams.final_pass.search is None and beams.onnx_step is not None  # the graph searches greedily only
    greedy = load(**STREAM, graph_runtime="onnxruntime", final_pass="offline")
    assert greedy.final_pass.search.step.cross is None  # the pass projects its own frames
    with pytest.raises(RuntimeError, match="without its cross-attention graph"):
        greedy.final_pass.search.step.cross_kv(torch.zeros(2, greedy.model.config.d_model))
    monkeypatch.setattr(onnx_decoder, "export_graph", lambda *a, **k: pytest.fail("exported for a CUDA model"))
    cfg = ASRConfig(graph_runtime="onnxruntime", final_pass="offline")
    with pytest.raises(ConfigError, match="graphs run on the CPU, and asr runs on cuda"):
        pass_graph(copy.deepcopy(greedy.model), greedy.final_pass.offline, cfg, "cuda", None)
    said: list[str] = []
    auto = replace(cfg, graph_runtime="auto")
    assert pass_graph(copy.deepcopy(greedy.model), greedy.final_pass.offline, auto, "cuda", said.append) is None
    assert any("torch runs the offline pass" in line for line in said), said


def test_the_quantizer_is_imported_without_configuring_the_root_logger() -> None:
    """onnxruntime's quantizer module calls `logging.basicConfig(level=INFO)` when imported: after the first int8
    export, a server's stderr carried every library's INFO records. Checked in a fresh process (pytest's own logging
    handlers would make basicConfig a no-op here): none through `quantizer_class`, and the module run again bare
    shows the side effect it guards against."""
    import subprocess

    probe = ("import importlib, logging, sys\n"
             "from runtime.models.asr.causal_whisper.onnx_export import quantizer_class\n"
             "root = logging.getLogger()\n"
             "module = sys.modules[quantizer_class().__module__]\n"
             "print(len(root.handlers), root.level)\n"
             "importlib.reload(module)\n"
             "print(len(root.handlers), root.level)\n")
    ours, bare = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                                timeout=120).stdout.splitlines()
    assert ours.split() == ["0", "30"]  # no handler, WARNING (the default)
    assert bare.split() == ["1", "20"]  # the library's own import: one handler, INFO
