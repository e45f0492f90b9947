"""`runtime bench serve --quick --json` runs a real server process and real SDK clients, and prints one JSON
object with the issue's fields. Phases are shortened to a few seconds; timing targets are not asserted (the
machine is shared and noisy), only that every number is there and consistent."""

import json

import pytest

from runtime.bench import serve
from runtime.cli import main

# paced in real time with time-outs: `make test` runs these alone, after the rest (docs/testing.md)
pytestmark = pytest.mark.realtime


@pytest.mark.slow
def test_bench_serve_quick_json(capsys, monkeypatch):
    monkeypatch.setenv(serve.SECONDS_ENV, "3")
    assert main(["bench", "serve", "--quick", "--json", "-q"]) == 0
    out = capsys.readouterr().out
    assert len(out.strip().splitlines()) == 1
    result = json.loads(out)
    for key in ("event_latency_ms", "loop_lag_ms", "sessions_kept_realtime", "rss_mb_per_session", "keeps_up",
                "targets", "chunk_ms", "n_sessions", "duration_s", "machine", "random_weights"):
        assert key in result, key
    ns = [str(n) for n in result["n_sessions"]]
    assert ns == ["1", "4"] and result["duration_s"] == 3.0 and result["random_weights"] is True
    for n in ns:
        latency = result["event_latency_ms"][n]
        assert latency["events"] > 0
        assert 0 < latency["p50"] <= latency["p95"] <= latency["p99"] <= latency["max"]
        assert 0 <= result["loop_lag_ms"][n]["p99"] <= result["loop_lag_ms"][n]["max"]
        assert result["loop_lag_ms"][n]["samples"] > 0
        # Per-session growth is a difference of two RSS readings: with pages the warm-up freed and glibc kept,
        # a short phase can read at or below the idle figure, so only the arithmetic is checked, not the sign.
        assert result["rss_mb"][n] > 0 and result["rss_mb"]["idle_after_warmup"] > 0
        expected = (result["rss_mb"][n] - result["rss_mb"]["idle_after_warmup"]) / int(n)
        assert abs(result["rss_mb_per_session"][n] - expected) <= 0.06
        assert result["server_sessions_live"][n] == int(n)
        sessions = result["keeps_up"][n]["sessions"]
        assert len(sessions) == int(n) and all(s["sent_s"] == 3.0 for s in sessions)
        assert result["keeps_up"][n]["all"] == all(s["keeps_up"] for s in sessions)
    assert result["sessions_kept_realtime"] in (0, *result["n_sessions"])
    assert set(result["targets"]) >= {"event_latency_p95_ms_at_4", "loop_lag_p99_ms_at_4"}
    for target in ("event_latency_p95_ms_at_4", "loop_lag_p99_ms_at_4"):
        assert isinstance(result["targets"][target]["met"], bool)
    assert result["machine"]["cpu_count"] >= 1
