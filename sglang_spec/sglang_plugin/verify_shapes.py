"""The verify sizes a tree-auto server steps at, each with SGLang's runtime state for its shape.

A decode step's shape is fixed by SGLang's draft steps and verify tokens a request: its attention backends plan for
it and its CUDA graphs (the draft loop's, the target's verify, the draft extend's) are captured for it. SGLang's
adaptive speculation keeps one ``SpecRuntimeState`` per shape (``EAGLEWorkerV2.build_adaptive_runtime_state``,
``adaptive_runtime_state.py``) and swaps them whole; the planner's sizes reuse that machinery: at start-up each size
gets its state (SGLang builds its backends and, with decode graphs on, captures its graphs), and a step at a size
runs under its state, the full tree's restored after. A size of ``n`` tokens drafts ``min(steps, n - 1)`` steps (no
tree of n - 1 nodes needs more head rounds or parent_list entries); its accepted path's bound is the step's tree
depth (``WorkerState.step_depth``); size 1 is SGLang's own 0-step plain step.

SGLang's own ``apply_runtime_state`` keys its early return on the step count alone, which two sizes may share, so
the swap is done here (``_apply``), field for field as SGLang's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator


@dataclass(eq=False)
class VerifyShapes:
    """worker: the EAGLEWorkerV2; full: its tree's verify tokens (budget + 1); steps: its draft steps; states:
    verify size -> SGLang's SpecRuntimeState (the full tree's a snapshot of the worker as started); graphs: whether
    the states hold captured decode graphs (then a plain step replays its one-token verify graph rather than
    running the target's DECODE forward)."""

    worker: Any
    full: int
    steps: int
    states: dict[int, Any]
    graphs: bool

    @classmethod
    def build(cls, worker: Any, sizes: tuple[int, ...]) -> VerifyShapes:
        """Every size's state; SGLang builds (and, with graphs, captures) each, the worker left as it was."""
        from sglang.srt.speculative.adaptive_runtime_state import SpecRuntimeState

        full, steps = worker.speculative_num_draft_tokens, worker.speculative_num_steps
        draft, target = worker.draft_worker, worker.target_worker.model_runner
        states = {full: SpecRuntimeState(
            speculative_num_steps=steps, speculative_num_draft_tokens=full,
            draft_attn_backend=draft.draft_attn_backend, cuda_graph_runner=draft.cuda_graph_runner,
            target_attn_backend=target.attn_backend, target_graph_runner=target.decode_cuda_graph_runner,
            draft_extend_attn_backend=draft.draft_extend_attn_backend,
            cuda_graph_runner_for_draft_extend=draft.cuda_graph_runner_for_draft_extend)}
        for size in sizes:
            if size not in states:
                states[size] = worker.build_adaptive_runtime_state(level_steps(steps, size), size)
        _apply(worker, states[full])
        return cls(worker, full, steps, states, graphs=target.decode_cuda_graph_runner is not None)

    @contextlib.contextmanager
    def step(self, size: int) -> Iterator[None]:
        """One step at ``size`` tokens a request, under its state; the full tree's state after."""
        if size == self.full:
            yield
            return
        _apply(self.worker, self.states[size])
        try:
            yield
        finally:
            _apply(self.worker, self.states[self.full])


def level_steps(steps: int, size: int) -> int:
    """Draft levels of a tree of ``size`` verify tokens (root included) on a server of ``steps`` draft steps."""
    return min(steps, size - 1)


def _apply(worker: Any, state: Any) -> None:
    """SGLang's ``EAGLEWorkerV2.apply_runtime_state`` without its early return (see the module docstring)."""
    worker.speculative_num_steps = state.speculative_num_steps
    worker.speculative_num_draft_tokens = state.speculative_num_draft_tokens
    draft = worker.draft_worker
    draft.speculative_num_steps = state.speculative_num_steps
    draft.speculative_num_draft_tokens = state.speculative_num_draft_tokens
    draft.draft_attn_backend = state.draft_attn_backend
    draft.draft_runner.draft_attn_backend = state.draft_attn_backend
    draft.cuda_graph_runner = state.cuda_graph_runner
    draft.draft_extend_attn_backend = state.draft_extend_attn_backend
    if state.draft_extend_attn_backend is not None:
        draft.draft_runner.attn_backend = state.draft_extend_attn_backend
    draft.cuda_graph_runner_for_draft_extend = state.cuda_graph_runner_for_draft_extend
    draft._rebuild_topk1_chain_buffers()
    target = worker.target_worker.model_runner
    target.attn_backend = state.target_attn_backend
    target.decode_cuda_graph_runner = state.target_graph_runner
