"""Parts of the causal stream run as ONNX Runtime graphs (`asr.graph_runtime = "onnxruntime"`): export, cache, load.

Why: the stream's calls are small (a 300 ms block is 15 encoder frames, a decoder feed one to three tokens), and
in torch's eager mode on a CPU a small call is mostly fixed cost: dozens of operations, each dispatched on its own,
and small matrix products that MKL runs far below its peak. The same computation exported once as a graph and run
by ONNX Runtime takes about half the time (docs/model_card_causal_whisper.md). What runs as a graph:
- the encoder's layers over a block or a preview's partial block (`onnx_encoder.py`), in float32, so the stream's
  states stay those of `CausalWhisperEncoder.forward_full` to float rounding, or with `asr.encoder_weights = "int8"`
  quantised as the decoder's are (below);
- the decoder's step (`onnx_decoder.py`), in float32, or with `asr.decoder_weights = "int8"` its weight products
  (every linear and the vocabulary projection) as `MatMulNBits`: 8-bit weights in blocks of 32 with a scale each,
  and activations quantised per block of 32 as well (accuracy level 4). ONNX Runtime's dynamic quantisation was
  tried first: one scale for a whole activation row was too coarse, and the stream stopped after the demo
  sample's first sentence where torch's int8 decoder goes on;
- the cross-attention K/V projections of new encoder frames, every decoder layer's in one call, quantised as the
  step is (`onnx_decoder.export_cross_kv`: in torch, eight small products a call cost 1.3 ms, as 8-bit graph 0.55);
- the same step exported from the checkpoint without the adapter, for the offline final pass's search
  (`onnx_pass.py`).

A graph is exported from the model the stream runs (its adapter merged) and kept under `cache_dir()/onnx` by a hash
of its weights, of the code that writes it and of the libraries', so a process exports it once (a few seconds) and
later loads read the file. Every new adapter, checkpoint or upgrade of the runtime writes new files (a decoder's is
112 MB), so an export keeps only the `KEEP` most recently used files of each graph and removes older ones: a
process loading a removed file exports it again. Exporting needs the `onnx` extra (`onnx`, and `onnx_ir` for the
quantiser); running needs onnxruntime alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import logging
import os
import re
import tempfile
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from runtime.errors import ConfigError
from runtime.models.build_lock import building, lock_path
from runtime.models.loading import cache_dir

if TYPE_CHECKING:
    from onnxruntime import InferenceSession

GRAPH_RUNTIMES = ("auto", "torch", "onnxruntime")  # auto: onnxruntime for a float32 model on the CPU
QUANT_BLOCK = 32  # int8 weights and activations in blocks of this many along the input, a scale each
KEEP = 4  # cached files kept per graph (name and weight format): the stream's and the pass's decoders are two


ENCODER_WEIGHTS = ("float", "int8")  # the encoder graph's linears: float32, or MatMulNBits as the decoder's


def check_runtime(kind: str) -> str:
    if kind not in GRAPH_RUNTIMES:
        raise ConfigError(f"asr.graph_runtime={kind!r} is not one of {', '.join(repr(k) for k in GRAPH_RUNTIMES)}")
    return kind


def check_encoder_weights(kind: str) -> str:
    if kind not in ENCODER_WEIGHTS:
        raise ConfigError(f"asr.encoder_weights={kind!r} is not one of {', '.join(repr(k) for k in ENCODER_WEIGHTS)}")
    return kind


def _fingerprint(module: nn.Module, quantize: bool) -> str:
    """The exported file's key: what the trace bakes in. The module's weights, its structure and the model config it
    reads (heads, activation, norms), the code of the graph modules, and the libraries that trace and write it."""
    import onnxruntime
    import transformers

    h = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(memoryview(tensor.detach().float().contiguous().numpy()).cast("B"))  # the bytes, not a copy of them
    h.update(repr(module).encode())
    config = next((m.config for m in module.modules() if hasattr(m, "config")), None)
    h.update(config.to_json_string().encode() if config is not None else b"")
    here = Path(__file__).parent
    for source in sorted(here.glob("onnx_*.py")):
        h.update(source.read_bytes())
    h.update(inspect.getsource(inspect.getmodule(type(module))).encode())
    h.update(f"{torch.__version__}|{transformers.__version__}|{onnxruntime.__version__}|{quantize}".encode())
    return h.hexdigest()[:24]


def export_graph(module: nn.Module, name: str, args: Sequence[torch.Tensor], inputs: Sequence[str],
                 outputs: Sequence[str], axes: Mapping[str, Mapping[int, str]], *, quantize: bool,
                 progress: Callable[[str], None] | None = None) -> Path:
    """`module` (float32, on the CPU) traced with `args` into an ONNX file named by `name` and its fingerprint:
    exported (and with `quantize` its weight products made 8-bit) once, then read from the cache."""
    tag = "-int8" if quantize else ""
    path = cache_dir() / "onnx" / f"{name}-{_fingerprint(module, quantize)}{tag}.onnx"
    if path.exists():
        return _used(path)
    with building(path, progress):  # processes started together: one exports, the others read its file
        if path.exists():
            return _used(path)
        _export(module, name, path, args, inputs, outputs, axes, quantize=quantize, progress=progress)
    _prune(path.parent, name, tag)
    return path


def _used(path: Path) -> Path:
    with contextlib.suppress(OSError):  # a read-only cache is still read
        os.utime(path)  # used now: what `_prune` keeps
    return path


def quantizer_class() -> type:
    """onnxruntime's 8-bit MatMul quantizer, imported without its side effect: its module calls
    `logging.basicConfig(level=INFO)` on import, after which every library's INFO records (faster-whisper's language
    guesses, httpx's requests) went to the process's stderr."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    return MatMulNBitsQuantizer


def _export(module: nn.Module, name: str, path: Path, args: Sequence[torch.Tensor], inputs: Sequence[str],
            outputs: Sequence[str], axes: Mapping[str, Mapping[int, str]], *, quantize: bool,
            progress: Callable[[str], None] | None) -> None:
    try:
        import onnx

        MatMulNBitsQuantizer = quantizer_class()  # noqa: N806 - a class
    except ImportError:
        raise ConfigError("asr.graph_runtime=onnxruntime exports its graphs once with the `onnx` extra, which is not "
                          "installed: pip install -e '.[onnx]'") from None
    if progress is not None:
        progress(f"{name}: exporting the ONNX graph once (a few seconds) into {path.parent}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        plain, out = Path(tmp) / "plain.onnx", Path(tmp) / "out.onnx"
        frozen = [p for p in module.parameters() if p.requires_grad]  # a trained model's: tracing wants constants
        try:
            for p in frozen:
                p.requires_grad_(False)
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter's own notices
                torch.onnx.export(module.eval(), tuple(args), str(plain), dynamo=False, opset_version=17,
                                  input_names=list(inputs), output_names=list(outputs),
                                  dynamic_axes={k: dict(v) for k, v in axes.items()})
        finally:
            for p in frozen:
                p.requires_grad_(True)
        if quantize:
            quantizer = MatMulNBitsQuantizer(onnx.load(str(plain)), bits=8, block_size=QUANT_BLOCK, is_symmetric=True,
                                             accuracy_level=4, op_types_to_quantize=("MatMul",))
            quiet = logging.getLogger(MatMulNBitsQuantizer.__module__)
            level = quiet.level
            quiet.setLevel(logging.WARNING)  # it logs every node it skips at INFO
            try:
                quantizer.process()
            finally:
                quiet.setLevel(level)
            quantizer.model.save_model_to_file(str(out), False)
        else:
            plain.rename(out)
        os.replace(out, path)  # atomic: a reader sees the whole file or none


def _prune(folder: Path, name: str, tag: str) -> None:
    """Remove all but the `KEEP` most recently used files of graph `name` (weights `tag`) from `folder`."""
    pattern = re.compile(rf"{re.escape(name)}-[0-9a-f]{{24}}{re.escape(tag)}\.onnx")
    files = []
    for file in folder.iterdir():
        if pattern.fullmatch(file.name):
            with contextlib.suppress(OSError):  # removed meanwhile by another process
                files.append((file.stat().st_mtime, file))
    for _, file in sorted(files, reverse=True)[KEEP:]:
        with contextlib.suppress(OSError):
            file.unlink()
            lock_path(file).unlink()


def open_session(path: Path, threads: int = 0) -> InferenceSession:
    """An ONNX Runtime CPU session of `path` on `threads` threads (0: torch's), idle threads sleeping rather than
    spinning: the device worker's other models share these cores."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or torch.get_num_threads()
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def graph_session(export: Callable[[], Path], threads: int = 0) -> InferenceSession:
    """The session of the file `export()` returns; a cached file that no longer loads (cut short by a full disk,
    edited by hand) is removed and exported again, once."""
    path = export()
    try:
        return open_session(path, threads)
    except Exception:  # onnxruntime raises its own error types, by what is wrong with the file
        path.unlink(missing_ok=True)
        return open_session(export(), threads)


def check_float_cpu(model: nn.Module) -> None:
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype != torch.float32:
        raise ConfigError("asr.graph_runtime=onnxruntime runs on the CPU in float32 activations; this model is "
                          f"{param.dtype} on {param.device.type}")
