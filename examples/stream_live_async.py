"""Send a file at real-time pace (or the microphone) with the async SDK while reading events concurrently;
type a question on stdin to ask it mid-stream. Media goes as binary messages (no base64). The program ends
when the session does, whether or not stdin is still open.

    runtime serve &
    python examples/stream_live_async.py talk.mp4 [ws://HOST:PORT/v1/realtime]
    python examples/stream_live_async.py --mic            # the default capture device, until Ctrl-C

Exits 1 with one line on stderr if the server cannot be reached or the connection breaks mid-session.
"""

import asyncio
import concurrent.futures
import sys
import threading

from websockets.exceptions import WebSocketException

from runtime.client import AsyncRealtimeClient

DEFAULT_URL = "ws://127.0.0.1:8765/v1/realtime"
USAGE = "usage: stream_live_async.py (FILE | --mic) [URL]"


def read_stdin(loop: asyncio.AbstractEventLoop, lines: asyncio.Queue[str | None]) -> None:
    """A daemon thread: a blocked readline cannot be cancelled, and a thread the program does not wait for at
    exit (unlike run_in_executor's pool, which asyncio.run joins) lets it end while stdin stays open. Each put
    waits for room, so the bounded queue slows this reader rather than growing."""
    try:
        for line in sys.stdin:
            asyncio.run_coroutine_threadsafe(lines.put(line), loop).result()
        asyncio.run_coroutine_threadsafe(lines.put(None), loop).result()
    except (RuntimeError, concurrent.futures.CancelledError):  # the loop has ended: so has the session
        pass


async def main(path: str, url: str = DEFAULT_URL) -> None:
    async with AsyncRealtimeClient(url, binary=True) as client:

        async def send() -> None:
            if path == "--mic":
                await client.stream_microphone("default")
            else:
                await client.stream_file(path, speed=1.0)
            await client.finish()

        async def ask_from_stdin() -> None:
            lines: asyncio.Queue[str | None] = asyncio.Queue(maxsize=8)
            threading.Thread(target=read_stdin, args=(asyncio.get_running_loop(), lines), daemon=True).start()
            while (line := await lines.get()) is not None:
                if line.strip():
                    await client.ask(line.strip())

        sender = asyncio.create_task(send())
        asker = asyncio.create_task(ask_from_stdin())
        try:
            async for event in client.events():  # raises if the connection breaks
                if event.type in ("conversation.item.input_audio_transcription.delta",
                                  "response.output_text.delta"):
                    print(event.delta, end="", flush=True)
                elif event.type in ("response.done", "conversation.item.input_audio_transcription.completed"):
                    print()
                elif event.type == "error":
                    print(f"error: {event.error['message']}", file=sys.stderr)
            await sender
        finally:
            asker.cancel()
            sender.cancel()


if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(__doc__)
        sys.exit(0)
    if not 1 <= len(sys.argv[1:]) <= 2:
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    try:
        asyncio.run(main(*sys.argv[1:]))
    except (OSError, WebSocketException) as exc:  # unreachable, refused, or the connection broke
        sys.exit(f"stream_live_async: the session with the server failed: {type(exc).__name__}: {exc}")
    except KeyboardInterrupt:
        sys.exit(130)
