"""Trees at page size > 1: SGLang's paged draft layout (each beam on its own pages, the prefix's partial tail page
copied into every branch: ``eagle_worker_common.prepare_for_draft``), the plugin's exact ancestry over it, and the
CPU bed's draft-metadata stand-in that reads it.

The ancestry test drives SGLang's real ``prepare_for_draft`` (its page > 1, topk > 1 branch: the draft slots and
the prefix-tail copy through a real ``MLATokenToKVPool``) and the plugin's own draft loop (``DraftLoop`` with the
KV column permutation, ``drafters.beams.permute_kv``) with a synthetic drafter, and reads every beam's attention rows
two ways at every draft step: token by token as SGLang's Triton backend lists them (the bed's stand-in, checked equal
to SGLang's ``generate_draft_decode_kv_indices`` under the Triton interpreter) and page by page as FlashInfer /
FA3 read them (the prefix's whole pages, then the branch's pages from their start, the copied tail included).
Each beam must see exactly the prefix and its own ancestors. Negative controls: the page-1 layout read over
paged slots, no ancestry permutation, and no prefix-tail copy each break it.
"""

from __future__ import annotations

import ast
import inspect
import types

import numpy as np
import pytest
import torch

from doubles import SyntheticCandidates
from doubles import plugin_worker_state
from sglang_spec.sglang_plugin.drafters.beams import permute_kv, supports_row_permutation
from sglang_spec.sglang_plugin.hooks import draft as hooks
from sglang_spec.sglang_plugin.messages import StartupError
from sglang_spec.sglang_plugin.state import attach, state_of
from sglang_spec_testbed import ops, patches
from sglang_spec.sglang_plugin.drafters.beam_selection import DraftLoop, ancestry_permutation

pytestmark = pytest.mark.sglang

PREFIX = 1_000.0  # the signature of a prefix token: PREFIX * (request + 1) + position


def paged_rows(seq_lens: list[int], width: int, steps: int, page_size: int, seed: int) -> tuple[torch.Tensor, int]:
    """req_to_token [bs, pool_len] as SGLang's paged allocator leaves it after a decode step's reserve: each
    request's positions on whole pages, pages drawn from a shuffled free list (page 0 is SGLang's padding page),
    enough for the widest paged draft layout. Returns the rows and the pool's token slots."""
    reach = [int(ops.draft_slot_starts(torch.tensor([length]), width, steps, page_size).max()) + steps
             for length in seq_lens]
    pages_per_row = [-(-need // page_size) for need in reach]
    rng = np.random.default_rng(seed)
    free = rng.permutation(np.arange(1, sum(pages_per_row) + 1))
    pool_len = max(pages_per_row) * page_size
    rows = torch.zeros(len(seq_lens), pool_len, dtype=torch.int32)
    used = 0
    for row, count in enumerate(pages_per_row):
        pages = torch.from_numpy(free[used:used + count].copy())
        used += count
        rows[row, :count * page_size] = (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1).int()
    return rows, (sum(pages_per_row) + 1) * page_size


def mla_pool(slots: int, page_size: int):
    """SGLang's MLA KV pool (the DeepSeek draft's) with one layer of 2-wide rows: (step, signature)."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    return MLATokenToKVPool(slots - page_size, page_size, torch.float32, kv_lora_rank=1, qk_rope_head_dim=1,
                            layer_num=1, device="cpu", enable_memory_saver=False)


def sglang_draft_slots(monkeypatch, rows, seq_lens, width, steps, page_size, pool):
    """SGLang's ``prepare_for_draft`` on a decode batch: the draft's out_cache_loc [bs * W * steps], and the prefix
    tail copied into each branch's first page in ``pool`` (its ForwardBatch is not built: not under test)."""
    from sglang.srt.speculative import eagle_worker_common

    monkeypatch.setattr(eagle_worker_common.ForwardBatch, "init_new", staticmethod(lambda batch, *a, **k: batch))
    batch = types.SimpleNamespace(
        forward_mode=types.SimpleNamespace(is_idle=lambda: False), seq_lens=torch.tensor(seq_lens),
        req_pool_indices=torch.arange(len(seq_lens)), token_to_kv_pool_allocator=types.SimpleNamespace(
            page_size=page_size), device="cpu", out_cache_loc=None, seq_lens_cpu=torch.tensor(seq_lens))
    runner = types.SimpleNamespace(token_to_kv_pool=pool,
                                   spec_algorithm=types.SimpleNamespace(is_standalone=lambda: False))
    eagle_worker_common.prepare_for_draft(types.SimpleNamespace(), types.SimpleNamespace(req_to_token=rows), batch,
                                          None, runner, width, steps)
    return batch.out_cache_loc


def page_granular_read(rows, request: int, length: int, beam: int, drafted: int, width: int, steps: int,
                       page_size: int) -> torch.Tensor:
    """The slots a paged attention kernel reads for one beam (FlashInfer / FA3, by page id): the prefix's whole
    pages, then the beam's branch from its first page's start (the prefix tail's copy, then ``drafted`` drafts)."""
    last_page = length % page_size
    base = length - last_page
    new_pages = -(-(last_page + steps) // page_size)
    branch = base + beam * new_pages * page_size
    positions = torch.cat([torch.arange(base), branch + torch.arange(last_page + drafted)])
    return rows[request, positions].long()


def run_paged_draft(monkeypatch, *, page_size: int, table_page_size: int | None = None, permute: bool = True,
                    copy_tail: bool = True, seq_lens=(9, 12, 5), width: int = 6, children: int = 3,
                    steps: int = 4, seed: int = 0) -> list[str]:
    """The plugin's own draft loop over SGLang's paged draft slots; returns every mismatch between what a beam
    reads (token-granular through the bed's table built at ``table_page_size``, default the page size, and
    page-granular) and its prefix + ancestors. Empty: exact ancestry on both reads."""
    seq_lens = list(seq_lens)
    batch = len(seq_lens)
    rows, slots = paged_rows(seq_lens, width, steps, page_size, seed)
    pool = mla_pool(slots, page_size)
    kv = pool.kv_buffer[0]
    for request, length in enumerate(seq_lens):
        kv[rows[request, :length].long(), 0, 1] = PREFIX * (request + 1) + torch.arange(length).float()
    if not copy_tail:
        monkeypatch.setattr(pool, "move_kv_cache", lambda target, source: None)
    out_cache_loc = sglang_draft_slots(monkeypatch, rows, seq_lens, width, steps, page_size, pool)
    # the stand-in's layout is SGLang's: the draft slots are the rows at draft_slot_starts
    starts = ops.draft_slot_starts(torch.tensor(seq_lens), width, steps, page_size)
    expected = torch.gather(rows.long(), 1, (starts[:, :, None] + torch.arange(steps)).reshape(batch, -1))
    assert torch.equal(out_cache_loc.view(batch, -1).long(), expected)
    from sglang.srt.speculative.eagle_utils import per_step_draft_out_cache_loc

    step_locs = per_step_draft_out_cache_loc(out_cache_loc, batch, width, steps)
    table = ops.build_draft_decode_metadata_cpu(rows, torch.arange(batch), torch.tensor(seq_lens), width, steps,
                                                rows.shape[1], page_size=table_page_size or page_size)
    source = SyntheticCandidates(vocab_size=40, seed=seed, sharpness=1.2)
    loop = DraftLoop.build(width, children, steps, None, "cpu")

    def top(paths):
        return torch.topk(torch.stack([source.distribution(path) for path in paths]), width, dim=-1)

    roots = [3 + request for request in range(batch)]
    level = loop.root_level(*top([[root] for root in roots]))
    paths = [[[root, int(token)] for token in level.tokens[request]] for request, root in enumerate(roots)]
    mismatches: list[str] = []
    for step in range(steps - 1):  # the draft forward of step s writes each beam's KV, then attends
        for request, length in enumerate(seq_lens):
            for beam in range(width):
                kv[int(step_locs[step, request * width + beam]), 0] = torch.tensor(
                    [step, hash(tuple(paths[request][beam])) % 100_000], dtype=torch.float32)
        for request, length in enumerate(seq_lens):
            prefix = PREFIX * (request + 1) + torch.arange(length).float()
            for beam in range(width):
                path = paths[request][beam]
                own = torch.tensor([hash(tuple(path[: depth + 2])) % 100_000 for depth in range(step + 1)],
                                   dtype=torch.float32)
                want = torch.cat([prefix, own])
                reads = {"token": table[request * width + beam, :length + step + 1].long(),
                         "page": page_granular_read(rows, request, length, beam, step + 1, width, steps, page_size)}
                for how, read in reads.items():
                    if not torch.equal(kv[read, 0, 1], want):
                        mismatches.append(f"step {step} request {request} beam {beam} ({how} read)")
        if step == steps - 2:
            break
        level = loop.next_level(step + 1, level.beam_scores, *top([path for row in paths for path in row]))
        tokens = level.beam_tokens.view(batch, width)
        paths = [[paths[r][int(level.parent_beam[r, j])] + [int(tokens[r, j])] for j in range(width)]
                 for r in range(batch)]
        if permute:
            permute_kv(pool, *ancestry_permutation(level.parent_beam, step_locs, step + 1))
    return mismatches


@pytest.mark.parametrize("page_size, seq_lens", [(4, (9, 12, 5)), (16, (9, 12, 31)), (4, (8, 4, 1)),
                                                 (1, (9, 12, 5))])
def test_exact_ancestry_over_sglangs_paged_draft_slots(sglang_with_plugin, monkeypatch, page_size, seq_lens):
    """6 beams of 3 children over 4 draft steps (wider than topk, beams re-chosen every step), prefixes that end
    mid-page, on a page boundary, and after one token: every beam reads its prefix and its own ancestors, token
    by token and page by page."""
    assert run_paged_draft(monkeypatch, page_size=page_size, seq_lens=seq_lens) == []


def test_negative_controls(sglang_with_plugin, monkeypatch):
    """Each part is needed: sgl-kernel's page-1 layout read over paged slots reads other branches' rows; without
    the ancestry permutation beams read the histories of the beams that held their column; without SGLang's
    prefix-tail copy the page-granular read sees the branches' empty first slots (the token read does not)."""
    page_one = run_paged_draft(monkeypatch, page_size=4, table_page_size=1)
    assert page_one and all("token read" in line for line in page_one)
    unpermuted = run_paged_draft(monkeypatch, page_size=4, permute=False)
    assert any("token read" in line for line in unpermuted) and any("page read" in line for line in unpermuted)
    uncopied = run_paged_draft(monkeypatch, page_size=4, copy_tail=False)
    assert uncopied and all("page read" in line for line in uncopied)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("topk, steps", [(1, 3), (2, 4), (5, 3)])
def test_draft_metadata_stand_in_equals_sglangs_triton_twin(sglang_with_plugin, page_size, topk, steps):
    """The bed's ``build_draft_decode_metadata_cpu`` bound to a page size lists, per beam and step, exactly the KV
    slots SGLang's ``generate_draft_decode_kv_indices`` (its Triton / FlashInfer backends' draft metadata,
    interpreted) lists: the prefix, then the beam's draft slots."""
    from sglang.kernels.ops.speculative.cache_locs import generate_draft_decode_kv_indices
    from sglang.srt.utils import next_power_of_2

    seq_lens = [9, 12, 5, 16]
    batch, rows_count = len(seq_lens), len(seq_lens) * topk
    rows, _ = paged_rows(seq_lens, topk, steps, page_size, seed=page_size + topk)
    lengths = torch.tensor(seq_lens)
    table = ops.build_draft_decode_metadata_cpu(rows, torch.arange(batch), lengths, topk, steps, rows.shape[1],
                                                page_size=page_size)
    kv_indices = torch.full((steps, rows_count * (max(seq_lens) + steps)), -1, dtype=torch.int64)
    kv_indptr = torch.zeros((steps, rows_count + 1), dtype=torch.int32)
    generate_draft_decode_kv_indices[(steps, batch, topk)](
        torch.arange(batch), rows, lengths.int(), kv_indices, kv_indptr, lengths.repeat_interleave(topk).int(),
        rows.shape[1], kv_indices.shape[1], kv_indptr.shape[1], next_power_of_2(batch), next_power_of_2(steps),
        next_power_of_2(rows_count), page_size, 0, 0)
    for step in range(steps):
        ends = kv_indptr[step].long()
        for row in range(rows_count):
            ours = table[row, :seq_lens[row // topk] + step + 1].long()
            assert torch.equal(kv_indices[step, ends[row]:ends[row + 1]], ours), (step, row)


def test_row_permutation_holds_at_any_page_size(sglang_with_plugin, monkeypatch):
    """SGLang's NHD MHA pool and its MLA pool hold one token a row at page sizes 1, 4 and 16 (a page is a run of
    rows): the plugin keeps exact ancestry there; the HND layout (rows are pages) is refused."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    for page_size in (1, 4, 16):
        assert supports_row_permutation(MHATokenToKVPool(64, page_size, torch.float32, 3, 8, 2, "cpu", False))
        assert supports_row_permutation(mla_pool(64 + page_size, page_size))
    monkeypatch.setenv("SGLANG_USE_HND_KVCACHE", "1")
    assert not supports_row_permutation(MHATokenToKVPool(64, 4, torch.float32, 3, 8, 2, "cpu", False))


def test_the_draft_pool_check_at_start_up(sglang_with_plugin, monkeypatch):
    """``alloc_memory_pool_after``: a paged NHD draft pool gets exact ancestry; an HND one ends the launch with one
    line naming the pool, its layout and the ways out."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    def worker(pool):
        owner = types.SimpleNamespace(draft_runner=types.SimpleNamespace(token_to_kv_pool=pool))
        attach(owner, plugin_worker_state(width=4, steps=3))
        return owner

    paged = worker(MHATokenToKVPool(64, 4, torch.float32, 3, 8, 2, "cpu", False))
    hooks.alloc_memory_pool_after(None, paged)
    assert state_of(paged).drafter.exact_ancestry
    monkeypatch.setenv("SGLANG_USE_HND_KVCACHE", "1")
    with pytest.raises(StartupError) as refused:
        hooks.alloc_memory_pool_after(None, worker(MHATokenToKVPool(64, 4, torch.float32, 3, 8, 2, "cpu", False)))
    message = str(refused.value)
    assert message.startswith("error: the draft KV pool (MHATokenToKVPool, layout hnd) does not hold one token a row")
    assert "SGLANG_USE_HND_KVCACHE" in message and "--speculative-tree-policy chain" in message


def test_the_bed_lets_only_sglangs_paged_tree_refusal_through(sglang_with_plugin):
    """SGLang refuses trees at page size > 1 off flashinfer / fa3 / triton as the last statement of
    ``_handle_eagle_family`` (so letting it through skips nothing); the bed lets that refusal through for
    ``intel_amx`` only, and any other error stands."""
    from sglang.srt.arg_groups import speculative_hook

    body = ast.parse(inspect.getsource(speculative_hook._handle_eagle_family).lstrip()).body[0].body
    last = body[-1]
    assert isinstance(last, ast.If) and isinstance(last.body[-1], ast.Raise)
    assert patches.PAGED_TREE_REFUSAL in ast.unparse(last.body[-1])

    def refuse(message):
        def original(server_args):
            raise ValueError(message)
        return original

    amx = (f"{patches.PAGED_TREE_REFUSAL} ('flashinfer', 'fa3', 'triton'); got attention_backend='intel_amx'. "
           "Use page_size == 1 or one of those backends.")
    patches.handle_eagle_family_cpu(refuse(amx), None)
    for other in (amx.replace("intel_amx", "torch_native"), "trtllm_mha backend only supports topk = 1"):
        with pytest.raises(ValueError):
            patches.handle_eagle_family_cpu(refuse(other), None)
