"""The built-in demo: recorded speech about moving shapes, and a synthetic video that shows them.

`runtime demo` must work offline, on any machine, without a camera or a download: the speech ships as a
small FLAC (made once with espeak-ng, see assets/README.md), the video is drawn here with numpy, and
`ensure_demo_file` muxes both into an MP4 in the cache the first time it is needed. `write_media_file`
is the same muxer, reused by tests to make small audio-only, video-only and audio+video files.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterable
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import soundfile

from runtime.chunks import SAMPLE_RATE

ASSETS = Path(__file__).resolve().parent / "assets"
SPEECH_ASSET = ASSETS / "demo_speech.flac"
SCRIPT_ASSET = ASSETS / "demo_script.txt"
DEMO_FPS = 10
DEMO_SIZE = (320, 240)
DEMO_TAIL_S = 1.0  # video runs this long after the speech ends
_RENDER_VERSION = "1"  # bump when render_frame or the muxing changes, so cached files are rebuilt

BALL_STOP_S = 9.5  # "Then the red ball stops near the right edge."
SQUARE_START_S, SQUARE_END_S = 3.0, 13.0  # "A blue square slides down slowly from the top."

_AUDIO_CODECS = {".wav": "pcm_s16le", ".flac": "flac", ".mp4": "flac", ".mov": "flac", ".mkv": "flac"}


def demo_script() -> str:
    """The exact text spoken in the demo speech (one line)."""
    return SCRIPT_ASSET.read_text(encoding="utf-8").strip()


def demo_speech() -> np.ndarray:
    """The demo speech as float32 mono at 16 kHz."""
    samples, rate = soundfile.read(SPEECH_ASSET, dtype="float32", always_2d=False)
    if rate != SAMPLE_RATE or samples.ndim != 1:
        raise RuntimeError(f"{SPEECH_ASSET} must be mono {SAMPLE_RATE} Hz, got {rate} Hz {samples.shape}")
    return samples


def _smooth(x: float) -> float:
    x = min(max(x, 0.0), 1.0)
    return x * x * (3 - 2 * x)


def render_frame(t: float, width: int = DEMO_SIZE[0], height: int = DEMO_SIZE[1]) -> np.ndarray:
    """Frame of the demo scene at media time `t`: RGB uint8 [height, width, 3], a pure function of its inputs.

    A red ball rolls left to right along the middle and stops near the right edge at BALL_STOP_S; a blue
    square slides down from the top between SQUARE_START_S and SQUARE_END_S; a green triangle stays still
    in the bottom-left corner. Positions are fractions of the frame, so any size shows the same scene.
    """
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    shade = (215 + 25 * ys / max(height - 1, 1)).astype(np.uint8)  # a soft vertical gradient backdrop
    image = np.repeat(shade[:, :, None], 3, axis=2)
    unit = min(width, height)

    # green triangle, bottom-left corner: right angle at the corner
    size = 0.25 * unit
    x0, y1 = 0.04 * width, 0.96 * height
    inside = (xs >= x0) & (ys <= y1) & ((xs - x0) + (y1 - ys) <= size)
    image[inside] = (40, 170, 60)

    # blue square, sliding down the right third
    side = 0.18 * unit
    progress = _smooth((t - SQUARE_START_S) / (SQUARE_END_S - SQUARE_START_S))
    sx = 0.68 * width
    sy = 0.03 * height + progress * (0.94 * height - side)
    inside = (xs >= sx) & (xs < sx + side) & (ys >= sy) & (ys < sy + side)
    image[inside] = (40, 80, 210)

    # red ball, rolling along the middle, drawn last so it passes in front of the square
    radius = 0.09 * unit
    progress = _smooth(t / BALL_STOP_S)
    bx = radius + 0.02 * width + progress * (0.96 * width - 2 * radius - 0.02 * width)
    by = 0.55 * height
    inside = (xs - bx) ** 2 + (ys - by) ** 2 <= radius**2
    image[inside] = (220, 40, 40)
    return image


def write_media_file(
    path: str | Path,
    audio: np.ndarray | None,
    frames: Iterable[tuple[float, np.ndarray]] | None,
    fps: float = DEMO_FPS,
    *,
    audio_codec: str | None = None,
    video_codec: str | None = None,
) -> Path:
    """Write float32 16 kHz mono `audio` and/or `(time, RGB uint8 image)` `frames` to a media file.

    The container follows the suffix (.wav/.flac audio only; .mp4/.mkv/.mov either or both). Video is H.264
    (libx264, else MPEG-4 part 2) yuv420p at `fps`; audio defaults to lossless FLAC (exact round trip; pass
    audio_codec="aac" for the common lossy case). Audio and video packets are interleaved by time.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if audio is None and frames is None:
        raise ValueError("write_media_file needs audio, frames or both")
    if frames is not None and suffix in (".wav", ".flac"):
        raise ValueError(f"{suffix} files cannot hold video")
    with av.open(str(path), "w") as container:
        audio_stream = None
        if audio is not None:
            audio = np.asarray(audio, dtype=np.float32).reshape(-1)
            codec = audio_codec or _AUDIO_CODECS.get(suffix, "aac")
            audio_stream = container.add_stream(codec, rate=SAMPLE_RATE, layout="mono")
        written = 0

        def audio_until(sample: int) -> None:
            nonlocal written
            while audio_stream is not None and audio is not None and written < min(sample, len(audio)):
                block = audio[written : min(written + 1024, sample, len(audio))]
                frame = av.AudioFrame.from_ndarray(block[None, :], format="flt", layout="mono")
                frame.sample_rate, frame.pts = SAMPLE_RATE, written
                frame.time_base = Fraction(1, SAMPLE_RATE)
                container.mux(audio_stream.encode(frame))
                written += len(block)

        if frames is not None:
            video_stream = None
            rate = Fraction(fps).limit_denominator(1001)
            for time, image in frames:
                if video_stream is None:
                    height, width = image.shape[:2]
                    if width % 2 or height % 2:
                        raise ValueError(f"frame size must be even for yuv420p, got {width}x{height}")
                    codec = video_codec or ("libx264" if "libx264" in av.codecs_available else "mpeg4")
                    video_stream = container.add_stream(codec, rate=rate)
                    video_stream.width, video_stream.height, video_stream.pix_fmt = width, height, "yuv420p"
                    if codec == "libx264":
                        video_stream.codec_context.options = {"preset": "veryfast", "crf": "26"}
                audio_until(int(round((time + 1.0) * SAMPLE_RATE)))  # keep audio ~1 s ahead of video
                image = np.ascontiguousarray(image, dtype=np.uint8)
                frame = av.VideoFrame.from_ndarray(image, format="rgb24")
                frame.pts, frame.time_base = int(round(time * rate)), 1 / rate
                container.mux(video_stream.encode(frame))
            if video_stream is not None:
                container.mux(video_stream.encode(None))
        audio_until(len(audio) if audio is not None else 0)
        if audio_stream is not None:
            container.mux(audio_stream.encode(None))
    return path


def default_cache_dir() -> Path:
    root = os.environ.get("RUNTIME_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "runtime") / "sample"


def ensure_demo_file(cache_dir: Path | None = None) -> Path:
    """Path to the demo MP4 (speech + synthetic video), written on first use and reused afterwards.

    The name carries a hash of the speech asset and the renderer version, so a changed asset makes a new
    file. It is written to a temporary file and renamed, so concurrent callers never see a partial file.
    """
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    digest = hashlib.sha256(SPEECH_ASSET.read_bytes() + _RENDER_VERSION.encode()).hexdigest()[:12]
    path = directory / f"demo-{digest}.mp4"
    if path.is_file() and path.stat().st_size > 0:
        return path
    directory.mkdir(parents=True, exist_ok=True)
    speech = demo_speech()
    n_frames = int(np.ceil((len(speech) / SAMPLE_RATE + DEMO_TAIL_S) * DEMO_FPS))
    frames = ((i / DEMO_FPS, render_frame(i / DEMO_FPS, *DEMO_SIZE)) for i in range(n_frames))
    fd, temp = tempfile.mkstemp(prefix=".demo-", suffix=".mp4", dir=directory)
    os.close(fd)
    try:
        write_media_file(temp, speech, frames, DEMO_FPS)
        os.replace(temp, path)
    finally:
        if os.path.exists(temp):
            os.unlink(temp)
    return path
