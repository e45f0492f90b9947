"""Screen text without OCR: which frames of a scripted sequence get read, and how reads merge into screens."""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from runtime.memory.screen_text import ScreenText
from runtime.models.ocr.reader import TextLine
from runtime.pipeline.screen_change import ChangeDetector, thumbnail

FONT = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"


def slide(lines: list[str], *, size=(1280, 720), shift: int = 0) -> np.ndarray:
    img = Image.new("RGB", size, (250, 250, 245))
    draw = ImageDraw.Draw(img)
    font = ImageFont.truetype(FONT, 40)
    for i, line in enumerate(lines):
        draw.text((80 + shift, 60 + 80 * i), line, font=font, fill=(20, 20, 40))
    return np.asarray(img)


def line(text: str, y: float, confidence: float = 0.95) -> TextLine:
    return TextLine(text, (0.1, y, 0.6, y + 0.05), confidence)


def test_thumbnail_is_block_means() -> None:
    image = np.zeros((4, 6, 3), np.uint8)
    image[:2, :3] = 255
    thumb = thumbnail(image, (2, 2))
    np.testing.assert_allclose(thumb, [[1.0, 0.0], [0.0, 0.0]])


def run(detector: ChangeDetector, frames: list[np.ndarray], fps: float = 1.0) -> list[int]:
    read = []
    for i, frame in enumerate(frames):
        if detector.due(i / fps, frame):
            detector.read_done(i / fps)
            read.append(i)
    return read


def test_a_slide_held_a_minute_is_read_a_few_times_and_each_change_once() -> None:
    a, b = slide(["Budget review", "- Lisbon office"]), slide(["Budget review", "- Lisbon office", "- Hiring: 12"])
    c = slide(["Roadmap 2027", "- Launch in May"])
    frames = [a] * 60 + [b] * 10 + [c] * 10
    assert run(ChangeDetector(refresh_s=30.0), frames) == [1, 31, 61, 71]  # settles at 1; refresh at 31; b; c
    assert run(ChangeDetector(refresh_s=1000.0), frames) == [1, 61, 71]


def test_a_transition_is_not_read_halfway_and_reads_are_rate_bounded() -> None:
    a, c = slide(["Budget review"]), slide(["Roadmap 2027", "- Launch in May"])
    blend = ((a.astype(np.float32) + c) / 2).astype(np.uint8)
    assert run(ChangeDetector(), [a, a, blend, c, c, c]) == [1, 4]  # blend and the first c are unsettled
    # camera noise is not a change
    rng = np.random.default_rng(0)
    noisy = [np.clip(a + rng.normal(0, 6, a.shape), 0, 255).astype(np.uint8) for _ in range(20)]
    assert run(ChangeDetector(refresh_s=1000.0), noisy) == [1]
    # a slide changing every half second is read at most every min_interval_s
    flicker = [(a, c)[i % 2] for i in range(40) for _ in range(2)]
    reads = run(ChangeDetector(min_interval_s=2.0), flicker, fps=4.0)
    assert len(reads) >= 3 and all(b - a >= 8 for a, b in zip(reads, reads[1:], strict=False))


def test_reads_merge_into_screens_with_spans() -> None:
    text = ScreenText(min_confidence=0.6)
    first = text.add(1.0, [line("Budget review", 0.1), line("- Lisbon office", 0.2), line("noise", 0.5, 0.3)])
    assert first is not None and first.text == "Budget review | - Lisbon office"
    assert text.add(5.0, [line("Budget reviev", 0.1, 0.8), line("- Lisbon office", 0.2)]) is None  # same, worse read
    built = text.add(9.0, [line("Budget review", 0.1), line("- Lisbon office", 0.2), line("- Hiring: 12", 0.3)])
    assert built is first and built.text == "Budget review | - Lisbon office | - Hiring: 12"
    assert (built.start, built.end) == (1.0, 9.0)
    nxt = text.add(12.0, [line("Roadmap 2027", 0.1), line("- Launch in May", 0.2)])
    assert nxt is not None and nxt is not first and first.closed and first.end == 12.0
    assert text.at(3.0) is first and text.at(13.0) is nxt
    assert text.add(20.0, []) is None and nxt.closed and text.current is None  # a scene without text
    assert text.at(25.0) is None
    again = text.add(30.0, [line("Roadmap 2027", 0.1), line("- Launch in May", 0.2)])
    assert again is not None and again.screen_id != nxt.screen_id  # shown again: a new screen, a new span


def test_screens_are_bounded() -> None:
    text = ScreenText(max_screens=3)
    for i in range(10):
        text.add(float(i), [line(f"Slide number {i} of ten", 0.1), line(f"{'abcdefghij'[i] * 8}", 0.3)])
    assert [s.screen_id for s in text.screens] == ["screen_7", "screen_8", "screen_9"]
