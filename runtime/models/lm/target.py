"""The model being decoded, as speculative decoding sees it.

A target holds a committed token sequence whose KV is cached. It can score a tree of candidate tokens after
that sequence in one forward (tree attention: each node sees the committed sequence and its own ancestors)
and then keep exactly one root-to-node path of the tree, discarding the KV of every other branch.

Plain decoding is the one-node tree: `score([pending], [-1])`, then `commit([0])`. The language engine's
sessions implement this, and so do draft models (a drafter is just a smaller target).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class Target(Protocol):
    vocab_size: int

    def score(self, tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """Feed `tokens` as a tree after the committed sequence, in one forward.

        `parents[i]` is the index of node i's parent, or -1 when node i follows the committed sequence
        directly; parents come before children (`parents[i] < i`). Returns float logits [n, vocab]: row i
        is the next-token distribution after node i given the committed sequence and the path to node i.
        The nodes' KV is held tentatively until `commit`.
        """
        ...

    def commit(self, nodes: Sequence[int]) -> None:
        """Keep the nodes on one root-to-node path of the last scored tree (indices in path order, starting at
        a node whose parent is -1) as committed tokens; drop every other node of that tree. `commit([])`
        drops the whole tree."""
        ...

    def committed_tokens(self) -> int:
        """How many tokens are committed (for the caller's bookkeeping and tests)."""
        ...
