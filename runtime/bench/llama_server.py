"""llama.cpp's OpenAI-compatible server (llama-cpp-python[server]) serving a GGUF file on 127.0.0.1: the real server
that `runtime bench remote-lm` measures the remote answerer against and its tests answer from (never a mock)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from runtime.models.packaged import packaged_checkpoint

INSTALL = "pip install 'llama-cpp-python[server]==0.3.36' (builds from source, ~10 min; .ci/run does it)"


def installed() -> str | None:
    """None when llama.cpp's server can run here, else why not (with the install command)."""
    try:
        import llama_cpp.server  # noqa: F401
    except ImportError:
        return f"llama.cpp's server is not installed: {INSTALL}"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """One `python -m llama_cpp.server` process; its stderr (where it reports prefix-cache hits) goes to a temporary
    file, removed by `stop` (a `start` after it writes a new one)."""

    def __init__(self, port: int | None = None, n_ctx: int = 4096, threads: int = 1) -> None:
        folder = packaged_checkpoint("smollm2-135m-instruct")
        assert folder is not None
        self.model = str(next(Path(folder).glob("*.gguf")))
        self.port = port or free_port()
        self.n_ctx, self.threads = n_ctx, threads
        self.log_path: Path | None = None  # made by `start`
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout_s: float = 120.0) -> LlamaServer:
        fd, name = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
        self.log_path = Path(name)
        log = os.fdopen(fd, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llama_cpp.server", "--model", self.model, "--host", "127.0.0.1",
             "--port", str(self.port), "--n_ctx", str(self.n_ctx), "--n_threads", str(self.threads),
             "--n_threads_batch", str(self.threads), "--interrupt_requests", "False",
             "--chat_format", "chatml-function-calling", "--model_alias", "smollm2"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                said = self.log()[-2000:]
                self.stop()
                raise RuntimeError(f"llama.cpp's server exited: {said}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/models", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"llama.cpp's server did not start in {timeout_s:g} s")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the process (`sig`, then SIGKILL after 10 s) and remove its log."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.proc = None
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)

    def log(self) -> str:
        """What the server wrote since it started ("" before a start and once stopped)."""
        try:
            return self.log_path.read_text(errors="replace") if self.log_path is not None else ""
        except FileNotFoundError:
            return ""


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> None:
    """`python -m runtime.bench.llama_server [--port 8000]`: serve the shipped SmolLM2 until Ctrl-C, for
    `lm.backend = openai` (docs/remote_lm.md) without finding the GGUF file by hand."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--n-ctx", type=int, default=8192, help="the server's context in tokens")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    reason = installed()
    if reason is not None:
        raise SystemExit(f"runtime: error: {reason}")
    signal.signal(signal.SIGTERM, _interrupt)  # `kill`, systemd, `timeout`: stop the server too, as Ctrl-C does
    server = LlamaServer(args.port, n_ctx=args.n_ctx, threads=args.threads).start()
    print(f"serving {server.model} at {server.base_url} as model 'smollm2' (log: {server.log_path}); Ctrl-C stops it",
          flush=True)
    try:
        while server.proc is not None and server.proc.poll() is None:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


if __name__ == "__main__":
    main()
