"""Stream a media file to a running `runtime serve`, then ask a question about what was sent and print the
captions and the answer. (The question goes once the whole file is sent; to ask mid-stream, see
stream_live_async.py.)

    runtime serve &                      # in another terminal
    python examples/ask_about_a_file.py talk.mp4 "what was the plan?" [ws://HOST:PORT/v1/realtime]

Exits 1 with one line on stderr if the server cannot be reached or the connection breaks mid-session.
"""

import argparse
import sys

from websockets.exceptions import WebSocketException

from runtime.client import RealtimeClient

DEFAULT_URL = "ws://127.0.0.1:8765/v1/realtime"


def main(path: str, question: str, url: str = DEFAULT_URL) -> None:
    with RealtimeClient(url) as client:
        client.stream_file(path)  # as fast as the server takes it; speed=1.0 plays at real-time pace
        client.ask(question)
        client.finish()  # end of input: the server flushes the transcript, answers, then closes
        for event in client.events():  # raises if the connection breaks instead of ending as if all went well
            if event.type.endswith("transcription.completed"):
                print(f"[{event.start:6.1f}s] {event.transcript}")
            elif event.type == "response.output_text.delta":
                print(event.delta, end="", flush=True)
            elif event.type == "response.done":
                print()
            elif event.type == "error":
                print(f"error: {event.error['message']}", file=sys.stderr)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Stream a media file to `runtime serve` and ask about it.")
    parser.add_argument("path", help="a media file with audio (and video)")
    parser.add_argument("question", help="what to ask once the file is sent")
    parser.add_argument("url", nargs="?", default=DEFAULT_URL, help=f"the server's websocket (default {DEFAULT_URL})")
    args = parser.parse_args()
    try:
        main(args.path, args.question, args.url)
    except (OSError, WebSocketException) as exc:  # unreachable, refused, or the connection broke
        sys.exit(f"ask_about_a_file: the session with {args.url} failed: {type(exc).__name__}: {exc}")
