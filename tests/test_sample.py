"""The built-in demo: shipped speech, a deterministic synthetic video that matches the script, and an MP4
that plays back through FileSource with the speech intact."""

from pathlib import Path

import numpy as np
import pytest

from runtime.chunks import SAMPLE_RATE, AudioChunk, VideoFrame
from runtime.io.file_source import FileSource
from runtime.io.sample import (
    ASSETS,
    demo_script,
    demo_speech,
    ensure_demo_file,
    render_frame,
    write_media_file,
)
from runtime.io.source import available_time


def test_assets_are_small_and_match() -> None:
    assert (ASSETS / "demo_speech.flac").stat().st_size < 300_000
    script = demo_script()
    assert "red ball" in script and "blue square" in script and "\n" not in script
    speech = demo_speech()
    assert speech.dtype == np.float32 and speech.ndim == 1
    assert 12 <= len(speech) / SAMPLE_RATE <= 16
    assert 0.05 < np.abs(speech).max() <= 1.0


def red_centre(image: np.ndarray) -> tuple[float, float]:
    ys, xs = np.nonzero((image[:, :, 0] > 200) & (image[:, :, 1] < 80) & (image[:, :, 2] < 80))
    return float(xs.mean()), float(ys.mean())


def blue_top(image: np.ndarray) -> int:
    ys, _ = np.nonzero((image[:, :, 2] > 180) & (image[:, :, 0] < 80))
    return int(ys.min())


def test_render_frame_is_deterministic_and_consistent_with_the_script() -> None:
    frame = render_frame(2.5)
    assert frame.shape == (240, 320, 3) and frame.dtype == np.uint8
    np.testing.assert_array_equal(frame, render_frame(2.5))
    assert render_frame(1.0, 64, 48).shape == (48, 64, 3)
    # the red ball rolls left to right, then stops near the right edge
    xs = [red_centre(render_frame(t))[0] for t in (0.0, 3.0, 6.0, 9.5, 12.0)]
    assert xs == sorted(xs) and xs[0] < 60 and xs[3] > 260 and xs[4] == xs[3]
    # the blue square slides down slowly from the top
    tops = [blue_top(render_frame(t)) for t in (0.0, 5.0, 9.0, 13.0)]
    assert tops == sorted(tops) and tops[0] < 20 and tops[-1] > 150


def test_ensure_demo_file_is_written_once(tmp_path: Path) -> None:
    path = ensure_demo_file(tmp_path)
    mtime = path.stat().st_mtime_ns
    assert ensure_demo_file(tmp_path) == path and path.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind
    assert path.suffix == ".mp4" and path.stat().st_size < 1_000_000


def test_default_cache_dir_follows_runtime_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNTIME_CACHE", str(tmp_path))
    assert ensure_demo_file().parent == tmp_path / "sample"


@pytest.mark.asyncio
async def test_demo_file_plays_back(demo_file: Path) -> None:
    items = [item async for item in FileSource(demo_file, speed=0)]
    chunks = [i for i in items if isinstance(i, AudioChunk)]
    frames = [i for i in items if isinstance(i, VideoFrame)]
    speech = demo_speech()
    audio = np.concatenate([c.samples for c in chunks])
    assert abs(len(audio) - len(speech)) / SAMPLE_RATE < 0.05
    assert np.abs(audio[: len(speech)] - speech[: len(audio)]).max() < 1e-3  # FLAC in MP4: lossless
    times = [f.time for f in frames]
    assert times == sorted(times) and times[0] == 0.0
    assert np.median(np.diff(times)) == pytest.approx(0.1, abs=1e-3)
    assert times[-1] >= len(speech) / SAMPLE_RATE + 0.8
    assert {(f.width, f.height) for f in frames} == {(320, 240)}
    keys = [available_time(i) for i in items]
    assert keys == sorted(keys)


@pytest.mark.asyncio
async def test_write_media_file_variants(tmp_path: Path) -> None:
    audio = np.zeros(8000, np.float32)
    frames = [(i / 10, render_frame(i / 10, 64, 48)) for i in range(5)]
    for name, a, f in [("a.wav", audio, None), ("v.mp4", None, frames), ("av.mkv", audio, frames)]:
        path = write_media_file(tmp_path / name, a, f, 10)
        kinds = {type(i) for i in [item async for item in FileSource(path, speed=0)]}
        assert kinds == {t for t, given in ((AudioChunk, a), (VideoFrame, f)) if given is not None}
    with pytest.raises(ValueError):
        write_media_file(tmp_path / "x.wav", audio, frames)
    with pytest.raises(ValueError):
        write_media_file(tmp_path / "odd.mp4", None, [(0.0, np.zeros((5, 5, 3), np.uint8))])
