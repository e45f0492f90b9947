"""Which parts of causal streaming Whisper run as ONNX Runtime graphs (`asr.graph_runtime`), built here.

"onnxruntime" asks for them; "auto" for a float32 model on the CPU, where they are faster (onnx_export.py says why).
Under "auto" a graph that cannot be exported or loaded (no `onnx` package, a read-only cache, an exporter error)
leaves torch running that part, with a line saying why; under "onnxruntime" it is a `ConfigError`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from transformers import WhisperForConditionalGeneration

from runtime.config import ASRConfig
from runtime.errors import ConfigError
from runtime.models.asr.causal_whisper.onnx_decoder import OnnxStep
from runtime.models.asr.causal_whisper.onnx_encoder import OnnxEncoderLayers
from runtime.models.asr.causal_whisper.onnx_pass import GraphSearch
from runtime.models.asr.whisper_buffered import WhisperBuffered

_log = logging.getLogger(__name__)


def wants_graphs(cfg: ASRConfig, device: str, dtype: str) -> bool:
    """Whether `cfg.graph_runtime` asks for ONNX Runtime graphs: "onnxruntime", or "auto" for float32 on the CPU."""
    return cfg.graph_runtime == "onnxruntime" or (cfg.graph_runtime == "auto" and (torch.device(device).type, dtype)
                                                   == ("cpu", "float32"))


def stream_graphs(model: WhisperForConditionalGeneration, cfg: ASRConfig, progress: Callable[[str], None] | None
                  ) -> tuple[OnnxStep | None, OnnxEncoderLayers | None]:
    """The stream's ONNX Runtime graphs (onnx_export.py), or (None, None) for torch. Under "auto" a graph that cannot
    be exported or loaded (no `onnx` package, a read-only cache, an exporter error) leaves torch running the stream,
    saying why; under "onnxruntime" it is an error."""
    param = next(model.parameters())
    if not wants_graphs(cfg, param.device.type, str(param.dtype).removeprefix("torch.")):
        return None, None
    try:  # the decoder's graph is quantised as a whole: head and layers
        return (OnnxStep(model, quantize=cfg.decoder_weights == "int8", progress=progress),
                OnnxEncoderLayers(model.get_encoder(), progress=progress, quantize=cfg.encoder_weights == "int8"))
    except Exception as err:  # the exporter, the quantiser and onnxruntime each raise their own types
        _no_graph(cfg, "the stream", err, progress)
        return None, None


def pass_graph(model: WhisperForConditionalGeneration, offline: WhisperBuffered, cfg: ASRConfig, device: str,
               progress: Callable[[str], None] | None) -> GraphSearch | None:
    """The `offline` pass's greedy search on a graph of `model` (the checkpoint without the adapter, float32, not
    yet moved to `device`: the caller has asked `wants_graphs`), or None where it cannot be built and torch's search
    runs."""
    try:
        if torch.device(device).type != "cpu":  # before any export: the graphs are for the CPU
            raise ConfigError(f"the graphs run on the CPU, and asr runs on {device}")
        step = OnnxStep(model, quantize=cfg.decoder_weights == "int8", cross_kv=False, progress=progress)
        return GraphSearch(step, offline)
    except Exception as err:  # as in stream_graphs
        _no_graph(cfg, "the offline pass", err, progress)
        return None


def _no_graph(cfg: ASRConfig, what: str, err: Exception, progress: Callable[[str], None] | None) -> None:
    """A graph could not be built: an error under "onnxruntime", a line saying so under "auto" (torch runs it)."""
    if cfg.graph_runtime != "auto":
        if isinstance(err, ConfigError):
            raise err
        raise ConfigError(f"asr.graph_runtime=onnxruntime: {what}'s graphs cannot be built "
                          f"({type(err).__name__}: {err}); --set asr.graph_runtime=torch runs it in torch") from err
    (progress or _log.warning)(f"asr.graph_runtime=auto: torch runs {what} ({type(err).__name__}: {err})")
