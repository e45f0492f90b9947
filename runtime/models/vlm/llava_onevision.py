"""The vision half of a LLaVA-OneVision checkpoint: SigLIP tower and projector, without its language model.

Why LLaVA-OneVision: its language model is a plain Qwen2 with 1-D RoPE, so the engine's own attention-sink
cache runs it unchanged (Qwen2.5-VL's 3-D M-RoPE does not fit a cache whose keys are re-rotated by slot
position); its projector is a per-token MLP, so pooling the projected patch grid is what the family itself does
for video (`get_video_features` pools after the projector); and Flash-VStream, whose memory we follow, pools
LLaVA patch grids the same way. The 0.5B and 7B checkpoints share the SigLIP so400m tower.

Only the tower and projector weights are read (`weights.load_state` with a renaming that keeps them), so the
language model is never held twice. Frames are preprocessed as the family's video processor does (resize to
the tower's square input, rescale, normalise with the checkpoint's mean/std), in torch, since transformers'
processors need PIL or torchvision, which this project does not depend on.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import LlavaOnevisionConfig, SiglipVisionModel
from transformers.models.llava_onevision.modeling_llava_onevision import LlavaOnevisionMultiModalProjector

from runtime.errors import CheckpointNotFound, ConfigError
from runtime.models.lm.weights import VLM_TYPES, load_state
from runtime.models.loading import load_progress, resolve_checkpoint, torch_dtype

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # the family's video processor defaults
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_TOWER = ("model.vision_tower.", "vision_tower.")
_PROJECTOR = ("model.multi_modal_projector.", "multi_modal_projector.")


def _vision_name(name: str) -> str | None:
    """Checkpoint name -> `tower.*` / `projector.*`, or None for language-model weights."""
    for prefixes, new in ((_TOWER, "tower."), (_PROJECTOR, "projector.")):
        for old in prefixes:
            if name.startswith(old):
                rest = name[len(old):]
                if new == "tower." and rest.startswith("vision_model."):  # the hub layout nests the tower
                    rest = rest.removeprefix("vision_model.")
                return new + rest
    return None


def _preprocessing(path: Path) -> tuple[tuple[float, ...], tuple[float, ...], float]:
    """(mean, std, rescale) from the checkpoint's video (else image) preprocessor config, else the defaults."""
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        file = path / name
        if file.is_file():
            cfg = json.loads(file.read_text())
            return (tuple(cfg.get("image_mean", CLIP_MEAN)), tuple(cfg.get("image_std", CLIP_STD)),
                    float(cfg.get("rescale_factor", 1 / 255)))
    return CLIP_MEAN, CLIP_STD, 1 / 255


def _materialise_buffers(module: torch.nn.Module, device: str) -> None:
    """Non-persistent buffers are not in the checkpoint, so building on the meta device leaves them empty;
    SigLIP's only one is `position_ids` (0..patches-1)."""
    for name, buf in list(module.named_buffers()):
        if not buf.is_meta:
            continue
        if not name.endswith("position_ids"):
            raise ConfigError(f"vision tower buffer {name} has no value in the checkpoint")
        owner = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
        owner.register_buffer("position_ids", torch.arange(buf.shape[-1], device=device).expand(buf.shape),
                              persistent=False)


class VisionEncoder:
    """Frames in, projected patch features out, pooled to the memory's `grid` x `grid` tokens per frame."""

    def __init__(self, tower: SiglipVisionModel, projector: LlavaOnevisionMultiModalProjector,
                 config: LlavaOnevisionConfig, *, grid: int, mean: Sequence[float], std: Sequence[float],
                 rescale: float = 1 / 255, max_batch: int = 8) -> None:
        vision = config.vision_config
        self.tower, self.projector, self.grid, self.max_batch = tower, projector, grid, max_batch
        self.size = int(vision.image_size)
        self.patches = self.size // int(vision.patch_size)  # patches per side
        if grid > self.patches:
            raise ConfigError(f"video.grid {grid} is larger than the vision tower's {self.patches} patches a side")
        self.layer = config.vision_feature_layer
        self.strategy = config.vision_feature_select_strategy
        self.dim = int(config.text_config.hidden_size)
        p = next(tower.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.mean = torch.tensor(mean, dtype=torch.float32, device=self.device).view(1, 3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32, device=self.device).view(1, 3, 1, 1)
        self.rescale = rescale

    @classmethod
    def load(cls, ref: str, *, grid: int, device: str, dtype: str,
             progress: Callable[[str], None] | None = None) -> VisionEncoder:
        with load_progress(progress, "vision", ref, device, dtype):
            path = resolve_checkpoint(ref, role="lm", progress=progress)
            cfg_file = path / "config.json"
            kind = json.loads(cfg_file.read_text()).get("model_type") if cfg_file.is_file() else None
            if kind not in VLM_TYPES:
                raise ConfigError(f"lm.model {ref!r} is a {kind!r} checkpoint, not a vision-language model "
                                  f"({', '.join(VLM_TYPES)}): video memory needs one")
            config = LlavaOnevisionConfig.from_pretrained(path)
            with torch.device("meta"):
                tower = SiglipVisionModel(config.vision_config)
                projector = LlavaOnevisionMultiModalProjector(config)
            state = load_state(path, device=device, dtype=torch_dtype(dtype), rename=_vision_name)
            for name, module in (("tower", tower), ("projector", projector)):
                part = {k.removeprefix(f"{name}."): v for k, v in state.items() if k.startswith(f"{name}.")}
                missing = sorted(set(module.state_dict()) - set(part))
                if missing:
                    raise CheckpointNotFound(f"vlm checkpoint {path} lacks {name} weights {missing[:3]}")
                module.load_state_dict(part, strict=False, assign=True)
            _materialise_buffers(tower, device)
            tower.eval().requires_grad_(False)
            projector.eval().requires_grad_(False)
            mean, std, rescale = _preprocessing(path)
        return cls(tower, projector, config, grid=grid, mean=mean, std=std, rescale=rescale)

    def preprocess(self, images: Sequence[np.ndarray]) -> Tensor:
        """RGB uint8 [H, W, 3] frames -> normalised pixels [n, 3, size, size] in the tower's dtype."""
        out = []
        for image in images:
            x = torch.from_numpy(np.ascontiguousarray(image)).to(self.device).permute(2, 0, 1)[None].float()
            if x.shape[-2:] != (self.size, self.size):
                x = F.interpolate(x, size=(self.size, self.size), mode="bicubic", align_corners=False,
                                  antialias=True)
            out.append(x)
        x = torch.cat(out) * self.rescale
        return ((x - self.mean) / self.std).to(self.dtype)

    @torch.inference_mode()
    def project(self, pixels: Tensor) -> Tensor:
        """Projected patch features [n, patches^2, dim] (the language model's embedding space)."""
        hidden = self.tower(pixel_values=pixels, output_hidden_states=True).hidden_states
        layers = [self.layer] if isinstance(self.layer, int) else list(self.layer)
        feats = torch.cat([hidden[i] for i in layers], dim=-1)
        if self.strategy == "default":  # drop a CLS token (SigLIP has none; kept for the family's contract)
            feats = feats[:, 1:]
        return self.projector(feats)

    def pool(self, feats: Tensor) -> Tensor:
        """[n, patches^2, dim] -> [n, grid^2, dim] by average pooling over the patch grid."""
        n, _, dim = feats.shape
        x = feats.reshape(n, self.patches, self.patches, dim).permute(0, 3, 1, 2)
        x = F.adaptive_avg_pool2d(x.float(), self.grid)
        return x.permute(0, 2, 3, 1).reshape(n, self.grid * self.grid, dim).to(feats.dtype)

    @torch.inference_mode()
    def encode(self, images: Sequence[np.ndarray]) -> Tensor:
        """Frames -> memory features [n, grid^2, dim], in batches of at most `max_batch`."""
        parts = [self.pool(self.project(self.preprocess(images[i : i + self.max_batch])))
                 for i in range(0, len(images), self.max_batch)]
        return torch.cat(parts) if parts else torch.empty(0, self.grid * self.grid, self.dim, dtype=self.dtype)
