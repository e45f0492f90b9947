"""The screen reader on real PP-OCRv4 weights: a rendered slide read exactly, and end to end through the CLI, a
slide video's text in `runtime transcribe --json` (the answers from a slide: tests/test_refusal_check.py and
tests/test_bench_video_qa.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from weights_common import packaged_or_skip

from runtime.chunks import SAMPLE_RATE
from runtime.io.sample import demo_speech
from runtime.io.slides import Slide, render_slide, write_slide_video

REPO = Path(__file__).resolve().parents[1]
SLIDES = [Slide(5, "Budget review 2027", ["Office opens in Lisbon", "Hiring: 12 engineers by March"]),
          Slide(5, "Roadmap", ["Launch in May", "Total cost: 4.2 million EUR"])]


@pytest.fixture(scope="module")
def reader():
    packaged_or_skip("pp-ocrv4-det")
    from runtime.models.ocr.reader import TextReader

    return TextReader()


def test_a_rendered_slide_reads_back_exactly(reader) -> None:
    lines = reader.read(render_slide(SLIDES[0]))
    assert [t.text for t in lines] == ["Budget review 2027", "- Office opens in Lisbon",
                                       "- Hiring: 12 engineers by March"]
    assert all(t.confidence > 0.9 for t in lines)
    x0, y0, x1, y1 = lines[0].box
    assert 0 <= x0 < x1 <= 1 and 0 <= y0 < y1 <= 0.25  # the title is at the top


def run(*argv: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "runtime", *argv], capture_output=True, text=True, timeout=600,
                            cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    return result


@pytest.mark.slow
def test_slide_video_end_to_end(reader, tmp_path: Path) -> None:
    seconds = sum(s.seconds for s in SLIDES)
    speech = demo_speech()[: seconds * SAMPLE_RATE]  # someone talks over the slides: user items beside the screens
    audio = np.pad(speech, (0, seconds * SAMPLE_RATE - len(speech)))
    video = write_slide_video(tmp_path / "talk.mp4", SLIDES, audio=audio)
    events = [json.loads(line) for line in run("transcribe", str(video), "--json", "-q").stdout.splitlines()]
    screens = [e for e in events if e["type"] == "runtime.screen.text"]
    assert [s["text"] for s in screens] == ["Budget review 2027 | - Office opens in Lisbon | - Hiring: 12 engineers "
                                            "by March", "Roadmap | - Launch in May | - Total cost: 4.2 million EUR"]
    assert 0 < screens[0]["start"] < 5 <= screens[1]["start"] < 10  # read once each, soon after it appeared
    # the screens are the runtime's own items: no API event points at one as the item before it
    assert all(not str(e.get("previous_item_id")).startswith("screen_") for e in events)
    assert any(e["type"] == "input_audio_buffer.committed" for e in events)
    said = " ".join(e["transcript"] for e in events if e["type"].endswith("input_audio_transcription.completed"))
    assert "red ball" in said.lower(), said
    metrics = [e for e in events if e["type"] == "runtime.metrics"][-1]["metrics"]["screen"]
    assert metrics["reads"] <= 4 and metrics["screens"] == 2
