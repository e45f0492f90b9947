"""DySpec (Xiong et al., 2024): a draft model's tree grown where the draft model is sure, not in a fixed shape.

A chain from a draft model wastes its later nodes once one guess is unsure, and a fixed tree (Token Recycling's,
Medusa's) spends nodes on branches that are rarely taken. DySpec's observation is that the draft model's own
probability of a token predicts well whether the target will accept it, so the tree is grown best first: every
candidate (a token below a node already in the tree) is valued at the product of the draft probabilities along
its path, the estimated chance that the target walks that far, and the most valuable candidates join the tree.

Growing one node at a time would cost one draft forward per node. As the paper does to batch its expansion, each
round here adds the `per_round` most valuable candidates at once, then one forward of the draft model over the
whole tree gives the new nodes' own children. A proposal at depth budget k costs the draft model k forwards, as
a chain of k does (one to feed the accepted tokens and the pending one, k - 1 over the growing tree), and holds
up to `per_round` * k nodes, no deeper than k.

The tree is chosen deterministically (the top children by draft probability), so every node reports q = None: the
verifier treats each guess as certain, which is lossless at any temperature (`speculative.py`). Sampled answers
accept less often than with the draft's q, greedy ones lose nothing.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from runtime.models.lm.drafters import EMPTY, Draft, DraftModelDrafter
from runtime.models.lm.target import Target


class DynamicTreeDrafter(DraftModelDrafter):
    """A draft model's tree, grown best first by path probability (module doc). `per_round`: nodes added per
    draft forward; `children`: how many of each node's most probable tokens become candidates."""

    def __init__(self, draft: Target, *, fed: Sequence[int] = (), per_round: int = 2, children: int = 3) -> None:
        super().__init__(draft, fed=fed)
        if per_round < 1 or children < 1:
            raise ValueError("per_round and children must be at least 1")
        self.per_round, self.children = per_round, children

    def _candidates(self, heap: list, node: int, row: torch.Tensor, value: float, order: int) -> int:
        """Push `node`'s most probable children as candidates; returns the next tie-breaking counter."""
        probs, ids = torch.softmax(row.float(), -1).topk(self.children)
        for p, tok in zip(probs.tolist(), ids.tolist(), strict=True):
            heapq.heappush(heap, (-value * p, order, node, tok))
            order += 1
        return order

    @torch.inference_mode()
    def propose(self, context: Sequence[int], pending: int, budget: int) -> Draft:
        if budget <= 0:
            return EMPTY
        heap: list[tuple[float, int, int, int]] = []  # (-value, insertion order, parent node, token)
        order = self._candidates(heap, -1, self._feed(context, pending), 1.0, 0)
        tokens: list[int] = []
        parents: list[int] = []
        depth: list[int] = []
        value: list[float] = []
        for round_ in range(budget):
            added: list[int] = []
            while heap and len(added) < self.per_round:
                neg, _, parent, tok = heapq.heappop(heap)  # only nodes above the budget's depth have children
                added.append(len(tokens))
                tokens.append(tok)
                parents.append(parent)
                depth.append(1 + (depth[parent] if parent >= 0 else 0))
                value.append(-neg)
            if not added or round_ == budget - 1:
                break
            logits = self.draft.score(tokens, parents)  # the whole tree after the committed sequence
            self.draft.commit([])
            for node in added:
                if depth[node] < budget:
                    order = self._candidates(heap, node, logits[node], value[node], order)
        return Draft(tokens, parents) if tokens else EMPTY
