"""Cache-aware streaming of the FastConformer encoder: exact, flat per-chunk work.

State carried between chunks ("Stateful Conformer with Cache-based Inference"), all of constant size:
- features: at most one STFT window of pre-emphasised samples (features.FeatureStream);
- subsampling: per stride-2 stage, the <= 2 input frames its next output reads (the receptive-field context,
  as StreamiNNC argues for streaming CNNs). NeMo instead re-runs the subsampling over a cache of
  `subsampling_factor + 1` feature frames and drops outputs; carrying each stage's own context is exact by
  construction and does no repeated work;
- last-channel cache [layers, B, C, d]: each layer's attention inputs (after `norm_self_att`) of the last
  C = (left // chunk) * chunk frames (70 for the [[70, 13], [70, 6], [70, 1], [70, 0]] contexts), with a count
  of how many are real so the keys before the stream's start are masked exactly as the offline mask has none;
- last-time cache [layers, B, d, kernel - 1]: each layer's depthwise-conv inputs of the last kernel - 1 frames
  (zeros at the start = the offline causal left padding).

Encoder frames are released chunk by chunk (right + 1 frames): a chunk runs as soon as its last frame (the
right context of its first) has been computed, which happens once the audio reaches 12.5 ms past that
frame's centre. `finish()` zero-pads the features and the subsampling stages like the offline forward and
runs the last, possibly partial, chunk. The concatenated outputs equal `ConformerEncoder.forward` over the
whole signal with the same chunked-limited mask (tests: max abs diff <= 1e-4 in fp32).
"""

from __future__ import annotations

import numpy as np
import torch

from runtime.models.asr.fastconformer.features import FeatureStream
from runtime.models.asr.fastconformer.model import (
    SUB_KERNEL,
    SUB_LEFT,
    SUB_RIGHT,
    SUB_STRIDE,
    ConvSubsampling,
    FastConformerCTC,
)


class SubsamplingStream:
    """`ConvSubsampling.forward` incrementally: stage i keeps the tail of its input that its next output
    still reads; it starts as the left padding (zeros)."""

    def __init__(self, sub: ConvSubsampling, n_mels: int, device: torch.device, dtype: torch.dtype) -> None:
        self.sub = sub
        self.bufs: list[torch.Tensor] = []
        channels, freq = 1, n_mels
        for i in range(len(sub.stage_slices)):
            self.bufs.append(torch.zeros(1, channels, SUB_LEFT, freq, device=device, dtype=dtype))
            channels = sub.conv[sub.stage_slices[i][0]].out_channels
            freq = (freq + SUB_LEFT + SUB_RIGHT - SUB_KERNEL) // SUB_STRIDE + 1

    def _push(self, i: int, x: torch.Tensor | None) -> torch.Tensor | None:
        """Append stage i's new inputs; run every output they complete (None if none)."""
        buf = self.bufs[i] if x is None or x.shape[2] == 0 else torch.cat([self.bufs[i], x], dim=2)
        length = buf.shape[2]
        if length < SUB_KERNEL:
            self.bufs[i] = buf
            return None
        count = (length - SUB_KERNEL) // SUB_STRIDE + 1
        out = self.sub.stage(i, buf[:, :, : (count - 1) * SUB_STRIDE + SUB_KERNEL])
        self.bufs[i] = buf[:, :, count * SUB_STRIDE :]
        return out

    def _project(self, x: torch.Tensor | None) -> torch.Tensor:
        if x is None:
            return self.bufs[0].new_zeros(1, 0, self.sub.out.out_features)
        return self.sub.project(x)

    def accept(self, features: torch.Tensor) -> torch.Tensor:
        """[T, mels] new feature frames -> [1, n, d] new subsampled frames (before xscale)."""
        x: torch.Tensor | None = features.unsqueeze(0).unsqueeze(0)
        for i in range(len(self.bufs)):
            x = self._push(i, x)
            if x is None:
                break
        return self._project(x)

    def finish(self, features: torch.Tensor) -> torch.Tensor:
        """The last frames, then each stage's right padding (one zero frame) in turn, as offline."""
        x: torch.Tensor | None = features.unsqueeze(0).unsqueeze(0)
        for i, buf in enumerate(self.bufs):
            pad = buf.new_zeros(1, buf.shape[1], SUB_RIGHT, buf.shape[3])
            x = self._push(i, pad if x is None else torch.cat([x, pad], dim=2))
        return self._project(x)


class CacheAwareEncoderStream:
    """One stream of encoder frames for a fixed [left, right] attention context."""

    def __init__(self, model: FastConformerCTC, context: tuple[int, int]) -> None:
        cfg = model.cfg
        if tuple(context) not in cfg.att_context_sizes:
            raise ValueError(f"attention context {list(context)} not among the model's {cfg.att_context_sizes}")
        self.model = model
        self.context = tuple(context)
        self.chunk = context[1] + 1
        self.cache_len = (context[0] // self.chunk) * self.chunk
        device, dtype = model.device, model.dtype
        self.features = FeatureStream(model.preprocessor.featurizer)
        self.subsampling = SubsamplingStream(model.encoder.pre_encode, cfg.features.features, device, dtype)
        kernel_ctx = cfg.conv_kernel_size - 1
        self.cache_last_channel = torch.zeros(cfg.n_layers, 1, self.cache_len, cfg.d_model, device=device, dtype=dtype)
        self.cache_last_time = torch.zeros(cfg.n_layers, 1, cfg.d_model, kernel_ctx, device=device, dtype=dtype)
        self.cache_valid = 0  # real frames in the last-channel cache
        self.pending = torch.zeros(1, 0, cfg.d_model, device=device, dtype=dtype)  # frames awaiting a chunk
        self.frames_out = 0
        self.samples_in = 0
        self.finished = False

    def state_sizes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of everything carried between calls (for the flat-work check)."""
        return {
            "cache_last_channel": tuple(self.cache_last_channel.shape),
            "cache_last_time": tuple(self.cache_last_time.shape),
            "pending": tuple(self.pending.shape),
            "feature_samples": (self.features.buffered,),
            **{f"subsampling_{i}": tuple(b.shape) for i, b in enumerate(self.subsampling.bufs)},
        }

    @torch.inference_mode()
    def accept(self, samples: np.ndarray) -> torch.Tensor:
        """Float32 mono samples -> [n, d] encoder frames completed by them (n may be 0)."""
        if self.finished:
            raise RuntimeError("encoder stream is finished")
        self.samples_in += len(samples)
        feats = self.features.accept(samples)
        if len(feats) == 0:
            return self.pending.new_zeros(0, self.pending.shape[2])
        return self._frames(self.subsampling.accept(feats.to(self.pending.device, self.pending.dtype)), final=False)

    @torch.inference_mode()
    def finish(self) -> torch.Tensor:
        """Flush: the remaining frames, the last chunk possibly partial."""
        if self.finished:
            return self.pending.new_zeros(0, self.pending.shape[2])
        self.finished = True
        if self.samples_in == 0:
            return self.pending.new_zeros(0, self.pending.shape[2])
        feats = self.features.finish().to(self.pending.device, self.pending.dtype)
        return self._frames(self.subsampling.finish(feats), final=True)

    def _frames(self, new: torch.Tensor, *, final: bool) -> torch.Tensor:
        pending = torch.cat([self.pending, new * self.model.encoder.xscale], dim=1) if new.shape[1] else self.pending
        outs = []
        start = 0
        while pending.shape[1] - start >= self.chunk or (final and pending.shape[1] > start):
            n = min(self.chunk, pending.shape[1] - start)
            outs.append(self._run_chunk(pending[:, start : start + n]))
            start += n
        self.pending = pending[:, start:]
        if not outs:
            return pending.new_zeros(0, pending.shape[2])
        out = torch.cat(outs, dim=1)[0]
        self.frames_out += out.shape[0]
        return out

    def _run_chunk(self, x: torch.Tensor) -> torch.Tensor:
        n, c = x.shape[1], self.cache_len
        keys = c + n
        allowed = torch.ones(n, keys, dtype=torch.bool, device=x.device)
        allowed[:, : c - self.cache_valid] = False  # cache slots from before the stream's start
        pos = self.model.encoder.pos_emb(keys, x)
        for i, layer in enumerate(self.model.encoder.layers):
            x, att_keys, conv_full = layer(x, pos, allowed, self.cache_last_channel[i], self.cache_last_time[i])
            self.cache_last_channel[i].copy_(att_keys[:, n:])
            self.cache_last_time[i].copy_(conv_full[:, :, conv_full.shape[2] - self.cache_last_time.shape[3] :])
        self.cache_valid = min(c, self.cache_valid + n)
        return x
