"""LoRA adapters that teach an offline Whisper to read block-causal encoder states (CarelessWhisper).

Adapters sit on the q/k/v/out projections of the encoder self-attention, the decoder self-attention and the
decoder cross-attention: the encoder must learn to work without future context, and the decoder to read
the states that result. Rank 16-32 (default 16), alpha = rank (scale 1), no dropout; peft initialises B to
zero, so an untrained adapter leaves the model's outputs exactly unchanged and training starts from the
offline model. Convolutions, MLPs, embeddings and norms stay frozen.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from peft import LoraConfig, PeftModel, get_peft_model
from transformers import WhisperForConditionalGeneration

DEFAULT_RANK = 16
# peft full-matches a string target against module names such as model.decoder.layers.3.encoder_attn.k_proj
TARGET_MODULES = (
    r"(.*\.)?(encoder\.layers\.\d+\.self_attn|decoder\.layers\.\d+\.(self_attn|encoder_attn))"
    r"\.(q_proj|k_proj|v_proj|out_proj)"
)


@contextmanager
def _quiet() -> Iterator[None]:
    """peft 0.21 calls a transformers API that transformers 5 deprecates: noise, not the user's problem."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        yield


def lora_config(rank: int = DEFAULT_RANK) -> LoraConfig:
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    return LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0, bias="none", target_modules=TARGET_MODULES)


def add_lora(model: WhisperForConditionalGeneration, rank: int = DEFAULT_RANK) -> PeftModel:
    """Wrap `model` (in place) with fresh trainable adapters; only the adapters require grad."""
    with _quiet():
        return get_peft_model(model, lora_config(rank))


def adapter_path(ref: str | Path) -> Path:
    """A folder, or `builtin:NAME` for an adapter shipped in the package (runtime/models/builtin/NAME)."""
    if str(ref).startswith("builtin:"):
        from runtime.models.loading import BUILTIN_DIR

        return BUILTIN_DIR / str(ref).removeprefix("builtin:")
    return Path(ref).expanduser()


def load_adapter(model: WhisperForConditionalGeneration, path: str | Path, *, trainable: bool = False) -> PeftModel:
    """Wrap `model` with the adapter saved in `path` (peft `save_pretrained` layout, as `runtime train` writes).
    For inference, `.merge_and_unload()` folds it into the weights."""
    path = adapter_path(path)
    if not (path / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{path} has no adapter_config.json")
    trained_for = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
    mismatch = ValueError(f"it was trained for another base model ({trained_for or 'unrecorded'}): its layers or "
                          "widths do not match this one's")
    with _quiet(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        try:
            adapted = PeftModel.from_pretrained(model, str(path), is_trainable=trainable)
        except RuntimeError as err:  # torch's "size mismatch for ..." while loading the adapter's state
            raise mismatch from err
    if any("missing adapter keys" in str(w.message) for w in caught):  # fewer layers: a silent partial load
        raise mismatch
    return adapted
