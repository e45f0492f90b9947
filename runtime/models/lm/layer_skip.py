"""Self-speculation by layer skipping (SWIFT, 2024): the model itself, run through a subset of its layers, is
the draft model. No second checkpoint and no extra weights: the view shares every tensor with the target; only
its KV cache (one per kept layer) is its own.

SWIFT searches the skipped set on the fly; this keeps a fixed, simple one: every fifth layer between the first
two and the last two is skipped (5 of SmolLM2-135M's 30). Small models have little to spare: there, the draft's
greedy tokens agree with the full model's on 37 % of a fixed paragraph when every fifth layer is skipped, 5 %
for every fourth and 7 % for every other one (SWIFT's 1.3-1.6x were measured on 7B-13B models).
`runtime bench llm --model ...` measures what it buys against the other drafters.
"""

from __future__ import annotations

import copy
from dataclasses import replace

from torch import nn

from runtime.models.lm.transformer import Transformer


def kept_layers(num_layers: int) -> list[int]:
    """The layers the draft runs: all but every fifth one between the first two and the last two."""
    return [i for i in range(num_layers) if i < 2 or i >= num_layers - 2 or i % 5 != 4]


def layer_skip_view(model: Transformer, keep: list[int] | None = None) -> Transformer:
    """A Transformer over `keep` of `model`'s layers (default `kept_layers`), sharing its weights."""
    keep = kept_layers(model.args.num_layers) if keep is None else keep
    if not keep or any(not 0 <= i < model.args.num_layers for i in keep):
        raise ValueError(f"layers {keep} are not a non-empty subset of 0..{model.args.num_layers - 1}")
    view = copy.copy(model)
    view.__dict__["_modules"] = dict(model._modules)  # our own module table: the original's is left as it is
    backbone = copy.copy(model.model)
    backbone.__dict__["_modules"] = dict(model.model._modules)
    backbone.layers = nn.ModuleList(model.model.layers[i] for i in keep)
    view.model = backbone
    view.args = replace(model.args, num_layers=len(keep))
    view._rope_table = None
    return view
