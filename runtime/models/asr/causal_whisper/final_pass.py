"""The second pass of causal streaming Whisper: when an item ends at a commit (the end of a turn or of the
input), its text is decoded once more with everything the item heard, and that is the item's final transcript.

The block-causal stream decides each token with only the audio heard so far, so its words are shown within
the chunk plus a few hundred ms; the second pass costs one decode per item and fixes what only later audio
settles (two-pass streaming ASR, as U2/WeNet's attention rescoring or Google's two-pass decoders do). Captions
show the first pass as it streams; the completed event carries the second, which may revise it.

- `decoder`: the item's own decoder reads all of its block-causal encoder frames at once and decodes the item
  again from its context (cheap: decoder steps only; the encoder frames and their cross-attention K/V exist).
- `offline`: the base checkpoint (without the streaming adapter) decodes the item's audio with full context: the
  offline ceiling, for one encoder pass and one decode per item. Padded to 30 s as Whisper was trained, or
  (`asr.final_pass_window_s`) to its own windows with silence's encoder states after them (`whisper_window.py`);
  greedy, or by beam search with `asr.final_pass_beam` beams (`whisper_beam.py`). Torch's greedy search checks the
  stream's own words as a draft, several at a time, and keeps those it would have chosen (transcript_draft.py); with
  `asr.graph_runtime` the greedy search's steps run as an ONNX Runtime graph instead (onnx_pass.py).

Decoded greedily with full context, Whisper sometimes loops ("wait, wait, wait, ..." to the token limit: 5 of the
200 synthetic held-out clips, which lifted the pass's word error rate there from 50 % to 114 %). So the offline pass
takes openai-whisper's test: a transcript that zlib compresses more than 2.4 times is a loop. A looping greedy
transcript is decoded again from the same encoder states with 5 beams (openai-whisper and faster-whisper fall back
on temperature sampling instead: this one stays deterministic); if that loops too, the item keeps the stream's own
text, whose decoding ends loops (`asr.loop_repeats`).

An item completed by a 30 s cache reset keeps its first pass (its audio was cut mid-stream; only the item a commit
ends is decoded again). With the `decoder` pass an item the stream heard no words in stays empty (Whisper given
silence says "Thank you."); the `offline` pass decodes it too and judges it by Whisper's no-speech probability
(below): a stream given the turns before as context sometimes writes nothing for a short turn ("two" after
"one" on the human development clips) that the full-context pass hears.

The pass decodes with the item's previous text (the turns before it and the user's vocabulary, `ItemDecoder.previous`)
as the stream did, and it asks Whisper whether it heard speech at all: over silence, noise, tones and music tiny.en
writes "you" while its no-speech probability (`<|nocaptions|>` after `<|startoftranscript|>`) is 0.70-0.92 on the
generated non-speech set (`runtime/bench/non_speech.py`), against at most 0.29 on the human development clips and a
99th percentile of 0.52 on the synthetic held-out speech. An item whose probability is above openai-whisper's
`no_speech_threshold` (0.6) completes empty. openai-whisper keeps such a segment anyway when its average log
probability is above -1 (the decoder was sure of its words); that exception is not taken here, because Whisper's
"you" over non-speech is sure (-0.48 to -0.97 on the same set) and the VAD gate before the pass
(pipeline/transcript_gate.py) is the second opinion. `runtime bench asr-quality` reports the words this loses on
speech (`gate_words_lost`).

Previous text primes the pass, for better and worse: after a statement misheard as "Let me then move to Thursday at
10." (espeak's "The meeting moved to ..."), the pass with that context wrote "What's next?" for "What day is the
meeting?", which the stream, given the same context, wrote right, and the pass without it too. So the stream is the
pass's witness: where the pass with previous text shares fewer than half the words of the stream's own transcript
(`agrees`), it decodes once more without previous text, and keeps whichever transcript shares more words with the
stream's (a tie keeps the one with context). A stream that wrote nothing is no witness: given "... Fail better.
1." before it, the stream wrote nothing for the human turn "two" that the pass with context hears.

The greedy search also ends too soon: the first sentence of a passage read by a synthetic voice (`bench
asr-quality`'s `long_form_reading`), "Every morning the ferry leaves the old harbor at half past six.", became "and"
with its turn's own audio alone, where the stream wrote "Every morning the fairy leaves the old harbor at half past
six". So where the pass holds fewer than half the stream's words (`covers`: a pass that adds words the stream
missed is no sign of it), it decodes once more with `RETRY_BEAMS` beams and keeps the beams' transcript if it
shares more words with the stream's. The stream only witnesses: the transcript is always one of the pass's. The
beams run at the commit (they read the stream's words), so the turn they fire on completes later by a 5-beam search;
on the quick sets of `bench asr-quality` no English transcript changed with them.

Prepared during the pause (`OfflinePass.prepare`): with turn detection the pass reads a turn's audio up to its speech
end plus `FINAL_TAIL_S` (pipeline/pause_pass.py), audio that is all there while the pause is still being timed, so its
costly parts (the encoding, the language, the greedy search and the no-speech judgement) are computed then, and the
commit finds them. They are pure functions of the audio, the previous text and the language asked for, and are kept
under exactly those (a digest of the samples): a `revise` whose inputs differ computes them again, so a prepared
pass gives the same transcript as an unprepared one, only sooner. The pass is the model's, shared by every session
of a server, so it keeps the newest `PREPARED` preparations, not one: with a single slot, two conversations pausing
together each replaced the other's, and both commits computed their pass again (0.1 s each on the worker's ASR
thread, in the final transcript's time at two conversations: 0.10 s p50 against 0.015 s at one). What depends on
the stream's own words (the loop fallback, the witness check, a beam search's draft) is decided at the commit, on the
words the stream has then.

Reading on from the turn before (`TurnBefore`, captions sessions: pipeline/turns_before.py). A turn alone loses words a
reader's sentence carries across a pause, and the previous text alone does not bring them back: on `bench
asr-quality`'s passage read by two held-out voices, tiny.en's captions had 13.6 % and 10.5 % WER against
faster-whisper's 11.7 % and 7.4 % over the whole file, whose 30 s windows hold the sentences before. So where the
turn before is given, the pass also decodes that turn's audio and this one's in one window, the turn before's final
ids forced as the start of the transcript (as Whisper, trained on 30 s windows, reads a sentence that follows
another), and keeps what comes after them when the stream is its witness (it wrote words, `agrees` and `covers`, and
no loop); else the turn's own pass stands. A forced prefix that was misheard can derail a greedy search (tried on a
sentence at a time: byte tokens from the second sentence on), which the witness catches. It runs at the commit (not
prepared), once the turn's own pass has judged it speech, and only while both turns fit Whisper's 30 s.
"""

from __future__ import annotations

import hashlib
import logging
import unicodedata
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from runtime.chunks import SAMPLE_RATE
from runtime.errors import ConfigError
from runtime.models.asr.causal_whisper.emission import ItemDecoder
from runtime.models.asr.whisper_language import Speech
from runtime.models.asr.whisper_window import Encoded

FINAL_PASSES = ("none", "decoder", "offline")
_log = logging.getLogger(__name__)


# openai-whisper's `compression_ratio_threshold`: a transcript that zlib compresses more than this is a decoding loop
LOOP_RATIO = 2.4
NO_SPEECH = 0.6  # openai-whisper's `no_speech_threshold`: above it Whisper says the audio holds no speech
RETRY_BEAMS = 5  # the beams a looping transcript is decoded again with (openai-whisper's and faster-whisper's default)


class Hypothesis(Protocol):
    """A full-context Whisper decoder (`whisper_buffered.WhisperBuffered`): encoder states of some audio, their
    transcript ids by its own search (`beams`: 1 is greedy) or by `beams` given, and the text of ids. A greedy search
    checks `draft` as it goes (transcript_draft.py): the same ids, found in fewer decoder calls when it is right."""

    beams: int

    def encode(self, audio: np.ndarray) -> Encoded: ...

    def decode(self, encoded: Encoded, forced: Sequence[int] = (), beams: int | None = None,
               draft: Sequence[int] = (), previous: Sequence[int] = (), sot: Sequence[int] | None = None
               ) -> list[int]: ...

    def sot_for(self, encoded: Encoded, speech: Speech | None = None) -> tuple[list[int], str]:
        """(start-of-transcript sequence, language) of `speech` over `encoded`, its language detected if not given."""
        ...

    def judge(self, encoded: Encoded, ids: Sequence[int], previous: Sequence[int] = (),
              sot: Sequence[int] | None = None) -> tuple[float, float]:
        """(no-speech probability, average log probability) of the transcript `ids`."""
        ...

    def text(self, ids: Sequence[int]) -> str: ...


class Search(Protocol):
    """A greedy search over encoder states (`onnx_pass.GraphSearch`) after some previous text: transcript ids."""

    def __call__(self, encoded: Encoded, previous: Sequence[int] = (), sot: Sequence[int] | None = None
                 ) -> list[int]: ...


def compression_ratio(text: str) -> float:
    """UTF-8 bytes over zlib-compressed bytes: about 1.5-2 for speech, far more for a phrase written over and over."""
    data = text.encode()
    return len(data) / len(zlib.compress(data)) if data else 0.0


def loops(text: str) -> bool:
    return compression_ratio(text) > LOOP_RATIO


# Scripts written without spaces between words (Thai, Lao, Tibetan, Myanmar, Khmer, kana, Han): there each character,
# with the vowel signs and marks that follow it, counts as a word.
_UNSPACED = ((0x0E00, 0x0FFF), (0x1000, 0x109F), (0x1780, 0x17FF), (0x3040, 0x30FF), (0x3400, 0x4DBF),
             (0x4E00, 0x9FFF), (0xF900, 0xFAFF), (0xFF66, 0xFF9F), (0x20000, 0x3134F))


def _unspaced(ch: str) -> bool:
    code = ord(ch)
    return any(lo <= code <= hi for lo, hi in _UNSPACED)


def words(text: str) -> list[str]:
    """Lower-case words of any script, punctuation dropped: what two transcripts are compared by. A word is letters and
    digits with the marks that follow them (Hindi's vowel signs, a decomposed accent) and apostrophes inside it
    ("don't"); the whisper-base profile writes German, Spanish, Hindi, ...: "años" is one word, not "a" and "os"."""
    out: list[str] = []
    word: list[str] = []
    cluster = False  # the word is one character of an unspaced script (and its marks)

    def flush() -> None:
        if piece := "".join(word).rstrip("'"):
            out.append(piece)
        word.clear()

    for ch in unicodedata.normalize("NFC", text.lower()):
        kind = unicodedata.category(ch)
        if kind in ("Mn", "Mc") and word:
            word.append(ch)
        elif kind[0] in "LN":
            unspaced = _unspaced(ch)
            if cluster or unspaced:
                flush()
            cluster = unspaced
            word.append(ch)
        elif ch in "'\u2019" and word and not cluster:
            word.append("'")
        else:
            flush()
            cluster = False
    flush()
    return out


def shared_words(a: str, b: str) -> int:
    """Words of `a` that `b` has in the same order (their longest common subsequence)."""
    x, y = words(a), words(b)
    row = [0] * (len(y) + 1)
    for w in x:
        diagonal = 0
        for j, v in enumerate(y, 1):
            diagonal, row[j] = row[j], diagonal + 1 if w == v else max(row[j], row[j - 1])
    return row[-1]


def agrees(stream: str, decoded: str) -> bool:
    """Whether `decoded` shares at least half the words of the longer of it and the stream's transcript (or the
    stream wrote nothing: no witness)."""
    longest = max(len(words(stream)), len(words(decoded)))
    return not words(stream) or 2 * shared_words(stream, decoded) >= longest


def covers(stream: str, decoded: str) -> bool:
    """Whether `decoded` holds at least half the words of the stream's transcript (a pass may add the words a stream
    missed; one that lost most of the stream's was cut short)."""
    return 2 * shared_words(stream, decoded) >= len(words(stream))


class FinalPass(Protocol):
    name: str
    judges_speech: bool  # it says itself whether an item holds speech (run even where the stream wrote nothing)

    def revise(self, item: ItemDecoder, audio: np.ndarray, speech: Speech | None = None,
               before: TurnBefore | None = None) -> list[int]:
        """The item's final token ids, given its decoder state after the last block and the audio it covers, in
        `speech`'s language and task (None: the model's); `before`: the turn before it, which a pass may read
        first (module doc)."""
        ...


class DecoderPass:
    name = "decoder"
    judges_speech = False

    def revise(self, item: ItemDecoder, audio: np.ndarray, speech: Speech | None = None,
               before: TurnBefore | None = None) -> list[int]:
        item.redecode()  # in the stream's own language and task
        return [t.id for t in item.tokens]


@dataclass(frozen=True)
class _Prepared:
    """The offline pass's pure parts, computed for `key` (audio digest, previous text, speech) before the commit."""

    key: tuple[object, ...]
    encoded: Encoded
    sot: list[int]
    language: str
    ids: list[int] | None  # the greedy search's (None: the pass searches with beams, which read the stream's words)
    no_speech: float | None  # the judgement of `ids` with the previous text


WINDOW_SAMPLES = 30 * SAMPLE_RATE  # Whisper's window: a turn and the turn before it are read together only within it


@dataclass(frozen=True, eq=False)
class TurnBefore:
    """The turn before an item, as its final pass may read it first: the audio that turn's pass read, the ids it
    gave, and the language and task they were written in (a turn in another language or task is not read on: its
    ids, forced, would ask the model to go on in a language the item is not in)."""

    audio: np.ndarray
    ids: tuple[int, ...]
    speech: Speech


PREPARED = 8  # preparations kept (each 1-3 MB: 1,500 encoder states), for conversations that pause at once


def _key(audio: np.ndarray, previous: Sequence[int], speech: Speech | None) -> tuple[object, ...]:
    digest = hashlib.blake2b(np.ascontiguousarray(audio, np.float32).tobytes(), digest_size=16).digest()
    return len(audio), digest, tuple(previous), speech


class OfflinePass:
    name = "offline"
    judges_speech = True

    def __init__(self, offline: Hypothesis, search: Search | None = None, no_speech: float = NO_SPEECH,
                 read_on: bool = True) -> None:
        """`search`: the greedy search run elsewhere than `offline`'s own decoder (an ONNX Runtime graph of it,
        onnx_pass.py); the encoding, the loop check and the beam retry stay `offline`'s. `no_speech`: the
        no-speech probability above which an item completes empty (above 1: never; the bench's ungated row).
        `read_on`: whether it reads on from a turn before given to `revise` (`asr.final_pass_read_on`)."""
        self.offline, self.search, self.no_speech, self.reads_on = offline, search, no_speech, read_on
        self.retried = 0  # items whose transcript looped and were decoded again with RETRY_BEAMS
        self.kept_stream = 0  # items that looped with beams too and kept the stream's text
        self.silent = 0  # items Whisper heard no speech in (completed empty)
        self.redecoded = 0  # items decoded again without previous text (the stream disagreed with the pass)
        self.beamed = 0  # items decoded again with RETRY_BEAMS beams (the stream still disagreed with the pass)
        self.last_no_speech = 0.0  # the no-speech probability of the last item revised
        self.last_language = ""  # the language the last item was decoded in (detected over it when not given)
        self.prepared_used = 0  # revisions that found their pure parts prepared (module doc)
        self.read_on = 0  # items whose transcript came from reading on from the turn before (module doc)
        self._prepared: OrderedDict[tuple[object, ...], _Prepared] = OrderedDict()  # by key, oldest first

    def prepare(self, item: ItemDecoder, audio: np.ndarray, speech: Speech | None = None) -> list[int] | None:
        """Compute what a `revise` of `audio` for `item` will need, ahead of it (module doc); keeps only the
        preparation under its inputs. Returns the ids the
        revision will give unless the stream's words at the commit overrule them (a loop, the witness check), or
        None when that cannot be told yet (a beam search reads the stream's words). Keeps the newest `PREPARED`
        preparations (every stream of the model prepares here)."""
        offline, previous = self.offline, item.previous
        encoded = offline.encode(audio)
        sot, language = offline.sot_for(encoded, speech)
        ids = self.search(encoded, previous, sot) if self.search is not None and offline.beams == 1 else None
        no_speech = offline.judge(encoded, ids, previous, sot)[0] if ids is not None else None
        key = _key(audio, previous, speech)
        self._prepared.pop(key, None)
        self._prepared[key] = _Prepared(key, encoded, sot, language, ids, no_speech)
        while len(self._prepared) > PREPARED:
            self._prepared.popitem(last=False)
        if ids is None or no_speech is None:
            return None
        return [] if no_speech > self.no_speech else list(ids)

    def revise(self, item: ItemDecoder, audio: np.ndarray, speech: Speech | None = None,
               before: TurnBefore | None = None) -> list[int]:
        """As `FinalPass.revise`; a language `speech` does not give is detected over the item's audio (its first 30 s
        window: Whisper's own language identification), which may differ from what the stream detected early."""
        ids = self._own(item, audio, speech)
        if before is None or not self.reads_on or not ids or len(before.audio) + len(audio) > WINDOW_SAMPLES:
            return ids
        if before.speech != Speech(self.last_language, (speech or Speech()).task):
            return ids  # the turn before was in another language or task
        try:
            return self._read_on(item, audio, speech, before, ids)
        except Exception:  # reading on only improves a transcript the item already has: a failure must not lose it
            _log.exception("reading on from the turn before failed; the turn's own transcript stands")
            return ids

    def _read_on(self, item: ItemDecoder, audio: np.ndarray, speech: Speech | None, before: TurnBefore,
                 ids: list[int]) -> list[int]:
        """The item read on from the turn before in one window (module doc), if the stream agrees; else `ids`."""
        offline, forced = self.offline, list(before.ids)
        stream = offline.text([t.id for t in item.tokens])
        if not words(stream):  # no witness: a forced prefix that derailed would go unseen
            return ids
        encoded = offline.encode(np.concatenate([before.audio, audio]))
        # in the language the item's own pass decoded in (detected over the item alone when not given): the turn
        # before's (revise checked)
        sot, _ = offline.sot_for(encoded, before.speech)
        # a captions session's previous text ends with the turn before's words, which the window now holds as forced
        # ids: read once, not twice (espeak reading 9.88 -> 9.26 % WER, synthetic long form 41.98 -> 40.61)
        previous = list(item.previous)
        if forced and previous[-len(forced):] == forced:
            previous = previous[: -len(forced)]
        read = offline.decode(encoded, forced=forced, beams=1, previous=previous, sot=sot)[len(forced):]
        text = offline.text(read)
        if not read or loops(text) or not (agrees(stream, text) and covers(stream, text)):
            return ids
        self.read_on += 1
        return read

    def _own(self, item: ItemDecoder, audio: np.ndarray, speech: Speech | None) -> list[int]:
        """The item's transcript from its own audio (module doc: the witness, the beams and the no-speech rule)."""
        offline, previous = self.offline, item.previous
        ready = self._prepared.pop(_key(audio, previous, speech), None)
        self.prepared_used += ready is not None
        encoded = ready.encoded if ready is not None else offline.encode(audio)
        sot, self.last_language = (ready.sot, ready.language) if ready is not None else offline.sot_for(encoded,
                                                                                                         speech)
        draft = [t.id for t in item.tokens]  # the stream's words: on human speech most are right
        greedy = self.search is not None and offline.beams == 1
        ids = (ready.ids if ready is not None and ready.ids is not None
               else self.search(encoded, previous, sot) if greedy  # type: ignore[misc]
               else offline.decode(encoded, draft=draft, previous=previous, sot=sot))
        looped = loops(offline.text(ids))
        beams = offline.beams  # of the search that gave `ids`
        if looped and beams < RETRY_BEAMS:
            self.retried += 1
            ids, beams = offline.decode(encoded, beams=RETRY_BEAMS, previous=previous, sot=sot), RETRY_BEAMS
            looped = loops(offline.text(ids))
        if looped:
            self.kept_stream += 1
            ids = [t.id for t in item.tokens]
        stream = offline.text([t.id for t in item.tokens])
        if previous and not agrees(stream, offline.text(ids)):  # the context may have misled it (module doc)
            self.redecoded += 1
            plain = self.search(encoded, (), sot) if greedy else offline.decode(encoded, draft=draft, sot=sot)
            if not loops(offline.text(plain)) and (shared_words(stream, offline.text(plain))
                                                   > shared_words(stream, offline.text(ids))):
                ids, previous = plain, []
        if not covers(stream, offline.text(ids)) and beams < RETRY_BEAMS:  # a greedy search cut short (module doc)
            self.beamed += 1
            beamed = offline.decode(encoded, beams=RETRY_BEAMS, previous=previous, sot=sot)
            if not loops(offline.text(beamed)) and (shared_words(stream, offline.text(beamed))
                                                    > shared_words(stream, offline.text(ids))):
                ids = beamed
        if ready is not None and ready.no_speech is not None and ids == ready.ids and previous == item.previous:
            self.last_no_speech = ready.no_speech
        else:
            self.last_no_speech, _ = offline.judge(encoded, ids, previous, sot)
        if self.last_no_speech > self.no_speech:
            self.silent += 1
            return []
        return ids


def check(kind: str) -> str:
    if kind not in FINAL_PASSES:
        raise ConfigError(f"asr.final_pass={kind!r} is not one of {', '.join(FINAL_PASSES)}")
    return kind
