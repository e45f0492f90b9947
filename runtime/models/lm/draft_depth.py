"""How deep to draft: the depth controller of speculative decoding (`speculative.py`) and the costs it prices steps by.

Why apart from the decoder: the decoder's job is exactness (whatever is drafted, the output is the target's own);
this module's is speed, a bet on expected accepted tokens per second of a step, made from measured acceptance and
measured verification times. The two change for different reasons and are tested apart (`tests/test_speculative.py`:
the decoder against plain decoding, the controller against constructed costs and acceptance runs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass
class CostLine:
    """A verification's time against its rows, a line fitted by least squares to the recent measurements of every
    size (each earlier one weighing `decay` as much as the next).

    Why: priced per size (an average of that size's own measurements), a size measured once in a slow moment of a
    shared machine kept that price until it was measured again, and a price that steers the depth away from it is
    not measured again: on the 1.5B the tables of four answerers one minute apart held 41 to 56 ms for four rows, and
    two rows dearer than four. Every measurement moves the whole line, so no size keeps a stale price; the
    verification's cost on a CPU is near a line in its rows (about 5 ms a row above a 31-35 ms step at 2 threads)."""

    decay: float = 0.95
    weight: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0

    def add(self, rows: int, seconds: float) -> None:
        d = self.decay
        self.weight, self.x, self.y = d * self.weight + 1.0, d * self.x + rows, d * self.y + seconds
        self.xx, self.xy = d * self.xx + rows * rows, d * self.xy + rows * seconds

    def price(self, rows: int) -> float | None:
        """The fitted time of `rows` rows; None until sizes far enough apart were measured to fit a slope."""
        if self.weight <= 0.0:
            return None
        mean_x, mean_y = self.x / self.weight, self.y / self.weight
        spread = self.xx / self.weight - mean_x * mean_x
        if spread < 0.1:  # (nearly) one size measured: no slope to fit
            return None
        slope = max(0.0, (self.xy / self.weight - mean_x * mean_y) / spread)
        return max(1e-6, mean_y + slope * (rows - mean_x))


@dataclass
class StepCosts:
    """What steps cost, measured: a tree's scoring by its size, a drafter's proposal and the nodes it offers by the
    depth asked. They belong to the machine, the model and the drafter, not to one answer or one conversation, so an
    answerer keeps them for every answer of every stream (`EngineAnswerer.costs`): an answer that began with nothing
    measured drafted its first step at full depth, a nine-node tree that cost the 1.5B 140 ms at one thread against
    60 ms for a plain step (on an AVX2-only path, 100-135 ms against 33-43 ms at two threads)."""

    verify: dict[int, float] = field(default_factory=dict)  # rows scored -> EMA seconds (before `line` has a slope)
    line: CostLine = field(default_factory=CostLine)  # seconds against rows scored, every size's measurements
    draft: dict[int, float] = field(default_factory=dict)  # requested depth -> EMA seconds
    nodes: dict[int, float] = field(default_factory=dict)  # requested depth -> EMA of draft nodes proposed


@dataclass
class Acceptance:
    """How often drafts were accepted, per depth: exponentially decayed counts of tries and acceptances, kept apart
    per state (1 after a step that took its whole draft, 0 after any other) and kind of draft (`Draft.kind`).

    Why shared by an answerer's answers (`EngineAnswerer.acceptance`), as its costs are: an answer to a question
    about a transcript is 10-30 tokens, too few to learn from scratch how often a kind of draft is right, and a
    kind's rate belongs to the model, the drafter and the task more than to one answer (modeled over the 1.5B's
    answers to the bench's prompts and the answer set's questions, shared counts gained on every task but open chat;
    docs/llm.md)."""

    acc: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    tries: dict[tuple[int, int], list[float]] = field(default_factory=dict)

    def counts(self, state: int, kind: int, depths: int) -> tuple[list[float], list[float]]:
        """(acceptances, tries) per depth 0..depths of drafts of `kind` in `state`, made empty the first time."""
        acc, tries = self.acc.setdefault((state, kind), []), self.tries.setdefault((state, kind), [])
        while len(acc) <= depths:  # a controller of a deeper limit than the last: the deeper depths are new
            acc.append(0.0)
            tries.append(0.0)
        return acc, tries


class DraftController:
    """Chooses the draft depth k that maximizes expected tokens per second of a step.

    Expected tokens with depth k: E(k) = 1 + sum_{j<=k} prod_{d<=j} a_d, where a_d estimates P(accept at depth d |
    depth d-1 accepted and the tree offered a node there), from exponentially decayed counts (`decay` per step
    for depths with evidence, the slower `stale_decay` for the others) with one pseudo-count pulling a_d toward
    a_{d-1}: unexplored depths borrow the shallower estimate, and stale ones drift back, so a depth judged bad
    is re-probed now and then. The counts are kept twice, after a step whose whole draft was accepted and after any
    other, since acceptance comes in runs. A free drafter's tree (`Drafter.free`) is cut after it is proposed
    (`choose_cut`, priced at its real size); another's depth is chosen before (`choose`). Cost of a step:
    `cost_model(nodes)` when given (nodes = tree size incl. the root), else the score time for that many nodes
    plus the measured propose time for that depth. The score time is the line fitted to every size's recent
    measurements (`CostLine`) once two sizes were measured; before that, and for the propose time, it is
    piecewise-linear over the sizes measured and optimistic outside them, so that other sizes get tried: flat
    above, proportional to the size below (a first answer that began with a deep draft model's tree would otherwise
    price a plain step at that tree's cost and never try one). When k = 0 wins, depth 1 is probed every
    `probe_every` steps so that a drafter that starts matching is noticed.
    """

    def __init__(
        self,
        max_depth: int,
        cost_model: Callable[[int], float] | None = None,
        *,
        decay: float = 0.95,
        stale_decay: float = 0.99,
        prior: float = 0.5,
        probe_every: int = 8,
        costs: StepCosts | None = None,
        acceptance: Acceptance | None = None,
    ) -> None:
        """`costs` and `acceptance`: measured costs and acceptance counts to start from and add to (an answerer's,
        shared with its earlier answers)."""
        self.max_depth = max_depth
        self.cost_model = cost_model
        self.decay, self.stale_decay, self.prior, self.probe_every = decay, stale_decay, prior, probe_every
        # acceptance counts per depth, apart after a step that took its whole draft (state 1) and after any other
        # (state 0): acceptance comes in runs (a quote is copied to its end, then nothing fits), so the step after
        # a full acceptance is likely inside the run and the step after a rejection outside it; and apart per kind
        # of draft (`Draft.kind`: a copy matched on one token against one matched on several)
        self.acceptance = acceptance if acceptance is not None else Acceptance()
        self.state = 0
        self.kind = 0  # the kind of draft being priced and counted (`choose_cut`'s)
        self.costs = costs if costs is not None else StepCosts()
        self.verify_cost, self.draft_cost, self.nodes = self.costs.verify, self.costs.draft, self.costs.nodes
        self._since_probe = 0

    def alphas(self) -> list[float]:
        """P(accept at depth d | accepted to d - 1 and offered d), d = 1.., in the present state."""
        acc, tries = self._counts()
        out, prev = [], self.prior
        for d in range(1, self.max_depth + 1):
            prev = (acc[d] + prev) / (tries[d] + 1.0)
            out.append(prev)
        return out

    def _counts(self) -> tuple[list[float], list[float]]:
        return self.acceptance.counts(self.state, self.kind, self.max_depth)

    def expected_tokens(self, k: int) -> float:
        total, run = 1.0, 1.0
        for a in self.alphas()[:k]:
            run *= a
            total += run
        return total

    def step_cost(self, k: int) -> float:
        """A step drafted to depth k: its expected tree's scoring and the drafter's proposing."""
        return self.score_cost(1 + round(self.nodes.get(k, float(k)))) + (
            self._interp(self.draft_cost, k, 0.0) if k and self.cost_model is None else 0.0)

    def score_cost(self, rows: int) -> float:
        """A forward of `rows` rows: `cost_model` when given, else the fitted line, else the sizes' own prices."""
        if self.cost_model is not None:
            return self.cost_model(rows)
        fitted = self.costs.line.price(rows)
        return fitted if fitted is not None else self._interp(self.verify_cost, rows, 1.0)

    @staticmethod
    def _interp(table: dict[int, float], x: int, empty: float) -> float:
        if not table:
            return empty
        if x in table:
            return table[x]
        keys = sorted(table)
        if x < keys[0]:  # optimistic below the smallest size measured (a cost grows with size), so it gets tried
            return table[keys[0]] * x / keys[0]
        if x >= keys[-1]:
            return table[keys[-1]]
        hi = next(i for i, key in enumerate(keys) if key > x)
        x0, x1 = keys[hi - 1], keys[hi]
        return table[x0] + (table[x1] - table[x0]) * (x - x0) / (x1 - x0)

    def choose(self, limit: int) -> int:
        """The depth to ask the drafter for, before it proposes (a drafter that runs a model per level)."""
        limit = min(limit, self.max_depth)
        self.kind = 0
        if limit <= 0:
            return 0
        return self._best(limit, self.step_cost)

    def choose_cut(self, nodes_within: Sequence[int], kind: int = 0) -> int:
        """The depth to cut a tree already proposed to: `nodes_within[k]` of its nodes lie within depth k (k = 0 to
        its depth). Why: the depth chosen before a proposal prices the tree a drafter offered on average, and a
        copy drafter offers nothing at most steps and a full chain at the others, so a fresh answer paid 8 rows for
        a chain priced as one or two (on the 1.5B, 62-75 ms against a 30 ms step, at its first drafted step). A
        proposal that cost nothing is better cut knowing its real size: only its scoring is priced. `kind`: the
        draft's (`Draft.kind`), whose own acceptance prices it and counts its outcome."""
        self.kind = kind
        deepest = min(len(nodes_within) - 1, self.max_depth)
        if deepest <= 0:
            return 0
        return self._best(deepest, lambda k: self.score_cost(1 + nodes_within[k]))

    def _best(self, limit: int, cost: Callable[[int], float]) -> int:
        best = max(range(limit + 1), key=lambda k: self.expected_tokens(k) / max(cost(k), 1e-12))
        self._since_probe = 0 if best > 0 else self._since_probe + 1
        if best == 0 and self._since_probe >= self.probe_every:
            self._since_probe = 0
            return 1
        return best

    def record_cost(self, k: int, nodes: int, verify_s: float, draft_s: float, rows: int | None = None) -> None:
        """One step's measured cost: depth k requested, `nodes` draft nodes scored (plus the root), in a forward of
        `rows` rows (default: the tree's own, nodes + 1; more when other answers' trees shared it: the time is then
        that forward's price, not this tree's)."""
        self.nodes[k] = nodes if k not in self.nodes else 0.7 * self.nodes[k] + 0.3 * nodes
        rows = nodes + 1 if rows is None else rows
        for table, key, value in ((self.verify_cost, rows, verify_s), (self.draft_cost, k, draft_s)):
            table[key] = value if key not in table else 0.7 * table[key] + 0.3 * value
        self.costs.line.add(rows, verify_s)

    def record_acceptance(self, accepted: int, offered_next: bool) -> None:
        """One drafted step: `accepted` drafts taken, and whether the last accepted node had children (a rejection
        at depth accepted+1) or the tree simply ended there (no evidence about that depth)."""
        seen = min(accepted + (1 if offered_next else 0), self.max_depth)
        acc, tries = self._counts()
        for d in range(1, self.max_depth + 1):
            keep = self.decay if d <= seen else self.stale_decay
            acc[d] *= keep
            tries[d] *= keep
            if d <= seen:
                tries[d] += 1.0
                acc[d] += 1.0 if d <= accepted else 0.0
        self.state = 1 if accepted and not offered_next else 0
