"""The ranks that run one batch (or one step) together, and what they must agree on.

Under tensor parallelism (and DP attention's attention-TP groups) every rank of a group drafts, verifies and
accepts the same batch; the verify forward's all-reduces add up every rank's part of the same tokens. So where a
rank-local event (a fault, a fallback) would make one rank take another path than its peers, the group first
agrees (``Peers.any_rank``), and every rank takes the fallback together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sglang_spec.planner import SizeTable


@dataclass(frozen=True)
class Peers:
    """The ranks that verify one batch together (SGLang's attention-TP group), more than one. Their drafts must
    agree, because the verify forward's all-reduces add up every rank's part of the same tokens (a rank that
    verified its filler tree beside the others' real trees would corrupt every rank's logits); and on a sampled
    batch their accepts must take one path, because the fused accept and SGLang's broadcast rank 0's accept in
    different layouts.

    ``any_rank`` is called by every rank at the same points of every step outside a graph capture (after each
    draft; before a sampled batch's accept broadcast), and SGLang's scheduler runs its steps on one thread, so the
    calls pair up in order: one int summed over the group's gloo group, on the host, no device sync. This covers
    faults after a draft's last collective (the trees' organisation and encoding, the host's reads) and in the
    accept; a rank that raises in the middle of the head's forward leaves its peers waiting in that forward's
    all-reduce, which no rank-local fallback can undo (SGLang's watchdog ends such a server)."""

    cpu_group: Any

    @classmethod
    def of_worker(cls) -> Peers | None:
        group = accept_tp_group()
        return None if group is None else cls(group.cpu_group)

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank of the group."""
        total = torch.tensor([int(flag)], dtype=torch.int32)
        torch.distributed.all_reduce(total, group=self.cpu_group)
        return bool(total.item())


def accept_tp_group() -> Any:
    """The group eagle_sample broadcasts its accept over (attention TP under DP attention), or None with one rank."""
    from sglang.srt.runtime_context import get_parallel

    try:
        group = get_parallel().attn_tp_group if dp_attention() else get_parallel().tp_group
    except RuntimeError:  # parallel state not published (single-process tests): the only rank
        return None
    return group if group.world_size > 1 else None


def attention_tp_rank() -> int:
    """This process's rank in its attention-TP group (0 with one rank)."""
    from sglang.srt.runtime_context import get_parallel

    try:
        return int(get_parallel().attn_tp_rank)
    except Exception:  # parallel state not published (single-process tests): the only rank
        return 0


def dp_attention() -> bool:
    from sglang.srt.layers.dp_attention import is_dp_attention_enabled

    return bool(is_dp_attention_enabled())


@dataclass(frozen=True)
class PlanGroup:
    """The ranks that take one verify size each step: the whole tensor-parallel group, which under DP attention spans
    every DP group too (their MLP runs all their tokens together). Every rank calls ``agree`` once per
    forward_batch_generation call, prefills and idle batches included (with an empty table), so the calls pair
    up; the result is the same on every rank: the batch's expected tokens summed over the group (a constant factor
    under plain tensor parallelism, where every rank holds the same batch), each size's seconds the slowest rank's.
    A tree step whose drafter prices head levels (plain tensor parallelism: the ranks hold one batch) meets once
    more after it (``slowest``), so the prices, and the trees they shape, are the same on every rank."""

    cpu_group: Any

    @classmethod
    def of_worker(cls) -> PlanGroup | None:
        from sglang.srt.runtime_context import get_parallel

        try:
            group = get_parallel().tp_group
        except RuntimeError:  # parallel state not published (single-process tests): the only rank
            return None
        return cls(group.cpu_group) if group.world_size > 1 else None

    def agree(self, table: SizeTable) -> SizeTable:
        expected = torch.tensor(table.expected, dtype=torch.float64)
        seconds = torch.tensor(table.seconds, dtype=torch.float64)
        torch.distributed.all_reduce(expected, op=torch.distributed.ReduceOp.SUM, group=self.cpu_group)
        torch.distributed.all_reduce(seconds, op=torch.distributed.ReduceOp.MAX, group=self.cpu_group)
        return SizeTable(table.sizes, tuple(expected.tolist()), tuple(seconds.tolist()))

    def least(self, values: tuple[int, ...]) -> tuple[int, ...]:
        """Each of ``values`` (a ragged plan's per-request shares) as the group's least: the same on every rank,
        and the rank's own wherever the ranks predicted alike (every rank calls this at the same steps)."""
        tensor = torch.tensor(values, dtype=torch.int64)
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MIN, group=self.cpu_group)
        return tuple(tensor.tolist())

    def slowest(self, *seconds: float) -> tuple[float, ...]:
        """Each of ``seconds`` as the group's slowest rank measured it (every rank calls this at the same point of
        the same steps)."""
        values = torch.tensor(seconds, dtype=torch.float64)
        torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX, group=self.cpu_group)
        return tuple(values.tolist())
