"""Stream a media file to a running `runtime serve`, ask a question halfway, print captions and the answer.

    runtime serve &                      # in another terminal
    python examples/ask_about_a_file.py talk.mp4 "what was the plan?"
"""

import sys

from runtime.client import RealtimeClient


def main(path: str, question: str, url: str = "ws://127.0.0.1:8765/v1/realtime") -> None:
    with RealtimeClient(url) as client:
        client.stream_file(path)  # as fast as the server takes it; speed=1.0 plays at real-time pace
        client.ask(question)
        client.commit()  # end of input: the server flushes the transcript, answers, then closes
        for event in client.events():
            if event.type.endswith("transcription.completed"):
                print(f"[{event.start:6.1f}s] {event.transcript}")
            elif event.type == "response.output_text.delta":
                print(event.delta, end="", flush=True)
            elif event.type == "response.done":
                print()
            elif event.type == "error":
                print(f"error: {event.error['message']}", file=sys.stderr)


if __name__ == "__main__":
    main(*sys.argv[1:])
