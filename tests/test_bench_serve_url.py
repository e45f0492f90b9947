"""`runtime bench serve --url URL` drives voice conversations through a server it did not start: here a real
`runtime serve --profile tiny` process the test starts on a free port. The JSON holds turn latency and error
counts per M, and the server's own /metrics show the bench's turns and answers really went through it (the
bench reads nothing from the server itself). Timing is not asserted, only that the numbers are there and
consistent. Bad input is one error line. (Through a fleet's proxy: tests/test_fleet.py.)"""

import argparse
import asyncio
import json
import urllib.request

import pytest
from cli_common import one_error_line, run_cli

from runtime.bench.serve import _Server
from runtime.bench.serve_url import base_url
from runtime.errors import UserError

# paced in real time with time-outs: `make test` runs these alone, after the rest (docs/testing.md)
pytestmark = pytest.mark.realtime


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = _Server(argparse.Namespace(device="cpu", dtype=None, threads=1), 8, tmp_path_factory.mktemp("srv"))
    try:
        asyncio.run(server.wait_ready())
        yield server
    finally:
        server.stop()


def test_bench_serve_url_through_a_running_server(capsys, server):
    turns_before = metric(server.port, "runtime_turns_committed_total")
    code, out, _ = run_cli(capsys, "bench", "serve", "--url", f"ws://127.0.0.1:{server.port}/v1", "--quick",
                           "--sessions", "2", "--json", "-q")
    assert code == 0 and len(out.strip().splitlines()) == 1
    result = json.loads(out)
    assert result["bench"] == "serve-url" and result["url"] == f"ws://127.0.0.1:{server.port}/v1"
    assert result["sessions"] == [2] and result["turns_per_session"] == 2 and list(result["per_m"]) == ["2"]
    m = result["per_m"]["2"]
    assert m["turns_spoken"] == 4 == m["turns_answered"] and m["lost"] == 0
    assert m["errors"] == 0 and m["error_codes"] == {} and m["sessions_failed"] == 0
    latency = m["turn_latency_ms"]
    assert latency["n"] == 4 and 0 < latency["p50"] <= latency["p95"] <= latency["max"]
    assert result["errors"] == result["sessions_failed"] == result["lost"] == 0
    assert len(result["rows"]) == 1 and result["rows"][0]["n"] == 2
    # the server counted them: the warm-up's turn and the phase's four, each session's finish commits once more
    assert metric(server.port, "runtime_turns_committed_total") - turns_before >= 5
    assert metric(server.port, 'runtime_responses_total{status="incomplete"}') >= 5  # tiny: 24 tokens, incomplete


def test_bench_serve_url_unreachable_is_one_line(capsys, server):
    code, _, err = run_cli(capsys, "bench", "serve", "--url", f"ws://127.0.0.1:{server.port}/nowhere", "--quick")
    assert code != 0 and "HTTP 404" in one_error_line(err)


@pytest.mark.parametrize("argv, says", [
    (("bench", "serve", "--url", "http://127.0.0.1:1/v1"), "ws://HOST:PORT/v1"),
    (("bench", "serve", "--url", "ws://127.0.0.1:1/v1"), "cannot open a session"),
    (("bench", "asr", "--url", "ws://127.0.0.1:1/v1"), "mode of `runtime bench serve`"),
    (("bench", "serve", "--sessions", "2"), "only with runtime bench serve --url"),
])
def test_bad_url_arguments_are_one_line(capsys, argv, says):
    code, _, err = run_cli(capsys, *argv)
    assert code != 0 and says in one_error_line(err)


def test_sessions_must_be_counts(capsys):
    with pytest.raises(SystemExit):
        run_cli(capsys, "bench", "serve", "--url", "ws://127.0.0.1:1/v1", "--sessions", "0,2")
    assert "whole numbers >= 1" in capsys.readouterr().err


def test_base_url_takes_the_sdk_base_or_the_full_path():
    assert base_url("ws://127.0.0.1:8080/v1") == "ws://127.0.0.1:8080/v1"
    assert base_url("ws://127.0.0.1:8080/v1/realtime") == "ws://127.0.0.1:8080/v1"
    assert base_url("wss://fleet.example/v1/") == "wss://fleet.example/v1"
    with pytest.raises(UserError):
        base_url("ws://127.0.0.1:8080/v1/realtime?model=x")
