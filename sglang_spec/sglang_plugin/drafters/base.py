"""The one interface behind which a tree server drafts: ``ServedDrafter``.

A server's drafter is chosen once, at the draft worker's start-up, from its tree options
(``drafters.drafter_for``); the draft hook calls ``draft`` for every draft step and knows nothing of the kind:

| policy | drafter | trees |
|---|---|---|
| chain, eagle | ``SGLangLoopDrafter`` | SGLang's own EAGLE loop, each beam keeping its own KV ancestry |
| sequoia, specexec | ``HeadLoopDrafter`` | the plugin's device loop over SGLang's beams (graph-capturable) |
| lookup, hybrid (host) | ``HostContextDrafter`` | the core's best-first builder on the host, one head round a level |
| lookup, hybrid (device) | ``DeviceLookupDrafter``, ``DeviceHybridDrafter`` | the same trees grown on the device |

The context drafters learn online from the accepted paths, through the core's ``TreeDrafter`` (``observe``):
``record_outcome`` keeps a verify's accepted paths (``VerifyOutcome``: device tensors, no sync),
``observe_outcome`` teaches them at the next draft. A head swapped in place (``head_swapped``) makes them forget
what they learnt of the old head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from sglang_spec.sglang_plugin.committed import CommittedOutputs
from sglang_spec.sglang_plugin.drafters.head_guard import HeadGuard
from sglang_spec.sglang_plugin.level_costs import LevelCosts

# SGLang's draft outputs, what its EagleDraftWorker.draft_forward returns: parent_list [bs, W * (steps - 1) + 1],
# top_scores_index [bs, budget], draft_tokens [bs, budget] (int64; the UNO encoding, ``tree.encode_sglang``) and
# draft_probs (None: greedy and target-only verification never read them)
SGLangDraft = tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]


@dataclass(frozen=True, eq=False)
class DraftCall:
    """One draft step, as SGLang's ``EagleDraftWorker.draft_forward`` runs it.

    worker:        the EagleDraftWorker.
    forward_batch: its ForwardBatch (``batch_size`` requests, ``spec_info`` the previous commit's draft input).
    requests:      the ScheduleBatch's requests in batch order; None inside a draft-graph capture.
    budget:        draft nodes each request's tree holds this step (SGLang verifies budget + 1 tokens a request:
                   the server's budget, or the planner's smaller tree).
    steps:         SGLang's draft steps this step (below the server's with a smaller tree): the draft KV slots and
                   the parent_list width (``encode_sglang``).
    depth:         draft tokens on a tree's path at most this step, what the verify input's accept holds (a head
                   tree's: ``steps``; a context tree's: deeper, its copies need no draft step).
    sglang_loop:   SGLang's own draft_forward for this call (no arguments).
    budgets:       each request's draft nodes at most where the plan is ragged (batch order, each <= ``budget``;
                   the tree is still padded to ``budget``); None: ``budget`` for every request.
    """

    worker: Any
    forward_batch: Any
    requests: list[Any] | None
    budget: int
    steps: int
    depth: int
    sglang_loop: Callable[[], Any]
    budgets: tuple[int, ...] | None = None


@dataclass(frozen=True, eq=False)
class VerifyOutcome:
    """One verify's accept, as SGLang's eagle_sample gives it.

    slots:         [bs] int64, the requests' rows in SGLang's request table (req_pool_indices).
    predict:       [bs * verify_tokens] int32, the target's token at each node (accepted path and bonus written).
    accept_index:  [bs, steps + 1] int32, the accepted path's global node ids (row * verify_tokens + node), -1 padded.
    accept_lens:   [bs] int32, accepted drafts + 1.
    verify_tokens: tokens verified a request, root included.
    """

    slots: torch.Tensor
    predict: torch.Tensor
    accept_index: torch.Tensor
    accept_lens: torch.Tensor
    verify_tokens: int


class ServedDrafter:
    """How one server drafts its requests' trees inside SGLang's draft step.

    eager:     its trees are built on the host, so the draft step never replays a captured draft graph.
    uses_head: whether its trees ask the MTP head (False for lookup: the server then skips the head's forwards).
    guard:     the device check that a request drafted from a non-finite head output verifies the filler tree.
    exact_ancestry: each beam keeps its own KV history (set once the draft KV pool is known to allow it; the
               drafters of the plugin's own rounds always copy ancestry, SGLang's loop only with this set).
    reads_outputs: its trees read each request's committed output on the host, so with the overlap scheduler
               (whose output ids lag a step) it is given every verify's committed tokens (``use_outputs``).
    reports_reach: it grows trees of any budget (``DraftCall.budget``) and reports its nodes' reach
               (``drafted_reach``), so the planner can verify a smaller tree and weigh each request's own.
    setup_seconds: what the last draft spent on one-time work (a new request's context index), not a step's
               recurring cost (the planner leaves it out of the step's time).
    level_costs, rounds, rounds_seconds, priced_out: the prices of the head's levels under tree auto, the rounds
               the last draft ran and their seconds, and how many trees left a level out (a host context drafter's;
               None / 0 for the others).
    ragged_trees: its trees' real nodes come first in verify order and it counts them on the host
               (``verify_lengths``), so a step can verify each request's real tree alone (``ragged_verify``).
    all_head_rounds: every draft runs the step's ``steps - 1`` head forwards, those its trees did not ask for over
               dummy beams (``beams.pad_head_rounds``): set under DP attention, where the ranks' forwards pair up.
    """

    eager: bool = False
    uses_head: bool = True
    guard: HeadGuard | None = None
    exact_ancestry: bool = False
    reads_outputs: bool = False
    reports_reach: bool = False
    setup_seconds: float = 0.0
    level_costs: LevelCosts | None = None
    rounds: int = 0
    rounds_seconds: float = 0.0
    priced_out: int = 0
    all_head_rounds: bool = False
    ragged_trees: bool = False

    def use_outputs(self, outputs: CommittedOutputs) -> None:
        """With the overlap scheduler: where each request's lagging output ids are completed from."""

    def draft(self, call: DraftCall) -> SGLangDraft:
        raise NotImplementedError

    def prior_reach(self, budget: int) -> list[float]:
        """A reach by rank for requests nothing is known of yet (best first, at most ``budget``): the planner's prior
        until served trees teach it the traffic's; empty where the drafter reports no reach."""
        return []

    def estimate_reach(self, requests: list[Any], budget: int) -> dict[str, list[float]]:
        """rid -> the reach a tree would have now for each of ``requests``, best first, estimated without a forward
        (host work only); empty where the drafter cannot. What keeps a request's prediction current while the
        planner decodes it plainly."""
        return {}

    def drafted_reach(self) -> dict[str, list[float]]:
        """rid -> the reach of the draft nodes of the tree it last drafted, best first (each request once: read
        after the step; empty where it reports none)."""
        return {}

    def verify_lengths(self) -> list[int] | None:
        """Per request of its last draft (batch order), the tokens of its real tree (the root and its draft nodes,
        which come first in verify order, the fillers after them): what a ragged verify computes. None: every
        node is real, or the drafter cannot tell without a device read (the step stays dense)."""
        return None

    def learns(self) -> bool:
        """Whether ``record_outcome`` / ``observe_outcome`` teach it anything (the context drafters)."""
        return False

    def record_outcome(self, outcome: VerifyOutcome) -> None:
        """Every verify's accept (on the device: no host read); what the last draft proposed learns from it at
        ``observe_outcome``."""

    def observe_outcome(self) -> None:
        """Teaches what the last verified trees accepted (at the next draft, which reads the host anyway)."""

    def forget_proposal(self) -> None:
        """The last draft faulted: it proposed nothing, so its accept teaches nothing."""

    def learnt(self) -> dict[str, tuple[float, ...]]:
        """What it has learnt, for ``restore`` (ranks that must keep equal counts)."""
        return {}

    def restore(self, learnt: dict[str, tuple[float, ...]]) -> None:
        """Back to ``learnt``."""

    def head_swapped(self) -> None:
        """The head was swapped in place (``WorkerState.swap_head``): forget what was learnt of the old one."""
