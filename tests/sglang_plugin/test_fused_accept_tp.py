"""With tensor parallelism the fused sampled accept is rank 0's on every rank, as SGLang's ``eagle_sample`` makes its
own: two processes over gloo see the same verify batch but draw different coins (as ``torch.rand`` may on different
ranks). Alone they accept different paths (ranks that commit different lengths hang in the next collective); with
the TP group, SGLang's own ``GroupCoordinator.broadcast`` (only its process-group plumbing stood in) gives both rank
0's accept.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers import random_tree, targets_following_drafts
from optional_packages import require_sglang
from sglang_spec.sglang_plugin.fused_accept import FusedAccept
from sglang_spec.tree import encode_sglang_verify

pytestmark = pytest.mark.sglang

VOCAB, BATCH, NODES, DEPTH, WORLD = 30, 4, 9, 4, 2


def tp_group(world: int):
    """SGLang's GroupCoordinator over the default (gloo) group, without NCCL: its broadcast goes to
    torch.distributed.broadcast, as on any group whose PyNccl communicator is off."""
    import torch.distributed as dist
    from sglang.srt.distributed.parallel_state import GroupCoordinator

    group = object.__new__(GroupCoordinator)
    group.__dict__.update(world_size=world, ranks=list(range(world)), pynccl_comm=None,
                          device_group=dist.group.WORLD)
    return group


def sampled_batch(rank: int):
    """The verify batch every rank holds (same trees, logits, temperatures) and this rank's coins."""
    rng = np.random.default_rng(0)
    trees = [random_tree(rng, NODES, 3, DEPTH, vocab_size=VOCAB) for _ in range(BATCH)]
    meta = encode_sglang_verify(trees, [DEPTH + 1] * BATCH)
    target = targets_following_drafts(rng, trees, NODES, accept_rate=0.7, vocab_size=VOCAB)
    logits = torch.nn.functional.one_hot(target.reshape(-1), VOCAB).float() * 2.5 \
        + torch.from_numpy(rng.standard_normal((BATCH * NODES, VOCAB))).float()
    verify_input = SimpleNamespace(retrieve_next_token=meta.retrieve_next_token.long(),
                                   retrieve_next_sibling=meta.retrieve_next_sibling.long(),
                                   draft_token=meta.draft_tokens.long())
    batch = SimpleNamespace(seq_lens=torch.full((BATCH,), 11),
                            sampling_info=SimpleNamespace(temperatures=torch.full((BATCH, 1), 1.3)))
    generator = torch.Generator().manual_seed(100 + rank)
    coins = (torch.rand(BATCH, NODES, generator=generator), torch.rand(BATCH, generator=generator))
    return verify_input, batch, logits, coins


def rank_accepts(rank: int, port: int, out_dir: str) -> None:
    """One TP rank: its sampled accept alone and over the TP group, saved for the parent."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        metrics = SimpleNamespace(record_accept=lambda outcome: None)
        results = {}
        for name, group in (("alone", None), ("broadcast", tp_group(WORLD))):
            fused = FusedAccept(NODES, DEPTH, "cpu", metrics, tp_group=group)
            accepted = fused.sample(*sampled_batch(rank))
            if fused.broadcasts(sampled=True):
                fused.agree(accepted)
            results[name] = [accepted.predict.clone(), accepted.accept_lens.clone(), accepted.accept_index.clone()]
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()  # both ranks past their last collective before either tears gloo down
    finally:
        dist.destroy_process_group()
    # The results are saved: leave without the interpreter's teardown, where a C++ thread left joinable aborts
    # the process after destroy_process_group returned ("terminate called without an active exception": 4 runs in
    # 13 without the barrier, 1 in 19 with it).
    os._exit(0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_sampled_accept_is_rank_zeros_on_every_tp_rank(tmp_path):
    require_sglang()
    torch.multiprocessing.spawn(rank_accepts, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]
    alone = [rank["alone"] for rank in ranks]
    assert any(not torch.equal(ours, theirs) for ours, theirs in zip(*alone))  # the coins really split the ranks
    for rank in ranks:
        for ours, rank_zero in zip(rank["broadcast"], alone[0]):
            assert torch.equal(ours, rank_zero)
