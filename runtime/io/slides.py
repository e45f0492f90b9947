"""Slide videos rendered offline: the material of screen-text tests and `runtime bench video-qa` (a talk's
slides in a real font, held for seconds each, with a soundtrack), written with PyAV like the demo sample.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from runtime.chunks import SAMPLE_RATE
from runtime.io.sample import write_media_file

FONTS = ("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf", "/usr/share/fonts/truetype/dejavu/DejaVuSans-Bold.ttf")


@dataclass(frozen=True)
class Slide:
    seconds: float
    title: str
    lines: Sequence[str] = ()


def _font(bold: bool, size: int) -> ImageFont.FreeTypeFont:
    path = Path(FONTS[bold])
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing (Debian: apt-get install fonts-dejavu-core)")
    return ImageFont.truetype(str(path), size)


def render_slide(slide: Slide, size: tuple[int, int] = (1280, 720)) -> np.ndarray:
    """An RGB uint8 frame: the title in bold, then one bullet per line."""
    width, height = size
    image = Image.new("RGB", size, (248, 248, 244))
    draw = ImageDraw.Draw(image)
    draw.text((width // 16, height // 12), slide.title, font=_font(True, height // 13), fill=(16, 24, 64))
    body = _font(False, height // 20)
    for i, line in enumerate(slide.lines):
        draw.text((width // 12, height // 4 + i * height // 9), f"- {line}", font=body, fill=(24, 24, 24))
    return np.asarray(image)


def slide_frames(slides: Sequence[Slide], fps: float, size: tuple[int, int]) -> Iterator[tuple[float, np.ndarray]]:
    t, frame = 0.0, 0
    for slide in slides:
        image = render_slide(slide, size)
        end = t + slide.seconds
        while frame / fps < end - 1e-9:
            yield frame / fps, image
            frame += 1
        t = end


def write_slide_video(path: str | Path, slides: Sequence[Slide], *, audio: np.ndarray | None = None,
                      fps: float = 2.0, size: tuple[int, int] = (1280, 720)) -> Path:
    """An .mp4 of `slides` at `fps` with `audio` (16 kHz float32; silence as long as the slides if None)."""
    seconds = sum(s.seconds for s in slides)
    if audio is None:
        audio = np.zeros(int(seconds * SAMPLE_RATE), np.float32)
    return write_media_file(path, audio, slide_frames(slides, fps, size), fps)
