"""What a drafter is given and what it proposes: ``DraftSources`` in, a ``DraftTree`` out.

Every tree policy (``tree/policies.py``: chain, eagle, sequoia, specexec, lookup, hybrid) builds from the same
sources and returns the same result, so the reference decoder and the SGLang plugin drive them one way
(``tree/drafter.py``) and nothing downstream asks which kind of tree it holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_spec.tree.candidates import CandidateSource
from sglang_spec.tree.ngram import NgramIndex
from sglang_spec.tree.profile import SOURCE_MTP
from sglang_spec.tree.token_tree import TokenTree


@dataclass(frozen=True, eq=False)
class DraftSources:
    """Where one request's candidates come from.

    mtp:     the MTP head's top-k for any node (exact ancestry); None when the policy does not use the head.
    context: the request's verified tokens (prompt + generated, up to and including the root) as an n-gram index;
             None when the policy does not look the context up.
    """

    mtp: CandidateSource | None = None
    context: NgramIndex | None = None


@dataclass(frozen=True, eq=False)
class DraftTree:
    """A proposed tree and, per node (the tree's numbering, node 0 the root):

    sources:   SOURCE_* flags of who proposed it (0 for the root).
    cells:     the ``SourceCounts`` cells its outcome is counted in (empty for the root and for trees whose
               policy ranks by the positional table rather than by source counts).
    estimates: its estimated conditional acceptance (1.0 where the policy does not estimate per node).
    mtp_forwards: head forwards spent building it (the root's children come free with the previous commit).
    expected_accept_length: 1 + the sum of the nodes' reach estimates (NaN where the policy does not estimate).
    """

    tree: TokenTree
    sources: tuple[int, ...]
    cells: tuple[tuple[list[float], ...], ...]
    estimates: tuple[float, ...]
    mtp_forwards: int
    expected_accept_length: float

    def best_reach(self) -> list[float]:
        """The draft nodes' reach (the probability the target accepts the node and every ancestor: the product of
        the estimates on its path), best first: what the planner weighs a prefix of this tree by."""
        parents = self.tree.parents.tolist()
        reach = [1.0] * len(parents)
        for node in range(1, len(parents)):  # parents first
            reach[node] = reach[parents[node]] * self.estimates[node]
        return sorted(reach[1:], reverse=True)

    @classmethod
    def root_only(cls, root_token: int) -> DraftTree:
        """A plain step's tree: the root alone (the target's next token, nothing drafted)."""
        return cls(TokenTree.from_parents([-1], tokens=[root_token]), (0,), ((),), (1.0,), 0, 1.0)

    @classmethod
    def from_head(cls, tree: TokenTree) -> DraftTree:
        """A tree whose every draft node is the head's, shaped by the positional table (chain, eagle, sequoia,
        specexec)."""
        count = tree.num_nodes
        return cls(tree, (0,) + (SOURCE_MTP,) * (count - 1), ((),) * count, (1.0,) * count, 0, float("nan"))
