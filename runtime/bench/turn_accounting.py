"""The accounting of `runtime bench serve --conversations` (serve_conversations.py): what a session's received
events say about each turn (latencies from the end of its speech) and whether anything was lost. Pure functions
over timestamps, so a unit test scripts them; the bench's docstring defines every number.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

ANSWERED = ("completed", "incomplete")  # incomplete: stopped at max_output_tokens, which random weights always reach


@dataclass
class TurnMarks:
    """The client's side of one turn: when its first chunk and its end-of-speech chunk were sent."""

    turn: int
    first_sent: float
    speech_end_sent: float
    timed_out: bool = False


@dataclass(frozen=True)
class Ev:
    """One received server event, reduced to what the accounting reads."""

    at: float
    type: str
    item_id: str | None = None
    response_id: str | None = None
    status: str | None = None
    role: str | None = None
    code: str | None = None


@dataclass
class Account:
    """One session's latencies (seconds, one per turn that has the event) and loss counts."""

    speech_stopped: list[float] = field(default_factory=list)
    response_created: list[float] = field(default_factory=list)
    first_delta: list[float] = field(default_factory=list)
    after_stop: list[float] = field(default_factory=list)  # first delta - speech_stopped, both received
    counts: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)


LOSS_KEYS = ("turns_spoken", "turns_answered", "missed", "turns_without_text", "extra_responses", "committed",
             "transcripts_not_once", "items_done_not_once", "responses_created", "responses_not_done_once",
             "responses_cancelled", "sessions_failed")


def account(turns: list[TurnMarks], events: list[Ev], failed: bool = False) -> Account:
    """Latencies per turn and loss counts over one session's whole event stream (see the module docstring)."""
    out = Account()
    c = out.counts
    for i, turn in enumerate(turns):
        until = turns[i + 1].first_sent if i + 1 < len(turns) else float("inf")
        mine = [e for e in events if turn.speech_end_sent <= e.at < until]

        def first(kind: str, mine: list[Ev] = mine) -> float | None:
            return next((e.at for e in mine if e.type == kind), None)

        for kind, into in (("input_audio_buffer.speech_stopped", out.speech_stopped),
                           ("response.created", out.response_created), ("response.output_text.delta", out.first_delta)):
            if (at := first(kind)) is not None:
                into.append(at - turn.speech_end_sent)
        stopped, delta = first("input_audio_buffer.speech_stopped"), first("response.output_text.delta")
        if stopped is not None and delta is not None:
            out.after_stop.append(delta - stopped)
        created = [e.response_id for e in mine if e.type == "response.created"]
        answered = any(e.type == "response.done" and e.response_id in created and e.status in ANSWERED for e in mine)
        c["turns_spoken"] += 1
        c["turns_answered"] += answered
        c["turns_without_text"] += answered and first("response.output_text.delta") is None
        c["extra_responses"] += max(0, len(created) - 1)
    c["missed"] = c["turns_spoken"] - c["turns_answered"]
    committed = [e.item_id for e in events if e.type == "input_audio_buffer.committed"]
    transcripts = Counter(e.item_id for e in events
                          if e.type == "conversation.item.input_audio_transcription.completed")
    done = Counter(e.item_id for e in events if e.type == "conversation.item.done" and e.role == "user")
    c["committed"] = len(committed)
    c["transcripts_not_once"] = sum(transcripts[i] != 1 for i in committed) + len(committed) - len(set(committed))
    c["items_done_not_once"] = sum(done[i] != 1 for i in committed)
    created_ids = Counter(e.response_id for e in events if e.type == "response.created")
    done_ids = Counter(e.response_id for e in events if e.type == "response.done")
    c["responses_created"] = sum(created_ids.values())
    c["responses_not_done_once"] = (sum(done_ids[r] != 1 for r in created_ids) + sum(created_ids.values())
                                    - len(created_ids) + sum(1 for r in done_ids if r not in created_ids))
    c["responses_cancelled"] = sum(e.type == "response.done" and e.status == "cancelled" for e in events)
    c["sessions_failed"] = int(failed)
    out.errors = Counter(e.code or "?" for e in events if e.type == "error")
    return out


def lost(counts: Counter[str] | dict[str, int]) -> int:
    return sum(counts.get(k, 0) for k in ("missed", "transcripts_not_once", "items_done_not_once",
                                          "responses_not_done_once", "sessions_failed"))


def stats_ms(seconds: list[float]) -> dict[str, Any]:
    if not seconds:
        return {"p50": None, "p95": None, "max": None, "n": 0}
    values = np.asarray(seconds) * 1000.0
    return {"p50": round(float(np.percentile(values, 50)), 2), "p95": round(float(np.percentile(values, 95)), 2),
            "max": round(float(values.max()), 2), "n": len(seconds)}


def summarize(accounts: list[Account]) -> dict[str, Any]:
    """One row's latencies and loss counts, over the sessions' accounts."""
    counts: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    for a in accounts:
        counts.update(a.counts)
        errors.update(a.errors)
    loss: dict[str, Any] = {k: counts.get(k, 0) for k in LOSS_KEYS}
    loss["errors"] = dict(errors)
    loss["lost"] = lost(loss)
    return {"turn_latency_ms": stats_ms([x for a in accounts for x in a.first_delta]),
            "speech_stopped_ms": stats_ms([x for a in accounts for x in a.speech_stopped]),
            "response_created_ms": stats_ms([x for a in accounts for x in a.response_created]),
            "answer_after_stop_ms": stats_ms([x for a in accounts for x in a.after_stop]),
            "loss": loss}
