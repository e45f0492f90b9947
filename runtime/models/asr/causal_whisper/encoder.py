"""Block-causal Whisper encoder (CarelessWhisper) with an exact incremental streaming path.

Encoder frames are 20 ms (mel hop 10 ms, conv2 stride 2). Frames are grouped in blocks of `block_frames`
(`gran`, = chunk_ms / 20); the first block is widened by one block (2 * gran frames), so the first output
has enough context. A frame in block b attends to every frame of blocks <= b: bidirectional inside a block,
causal across blocks. `forward_full` runs that mask over a whole mel in one pass (training, reference);
`MelEncoderStream` computes the same states chunk by chunk, each frame exactly once:

- The convolutions run incrementally: between calls only their receptive-field context is carried (two
  mel frames for conv1, at most two conv1 frames for conv2). Encoder frame s reads mel frames 2s-2..2s+2,
  so it is held back until mel frame 2s+2 has arrived (10 ms of look-ahead); at flush the right edge is
  zero-padded exactly as the convs' own padding pads it in `forward_full`.
- Positional embeddings are added at each frame's absolute index.
- Only completed blocks go through the layers: queries are the block's frames, keys/values the per-layer
  cache (allocated for 1500 frames) plus the block; a single block sees all of them and runs unmasked.
  Attention to the past is the only cost that grows with the stream.

A stream holds at most `max_source_positions` (1500, 30 s) encoder frames, the size of the positional
table; feeding more raises `EncoderWindowFull` before any state changes. The caller resets by opening a new
stream (CarelessWhisper resets its caches at 30 s and carries text, not audio, across the reset).

`forward_full` calls the HF modules themselves (q/k/v/out projections, fc1/fc2, layer norms, convs), looked up
at every call, so peft LoRA wrappers injected into the model are used and trained through it. The stream calls
them too in train mode or while a projection is wrapped (unmerged LoRA); otherwise its layers run on packed
copies of the projections (q/k/v fused into one GEMM, [in, out] matrices on CPU), built from the current
weights and rebuilt when they change (`CausalWhisperEncoder.stream_weights`). The layer math, both ways, is in
encoder_layers.py.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.models.whisper.modeling_whisper import WhisperEncoder

from runtime.errors import ConfigError
from runtime.models.asr.causal_whisper.encoder_layers import KVCache, PackedLayer, hf_layer, pack_layer, packed_layer
from runtime.models.asr.causal_whisper.features import HOP, INIT_MAX, StreamingLogMel, log_mel

if TYPE_CHECKING:
    from runtime.models.asr.causal_whisper.onnx_encoder import OnnxEncoderLayers

FRAME_MS = 20  # one encoder frame: two 10 ms mel hops
MEL_PER_FRAME = 2
FRAME_SAMPLES = MEL_PER_FRAME * HOP  # one 20 ms encoder frame in 16 kHz samples


def stream_conv(x: torch.Tensor, conv: nn.Conv1d, stride: int = 1) -> torch.Tensor:
    """`conv` (no padding: the stream carries its context) over x [1, channels, t], on a CPU in float32 by oneDNN.

    Why: torch picks oneDNN only for inputs of more than 20,480 values, so a stream's few frames went to its
    im2col-and-GEMM path, which a stride-2 convolution over a dozen frames makes slow (0.6-1 ms on one core against
    0.3 ms) and which rounds otherwise than `forward_full`, whose clips of more than 2.56 s take oneDNN. oneDNN's
    outputs here were bit for bit those of such a clip's, however many frames a call has. Where oneDNN is turned
    off (`torch.backends.mkldnn.flags(enabled=False)`), `F.conv1d` runs as before."""
    mkldnn = torch.backends.mkldnn
    if x.device.type == "cpu" and x.dtype == torch.float32 and mkldnn.is_available() and mkldnn.enabled:
        out = torch.ops.aten.mkldnn_convolution(x[..., None], conv.weight[..., None], conv.bias, [0, 0], [stride, 1],
                                                [1, 1], 1)  # as a 2-D convolution of width 1
        return out[..., 0]
    return F.conv1d(x, conv.weight, conv.bias, stride=stride)


class EncoderWindowFull(RuntimeError):
    """More audio than the positional table holds (1500 frames, 30 s): open a new stream."""


def block_frames_for(chunk_ms: int) -> int:
    """Block size in encoder frames for a chunk of `chunk_ms` (40/100/200/300/1000 ms -> 2/5/10/15/50)."""
    if chunk_ms <= 0 or chunk_ms % FRAME_MS:
        raise ConfigError(f"asr.chunk_ms must be a positive multiple of {FRAME_MS} ms, got {chunk_ms}")
    return chunk_ms // FRAME_MS


def block_end(frame: int, block_frames: int) -> int:
    """Exclusive end (in encoder frames) of the block holding `frame`; the first block is 2 * block_frames."""
    return max(2, frame // block_frames + 1) * block_frames


def emission_sample(frame_end: int) -> int:
    """Samples after which the block ending at encoder frame `frame_end` is emitted (its last 10 ms hop
    plus the conv's 10 ms look-ahead; see `AudioEncoderStream`)."""
    return FRAME_SAMPLES * frame_end + FRAME_SAMPLES // 2


def block_causal_mask(
    q_start: int, q_end: int, k_end: int, block_frames: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Boolean [q_end - q_start, k_end] mask (True = attend) of queries q_start.. over keys 0..k_end-1."""
    i = torch.arange(q_start, q_end, device=device)
    limit = torch.clamp(i // block_frames + 1, min=2) * block_frames
    return torch.arange(k_end, device=device)[None, :] < limit[:, None]


_PACKED: weakref.WeakKeyDictionary[WhisperEncoder, tuple[tuple, list[PackedLayer]]] = weakref.WeakKeyDictionary()


class CausalWhisperEncoder:
    """The block-causal view of a Whisper model's encoder (its weights, not a copy).

    `model` is a WhisperForConditionalGeneration / WhisperModel (possibly peft-wrapped) or a WhisperEncoder.
    Dropout follows the encoder's train/eval mode; layerdrop is not applied.
    """

    def __init__(self, model: PreTrainedModel | WhisperEncoder, *, block_frames: int,
                 graph: OnnxEncoderLayers | None = None) -> None:
        """`graph`: the layers as an ONNX Runtime graph, which streams run wherever they would run packed weights
        (`asr.graph_runtime = onnxruntime`; onnx_encoder.py)."""
        if block_frames < 1:
            raise ConfigError(f"block_frames must be >= 1, got {block_frames}")
        self.encoder: WhisperEncoder = model if isinstance(model, WhisperEncoder) else model.get_encoder()
        self.block_frames = block_frames
        config = self.encoder.config
        self.n_mels: int = config.num_mel_bins
        self.d_model: int = config.d_model
        self.max_frames: int = config.max_source_positions  # 1500: the positional table
        self.heads: int = config.encoder_attention_heads
        self.graph = graph

    @property
    def device(self) -> torch.device:
        return self.encoder.conv1.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.encoder.conv1.weight.dtype

    def stream_weights(self) -> list[PackedLayer] | None:
        """Per-layer packed weights for streaming, or None where the stream must call the modules.

        None in train mode (dropout) and when any projection is not a plain `nn.Linear` (peft LoRA wrappers,
        unmerged). Built lazily from the modules' current weights, shared by every view of the same encoder,
        and rebuilt when a parameter is replaced, moved or changed in place (its version counter); writes
        through `param.data` (or to inference tensors) bypass it and are not seen. On CPU this holds a second
        copy of the layer weights, transposed: MKL's GEMM on 2-50 rows is ~1.5-2x faster on [in, out] matrices.
        """
        enc = self.encoder
        linears = [(la.self_attn.q_proj, la.self_attn.k_proj, la.self_attn.v_proj, la.self_attn.out_proj, la.fc1,
                    la.fc2) for la in enc.layers]  # fmt: skip
        if any(m.training for m in enc.modules()) or any(type(m) is not nn.Linear for ms in linears for m in ms):
            return None
        key = tuple((p.data_ptr(), -1 if p.is_inference() else p._version, p.dtype) for p in enc.layers.parameters())
        cached = _PACKED.get(enc)
        if cached is None or cached[0] != key:
            _PACKED.pop(enc, None)  # free the stale copy before building the new one
            with torch.no_grad():
                cached = _PACKED[enc] = (key, [pack_layer(layer) for layer in enc.layers])
        return cached[1]

    def frames_for(self, mel_frames: int) -> int:
        """Encoder frames of `mel_frames` mel frames: ceil(T / 2)."""
        return -(-mel_frames // MEL_PER_FRAME)

    def forward_full(self, mel: torch.Tensor, frames: int | None = None) -> torch.Tensor:
        """[B, n_mels, T] mel -> [B, ceil(T / 2), d_model] states under the block-causal mask, in one pass.

        Differentiable and batched. Every sequence in the batch is read as T frames long: with right padding,
        frames whose block (or whose conv window, one mel frame ahead) reaches the padding see it. `frames`
        keeps only the first `frames` encoder frames after the convs (the last block ends there): what a stream's
        `preview` computes when its front end has made that many.
        """
        enc = self.encoder
        if mel.ndim != 3 or mel.shape[1] != self.n_mels:
            raise ValueError(f"mel must be [batch, {self.n_mels}, frames], got {tuple(mel.shape)}")
        if self.frames_for(mel.shape[2]) > self.max_frames:
            raise ValueError(f"{mel.shape[2]} mel frames exceed the encoder's {self.max_frames} positions (30 s)")
        mel = mel.to(self.device, self.dtype)
        x = F.gelu(enc.conv2(F.gelu(enc.conv1(mel)))).transpose(1, 2)
        if frames is not None:
            x = x[:, :frames]
        t = x.shape[1]
        h = x + enc.embed_positions(torch.arange(t, device=x.device))
        h = F.dropout(h, p=enc.dropout, training=enc.training)
        mask = block_causal_mask(0, t, t, self.block_frames, x.device)
        for layer in enc.layers:
            h = hf_layer(layer, h, mask, None)
        return enc.layer_norm(h)

    @torch.inference_mode()
    def encode_audio(self, samples: np.ndarray, *, init_max: float = INIT_MAX,
                     frames: int | None = None) -> torch.Tensor:
        """Offline states [frames, d_model] of up to 30 s of 16 kHz audio: what `AudioEncoderStream` emits
        (`frames`: only the first so many, the last block ending there: see `forward_full`)."""
        return self.forward_full(log_mel(samples, self.n_mels, init_max=init_max)[None], frames)[0]

    @torch.inference_mode()
    def open(self) -> MelEncoderStream:
        """A new mel-frame stream with empty caches."""
        return MelEncoderStream(self)

    def open_audio(self, *, init_max: float = INIT_MAX) -> AudioEncoderStream:
        """A new audio stream (causal log-mel + encoder stream)."""
        return AudioEncoderStream(self, init_max=init_max)


class MelEncoderStream:
    """Exact incremental `forward_full` of one mel stream; see the module docstring.

    `accept(mel [n_mels, n])` returns the encoder frames [k, d_model] of every block it completes (k is a
    whole number of blocks, often 0); `flush()` ends the input and returns the rest, including a final
    partial block. `frames_done` counts emitted frames; `conv1_frames`, `conv2_frames` and `layer_frames`
    count the work done, each frame exactly once.
    """

    def __init__(self, owner: CausalWhisperEncoder) -> None:
        self.owner = owner
        enc, device, dtype = owner.encoder, owner.device, owner.dtype
        self._mel = torch.zeros(owner.n_mels, 1, device=device, dtype=dtype)  # conv1's left zero padding
        self._conv = torch.zeros(owner.d_model, 1, device=device, dtype=dtype)  # conv2's left zero padding
        self._pending = torch.empty(0, owner.d_model, device=device, dtype=dtype)  # embedded, not yet in a block
        self._caches = [KVCache(owner.max_frames) for _ in enc.layers]
        self._packed = owner.stream_weights()  # None: the modules' path (peft LoRA, train mode)
        self.mel_frames = 0  # mel frames received
        self.conv1_frames = 0
        self.conv2_frames = 0  # = encoder frames out of the front end (their positions)
        self.layer_frames = 0  # frames pushed through the layers
        self.frames_done = 0  # encoder frames emitted
        self.closed = False

    def _front(self, mel: torch.Tensor, *, last: bool) -> None:
        """Run the convs over the new mel frames as far as their right context allows (all of it if last)."""
        enc = self.owner.encoder
        zero_mel = mel.new_zeros(mel.shape[0], 1 if last and self.mel_frames else 0)
        x = torch.cat([self._mel, mel, zero_mel], dim=1)
        n1 = max(0, x.shape[1] - 2)
        self._mel = x[:, n1:]
        y = self._conv
        if n1:
            y1 = F.gelu(stream_conv(x[None], enc.conv1))[0]
            y = torch.cat([y, y1], dim=1)
            self.conv1_frames += n1
        if last and self.mel_frames:
            y = torch.cat([y, y.new_zeros(y.shape[0], 1)], dim=1)  # conv2's right zero padding
        n2 = max(0, (y.shape[1] - 3) // 2 + 1)
        self._conv = y[:, 2 * n2 :]
        if n2:
            y2 = F.gelu(stream_conv(y[None], enc.conv2, stride=2))[0].T
            pos = enc.embed_positions(torch.arange(self.conv2_frames, self.conv2_frames + n2, device=y2.device))
            self._pending = torch.cat([self._pending, y2 + pos])
            self.conv2_frames += n2

    def _layers(self, *, last: bool) -> torch.Tensor:
        """Push every completed block (every pending frame if last) through the layers; return the states."""
        gran, start = self.owner.block_frames, self.layer_frames
        end = start
        while end < self.conv2_frames and (last or block_end(end, gran) <= self.conv2_frames):
            end = min(block_end(end, gran), self.conv2_frames)
        if end == start:
            return self._pending.new_empty(0, self.owner.d_model)
        h, self._pending = self._pending[: end - start], self._pending[end - start :]
        self.layer_frames = self.frames_done = end
        return self._run(h, start)

    def _run(self, h: torch.Tensor, start: int) -> torch.Tensor:
        """The layers over frames h [t, d] at positions start.. (whole blocks, or one partial block), their
        keys/values appended to the caches; returns the final states."""
        gran, end = self.owner.block_frames, start + h.shape[0]
        single = block_end(start, gran) >= end  # one block: every key is visible, no mask needed
        mask = None if single else block_causal_mask(start, end, end, gran, h.device)
        if self._packed is not None and self.owner.graph is not None:
            return self.owner.graph.run(h, mask, self._caches)
        if self._packed is not None:
            for packed, cache in zip(self._packed, self._caches, strict=True):
                h = packed_layer(packed, h, mask, cache, self.owner.heads)
        else:
            h = h[None]
            for layer, cache in zip(self.owner.encoder.layers, self._caches, strict=True):
                h = hf_layer(layer, h, mask, cache)
            h = h[0]
        return self.owner.encoder.layer_norm(h)

    @torch.inference_mode()
    def preview(self, mel: torch.Tensor) -> torch.Tensor:
        """The states [k, d_model] of the frames past the last completed block, were `mel` [n_mels, n] accepted and
        the partial block ended there (its frames attend to each other and to every earlier block: `forward_full`
        over only these frames); then all of it is taken back. The front end runs on the carried convolution state
        and the layers append to the K/V caches, which are truncated again: the stream is left as it was, so what
        it emits later does not depend on whether, or where, it was previewed. Frames still held back for the
        convolutions' look-ahead are not in it."""
        if self.closed:
            raise RuntimeError("MelEncoderStream.preview after flush")
        if mel.ndim != 2 or mel.shape[0] != self.owner.n_mels:
            raise ValueError(f"mel must be [{self.owner.n_mels}, frames], got {tuple(mel.shape)}")
        start = self.layer_frames
        carried = self._mel, self._conv, self._pending, self.conv1_frames, self.conv2_frames  # `_front` rebinds them
        try:
            self._front(mel.to(self.owner.device, self.owner.dtype), last=False)
            if self._pending.shape[0] == 0:
                return self._pending.new_empty(0, self.owner.d_model)
            return self._run(self._pending, start)
        finally:
            self._mel, self._conv, self._pending, self.conv1_frames, self.conv2_frames = carried
            for cache in self._caches:
                cache.truncate(start)

    @torch.inference_mode()
    def accept(self, mel: torch.Tensor) -> torch.Tensor:
        """Feed mel frames [n_mels, n]; returns the encoder frames [k, d_model] of the blocks they complete."""
        if self.closed:
            raise RuntimeError("MelEncoderStream.accept after flush: open a new stream")
        if mel.ndim != 2 or mel.shape[0] != self.owner.n_mels:
            raise ValueError(f"mel must be [{self.owner.n_mels}, frames], got {tuple(mel.shape)}")
        limit = self.owner.max_frames * MEL_PER_FRAME
        if self.mel_frames + mel.shape[1] > limit:
            raise EncoderWindowFull(
                f"encoder stream full: {self.mel_frames + mel.shape[1]} mel frames exceed {limit} "
                f"({self.owner.max_frames} encoder frames, 30 s); flush it and open a new stream"
            )
        self._front(mel.to(self.owner.device, self.owner.dtype), last=False)
        self.mel_frames += mel.shape[1]
        return self._layers(last=False)

    @torch.inference_mode()
    def flush(self) -> torch.Tensor:
        """End of input: the held-back frames (right edge zero-padded as in `forward_full`); closes the stream."""
        if self.closed:
            raise RuntimeError("MelEncoderStream.flush called twice")
        self.closed = True
        self._front(self._mel[:, :0], last=True)
        return self._layers(last=True)


class AudioEncoderStream:
    """Audio in, encoder states out: `StreamingLogMel` feeding an `MelEncoderStream`.

    Block b (ending at encoder frame e, i.e. e * 20 ms) is emitted by the `accept` that brings the audio to
    e * 20 ms + 10 ms (sample 160 * (2e + 1)): its last 10 ms hop of mel plus one hop of conv look-ahead.
    At most 30 s (480000 samples) per stream.
    """

    def __init__(self, encoder: CausalWhisperEncoder, *, init_max: float = INIT_MAX) -> None:
        self.mel = StreamingLogMel(encoder.n_mels, init_max=init_max)
        self.stream = encoder.open()
        self.max_samples = encoder.max_frames * MEL_PER_FRAME * HOP

    @property
    def frames_done(self) -> int:
        return self.stream.frames_done

    def accept(self, samples: np.ndarray) -> torch.Tensor:
        """Feed float32 16 kHz samples; returns the new encoder frames [k, d_model]."""
        if self.mel.samples_seen + len(samples) > self.max_samples:
            raise EncoderWindowFull(
                f"encoder stream full: {self.mel.samples_seen + len(samples)} samples exceed "
                f"{self.max_samples} (30 s); flush it and open a new stream"
            )
        return self.stream.accept(self.mel.accept(samples))

    def preview(self, samples: np.ndarray) -> torch.Tensor:
        """The partial block's states were `samples` accepted, all taken back (`MelEncoderStream.preview`)."""
        return self.stream.preview(self.mel.peek(samples))

    def flush(self) -> torch.Tensor:
        """End of input: every remaining frame."""
        head = self.stream.accept(self.mel.flush())
        return torch.cat([head, self.stream.flush()])
