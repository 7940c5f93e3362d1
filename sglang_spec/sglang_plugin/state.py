"""The plugin's state inside SGLang's scheduler process, all in one place.

* ``WorkerState``: one object per speculative worker, shared by SGLang's ``EAGLEWorkerV2`` (the target side:
  verify, accept, tree auto) and its ``EagleDraftWorker`` (the draft side). Built by the draft worker's
  start-up hook, completed by the target worker's.
* ``VerifyStep``: what one verify step of a tree server carries from the worker's ``verify`` to the functions
  SGLang calls inside it.
* The attributes the plugin sets on SGLang objects: only through this module (``attach``, ``attach_options``),
  one attribute name each, so a reader finds every one here:

  | owner | attribute | value |
  |---|---|---|
  | ``ServerArgs`` | ``OPTIONS_ATTRIBUTE`` | ``TreeServerOptions`` (pickled into SGLang's subprocesses) |
  | ``ServerArgs``, ``RequestLogger`` | ``traffic_log.ATTRIBUTE`` | the traffic log's path; its writer |
  | ``EAGLEWorkerV2``, ``EagleDraftWorker`` | ``STATE_ATTRIBUTE`` | the worker's ``WorkerState`` |

* The context variables SGLang's call structure leaves: each is set by a hook that has the worker or the batch,
  and read by a function SGLang calls without either; the comment beside each says which.

No sglang import here.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from sglang_spec.train.server_counts import LAUNCH_HEAD

if TYPE_CHECKING:
    from sglang_spec.sglang_plugin.committed import CommittedOutputs
    from sglang_spec.sglang_plugin.drafters.base import ServedDrafter
    from sglang_spec.sglang_plugin.faults import FaultInjection
    from sglang_spec.sglang_plugin.fused_accept import FusedAccept, SGLangAccept
    from sglang_spec.sglang_plugin.options import TreeServerOptions
    from sglang_spec.sglang_plugin.peers import Peers, PlanGroup
    from sglang_spec.sglang_plugin.step_planner import StepPlanner
    from sglang_spec.sglang_plugin.verify_shapes import VerifyShapes
    from sglang_spec.tree.encode_sglang import SGLangDraftEncoding

OPTIONS_ATTRIBUTE = "_sglang_spec_tree"
STATE_ATTRIBUTE = "_sglang_spec"


@dataclass(frozen=True)
class HeadSwap:
    """The draft head a worker serves from now on: ``version`` counts the swaps since launch (1, 2, ...; a
    rollback to an earlier head is a swap too), ``label`` names the head (the ``weight_version`` of SGLang's update
    request, e.g. ``sglang-spec adapt``'s head number; the same label again for a head restored)."""

    version: int
    label: str


@dataclass(eq=False)
class WorkerState:
    """One speculative worker of a tree server (``--speculative-tree-policy`` set).

    Fixed at start-up:
      options:        the server's tree options.
      drafter:        how every request of this server is drafted (``drafters.drafter_for``, chosen once).
      width, steps:   SGLang's draft shape: beams a draft step (speculative_eagle_topk), draft steps.
      verify_tokens:  tokens verified a request, root included (speculative_num_draft_tokens = budget + 1).
      filler:         the filler tree's SGLang encoding, one request's rows (``drafters.filler``).
      exact_ancestry: whether each beam keeps its own KV history (decided with the draft KV pool).
      peers:          the tensor-parallel ranks that verify each batch together, None with one rank.
      plan_group:     the ranks that take one verify size each step (tree auto), None with one rank.
      faults:         injected faults (tests only, ``faults``), None on a served deployment.
      dp_attention:   whether the server runs DP attention (read once: its forwards pad their batches).
    Set by the target worker's start-up (None where the server runs without them):
      fused:          the fused accept (``--speculative-tree-accept fused``).
      committed:      each verify's committed tokens, with the overlap scheduler (``committed``).
      auto:           tree auto's planner (``--speculative-tree-auto``), made before the first step.
      shapes:         tree auto's verify sizes, each with SGLang's runtime state (made with the planner).
      ragged:         each request's verify forward covers its real tree only (``ragged_verify``), where the
                      target's back-end and the server's shape allow it (None until the first draft decides).
    The head served (``swap_head``, at every in-place update of the draft's weights, ``hooks.swap``):
      head_version:   swaps since launch (0: the launch head); what the acceptance estimates were made with.
      head_label:     the served head's label (``LAUNCH_HEAD`` at launch).
      head_swapped:   callbacks ``(HeadSwap) -> None`` run after every swap, in order, on the scheduler's thread
                      between steps: whatever estimates acceptance from served steps resets there.
    Per step, set and cleared by the hooks that own them:
      draft_requests: the requests of the draft step in flight, in batch order (the draft hook).
      step_budget:    draft nodes a request this step where the plan verifies a smaller tree (None: ``budget``).
      request_budgets: draft nodes of each request's tree this step (batch order) where the plan is ragged
                      (``StepPlanner.ragged``), at most ``step_nodes`` each; None: ``step_nodes`` for all.
      verified_tokens: the tokens the last verify forward computed, the batch's total (set by the verify hook
                      on a ragged server; None elsewhere).
    """

    options: TreeServerOptions
    drafter: ServedDrafter
    width: int
    steps: int
    verify_tokens: int
    filler: SGLangDraftEncoding
    peers: Peers | None = None
    plan_group: PlanGroup | None = None
    faults: FaultInjection | None = None
    dp_attention: bool = False
    fused: FusedAccept | None = None
    committed: CommittedOutputs | None = None
    auto: StepPlanner | None = None
    shapes: VerifyShapes | None = None
    ragged: bool | None = None
    draft_requests: list[Any] | None = None
    step_budget: int | None = None
    request_budgets: tuple[int, ...] | None = None
    verified_tokens: int | None = None
    head_version: int = 0
    head_label: str = LAUNCH_HEAD
    head_swapped: list[Callable[[HeadSwap], None]] = field(default_factory=list)

    @property
    def budget(self) -> int:
        """Draft nodes a request verifies (the root excluded)."""
        return self.verify_tokens - 1

    @property
    def step_nodes(self) -> int:
        """Draft nodes a request's tree holds this step: the planner's smaller tree's, else ``budget``."""
        return self.budget if self.step_budget is None else self.step_budget

    @property
    def step_depth(self) -> int:
        """Draft tokens on a path at most this step: the tree depth, within this step's nodes. The verify input's
        accept holds it (``hooks.draft.draft_around``); for a context tree it exceeds SGLang's draft steps."""
        return min(self.options.depth, self.step_nodes)

    def swap_head(self, label: str | None) -> HeadSwap:
        """The one event of a head swap: the version moves on, the drafter forgets what it learnt of the old head
        (``ServedDrafter.head_swapped``), then every ``head_swapped`` callback runs. ``label`` None: the version
        number as the label."""
        self.head_version += 1
        self.head_label = str(self.head_version) if label is None else label
        swap = HeadSwap(self.head_version, self.head_label)
        self.drafter.head_swapped()
        for callback in self.head_swapped:
            callback(swap)
        return swap


@dataclass(eq=False)
class VerifyStep:
    """A tree server's verify step: set by the worker's ``verify``, gone when it returns.

    state:       the worker's state.
    replayed:    the greedy accept of the verify graph this step replayed (fused accept under CUDA graphs).
    accepted:    whether the fused path accepted the batch (its KV commit follows it).
    fused_fault: a fault before the accept (the replay's links): SGLang's accept serves the batch.
    """

    state: WorkerState
    replayed: SGLangAccept | None = None
    accepted: bool = False
    fused_fault: bool = False

    def fire(self, stage: str) -> None:
        """Tests: raises where an injected accept fault is armed for ``stage`` (``faults``)."""
        faults = self.state.faults
        if faults is not None and faults.accept is not None:
            faults.accept.fire(stage)


def attach(owner: Any, value: Any) -> Any:
    """``value`` as the plugin's state of ``owner`` (a worker); returns it."""
    setattr(owner, STATE_ATTRIBUTE, value)
    return value


def state_of(owner: Any) -> Any:
    """The plugin's state of ``owner``, None where it has none (a server without tree options)."""
    return getattr(owner, STATE_ATTRIBUTE, None)


def attach_options(server_args: Any, options: TreeServerOptions) -> None:
    setattr(server_args, OPTIONS_ATTRIBUTE, options)


def options_of(server_args: Any) -> TreeServerOptions | None:
    """The tree options a ServerArgs carries, None on a server without them."""
    return getattr(server_args, OPTIONS_ATTRIBUTE, None)


# set by the worker's verify; read by eagle_sample, the KV move and the verify graph's replay, which SGLang calls
# with the batch but not the worker
VERIFY_STEP: contextvars.ContextVar[VerifyStep | None] = contextvars.ContextVar("sglang_spec_verify_step",
                                                                               default=None)
# the rows of a draft forward whose logits are computed (None: every row); set by the plugin's draft forward,
# read by SGLang's LogitsMetadata.from_forward_batch, which sees the forward batch alone
LOGIT_ROWS: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("sglang_spec_logit_rows",
                                                                                 default=None)
# set around SGLang's build of a tree server's req_to_token pool; read by its row-sizing function, which gets no
# configurator to tell a tree server from a plain one
TREE_POOL: contextvars.ContextVar[bool] = contextvars.ContextVar("sglang_spec_tree_pool", default=False)
@dataclass(frozen=True, eq=False)
class SGLangLoopStep:
    """One draft step of SGLang's own loop (chain, eagle): step_locs [steps, bs * W] (each step's draft KV slots), the
    draft KV pool, ``steps`` draft steps, whether beams keep exact ancestry."""

    step_locs: torch.Tensor
    pool: Any
    steps: int
    exact_ancestry: bool


# the draft step of SGLang's own loop in flight (chain, eagle); set by its drafter, read after each of SGLang's beam
# selections (spec_utils.select_top_k_tokens), which SGLang calls without the worker
SGLANG_LOOP_STEP: contextvars.ContextVar[SGLangLoopStep | None] = contextvars.ContextVar("sglang_spec_loop_step",
                                                                                        default=None)
