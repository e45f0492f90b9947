"""Live sources: a local camera and microphone through libavdevice (v4l2, alsa).

Devices are opened in the constructor with a hard deadline, so a missing camera or microphone fails within
seconds with one line that names the device and the way out, before any model is loaded. Media time of a
live source is seconds since it started: frames are stamped on arrival, audio by the count of samples
received (sample-accurate, so it never drifts against itself).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import av

from runtime.chunks import SAMPLE_RATE, VideoFrame
from runtime.errors import DeviceNotFound, UserError
from runtime.io.file_source import error_reason, scaled_size
from runtime.io.rechunk import AudioRechunker
from runtime.io.source import Emit, Producer, ThreadedSource

if TYPE_CHECKING:
    from runtime.config import Profile

OPEN_TIMEOUT_S = 4.0  # a device that does not open within this is reported missing
READ_TIMEOUT_S = 10.0  # a device that delivers nothing for this long ends the source with an error
# What to try next, said by every DeviceNotFound; the CLI passes its own, naming its flags.
CAMERA_FIX = "check the device (v4l2-ctl --list-devices) or stream a file instead"
MICROPHONE_FIX = "check the device name (arecord -L) or stream a file instead"


def camera_path(index_or_path: str) -> str:
    """Turn "0" into "/dev/video0" on Linux; paths and other names are returned unchanged."""
    text = str(index_or_path).strip()
    if text.isdigit() and sys.platform.startswith("linux"):
        return f"/dev/video{int(text)}"
    return text


def device_backends() -> set[str]:
    """Input device formats this PyAV build has (e.g. v4l2, alsa), each alias listed separately."""
    return {name for names in av.formats_available for name in names.split(",")}


def _use_system_alsa_config() -> None:
    # PyAV's wheels bundle an alsa-lib that looks for its configuration under its build prefix; pointing it
    # at the system's makes "default" and the card names resolve as they do for every other program.
    if "ALSA_CONFIG_DIR" not in os.environ and Path("/usr/share/alsa/alsa.conf").is_file():
        os.environ["ALSA_CONFIG_DIR"] = "/usr/share/alsa"


@contextlib.contextmanager
def _stderr_captured() -> Iterator[list[str]]:
    """Collect what C libraries (alsa-lib) print on fd 2 meanwhile, instead of spilling it on the user."""
    lines: list[str] = []
    try:
        saved = os.dup(2)
    except OSError:
        yield lines
        return
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            lines.extend(line for line in sink.read().decode(errors="replace").splitlines() if line.strip())


def open_device(device: str, backend: str, *, kind: str, fix: str, options: dict[str, str] | None = None):
    """`av.open` a capture device, failing within OPEN_TIMEOUT_S with `DeviceNotFound` naming it."""
    label = f"no {kind} at {device} ({backend})" if kind == "camera" else f"no {kind} {device!r} ({backend})"
    if backend not in device_backends():
        have = ", ".join(sorted(device_backends() & {"v4l2", "alsa", "pulse", "avfoundation", "dshow"}))
        raise DeviceNotFound(f"{label}: this PyAV build has no {backend!r} input (has: {have}); {fix}")
    if backend == "v4l2" and device.startswith("/dev/") and not os.path.exists(device):
        raise DeviceNotFound(f"{label}: No such file or directory; {fix}")
    if backend == "alsa":
        _use_system_alsa_config()
    result: dict[str, object] = {}

    def attempt() -> None:
        try:
            result["container"] = av.open(
                device, format=backend, options=options or {}, timeout=(OPEN_TIMEOUT_S, READ_TIMEOUT_S)
            )
        except Exception as error:  # noqa: BLE001 - reported to the caller below
            result["error"] = error

    opener = threading.Thread(target=attempt, name=f"open-{kind}", daemon=True)
    with _stderr_captured() if backend == "alsa" else contextlib.nullcontext([]) as noise:
        opener.start()
        opener.join(OPEN_TIMEOUT_S)
    if opener.is_alive():
        raise DeviceNotFound(f"{label}: did not open within {OPEN_TIMEOUT_S:g} s; {fix}")
    if "error" in result:
        reason = error_reason(result["error"])  # type: ignore[arg-type]
        detail = next((line.split(") ", 1)[-1] for line in reversed(noise) if "ALSA lib" in line), "")
        reason = f"{reason} ({detail})" if detail else reason
        raise DeviceNotFound(f"{label}: {reason}; {fix}")
    return result["container"]


class CameraSource(ThreadedSource):
    """RGB frames from a capture device, downscaled so the longer side is at most `max_side`.

    `fps` asks the device for that frame rate (None: its default)."""

    def __init__(
        self,
        device: str = "/dev/video0",
        *,
        fps: float | None = None,
        max_side: int = 640,
        backend: str = "v4l2",
        queue_size: int = 4,
        fix: str = CAMERA_FIX,
    ) -> None:
        super().__init__(speed=0.0, queue_size=queue_size)
        self.device, self.backend, self.max_side = camera_path(device), backend, max_side
        self.description = f"camera {self.device}"
        options = {"framerate": f"{fps:g}"} if fps else {}
        self._container = open_device(self.device, backend, kind="camera", fix=fix, options=options)
        if not self._container.streams.video:
            self._container.close()
            raise DeviceNotFound(f"no camera at {self.device} ({backend}): it has no video; {fix}")

    def _producers(self) -> list[Producer]:
        return [functools.partial(self._capture, clock0=time.monotonic())]

    def _release(self) -> None:
        self._container.close()

    def _capture(self, emit: Emit, clock0: float) -> None:
        try:
            for frame in self._container.decode(self._container.streams.video[0]):
                width, height = scaled_size(frame.width, frame.height, self.max_side)
                image = frame.reformat(width=width, height=height, format="rgb24").to_ndarray()
                if not emit(VideoFrame(image=image, time=max(0.0, time.monotonic() - clock0))):
                    return
        finally:
            self._container.close()


class MicrophoneSource(ThreadedSource):
    """Float32 mono 16 kHz chunks of `chunk_ms` from a capture device, numbered by samples received."""

    def __init__(
        self, device: str = "default", *, backend: str = "alsa", chunk_ms: int = 100, queue_size: int = 20,
        fix: str = MICROPHONE_FIX,
    ) -> None:
        super().__init__(speed=0.0, queue_size=queue_size)
        if chunk_ms <= 0:
            raise ValueError(f"chunk_ms must be > 0, got {chunk_ms}")
        self.device, self.backend = device, backend
        self.chunk_samples = max(1, round(chunk_ms * SAMPLE_RATE / 1000))
        self.description = f"microphone {device} ({backend})"
        self._container = open_device(device, backend, kind="microphone", fix=fix)
        if not self._container.streams.audio:
            self._container.close()
            raise DeviceNotFound(f"no microphone {device!r} ({backend}): it has no audio; {fix}")

    def _producers(self) -> list[Producer]:
        return [self._capture]

    def _release(self) -> None:
        self._container.close()

    def _capture(self, emit: Emit) -> None:
        resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
        rechunker = AudioRechunker(self.chunk_samples)
        try:
            for frame in self._container.decode(self._container.streams.audio[0]):
                for out in resampler.resample(frame):
                    for chunk in rechunker.push(out.to_ndarray().reshape(-1)):
                        if not emit(chunk):
                            return
        finally:
            self._container.close()


class LiveSource(ThreadedSource):
    """A camera and a microphone (either may be None) merged into one source on one clock."""

    def __init__(self, camera: CameraSource | None, microphone: MicrophoneSource | None) -> None:
        if camera is None and microphone is None:
            raise ValueError("LiveSource needs a camera, a microphone or both")
        super().__init__(speed=0.0, queue_size=max(s.queue_size for s in (camera, microphone) if s))
        self.camera, self.microphone = camera, microphone
        self.description = " + ".join(s.description for s in (camera, microphone) if s is not None)

    def _producers(self) -> list[Producer]:
        producers: list[Producer] = []
        if self.camera is not None:
            producers.append(functools.partial(self.camera._capture, clock0=time.monotonic()))
        if self.microphone is not None:
            producers.append(self.microphone._capture)
        return producers

    def _release(self) -> None:
        for source in (self.camera, self.microphone):
            if source is not None:
                source._release()


def live_source(args: argparse.Namespace, profile: Profile) -> LiveSource:
    """`serve --camera N [--mic NAME] [--no-mic] [--no-camera]` as a source, opened now (a missing device fails
    before any model loads)."""
    if args.no_camera and args.no_mic:
        raise UserError("--no-camera and --no-mic leave nothing to listen to or watch")
    camera = None
    if not args.no_camera and args.camera is not None:
        camera = CameraSource(camera_path(args.camera), fps=max(profile.video.fps, 1.0),
                              max_side=profile.video.max_side, fix="play a file instead with --source FILE")
    mic = None if args.no_mic else MicrophoneSource(args.mic or "default", backend=args.mic_backend,
                                                   chunk_ms=profile.pipeline.audio_chunk_ms,
                                                   fix="use --no-mic, or --source FILE")
    return LiveSource(camera, mic)
