"""llama.cpp's server as the tests run it (`runtime/bench/llama_server.py`): locally a missing llama-cpp-python
skips, in CI (which installs it: .ci/run, `make peers`) it fails."""

from __future__ import annotations

import os

import pytest

from runtime.bench import llama_server
from runtime.bench.llama_server import free_port

__all__ = ["LlamaServer", "free_port"]


def LlamaServer(port: int | None = None, n_ctx: int = 4096) -> llama_server.LlamaServer:  # noqa: N802 (a class, as callers see it)
    reason = llama_server.installed()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    return llama_server.LlamaServer(port, n_ctx)
