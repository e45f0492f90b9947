"""The processors a session runs: chunks in, events out. Each is one asyncio task reading one bounded channel
(or one signal), and hands model compute to the device worker (`worker.run`), so the loop only moves data:

    audio channel ---> AudioProcessor (audio.py) --(worker: ASR)--> transcript events, Conversation
    video channel ---> VideoProcessor (video.py) --(worker: vision tower)--> VideoMemory
                                                   '--> closed segments --> NoteWriter (notes.py) --> video.note
    context changes -> ContextPrefiller (prefill.py) --(worker: prefill)--> the LM stream's KV
    question channel -> QuestionProcessor (answers.py) --(worker: prefill, then one decode step per job)--> answer

Processors never hold each other: what one writes and another waits for goes through the small objects of
`runtime/session_state.py`, and `runtime/session_builder.py` hands each processor exactly what it uses.
"""

from collections.abc import Awaitable, Callable

from runtime.events import Event

Emit = Callable[[Event], Awaitable[None]]  # hands an event to the session's event channel (waits while full)
