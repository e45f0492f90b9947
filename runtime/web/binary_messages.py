"""Binary client messages, the media fast path, and the image decoding every frame goes through.

Binary messages carry media with no base64 and no JSON: a 5-byte header, kind then a client-chosen sequence
number that names the message in errors as `bin-SEQ`, then the payload:

    b"A" | u32 LE seq | audio in the session's input format                   (= input_audio_buffer.append)
    b"V" | u32 LE seq | f64 LE timestamp (media seconds) | JPEG or PNG bytes   (= runtime.input_video_frame.append)

`parse_binary` turns one into the same command as its JSON twin (`protocol.py`, which hands it binary
messages), and a bad payload gets the same error. Images, binary or base64 in JSON, are decoded here
(`decode_image`): the size is read from the header first, so an oversized image is refused before a pixel is
decoded. Pure functions, no I/O; `MAX_MESSAGE_BYTES` bounds text and binary messages alike.
"""

from __future__ import annotations

import io
import struct

import av
import numpy as np

from runtime.chunks import VideoFrame
from runtime.io.file_source import scaled_size
from runtime.web.commands import AppendAudio, AppendFrame, Command, ProtocolError

MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # a client message larger than this is answered with an error
MAX_IMAGE_PIXELS = 4096 * 4096  # an image larger than this is refused from its header, before decoding
BINARY_AUDIO, BINARY_FRAME = b"A"[0], b"V"[0]
BINARY_HEADER = struct.Struct("<BI")  # kind, sequence number
BINARY_TIMESTAMP = struct.Struct("<d")


def binary_audio(seq: int, pcm16: bytes) -> bytes:
    """The binary fast path's audio message (what the SDK sends with `binary=True`)."""
    return BINARY_HEADER.pack(BINARY_AUDIO, seq & 0xFFFFFFFF) + pcm16


def binary_frame(seq: int, timestamp: float, image: bytes) -> bytes:
    """The binary fast path's frame message: JPEG or PNG bytes at `timestamp` media seconds."""
    return BINARY_HEADER.pack(BINARY_FRAME, seq & 0xFFFFFFFF) + BINARY_TIMESTAMP.pack(timestamp) + image


def parse_binary(message: bytes, *, max_side: int = 640) -> Command:
    """One binary websocket message (the media fast path, see the module docstring) -> a command."""
    if len(message) > MAX_MESSAGE_BYTES:  # named by its sequence, read from the header like any binary message's
        raise ProtocolError(f"message of {len(message)} bytes exceeds {MAX_MESSAGE_BYTES}", code="message_too_large",
                            event_id=f"bin-{BINARY_HEADER.unpack_from(message)[1]}")
    if len(message) < BINARY_HEADER.size:
        raise ProtocolError(f"binary message of {len(message)} bytes is shorter than its {BINARY_HEADER.size}-byte "
                            "header (kind, u32 sequence)", code="invalid_binary_header")
    kind, seq = BINARY_HEADER.unpack_from(message)
    event_id = f"bin-{seq}"
    body = memoryview(message)[BINARY_HEADER.size :]
    try:
        if kind == BINARY_AUDIO:
            return AppendAudio(event_id, bytes(body))
        if kind == BINARY_FRAME:
            if len(body) < BINARY_TIMESTAMP.size:
                raise ProtocolError("binary frame message ends before its f64 timestamp", code="invalid_binary_header")
            (timestamp,) = BINARY_TIMESTAMP.unpack_from(body)
            if not timestamp >= 0 or timestamp == float("inf"):
                raise ProtocolError("timestamp must be finite media seconds >= 0", code="invalid_value",
                                    param="timestamp")
            image = decode_image(bytes(body[BINARY_TIMESTAMP.size :]), max_side)
            return AppendFrame(event_id, VideoFrame(image, timestamp))
        raise ProtocolError(f"unknown binary message kind 0x{kind:02x}; expected 0x41 'A' (audio) or 0x56 'V' "
                            "(frame)", code="invalid_binary_header")
    except ProtocolError as e:
        e.event_id = event_id
        raise


def image_size(raw: bytes) -> tuple[int, int]:
    """(width, height) from a JPEG's or PNG's header, without decoding a pixel: a megabyte of PNG can hold a
    16000 x 16000 image, a gigabyte once decoded, so the size is refused before anything is decoded."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(raw), formats=("JPEG", "PNG")) as image:
            return image.size
    except Image.DecompressionBombError as e:  # Pillow refuses sizes far past ours at open
        raise ProtocolError(f"image is too large: {e}", code="image_too_large", param="image") from None
    except (OSError, ValueError, SyntaxError) as e:  # Pillow's "cannot identify image file" and its parsers'
        raise ProtocolError(f"image could not be decoded as JPEG or PNG: {e}", code="invalid_image",
                            param="image") from None


def decode_image(raw: bytes, max_side: int = 640) -> np.ndarray:
    """JPEG or PNG bytes -> RGB uint8 [H, W, 3], shrunk so its longer side is at most `max_side`."""
    width, height = image_size(raw)
    if width * height > MAX_IMAGE_PIXELS:
        raise ProtocolError(f"image of {width}x{height} is too large (at most {MAX_IMAGE_PIXELS} pixels)",
                            code="image_too_large", param="image")
    try:
        with av.open(io.BytesIO(raw)) as container:
            frame = next(container.decode(video=0))
            width, height = scaled_size(frame.width, frame.height, max_side)
            return frame.reformat(width=width, height=height, format="rgb24").to_ndarray()
    except ProtocolError:
        raise
    except (av.FFmpegError, StopIteration, ValueError, IndexError) as e:
        raise ProtocolError(f"image could not be decoded as JPEG or PNG: {e}", code="invalid_image",
                            param="image") from None
