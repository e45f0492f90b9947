"""`runtime train average`: one FastConformer checkpoint whose weights are the mean of several.

Why: the last checkpoints of a run sit at different points around the same minimum, each a little off in its
own direction; their mean is usually nearer the middle, so it scores better than any one of them at no cost
at inference (the same architecture, the same size). NeMo and fairseq ship the same step as a script. Only
checkpoints of one run make sense to average: they must have the same architecture, features and tokenizer,
which is checked, and the mean goes through the same writer and loader as every other checkpoint.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from runtime.errors import ConfigError
from runtime.train.outputs import out_folder

if TYPE_CHECKING:  # the model code imports torch, which `--help` does not need
    from runtime.models.asr.fastconformer.model import FastConformerCTC
    from runtime.models.asr.fastconformer.tokenizer import CTCTokenizer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoints", nargs="+", help="two or more checkpoint directories of one run "
                        "(e.g. runs/fc/checkpoint-152000 runs/fc/checkpoint-154000 runs/fc/checkpoint-156000)")
    parser.add_argument("--out", required=True, help="the directory to write the averaged checkpoint into")


def average_checkpoints(directories: list[Path]) -> tuple[FastConformerCTC, CTCTokenizer]:
    """The first checkpoint's model with every floating-point tensor replaced by the mean over all of them
    (summed in float64); integer buffers must agree. Refuses checkpoints that differ in anything but weights."""
    import torch

    from runtime.models.asr.fastconformer.checkpoint import config_to_dict, load_checkpoint

    if len(directories) < 2:
        raise ConfigError("give at least two checkpoints to average")
    model, tokenizer = load_checkpoint(directories[0])
    reference = config_to_dict(model.cfg)
    sums = {k: v.double() if v.is_floating_point() else v for k, v in model.state_dict().items()}
    for directory in directories[1:]:
        other, other_tokenizer = load_checkpoint(directory)
        if config_to_dict(other.cfg) != reference:
            raise ConfigError(f"{directory}: its architecture or features differ from {directories[0]}'s; "
                              "only checkpoints of one run can be averaged")
        if other_tokenizer.to_json() != tokenizer.to_json():
            raise ConfigError(f"{directory}: its tokenizer differs from {directories[0]}'s")
        for key, value in other.state_dict().items():
            if value.is_floating_point():
                sums[key] += value.double()
            elif not torch.equal(value, sums[key]):
                raise ConfigError(f"{directory}: buffer {key} differs from {directories[0]}'s")
    model.load_state_dict({k: (v / len(directories)).float() if v.is_floating_point() else v for k, v in sums.items()})
    return model, tokenizer


def run(args: argparse.Namespace) -> int:
    from runtime.models.asr.fastconformer.checkpoint import CONFIG_FILE, save_checkpoint

    directories = [Path(p).expanduser() for p in args.checkpoints]
    out = Path(args.out).expanduser()
    if any(out.resolve() == d.resolve() for d in directories):
        raise ConfigError(f"--out {out} is one of the checkpoints being averaged; write the mean elsewhere")
    out_folder(out, create=False)  # made only once the checkpoints are known to average
    model, tokenizer = average_checkpoints(directories)
    trainings = [json.loads((d / CONFIG_FILE).read_text(encoding="utf-8")).get("training") or {} for d in directories]
    sources = [{"checkpoint": str(d), "steps": t.get("steps")} for d, t in zip(directories, trainings, strict=True)]
    save_checkpoint(model, tokenizer, out_folder(out), training={**trainings[-1], "averaged": sources})
    print(json.dumps({"out": str(out), "averaged": sources}))
    return 0
