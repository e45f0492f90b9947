"""Inputs and outputs: sources that turn files, cameras and microphones into `AudioChunk`/`VideoFrame`
streams (decoded off the event loop, bounded), the built-in demo sample, and the CLI's event printers.

Every source follows `runtime.io.source.Source`: `description`, `duration`, `async for item in source`
in media-time order, and `await source.aclose()`.
"""

from runtime.io.source import Source, ThreadedSource, available_time

__all__ = ["Source", "ThreadedSource", "available_time"]
