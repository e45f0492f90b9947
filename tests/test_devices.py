"""Live sources: missing devices fail fast with a message that names them; capture works end to end on
libavfilter's virtual devices (lavfi testsrc/sine), which exist on every machine."""

import threading
import time

import pytest

from runtime.chunks import AudioChunk, VideoFrame
from runtime.errors import DeviceNotFound
from runtime.io.devices import (
    CameraSource,
    LiveSource,
    MicrophoneSource,
    camera_path,
    device_backends,
)

needs_lavfi = pytest.mark.skipif("lavfi" not in device_backends(), reason="PyAV built without lavfi")


def test_camera_path() -> None:
    assert camera_path("0") == "/dev/video0"
    assert camera_path("12") == "/dev/video12"
    assert camera_path("/dev/video3") == "/dev/video3"


def fails_fast(make) -> str:
    start = time.monotonic()
    with pytest.raises(DeviceNotFound) as info:
        make()
    assert time.monotonic() - start < 5
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_camera() -> None:
    message = fails_fast(lambda: CameraSource("/dev/video99"))
    assert message.startswith("no camera at /dev/video99 (v4l2): No such file or directory")
    assert "v4l2-ctl" in message and "--source" not in message  # a library user has no CLI flags to try
    assert "/dev/video98" in fails_fast(lambda: CameraSource("98"))


def test_missing_microphone() -> None:
    message = fails_fast(lambda: MicrophoneSource("hw:99", backend="alsa"))
    assert message.startswith("no microphone 'hw:99' (alsa): ")
    assert "arecord -L" in message and "--no-mic" not in message


def test_unknown_backend_is_named() -> None:
    message = fails_fast(lambda: MicrophoneSource("default", backend="nosuchbackend"))
    assert "no 'nosuchbackend' input" in message


@needs_lavfi
@pytest.mark.asyncio
async def test_live_source_merges_camera_and_microphone() -> None:
    camera = CameraSource("testsrc=size=640x480:rate=25", backend="lavfi", max_side=320)
    microphone = MicrophoneSource("sine=frequency=440:sample_rate=48000", backend="lavfi", chunk_ms=50)
    source = LiveSource(camera, microphone)
    assert source.description.startswith("camera testsrc") and " + microphone sine" in source.description
    assert source.duration is None
    chunks: list[AudioChunk] = []
    frames: list[VideoFrame] = []
    async for item in source:
        (chunks if isinstance(item, AudioChunk) else frames).append(item)
        if len(chunks) >= 20 and frames:
            break
    await source.aclose()
    assert all(len(c.samples) == 800 for c in chunks)
    assert [c.start_sample for c in chunks] == [800 * i for i in range(len(chunks))]
    assert {(f.width, f.height) for f in frames} == {(320, 240)}
    assert all(b.time >= a.time for a, b in zip(frames, frames[1:], strict=False))
    assert not [t for t in threading.enumerate() if t.name.startswith("source-")]


@needs_lavfi
@pytest.mark.asyncio
async def test_microphone_alone_and_close_without_iterating() -> None:
    microphone = MicrophoneSource("sine=sample_rate=44100", backend="lavfi")
    assert microphone.description == "microphone sine=sample_rate=44100 (lavfi)"
    count = 0
    async for chunk in microphone:
        assert chunk.start_sample == 1600 * count
        count += 1
        if count == 5:
            break
    await microphone.aclose()
    unused = CameraSource("testsrc", backend="lavfi")
    await unused.aclose()
    await unused.aclose()


def test_live_source_needs_something() -> None:
    with pytest.raises(ValueError):
        LiveSource(None, None)


def test_the_cli_names_its_own_flags_when_a_device_is_missing(capsys) -> None:
    from cli_common import one_error_line, run_cli

    code, _, err = run_cli(capsys, "serve", "--camera", "/dev/video99", "--no-mic", "-q")
    assert code != 0 and "--source FILE" in one_error_line(err)
    code, _, err = run_cli(capsys, "serve", "--mic", "hw:99", "-q")
    assert code != 0 and "--no-mic" in one_error_line(err)
