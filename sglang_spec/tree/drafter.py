"""The one drafter interface, what the reference decoder drives and the SGLang plugin builds on (the way
transformers' ``CandidateGenerator`` has ``get_candidates`` / ``update_candidate_strategy``):

* ``propose(root_token, sources)``: the policy's tree for one request from its candidate sources (MTP head,
  context lookup, or both), ranked by the drafter's acceptance estimates;
* ``propose_rounds(root_token, context)``: the same tree for lookup / hybrid as a builder driven round by round,
  so a server batches each head round over its requests;
* ``observe(tree, accepted_nodes)``: online calibration from a verified step: every candidate offered at a node of
  the accepted path counts once in its source cell, accepted or not.

One drafter serves every request of a decoder or server, so what one request teaches the counts helps the next.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from sglang_spec.errors import SpecError
from sglang_spec.costs import CostCurve
from sglang_spec.tree.proposal import DraftSources, DraftTree
from sglang_spec.tree.best_first import BestFirstBuilder
from sglang_spec.tree.ngram import NgramIndex
from sglang_spec.tree.policies import TreePolicy
from sglang_spec.tree.profile import SourceCounts


class TreeDrafter:
    """A tree policy and the per-source counts it learns online (its own copy of the profile's)."""

    def __init__(self, policy: TreePolicy) -> None:
        self.policy = policy
        self.counts: SourceCounts = policy.source_counts()

    def propose(self, root_token: int, sources: DraftSources) -> DraftTree:
        """This step's tree below ``root_token`` (the last verified token)."""
        return self.policy.build(root_token, sources, self.counts)

    def propose_rounds(self, root_token: int, context: NgramIndex, costs: CostCurve | None = None,
                       budget: int | None = None, depth: int | None = None) -> BestFirstBuilder:
        """The same tree as ``propose`` for lookup / hybrid, as a builder its caller drives round by round
        (``builder.rounds()``), for callers that batch the head's forwards across requests (the SGLang plugin).
        ``costs``: this step's prices, in place of the policy's curve (a head level runs only where it pays);
        ``budget``, ``depth``: this step's draft nodes and levels at most, where below the policy's (a planned
        smaller tree; a budget of 0: the root alone, the request decoding plainly in a tree step)."""
        if not self.policy.uses_context:
            raise SpecError(f"{self.policy.name} trees are not grown round by round from a context")
        shape = self.policy.best_first_shape()
        if budget is not None or depth is not None:
            shape = replace(shape, budget=min(shape.budget if budget is None else budget, shape.budget),
                            depth=min(shape.depth if depth is None else depth, shape.depth))
        return BestFirstBuilder(shape, root_token, context, self.counts, costs)

    def observe(self, tree: DraftTree, accepted_nodes: Sequence[int]) -> None:
        """Counts the outcome of every child offered at a node of the accepted path (``accepted_nodes``: the
        tree's node ids from the root along the accepted path, root first)."""
        parents = tree.tree.parents.tolist()
        on_path = {node: index for index, node in enumerate(accepted_nodes)}
        for child in range(1, len(parents)):
            index = on_path.get(parents[child])
            if index is None:
                continue
            accepted = index + 1 < len(accepted_nodes) and accepted_nodes[index + 1] == child
            for cell in tree.cells[child]:
                self.counts.observe(cell, accepted)
