"""`runtime train average`: the mean of several checkpoints, written and loaded like any other, and refused
for checkpoints that are not of one run."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from cli_common import one_error_line, run_cli

from runtime.models.asr.fastconformer.checkpoint import load_checkpoint, save_checkpoint
from runtime.models.asr.fastconformer.model import FastConformerCTC

BUILTIN = Path(__file__).resolve().parents[1] / "runtime" / "models" / "builtin" / "demo-fastconformer"


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    """The shipped model and two perturbed copies, as checkpoints of "one run" (steps 1-3)."""
    root = tmp_path_factory.mktemp("avg")
    model, tokenizer = load_checkpoint(BUILTIN)
    generator = torch.Generator().manual_seed(0)
    paths = []
    for step in (1, 2, 3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=generator))
        paths.append(save_checkpoint(model, tokenizer, root / f"checkpoint-{step}", training={"steps": step}))
    return root, paths


def test_the_average_is_the_mean_and_loads_as_a_checkpoint(capsys, three):
    root, paths = three
    code, out, _ = run_cli(capsys, "train", "average", *map(str, paths), "--out", str(root / "mean"))
    assert code == 0 and [s["steps"] for s in json.loads(out)["averaged"]] == [1, 2, 3]
    mean, tokenizer = load_checkpoint(root / "mean")
    states = [load_checkpoint(p)[0].state_dict() for p in paths]
    for key, value in mean.state_dict().items():
        expected = sum(s[key].double() for s in states) / 3 if value.is_floating_point() else states[0][key]
        torch.testing.assert_close(value, expected.to(value.dtype), rtol=0, atol=1e-7)
    assert tokenizer.to_json() == load_checkpoint(BUILTIN)[1].to_json()
    training = json.loads((root / "mean" / "config.json").read_text())["training"]
    assert training["steps"] == 3 and len(training["averaged"]) == 3


def test_checkpoints_of_different_runs_or_too_few_are_refused(capsys, three, tmp_path):
    root, paths = three
    model, tokenizer = load_checkpoint(paths[0])
    other = FastConformerCTC(dataclasses.replace(model.cfg, n_layers=model.cfg.n_layers - 1))
    save_checkpoint(other, tokenizer, tmp_path / "other")
    for args, message in [([paths[0], tmp_path / "other"], "architecture or features differ"),
                          ([paths[0]], "at least two"), ([paths[0], tmp_path / "nope"], "not a FastConformer"),
                          ([paths[0], paths[1]], "one of the checkpoints")]:
        out_dir = paths[1] if message == "one of the checkpoints" else tmp_path / "mean"
        code, _, err = run_cli(capsys, "train", "average", *map(str, args), "--out", str(out_dir))
        assert code != 0 and message in one_error_line(err), err
    assert not (tmp_path / "mean").exists()


def test_an_out_that_cannot_be_a_folder_is_one_line(capsys, three, tmp_path):
    _, paths = three
    afile = tmp_path / "afile"
    afile.write_text("x")
    for out, message in [(afile, f"--out {afile} is a file, not a folder"),
                         (afile / "sub", f"{afile} is a file, not a folder"),
                         ("/proc/nope", "cannot create --out /proc/nope: ")]:
        code, _, err = run_cli(capsys, "train", "average", *map(str, paths[:2]), "--out", str(out))
        assert code != 0 and message in one_error_line(err) and "Traceback" not in err
    assert afile.read_text() == "x"
