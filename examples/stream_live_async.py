"""Send a file at real-time pace (or the microphone) with the async SDK while reading events concurrently;
type a question on stdin to ask it mid-stream. Media goes as binary messages (no base64).

    runtime serve &
    python examples/stream_live_async.py talk.mp4
    python examples/stream_live_async.py --mic            # the default capture device, until Ctrl-C
"""

import asyncio
import sys

from runtime.client import AsyncRealtimeClient


async def main(path: str, url: str = "ws://127.0.0.1:8765/v1/realtime") -> None:
    async with AsyncRealtimeClient(url, binary=True) as client:

        async def send() -> None:
            if path == "--mic":
                await client.stream_microphone("default")
            else:
                await client.stream_file(path, speed=1.0)
            await client.commit()

        async def ask_from_stdin() -> None:
            loop = asyncio.get_running_loop()
            while line := await loop.run_in_executor(None, sys.stdin.readline):
                if line.strip():
                    await client.ask(line.strip())

        sender = asyncio.create_task(send())
        asker = asyncio.create_task(ask_from_stdin())
        async for event in client.events():
            if event.type in ("conversation.item.input_audio_transcription.delta", "response.output_text.delta"):
                print(event.delta, end="", flush=True)
            elif event.type in ("response.done", "conversation.item.input_audio_transcription.completed"):
                print()
        asker.cancel()
        await sender


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))
