"""What the ``lookup`` and ``hybrid`` drafters share, on the host or on the device: the core's ``TreeDrafter`` (the
policy, and the per-source counts it learns online from the served traffic), SGLang's static draft shape, and the
export of what the counts learnt to ``/metrics`` (``SourceMetrics``: what ``calibrate --from-server`` reads).

Live calibration: the trees of a draft step are kept until SGLang's accept gives their accepted paths
(``record_outcome``, device tensors, no sync), and are observed at the next draft step, which reads the host
anyway (``observe_outcome``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from sglang_spec.sglang_plugin.drafters.base import ServedDrafter
from sglang_spec.sglang_plugin.metrics import SourceMetrics
from sglang_spec.tree.proposal import DraftTree
from sglang_spec.tree.drafter import TreeDrafter
from sglang_spec.tree.policies import TreePolicy

# the kinds of ``SourceCounts`` cells that rate the head's candidates (a swapped head starts them over)
HEAD_CELLS = ("mtp", "mtp_top1", "both")


class ContextDrafter(ServedDrafter):
    """lookup / hybrid, host or device: ``drafter`` (the core's TreeDrafter, with SGLang's width W as its bound),
    ``steps`` SGLang draft steps, ``budget`` verified nodes a request, ``metrics`` where the learnt counts go.
    Their trees are built outside SGLang's draft graph (they need the requests), so a draft step runs eagerly."""

    eager = True

    def __init__(self, policy: TreePolicy, steps: int, budget: int, metrics: SourceMetrics | None = None) -> None:
        self.drafter = TreeDrafter(policy)
        self.metrics = metrics
        self._exported = {name: tuple(cell) for name, cell in self.drafter.counts.named_cells().items()}
        self._prior = dict(self._exported)  # the counts before any served step (the profile's)
        self.steps = steps
        self.budget = budget

    @property  # type: ignore[override]
    def uses_head(self) -> bool:
        """False for ``lookup``: its trees never ask the head (the server then skips the head's forwards)."""
        return self.drafter.policy.uses_head

    def learns(self) -> bool:
        return True

    def prior_reach(self, budget: int) -> list[float]:
        """A chain of the likeliest candidates by depth, as the counts rate them: at each depth the better of the
        head's top-1 and a two-token context copy (what a tree holds at least of that depth), reach their
        product."""
        counts = self.drafter.counts
        reach, product = [], 1.0
        for depth in range(1, min(budget, self.drafter.policy.depth) + 1):
            candidates = [counts.estimate(counts.lookup_cell(2, 0))]
            if self.uses_head:
                candidates.append(counts.estimate(counts.mtp_top1_cell(depth)))
            product *= max(candidates)
            reach.append(product)
        return reach

    def learnt(self) -> dict[str, tuple[float, ...]]:
        """What the counts hold now (and what of it was exported), for ``restore``: a few dozen cells."""
        cells = {name: tuple(cell) for name, cell in self.drafter.counts.named_cells().items()}
        return {**cells, **{f"exported:{name}": cell for name, cell in self._exported.items()}}

    def restore(self, learnt: dict[str, tuple[float, ...]]) -> None:
        """The counts (and export marks) as ``learnt`` had them; the outcome they were to observe stays unobserved."""
        for name, cell in self.drafter.counts.named_cells().items():
            cell[:] = learnt[name]
        self._exported = {name: learnt[f"exported:{name}"] for name in self._exported}

    def head_swapped(self) -> None:
        """The cells that rate the head (``mtp/*``, ``mtp_top1/*``, and ``both/*``, candidates the head and the
        context agree on) go back to the profile's prior, with their export marks (what ``/metrics`` counted
        stays counted); the proposal in flight was the old head's and teaches nothing."""
        self.forget_proposal()
        for name, cell in self.drafter.counts.named_cells().items():
            if name.split("/", 1)[0] in HEAD_CELLS:
                cell[:] = self._prior[name]
                self._exported[name] = self._prior[name]

    def _observe(self, trees: Sequence[DraftTree | None], accept_index: torch.Tensor, verify_tokens: int) -> None:
        """Each tree's accepted path observed (a None tree, a request that verified the filler: nothing)."""
        for row, path in enumerate(accept_index.reshape(len(trees), -1).tolist()):
            tree = trees[row]
            if tree is None:
                continue
            nodes = [index - row * verify_tokens for index in path if index >= 0]
            self.drafter.observe(tree, nodes)
        if self.metrics is not None and self.metrics.enabled:
            observed = {}
            for name, cell in self.drafter.counts.named_cells().items():
                accepted, offered = self._exported[name]
                if cell[1] != offered:  # outcomes are whole: round off the prior's fraction
                    observed[name] = (round(cell[0] - accepted), round(cell[1] - offered))
                    self._exported[name] = (cell[0], cell[1])
            self.metrics.add(observed)
