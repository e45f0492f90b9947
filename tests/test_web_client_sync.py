"""The blocking SDK and the shipped example, against a real server running in its own thread (the blocking
client must never run on the server's loop)."""

import asyncio
import importlib.util
import threading
from pathlib import Path

import pytest

from runtime.client import RealtimeClient
from runtime.loaded_models import load_models
from runtime.profile_files import load_profile
from runtime.web.server import RealtimeServer
from runtime.worker import DeviceWorker

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(scope="module")
def server_url():
    """A RealtimeServer on its own loop in a thread; yields its websocket URL."""
    profile = load_profile("tiny", overrides=["pipeline.metrics_interval_s=0", "lm.max_new_tokens=6"])
    with DeviceWorker() as worker:
        models = load_models(profile, worker)
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        holder: dict = {}

        async def serve() -> None:
            holder["server"] = await RealtimeServer(profile, models, worker, host="127.0.0.1", port=0).start()
            holder["stop"] = asyncio.Event()
            ready.set()
            await holder["stop"].wait()
            await holder["server"].stop()

        thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
        thread.start()
        assert ready.wait(30)
        yield f"ws://127.0.0.1:{holder['server'].port}/v1/realtime"
        loop.call_soon_threadsafe(holder["stop"].set)
        thread.join(30)
        loop.close()


def test_blocking_client_round_trip(server_url, demo_file):
    with RealtimeClient(server_url) as client:
        sent = client.stream_file(demo_file)
        client.ask("what moved?")
        client.finish()
        events = list(client.events())
    types = [e.type for e in events]
    assert types[0] == "session.created" and "response.done" in types
    transcripts = [e for e in events if e.type.endswith("transcription.completed")]
    assert transcripts and abs(transcripts[-1].end - sent) < 1.0
    assert client.close_code == 1000


def test_example_script_runs(server_url, demo_file, capsys):
    spec = importlib.util.spec_from_file_location("ask_about_a_file", EXAMPLES / "ask_about_a_file.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(str(demo_file), "what moved?", url=server_url)
    out = capsys.readouterr().out
    assert "s] " in out  # a completed transcript line with its media time
