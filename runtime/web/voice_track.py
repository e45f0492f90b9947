"""The agent's voice on WebRTC: an aiortc audio track that the session's spoken output feeds (it is the speaker's
`Playout`, runtime/pipeline/spoken_output.py), paced at real time, and the Realtime API's `output_audio_buffer.*`
events about it.

Frames: 20 ms of 24 kHz mono s16, the format the voice is encoded in for this track (`FORMAT`), so nothing is
resampled on the event loop; aiortc's Opus encoder resamples to 48 kHz and encodes in its executor. `recv` hands out
one frame per 20 ms of wall time: the buffered audio, or silence when nothing plays, so the RTP clock runs on whether
the agent speaks or not and the browser's jitter buffer never has to resynchronise. A `recv` that comes late (a busy
loop) gets the frames owed at once, to catch up; more than `MAX_LATE_S` late, the clock restarts instead, since a
burst that long would only sit in the browser's jitter buffer and delay everything played after it.

The played clock: a sample counts as played out when the frame carrying it is handed to aiortc. The browser plays it
a network trip and a jitter buffer (tens of ms) later, so a barge-in's `audio_end_ms` can exceed what the user heard
by that much; it never counts audio that was made but not yet played, which on this transport is most of an answer
(the voice synthesises several times faster than real time).

The buffer: audio waiting to play, at most `buffer_s` seconds (60 s: 2.9 MB). When a piece does not fit, `play`
waits until enough has played out, so synthesis waits in turn (then the clause queue fills, then the answer's
decoding slows); nothing is dropped. A piece longer than the whole buffer is taken once the buffer is empty.

Events (`notify(type, response_id)`): `output_audio_buffer.started` when a response's first sample plays out;
`.stopped` once all of its audio has played and `end` said that no more comes; `.cleared` when `clear` empties the
buffer (barge-in, or the client's `output_audio_buffer.clear`). A clear drops what is buffered (the next frame is
silent) and every later piece of the responses it cut (they are being cancelled, or the client asked for silence);
`mute` does the same for a response that has sent nothing yet.
"""

from __future__ import annotations

import asyncio
import fractions
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import av
import numpy as np
from aiortc import MediaStreamTrack
from aiortc.mediastreams import MediaStreamError

from runtime.io.audio_formats import PCM, AudioFormat

RATE = 24000
FORMAT = AudioFormat(PCM, RATE)  # what the speaker encodes for this track
FRAME = RATE // 50  # 20 ms, the ptime browsers and aiortc use
BUFFER_S = 60.0
MAX_LATE_S = 0.2
REMEMBERED = 64  # items whose played clock is kept, and responses kept muted: far more than one turn has

STARTED, STOPPED, CLEARED = "output_audio_buffer.started", "output_audio_buffer.stopped", "output_audio_buffer.cleared"
Notify = Callable[[str, str], None]


@dataclass
class _Piece:
    response_id: str
    item_id: str
    samples: np.ndarray  # int16 at RATE
    offset: int = 0  # samples of it already played


class VoiceTrack(MediaStreamTrack):
    """The voice as an outgoing audio track; see the module docstring for its clock, its buffer and its events."""

    kind = "audio"

    def __init__(self, notify: Notify, *, buffer_s: float = BUFFER_S, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[object]] = asyncio.sleep) -> None:
        """`clock` and `sleep` pace the frames (a test gives its own)."""
        super().__init__()
        self.format = FORMAT
        self.notify = notify
        self.capacity = round(buffer_s * RATE)
        self._clock, self._sleep = clock, sleep
        self._pieces: deque[_Piece] = deque()
        self.buffered = 0  # samples waiting to play
        self._space = asyncio.Event()  # set whenever samples leave the buffer: a waiting `play` checks again
        self._pending: dict[str, int] = {}  # response -> its samples still buffered
        self._started: set[str] = set()  # responses whose audio began playing and has not stopped or been cleared
        self._ended: set[str] = set()  # responses that will send no more audio (`end`), not yet stopped
        self._muted: OrderedDict[str, None] = OrderedDict()
        self._played: OrderedDict[str, int] = OrderedDict()  # item -> samples of it played out
        self.last_response: str | None = None  # the newest response that sent audio
        self._start: float | None = None  # wall time of frame 0
        self._pts = 0  # samples handed out so far: the next frame's timestamp

    # The speaker's side (`Playout`).

    async def play(self, response_id: str, item_id: str, audio: bytes) -> None:
        """Queue 24 kHz PCM16 audio of an item; waits while the buffer is full (module docstring). Dropped when
        the response was cleared or muted, or the track has stopped."""
        samples = np.frombuffer(audio, dtype="<i2").astype(np.int16)
        if not len(samples):
            return
        while not self._takes(response_id, len(samples)):
            self._space.clear()
            await self._space.wait()
        if self.readyState != "live" or response_id in self._muted:
            return
        self._pieces.append(_Piece(response_id, item_id, samples))
        self.buffered += len(samples)
        self._pending[response_id] = self._pending.get(response_id, 0) + len(samples)
        self.last_response = response_id
        self._played.setdefault(item_id, 0)
        self._played.move_to_end(item_id)
        while len(self._played) > REMEMBERED:
            self._played.popitem(last=False)

    def _takes(self, response_id: str, samples: int) -> bool:
        gone = self.readyState != "live" or response_id in self._muted
        return gone or not self.buffered or self.buffered + samples <= self.capacity

    def end(self, response_id: str, item_id: str) -> None:
        """No more audio comes for this response: `stopped` follows once what is buffered has played."""
        if response_id in self._muted or (response_id not in self._started and not self._pending.get(response_id)):
            return  # cut, or it never sent any audio: nothing to stop
        self._ended.add(response_id)
        self._maybe_stopped(response_id)

    def played_ms(self, item_id: str) -> int:
        """Milliseconds of the item's audio played out so far (0 for one that never played)."""
        return self._played.get(item_id, 0) * 1000 // RATE

    # Cutting the sound.

    def clear(self, *, always: bool = False) -> str | None:
        """Empty the buffer now and drop any later audio of the responses cut; notifies `cleared` naming the response
        whose audio played or waited (with `always`, the newest one that sent audio, even when nothing was left).
        Returns the response named, if any."""
        cut = list(dict.fromkeys([*sorted(self._started), *(p.response_id for p in self._pieces)]))
        for response_id in cut:
            self.mute(response_id)
        named = cut[0] if cut else self.last_response if always else None
        if named is not None:
            self.notify(CLEARED, named)
        return named

    def mute(self, response_id: str) -> None:
        """Drop this response's audio from now on (what it sends later, too)."""
        self._muted[response_id] = None
        self._muted.move_to_end(response_id)
        while len(self._muted) > REMEMBERED:
            self._muted.popitem(last=False)
        self._pending.pop(response_id, None)
        self._started.discard(response_id)
        self._ended.discard(response_id)
        if any(p.response_id == response_id for p in self._pieces):
            kept = [p for p in self._pieces if p.response_id != response_id]
            self._pieces = deque(kept)
            self.buffered = sum(len(p.samples) - p.offset for p in kept)
            self._space.set()

    def stop(self) -> None:
        super().stop()
        self._pieces.clear()
        self.buffered = 0
        self._space.set()  # a waiting `play` returns, dropping its piece

    # aiortc's side.

    async def recv(self) -> av.AudioFrame:
        """The next 20 ms frame, when it is due."""
        if self.readyState != "live":
            raise MediaStreamError
        await self._pace()
        if self.readyState != "live":
            raise MediaStreamError
        frame = av.AudioFrame.from_ndarray(self._take(FRAME).reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = RATE, self._pts, fractions.Fraction(1, RATE)
        self._pts += FRAME
        return frame

    async def _pace(self) -> None:
        now = self._clock()
        if self._start is None:
            self._start = now
            return
        due = self._start + self._pts / RATE
        if due > now:
            await self._sleep(due - now)
        elif now - due > MAX_LATE_S:  # far behind: restart the clock rather than burst
            self._start = now - self._pts / RATE

    def _take(self, n: int) -> np.ndarray:
        """The next `n` samples to play: buffered audio, then silence; counts what played and notifies."""
        out = np.zeros(n, dtype=np.int16)
        filled = 0
        while filled < n and self._pieces:
            piece = self._pieces[0]
            response_id = piece.response_id
            if response_id not in self._started:
                self._started.add(response_id)
                self.notify(STARTED, response_id)
            k = min(n - filled, len(piece.samples) - piece.offset)
            out[filled : filled + k] = piece.samples[piece.offset : piece.offset + k]
            piece.offset += k
            filled += k
            self.buffered -= k
            self._pending[response_id] -= k
            if piece.item_id in self._played:
                self._played[piece.item_id] += k
            if piece.offset == len(piece.samples):
                self._pieces.popleft()
                self._maybe_stopped(response_id)
        if filled:
            self._space.set()
        return out

    def _maybe_stopped(self, response_id: str) -> None:
        if response_id in self._ended and response_id in self._started and not self._pending.get(response_id):
            self._ended.discard(response_id)
            self._started.discard(response_id)
            self._pending.pop(response_id, None)
            self.notify(STOPPED, response_id)
