"""The distributed engine training runs on: PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``) over the ranks
``torchrun`` starts, and one plain process otherwise (the world-size-1 case: no process group, no sharding).

    torchrun --nproc-per-node 2 -m sglang_spec.cli train --capture DIR --model MODEL --out head.safetensors

Every rank holds the same data and draws the same global batch; rank r trains on its rows r, r + W, ... .
The head's parameters are sharded (FSDP2: each rank keeps 1/W of every parameter, gathered for each forward and
reduce-scattered after backward); the target's embedding and output head are frozen and replicated. Checkpoints
are gathered into full tensors, so a run saved by W ranks resumes on any number, and rank 0 writes the files.
Collectives are in every forward, so all ranks must make the same calls: a rank with no row of a batch runs a
masked stand-in row (``rank_rows``).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import fully_shard

from sglang_spec.errors import SpecError
from sglang_spec.mtp.head import MTPHead


@dataclass(frozen=True)
class World:
    """rank: this process, 0..size-1; size: the number of processes; sharded: the head runs under FSDP2 (a
    process group exists, even when size is 1 under ``torchrun --nproc-per-node 1``)."""

    rank: int = 0
    size: int = 1
    sharded: bool = False

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes files and shows progress bars."""
        return self.rank == 0

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor summed over the ranks (a copy; itself in one process)."""
        if not self.sharded:
            return tensor
        total = tensor.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total

    def barrier(self) -> None:
        if self.sharded:
            dist.barrier()


def join_world() -> World:
    """The world of this process: a gloo (CPU) or NCCL (CUDA) process group when ``torchrun`` started it
    (``WORLD_SIZE`` in the environment), else one plain process."""
    if "WORLD_SIZE" not in os.environ:
        return World()
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":  # one GPU a rank (NCCL refuses two ranks on one device)
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        try:
            dist.init_process_group(backend)
        except (RuntimeError, ValueError) as error:
            raise SpecError(f"cannot join the torchrun process group ({str(error).splitlines()[0][:150]})") from None
    return World(dist.get_rank(), dist.get_world_size(), sharded=True)


def training_device() -> torch.device:
    """This rank's GPU when there is one (``join_world`` chose it), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def leave_world(world: World) -> None:
    if world.sharded:
        if dist.is_initialized():
            dist.destroy_process_group()


def exit_rank(code: int) -> NoReturn:
    """A torchrun rank's end once every rank has passed the final barrier: its output flushed, then the process
    leaves without tearing the gloo group down. That teardown races between ranks (a rank whose peer already
    closed its sockets aborts in C++, "terminate called without an active exception", after all its work is
    done), and torchrun would report the run failed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def shard_head(head: MTPHead, world: World) -> MTPHead:
    """FSDP2 over the head, in place: its decoder block is one unit (for DeepSeek, MLA + MoE: nearly all the
    weights), the norms and ``eh_proj`` the root unit. A no-op in one plain process."""
    if world.sharded:
        fully_shard(head.block)
        fully_shard(head)
    return head


def rank_rows(rows: list[int], world: World) -> tuple[list[int], bool]:
    """This rank's share of a global batch (rows r, r + W, ...) and whether it is real. A rank left without a row
    gets the first one as a stand-in, to be masked out of the loss, since it must still run every forward."""
    mine = rows[world.rank :: world.size]
    return (mine, True) if mine else (rows[:1], False)


def _state_options(**extra: Any) -> StateDictOptions:
    return StateDictOptions(full_state_dict=True, **extra)


def full_state(head: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """(head, optimizer) state dicts with full (unsharded) CPU tensors, keyed by parameter name. A collective in a
    sharded run: every rank calls it, rank 0 gets the tensors (the others empty dicts)."""
    options = _state_options(cpu_offload=True)
    return get_model_state_dict(head, options=options), get_optimizer_state_dict(head, optimizer, options=options)


def load_full_state(head: nn.Module, optimizer: torch.optim.Optimizer, head_state: dict[str, Any],
                    optimizer_state: dict[str, Any]) -> None:
    """Loads full state dicts (``full_state``'s) into a head sharded over any number of ranks, or a plain one.
    Every rank passes the full dicts."""
    set_model_state_dict(head, head_state, options=_state_options())
    set_optimizer_state_dict(head, optimizer, optimizer_state, options=_state_options())
