"""MLA tree verify's cascade through the CPU twin of FlashInfer: planning, page indexing over SGLang-style paged
pools, the tree kernel and the base-2 merge, against one masked attention over prefix + tree
(``cascade.mla_tree_attention_reference``) for random trees, prefixes and page sizes."""

import numpy as np
import pytest
import torch

from helpers import MLA_HEADS as HEADS
from helpers import MLA_LATENT as LATENT
from helpers import MLA_ROPE as ROPE
from helpers import paged_mla_batch, paged_mla_reference, to_device
from sglang_spec.attention.cascade import mla_attention
from sglang_spec.sglang_plugin.mla_cascade import (
    MLAShape,
    causal_tree_mask,
    mla_tree_verify_attention,
    paged_views,
    plan_prefix_wrapper,
    plan_tree_verify,
    prefix_page_indices,
)
from sglang_spec.kernels.mla_tree_attention import mla_tree_attention, mla_tree_attention_reference as tree_reference
from sglang_spec.attention import flashinfer_mla as twin
from sglang_spec.tree.encode_sglang import TreeMaskMode


def shape(data):
    _, heads, latent = data["q_latent"].shape
    return MLAShape(heads, latent, data["q_rope"].shape[-1], data["scale"], torch.float32, torch.float32)


def on_device(tree_attention, device):
    """``tree_attention`` run on ``device`` inside the CPU twin's cascade: its tensors (the mask layout's too) moved
    there, its out and lse copied back (a compiled kernel cannot read the twin's CPU tensors)."""
    def run(*args):
        *inputs, out, lse = args
        device_out, device_lse = tree_attention(*to_device(inputs, device), out.to(device), lse.to(device))
        out.copy_(device_out.cpu())
        lse.copy_(device_lse.cpu())
        return out, lse
    return run


def run_cascade(data, tree_tokens, page_size, mode, tree_attention=mla_tree_attention, mask=None):
    prefix_lens = torch.tensor(data["prefixes"], dtype=torch.int32)
    plan = plan_tree_verify(data["req_to_token"], data["rows"], prefix_lens, prefix_lens.clone(), tree_tokens,
                            page_size, mode)
    flashinfer = twin.namespace()
    wrapper = flashinfer.BatchMLAPagedAttentionWrapper(torch.empty(16, dtype=torch.uint8))
    plan_prefix_wrapper(flashinfer, wrapper, plan, shape(data))
    return mla_tree_verify_attention(flashinfer, wrapper, plan, data["q_latent"], data["q_rope"], data["kv_buffer"],
                                     data["tree_slots"], data["flat_mask"] if mask is None else mask, data["scale"],
                                     tree_attention=tree_attention)


@pytest.mark.parametrize("mode", [TreeMaskMode.QLEN_ONLY, TreeMaskMode.FULL_MASK])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("seed, batch, tree_tokens", [(0, 1, 1), (1, 3, 6), (2, 4, 9)])
def test_cascade_through_the_twin_equals_full_masked_attention(kernel_device, mode, page_size, seed, batch,
                                                               tree_tokens):
    data = paged_mla_batch(seed, batch, tree_tokens, page_size, mode)
    expected = paged_mla_reference(data, tree_tokens)
    with_reference = run_cascade(data, tree_tokens, page_size, mode, tree_attention=tree_reference)
    assert torch.allclose(with_reference, expected, atol=1e-5, rtol=1e-4)
    if page_size == 4:  # the kernel once per layout and shape (the kernel's own tests cover more)
        with_kernel = run_cascade(data, tree_tokens, page_size, mode,
                                  tree_attention=on_device(mla_tree_attention, kernel_device))
        assert torch.allclose(with_kernel, expected, atol=1e-5, rtol=1e-4)


def test_a_wrong_ancestor_mask_or_page_is_noticed():
    """Negative controls: the comparison above fails for a mask without one ancestor edge and for a prefix read
    one page off."""
    mode, page_size, tree_tokens = TreeMaskMode.QLEN_ONLY, 4, 6
    data = paged_mla_batch(3, 2, tree_tokens, page_size, mode)
    expected = paged_mla_reference(data, tree_tokens)
    wrong_mask = data["flat_mask"].clone()
    deepest = int(data["masks"][0].sum(dim=1).argmax())
    wrong_mask[deepest * tree_tokens] = False  # the deepest node of request 0 stops seeing the root
    assert deepest > 0
    wrong = run_cascade(data, tree_tokens, page_size, mode, tree_attention=tree_reference, mask=wrong_mask)
    assert not torch.allclose(wrong, expected, atol=1e-3)
    data["req_to_token"][data["rows"][1], :page_size] += page_size  # request 1's first page read one page off
    shifted = run_cascade(data, tree_tokens, page_size, mode, tree_attention=tree_reference)
    assert not torch.allclose(shifted[tree_tokens:], expected[tree_tokens:], atol=1e-3)


def test_prefix_page_indices_equal_a_loop_over_requests():
    rng = np.random.default_rng(4)
    for page_size in (1, 2, 16):
        req_to_token = torch.from_numpy(rng.integers(0, 1000, size=(6, 96))).to(torch.int32) * page_size
        rows = torch.tensor([4, 0, 5])
        prefix_lens = torch.tensor([1, 96, 17], dtype=torch.int32)
        pages = (prefix_lens + page_size - 1) // page_size
        kv_indptr = torch.zeros(4, dtype=torch.int32)
        kv_indptr[1:] = torch.cumsum(pages, 0)
        max_pages = int(pages.max())
        out = prefix_page_indices(req_to_token, rows, prefix_lens, kv_indptr, page_size, max_pages)
        expected = torch.cat([req_to_token[row, 0:int(p):page_size] // page_size for row, p in zip(rows, prefix_lens)])
        assert torch.equal(out[: int(kv_indptr[-1])], expected)
        assert out.shape[0] == 3 * max_pages


def test_plan_is_on_the_device_and_its_host_copy_agrees():
    data = paged_mla_batch(5, 3, 5, 4, TreeMaskMode.FULL_MASK)
    prefix_lens = torch.tensor(data["prefixes"], dtype=torch.int32)
    plan = plan_tree_verify(data["req_to_token"], data["rows"], prefix_lens, prefix_lens, 5, 4, TreeMaskMode.FULL_MASK)
    assert torch.equal(plan.qo_indptr, plan.qo_indptr_host) and plan.qo_indptr.tolist() == [0, 5, 10, 15]
    assert torch.equal(plan.kv_indptr, plan.kv_indptr_host) and torch.equal(plan.kv_lens, plan.kv_lens_host)
    assert plan.mask_layout.column.tolist() == data["prefixes"]


def test_the_twin_refuses_a_plan_whose_pages_disagree_with_its_lengths():
    flashinfer = twin.namespace()
    wrapper = flashinfer.BatchMLAPagedAttentionWrapper(torch.empty(16, dtype=torch.uint8))
    metadata = flashinfer.MLAPlanMetadata.csr(torch.tensor([0, 2]), torch.tensor([0, 2]), torch.tensor([3, 7]),
                                              torch.tensor([9]))  # 9 tokens need 3 pages of 4
    with pytest.raises(ValueError, match="disagrees"):
        wrapper.plan(metadata=metadata, num_heads=HEADS, head_dim_ckv=LATENT, head_dim_kpe=ROPE, page_size=4,
                     causal=False, sm_scale=1.0, q_data_type=torch.float32, kv_data_type=torch.float32)
    wrapper.plan(metadata=metadata, num_heads=HEADS, head_dim_ckv=LATENT, head_dim_kpe=ROPE, page_size=5,
                 causal=False, sm_scale=1.0, q_data_type=torch.float32, kv_data_type=torch.float32)
    kv_buffer = torch.randn(40, 1, LATENT + ROPE)
    with pytest.raises(ValueError, match="return_lse"):  # planned without lse
        wrapper.run(query=(torch.randn(2, HEADS, LATENT), torch.randn(2, HEADS, ROPE)),
                    kv_cache=paged_views(kv_buffer, LATENT, 5), return_lse=True)


def test_the_twin_merge_is_base_two_and_splits_attention_exactly():
    generator = torch.Generator().manual_seed(6)
    q_latent = torch.randn(4, HEADS, LATENT, generator=generator)
    q_rope = torch.randn(4, HEADS, ROPE, generator=generator)
    keys, rope_keys = torch.randn(11, LATENT, generator=generator), torch.randn(11, ROPE, generator=generator)
    whole = mla_attention(q_latent, q_rope, keys, rope_keys, 0.2)
    first = mla_attention(q_latent, q_rope, keys[:5], rope_keys[:5], 0.2)
    second = mla_attention(q_latent, q_rope, keys[5:], rope_keys[5:], 0.2)
    out, lse = twin.merge_state(first.out, first.lse / twin.LN_2, second.out, second.lse / twin.LN_2)
    assert torch.allclose(out, whole.out, atol=1e-6) and torch.allclose(lse * twin.LN_2, whole.lse, atol=1e-5)
    natural, _ = twin.merge_state(first.out, first.lse, second.out, second.lse)  # lse in the wrong base
    assert not torch.allclose(natural, whole.out, atol=1e-3)


def test_the_cascade_merges_deepseek_v3s_128_heads_of_512():
    """FlashInfer's merge_state launches one block a token with every head in it: 128 heads of 512 (DeepSeek-V3 on
    one GPU) is 4096 threads, over CUDA's 1024, and the launch fails (seen on an H200). The twin refuses what
    FlashInfer refuses, and the cascade, which folds the heads into the tokens, goes through at that width."""
    heads, latent, rope, tree_tokens = 128, 512, 64, 3
    with pytest.raises(RuntimeError, match="invalid argument"):
        twin.merge_state(*(torch.zeros(2, heads, latent), torch.zeros(2, heads)) * 2)
    twin.merge_state(*(torch.zeros(2, heads // 4, latent), torch.zeros(2, heads // 4)) * 2)  # 1024 threads: fine
    data = paged_mla_batch(8, 2, tree_tokens, 4, TreeMaskMode.FULL_MASK, heads=heads, latent=latent, rope=rope)
    result = run_cascade(data, tree_tokens, 4, TreeMaskMode.FULL_MASK, tree_attention=tree_reference)
    assert result.shape == (2 * tree_tokens, heads, latent)
    assert torch.allclose(result, paged_mla_reference(data, tree_tokens), atol=1e-5, rtol=1e-4)


def test_a_chain_without_a_mask_is_causal():
    mask = causal_tree_mask([3, 3], "cpu").view(2, 3, 3)
    assert torch.equal(mask[1], torch.ones(3, 3, dtype=torch.bool).tril())
    ragged = causal_tree_mask([2, 3], "cpu")  # each request its own block
    assert torch.equal(ragged[4:].view(3, 3), torch.ones(3, 3, dtype=torch.bool).tril()) and ragged[:4].tolist() == \
        [True, False, True, True]


@pytest.mark.parametrize("mode", [TreeMaskMode.QLEN_ONLY, TreeMaskMode.FULL_MASK])
def test_a_ragged_cascade_equals_the_dense_one_on_each_requests_own_tree(kernel_device, mode):
    """A ragged verify (``ragged_verify``: each request's first n_b tree tokens, the rest fillers it skips): the
    cascade planned with per-request lengths over the cut rows and the cut mask gives the dense cascade's output on
    those rows (a tree's first nodes hold all their ancestors). Negative control: the uncut mask read through the
    ragged plan is noticed."""
    from sglang_spec.sglang_plugin.ragged_verify import RaggedVerify, compact_mask

    page_size, tree_tokens = 4, 6
    data = paged_mla_batch(11, 3, tree_tokens, page_size, mode)
    assert all(torch.equal(mask, mask.tril()) for mask in data["masks"])  # node order: ancestors first
    dense = run_cascade(data, tree_tokens, page_size, mode, tree_attention=tree_reference)
    lengths = [2, 6, 1]
    rows = RaggedVerify.of(lengths, tree_tokens, "cpu").rows
    cut = dict(data, q_latent=data["q_latent"][rows], q_rope=data["q_rope"][rows], tree_slots=data["tree_slots"][rows],
               flat_mask=compact_mask(data["flat_mask"], mode, data["prefixes"], tree_tokens, lengths))
    prefix_lens = torch.tensor(data["prefixes"], dtype=torch.int32)

    def ragged_cascade(mask, tree_attention=tree_reference):
        plan = plan_tree_verify(cut["req_to_token"], cut["rows"], prefix_lens, prefix_lens.clone(), tree_tokens,
                                page_size, mode, tree_lens=lengths)
        assert plan.qo_indptr.tolist() == plan.qo_indptr_host.tolist() == [0, 2, 8, 9]
        flashinfer = twin.namespace()
        wrapper = flashinfer.BatchMLAPagedAttentionWrapper(torch.empty(16, dtype=torch.uint8))
        plan_prefix_wrapper(flashinfer, wrapper, plan, shape(cut))
        return mla_tree_verify_attention(flashinfer, wrapper, plan, cut["q_latent"], cut["q_rope"], cut["kv_buffer"],
                                         cut["tree_slots"], mask, cut["scale"], tree_attention=tree_attention)

    assert torch.allclose(ragged_cascade(cut["flat_mask"]), dense[rows], atol=1e-5, rtol=1e-4)
    with_kernel = ragged_cascade(cut["flat_mask"], tree_attention=on_device(mla_tree_attention, kernel_device))
    assert torch.allclose(with_kernel, dense[rows], atol=1e-5, rtol=1e-4)
    assert not torch.allclose(ragged_cascade(data["flat_mask"]), dense[rows], atol=1e-3)
    with pytest.raises(ValueError, match="tree_lens"):
        plan_tree_verify(cut["req_to_token"], cut["rows"], prefix_lens, prefix_lens, tree_tokens, page_size, mode,
                         tree_lens=[2, 7, 1])


def test_a_graph_wrapper_plans_into_its_buffers_and_replans():
    """A captured graph reads the buffers it was given: the twin copies each plan into them, as FlashInfer does."""
    data = paged_mla_batch(7, 2, 4, 1, TreeMaskMode.QLEN_ONLY)
    prefix_lens = torch.tensor(data["prefixes"], dtype=torch.int32)
    buffers = dict(qo_indptr=torch.zeros(3, dtype=torch.int32), kv_indptr=torch.zeros(3, dtype=torch.int32),
                   kv_indices=torch.zeros(200, dtype=torch.int32), kv_len_arr=torch.zeros(2, dtype=torch.int32))
    flashinfer = twin.namespace()
    wrapper = flashinfer.BatchMLAPagedAttentionWrapper(torch.empty(16, dtype=torch.uint8), use_cuda_graph=True,
                                                       **buffers)
    for step in range(2):
        plan = plan_tree_verify(data["req_to_token"], data["rows"], prefix_lens + step, prefix_lens + step, 4, 1,
                                TreeMaskMode.QLEN_ONLY, kv_indices_out=buffers["kv_indices"], max_pages=100)
        plan_prefix_wrapper(flashinfer, wrapper, plan, shape(data))
        assert torch.equal(buffers["kv_len_arr"], prefix_lens + step)
        assert plan.kv_indices.data_ptr() == buffers["kv_indices"].data_ptr()
    assert wrapper.plans == 2
