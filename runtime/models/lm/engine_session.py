"""One stream's state on the language engine (`engine.LMEngine`): its attention-sink KV cache, the source token
history prefilled as the context streams in, and the open answer's target group. The prompt layout, the streaming
prefill's rules and why they hold are in `engine.py`'s docstring; this module is their bookkeeping. Every method but
`set_context` runs on the device worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from transformers import PreTrainedTokenizerBase

from runtime.config import LMConfig
from runtime.errors import PromptTooLong
from runtime.models.lm.compiled_step import CompiledStep
from runtime.models.lm.kv_cache import Attend, SinkKVCache
from runtime.models.lm.pieces import Piece, visual_id
from runtime.models.lm.prompt import EMPTY_CONTEXT, Messages, Tools
from runtime.models.lm.source_tokens import SourceTokens
from runtime.models.lm.transformer import CachedPart, Transformer

if TYPE_CHECKING:  # imported at run time only on CUDA, by `EngineSession._decode_graph`
    from runtime.models.lm.cuda_graph import DecodeGraph


class SessionEngine(Protocol):
    """What a session reads of its shared engine (`engine.LMEngine`, which opens sessions): the model and its
    tokenizer, the cache geometry, the prompt's parts and the compiled step."""

    model: Transformer
    tokenizer: PreTrainedTokenizerBase
    cfg: LMConfig
    compiled: CompiledStep | None
    head: str  # the prompt's head without tools
    sink: int
    window: int
    reserve: int
    target: int
    chunk: int  # source tokens a prefill job runs at most
    by_token: bool  # prefill each token as a one-token step would (bitwise the same however it was cut)
    max_question_tokens: int

    def encode(self, text: str) -> list[int]: ...

    def encode_cached(self, text: str) -> list[int]: ...

    def head_for(self, tools: Tools) -> str: ...

    def prompt_parts(self, question: str, tools: Tools = None, after: Messages = ()) -> tuple[str, str]: ...


@dataclass
class SessionStats:
    prefilled: int = 0  # source tokens run through the model
    skipped: int = 0  # source tokens the window would have evicted before the context's end landed: never run
    restarts: int = 0  # edits before the window: the source started again from the sinks
    truncated: int = 0  # source tokens dropped by update mode or a restart (evicted ones too), re-run if wanted
    answers: int = 0


class EngineSession:
    """One stream: an attention-sink cache, the source token history, and the open answer (a `Target`)."""

    def __init__(self, engine: SessionEngine) -> None:
        a = engine.model.args
        self.engine = engine
        self.vocab_size = a.vocab_size
        self.cache = SinkKVCache(layers=a.num_layers, kv_heads=a.num_kv_heads, head_dim=a.head_dim,
                                 sink=engine.sink, window=engine.window, reserve=engine.reserve,
                                 target=engine.target, device=engine.model.device, dtype=engine.model.dtype)
        self.stats = SessionStats()
        self._wanted = ""  # the newest transcript, set from any thread
        self._wanted_suffix: tuple[Piece, ...] = ()  # the newest memory suffix, set from any thread
        self._tokens = SourceTokens(engine.tokenizer)  # the current source text's ids, kept incrementally
        self._suffix: tuple[Piece, ...] = ()  # the suffix `_ids` was built from
        self._suffix_ids: list[int] = []
        self._visual: dict[int, torch.Tensor] = {}  # stand-in id -> its embedding row, for the current suffix
        self._ids: list[int] = []  # the wanted source: transcript ids, then suffix ids
        self._synced: tuple[str, tuple[Piece, ...]] = ("", ())  # (transcript, suffix) of the last sync
        self.answered_from: tuple[str, tuple[Piece, ...]] = ("", ())  # what the open/last answer saw
        self._hist: list[int] = []  # source ids whose KV was computed, from the start (evicted ones included)
        self._answer_prefix: list[int] = []  # the live source ids the open answer sees
        self._target: list[int] = []  # the open answer's committed target ids: prompt tail, then answer
        self._next: torch.Tensor | None = None
        self._tree: tuple[list[int], torch.Tensor] | None = None
        self._graph: DecodeGraph | None = None  # the CUDA-graph decode step, recorded on first use
        self._restart = False  # an edit before the window came during an answer: restart after it
        self.tools: Tools = None  # the function tools the head renders (a tool-taking template's system turn)
        self.head = engine.head

    # -- source group ---------------------------------------------------------------------------------------

    def set_context(self, text: str, suffix: Sequence[Piece] | None = None) -> None:
        """Record the transcript so far (its unstable tail included) and, when given, the memory suffix that
        follows it (None keeps the current one); cheap and safe from the event loop."""
        self._wanted = text
        if suffix is not None:
            self._wanted_suffix = tuple(suffix)

    def set_tools(self, tools: Tools) -> None:
        """Write `tools` into the head (None: the plain head). A new head changes the source from its system turn
        on, so the context after it is prefilled again; a head longer than the sinks becomes the sinks (the window
        gives up the slots, so the cache and the compiled step keep their shapes) and is never evicted. Not during
        an answer."""
        head = self.engine.head_for(tools)
        if head == self.head:
            self.tools = tools
            return
        if self.cache.answering:
            raise RuntimeError("the tools do not change during an answer")
        need = len(self.engine.encode(head))
        if need > self.engine.window // 2:  # refused before anything changes
            raise PromptTooLong(f"the tools' descriptions take {need} prompt tokens with the system prompt, more "
                                f"than half the engine's window of {self.engine.window}; declare fewer or shorter")
        self.head, self.tools = head, tools
        if need > self.cache.sink:
            self._restart_source(0)
            self.cache.resplit(need)
            self._graph = None

    def _build_suffix(self, suffix: tuple[Piece, ...]) -> None:
        ids: list[int] = []
        visual: dict[int, torch.Tensor] = {}
        for piece in suffix:
            if isinstance(piece, str):
                ids.extend(self.engine.encode_cached(piece))
                continue
            rows = piece.embeds.reshape(-1, piece.embeds.shape[-1])
            for r in range(rows.shape[0]):
                vid = visual_id(piece.key, r)
                visual[vid] = rows[r]
                ids.append(vid)
        self._suffix, self._suffix_ids, self._visual = suffix, ids, visual

    def _sync(self) -> None:
        """Re-tokenise a changed transcript or suffix and cut the KV back to the longest common prefix of ids."""
        wanted, suffix = self._wanted, self._wanted_suffix  # read once: the event loop may set them meanwhile
        self._synced = (wanted, suffix)
        same = self._tokens.update(self.head + (wanted or EMPTY_CONTEXT))
        if same is None and suffix == self._suffix and not (self._restart and not self.cache.answering):
            return
        if same is None:
            same = len(self._tokens.ids)
        if suffix != self._suffix:
            self._build_suffix(suffix)
        # without a suffix, share the transcript's list (SourceTokens replaces it, never mutates it): no copy of
        # an hour's ids per transcript update
        self._ids = new = self._tokens.ids + self._suffix_ids if self._suffix_ids else self._tokens.ids
        hist = self._hist
        keep = min(same, len(hist))
        while keep < len(hist) and keep < len(new) and hist[keep] == new[keep]:
            keep += 1
        committed = self.cache.sink + self.cache.evicted  # what lies before the window
        if self.cache.evicted and keep < committed:
            # An edit before the window (a deleted item, older screens consolidated): the window must become the
            # new text's end, which the old history cannot give (it held nothing of a short context after a long
            # pasted item was deleted). The source starts again from the sinks (those still the same) and
            # `prefill_step` runs, or skips to, the new end: at most a window. During an answer, which must keep
            # its view, that waits for the next sync after it.
            self._restart = True
        if self._restart:
            if not self.cache.answering:  # the sinks kept are those still the same (a deferred edit may be older)
                limit = min(self.cache.sink, len(hist), len(new))
                self._restart_source(next((i for i in range(limit) if hist[i] != new[i]), limit))
                return
            keep = max(keep, committed)
        if keep < len(hist):
            drop = len(hist) - keep
            self.cache.truncate_source(self.cache.source_len - drop)
            del hist[keep:]
            self.stats.truncated += drop

    def _restart_source(self, keep: int) -> None:
        keep = min(keep, len(self._hist))
        self._restart = False
        self.stats.truncated += len(self._hist) - keep
        self.stats.restarts += 1
        self.cache.restart_source(keep)
        del self._hist[keep:]

    def pending_tokens(self) -> int:
        """Source tokens still to prefill (re-tokenises first if the context changed)."""
        self._sync()
        return max(0, len(self._ids) - len(self._hist))

    @torch.inference_mode()
    def prefill_step(self) -> int:
        """Prefill at most `prefill_chunk_tokens` pending source tokens; returns how many (0: nothing to do, or
        the reserve is full during an answer and the rest waits for `end_answer`)."""
        pending = self.pending_tokens()
        if self._restart:  # (during an answer) the restart after it drops whatever the reserve took meanwhile
            return 0
        self._skip_evicted(pending)
        n = min(pending, self.engine.chunk, self.cache.source_room())
        if n <= 0:
            return 0
        start = len(self._hist)
        ids = self._ids[start : start + n]
        attend = self.cache.append_source(n)
        # the source's own logits are never read (an answer's tail always follows it): the cache alone is filled
        self._forward(ids, attend, last_only=True, embeds=self._embeds(ids), by_token=self.engine.by_token, head=False)
        self._hist.extend(ids)
        self.stats.prefilled += n
        return n

    def _skip_evicted(self, pending: int) -> None:
        """A context that grew by more than the window at once (a pasted document, a restored conversation): the
        tokens the window would evict before the last one lands are recorded as evicted without being run, so
        the prefill costs at most a window however long the text (a 3 MB message took half an hour). What is
        lost is their attention on the tokens after them, and once the window slides the keys a token sees
        depend on how the context was cut anyway (docs/llm.md). The sinks are always run first."""
        skip = pending - self.cache.window
        if skip <= 0 or self.cache.answering or len(self._hist) < self.cache.sink:
            return
        start = len(self._hist)
        self._hist.extend(self._ids[start : start + skip])
        self.cache.skip_source(skip)
        self.stats.skipped += skip

    def source_ids(self) -> list[int]:
        """The source ids whose KV is live: the sinks, then the window, in order."""
        s = min(self.cache.sink, len(self._hist))
        return self._hist[:s] + self._hist[s + self.cache.evicted :]

    def _embeds(self, ids: Sequence[int]) -> torch.Tensor | None:
        """Input embeddings for `ids` when some stand for visual rows; None when all are plain tokens."""
        rows = [i for i, t in enumerate(ids) if t < 0]
        if not rows:
            return None
        model = self.engine.model
        plain = torch.tensor([max(t, 0) for t in ids], dtype=torch.long, device=model.device)
        x = model.model.embed_tokens(plain)
        x[rows] = torch.stack([self._visual[ids[i]] for i in rows]).to(device=x.device, dtype=x.dtype)
        return x

    def _forward(self, ids: Sequence[int], attend: Attend, *, last_only: bool,
                 embeds: torch.Tensor | None = None, by_token: bool = False, head: bool = True) -> torch.Tensor:
        tokens = torch.tensor([max(t, 0) for t in ids], dtype=torch.long, device=self.cache.k.device)
        return self.engine.model(tokens, attend.q_pos, attend.k_pos, attend.mask, cache=self.cache.buffers,
                                 slot=attend.slot, last_only=last_only, embeds=embeds, by_token=by_token,
                                 head=head)

    # -- target group (the open answer) -------------------------------------------------------------------

    @torch.inference_mode()
    def begin_answer(self, question: str, after: Messages = ()) -> list[int]:
        """Prefill what is pending of the source, then the prompt tail (the question, and `after`: the exchange of
        calls being continued) into a new target group; returns the tail's ids. `next_logits()` then gives the
        first token's distribution."""
        if self.cache.answering:
            raise RuntimeError("an answer is already open; end_answer() first")
        ids = self.engine.encode(self.engine.prompt_parts(question, self.tools, after)[1])
        if len(ids) > self.engine.max_question_tokens:  # refused before the pending context costs its prefill
            what = "the question, the response's instructions and the calls' outputs" if after else (
                "the question and the response's instructions")
            raise PromptTooLong(f"{what} need {len(ids)} prompt tokens, more than the engine's "
                                f"{self.engine.max_question_tokens}; shorten them")
        while self.prefill_step():
            pass
        self.answered_from = self._synced  # the transcript and suffix this answer sees
        self.cache.begin_target()
        self._answer_prefix = self.source_ids()
        attend = self.cache.append_target(len(ids))
        # not by token: the tail is one call whatever the timing, so its rounding does not depend on it
        self._next = self._forward(ids, attend, last_only=True)[0]
        self._target, self._tree = list(ids), None
        self.stats.answers += 1
        return list(ids)

    def answer_ids(self) -> list[int]:
        """The sequence the open answer conditions on: the live source at question time, tail, answer so far."""
        return self._answer_prefix + self._target

    def next_logits(self) -> torch.Tensor:
        """Logits [vocab] for the token after the committed sequence (after the prompt, then after commits)."""
        if self._next is None:
            raise RuntimeError("no open answer: begin_answer() first")
        return self._next

    @torch.inference_mode()
    def score(self, tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """Target protocol: logits [n, vocab] for a tree of tokens after the committed answer (tree attention)."""
        if not self.cache.answering:
            raise RuntimeError("no open answer: begin_answer() first")
        if len(tokens) != len(parents):
            raise ValueError("tokens and parents differ in length")
        attend = self.cache.score_tree(parents)
        one = len(tokens) == 1 and tokens[0] >= 0
        graph = self._decode_graph() if one else None
        compiled = self.engine.compiled if one and graph is None else None
        tree = self.engine.compiled if len(tokens) > 1 else None  # a drafted tree: its compiled verification
        # by token on CPU: each node's logits are exactly what a plain decode step there computes (lossless
        # greedy with row-independent matmuls: int8/int4; the compiled step computes them bitwise too). On CUDA
        # the decode step is the fixed-form graph, a different call anyway, and a call per node would make wide
        # trees dear: one masked call there.
        by_token = self.cache.k.device.type == "cpu"
        logits = None
        if graph:
            logits = graph.run(tokens[0], attend)
        elif compiled and compiled.fits(attend):
            logits = compiled.run(tokens[0], attend, self.cache)  # None: no compiled step for these inputs
        elif tree and tree.fits_tree(attend) and min(tokens) >= 0:
            logits = tree.run_tree(list(tokens), attend, self.cache)
        if logits is None:
            logits = self._forward(tokens, attend, last_only=False, by_token=by_token)
        self._tree = (list(tokens), logits)
        return logits

    @property
    def scores_together(self) -> bool:
        """Whether `score_together` may score this session's trees beside other sessions' of its engine: on the CPU
        (on CUDA a session's step is its own recorded graph). A compiled step scores one session: trees scored
        together run eagerly, which two sessions' steps in one read of the weights repay."""
        return self.cache.k.device.type == "cpu"

    def _decode_graph(self) -> DecodeGraph | None:
        """This session's recorded one-token step, on CUDA with `lm.cuda_graphs` (made on first use)."""
        if self._graph is None and self.engine.cfg.cuda_graphs and self.cache.k.device.type == "cuda":
            from runtime.models.lm.cuda_graph import DecodeGraph  # the CUDA-only boundary: imported only here

            self._graph = DecodeGraph(self.engine.model, self.cache, graph=True)
        return self._graph

    @torch.inference_mode()
    def commit(self, nodes: Sequence[int]) -> None:
        """Target protocol: keep one root-to-node path of the last scored tree, drop the other nodes."""
        if self._tree is None:
            if nodes:
                raise RuntimeError("commit() without a scored tree")
            return
        tokens, logits = self._tree
        self.cache.commit(nodes)
        self._target.extend(tokens[i] for i in nodes)
        if nodes:
            self._next = logits[nodes[-1]]
        self._tree = None

    def committed_tokens(self) -> int:
        """Target protocol: length of the committed sequence the answer conditions on (`answer_ids()`)."""
        return len(self._answer_prefix) + len(self._target)

    @torch.inference_mode()
    def end_answer(self) -> None:
        """Drop the target group; source tokens that arrived meanwhile become visible to the next answer."""
        self.cache.end_target()
        self._answer_prefix, self._target, self._next, self._tree = [], [], None, None


@torch.inference_mode()
def score_together(trees: Sequence[tuple[EngineSession, Sequence[int], Sequence[int]]]) -> list[torch.Tensor]:
    """`score` for several sessions of one engine (each `scores_together`) in one forward: (session, tokens,
    parents) in, each session's logits [n, vocab] out, every session left as its own `score` leaves it (`commit`
    next). Why: a decode step reads every weight, and on a CPU that read is the step's cost; two sessions' steps in
    one forward cost little more than one (`Transformer.forward_many`), so a server answering two conversations at
    once does not take turns. With the runtime's int8/int4 kernels each row's logits are bitwise those of the
    session's own `score`, so greedy answers are the same tokens (tested)."""
    if not trees:
        return []
    engine = trees[0][0].engine
    for session, tokens, parents in trees:  # every check before any cache changes
        if session.engine is not engine or not session.scores_together:
            raise ValueError("score_together takes sessions of one engine, on the CPU")
        if not session.cache.answering:
            raise RuntimeError("no open answer: begin_answer() first")
        if len(tokens) != len(parents) or not tokens or min(tokens) < 0:
            raise ValueError("a tree of plain tokens, one parent each")
    if len({id(session) for session, _, _ in trees}) < len(trees):
        raise ValueError("one tree per session")
    parts = []
    for session, tokens, parents in trees:
        attend = session.cache.score_tree(parents)
        ids = torch.tensor(list(tokens), dtype=torch.long, device=session.cache.k.device)
        parts.append(CachedPart(ids, attend.q_pos, attend.k_pos, attend.mask, session.cache.buffers, attend.slot))
    logits = engine.model.forward_many(parts)
    for (session, tokens, _), rows in zip(trees, logits, strict=True):
        session._tree = (list(tokens), rows)
    return logits
