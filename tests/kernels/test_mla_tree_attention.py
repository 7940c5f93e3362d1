"""The tree part of MLA tree verify: kernel vs its torch reference, and (merged with a prefix attention) vs one
masked attention over prefix + tree (``cascade.mla_tree_attention_reference``), for random trees and prefixes in
both of SGLang's tree-mask layouts."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from helpers import random_tree, to_device
from sglang_spec.attention.cascade import AttentionState, merge_states, mla_attention, mla_tree_attention_reference
from sglang_spec.kernels.mla_tree_attention import (
    LOG2_E,
    mla_tree_attention,
    mla_tree_attention_reference as tree_part_reference,
    tree_mask_layout,
)
from sglang_spec.tree.batch import with_prefix
from sglang_spec.tree.encode_sglang import TreeMaskMode


def random_batch(seed, batch, max_nodes, heads, latent, rope, mode, dtype=torch.float32):
    """Requests with random trees (1..max_nodes nodes) after random prefixes; the flat mask in ``mode``'s layout."""
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    nodes = [int(n) for n in rng.integers(1, max_nodes + 1, size=batch)]
    nodes[0] = max_nodes  # one request at the captured width
    prefixes = [int(p) for p in rng.integers(1, 40, size=batch)]
    masks = [random_tree(rng, n, 3, 5).ancestor_mask() for n in nodes]
    if mode == TreeMaskMode.QLEN_ONLY:
        flat = torch.cat([mask.reshape(-1) for mask in masks])
    else:
        flat = torch.cat([with_prefix(mask, prefix).reshape(-1) for mask, prefix in zip(masks, prefixes)])
    tokens = sum(nodes)

    def normal(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    return dict(
        nodes=nodes, prefixes=prefixes, masks=masks, flat_mask=flat.to(torch.uint8),
        q_latent=normal(tokens, heads, latent), q_rope=normal(tokens, heads, rope),
        tree_c_kv=normal(tokens, latent), tree_k_rope=normal(tokens, rope),
        prefix_c_kv=[normal(p, latent) for p in prefixes], prefix_k_rope=[normal(p, rope) for p in prefixes],
        qo_indptr=torch.tensor([0] + list(np.cumsum(nodes)), dtype=torch.int32),
        scale=(latent + rope) ** -0.5,
    )


def run_tree_part(data, mode, device, mask=None, launcher=mla_tree_attention):
    layout = tree_mask_layout(mode, torch.tensor(data["prefixes"]), torch.tensor(data["nodes"]))
    q_latent = data["q_latent"]
    out = torch.full_like(q_latent, float("nan"))
    lse = torch.full(q_latent.shape[:2], float("nan"), dtype=torch.float32)
    inputs = to_device((q_latent, data["q_rope"], data["tree_c_kv"], data["tree_k_rope"], data["qo_indptr"],
                        data["flat_mask"] if mask is None else mask, layout), device)
    out, lse = to_device((out, lse), device)
    block_latent = 64 if q_latent.shape[-1] % 64 == 0 else 32
    launcher(*inputs, max(data["nodes"]), data["scale"], out, lse, block_latent=block_latent)
    return to_device((out, lse), "cpu")


CASES = [  # (seed, batch, max_nodes, heads, latent, rope)
    (0, 1, 1, 4, 32, 8),
    (1, 3, 7, 3, 64, 16),
    (2, 5, 16, 20, 32, 8),
    (3, 2, 33, 2, 96, 24),
]


@pytest.mark.parametrize("mode", [TreeMaskMode.QLEN_ONLY, TreeMaskMode.FULL_MASK])
@pytest.mark.parametrize("case", CASES)
def test_kernel_equals_reference_and_the_cascade_equals_full_masked_attention(kernel_device, mode, case):
    seed, batch, max_nodes, heads, latent, rope = case
    data = random_batch(seed, batch, max_nodes, heads, latent, rope, mode)
    out, lse = run_tree_part(data, mode, kernel_device)
    reference_out, reference_lse = run_tree_part(data, mode, "cpu", launcher=tree_part_reference)
    assert torch.allclose(out, reference_out, atol=1e-5, rtol=1e-5)
    assert torch.allclose(lse, reference_lse, atol=1e-5, rtol=1e-5)
    bounds = data["qo_indptr"].tolist()
    for b in range(batch):
        rows = slice(bounds[b], bounds[b + 1])
        prefix = mla_attention(data["q_latent"][rows], data["q_rope"][rows], data["prefix_c_kv"][b],
                               data["prefix_k_rope"][b], data["scale"])
        merged = merge_states(prefix, AttentionState(out[rows], lse[rows] / LOG2_E))
        full = mla_tree_attention_reference(data["q_latent"][rows], data["q_rope"][rows], data["prefix_c_kv"][b],
                                            data["prefix_k_rope"][b], data["tree_c_kv"][rows],
                                            data["tree_k_rope"][rows], data["masks"][b], data["scale"])
        assert torch.allclose(merged.out, full.out, atol=1e-5, rtol=1e-4)
        assert torch.allclose(merged.lse, full.lse, atol=1e-5, rtol=1e-5)


def test_a_wrong_mask_changes_the_result(kernel_device):
    """Negative control: one ancestor edge dropped (a leaf of a deep path stops seeing its parent) is noticed."""
    data = random_batch(5, 2, 9, 4, 32, 8, TreeMaskMode.QLEN_ONLY)
    right_out, _ = run_tree_part(data, TreeMaskMode.QLEN_ONLY, kernel_device)
    wrong = data["flat_mask"].clone()
    mask = data["masks"][0]
    node = int(mask.sum(dim=1).argmax())  # the deepest node of request 0
    parent = int(mask[node, :node].nonzero().max())
    wrong[node * mask.shape[0] + parent] = 0
    wrong_out, _ = run_tree_part(data, TreeMaskMode.QLEN_ONLY, kernel_device, mask=wrong)
    assert not torch.allclose(right_out[node], wrong_out[node], atol=1e-3)
    untouched = [row for row in range(right_out.shape[0]) if row != node]
    assert torch.allclose(right_out[untouched], wrong_out[untouched], atol=1e-6)


def test_a_query_that_sees_nothing_gets_zero_and_minus_infinity(kernel_device):
    data = random_batch(6, 2, 4, 3, 32, 8, TreeMaskMode.QLEN_ONLY)
    empty = torch.zeros_like(data["flat_mask"])
    out, lse = run_tree_part(data, TreeMaskMode.QLEN_ONLY, kernel_device, mask=empty)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()
    prefix = AttentionState(torch.ones_like(out), torch.zeros_like(lse))
    merged = merge_states(prefix, AttentionState(out, lse / LOG2_E))  # the prefix half alone survives
    assert torch.equal(merged.out, prefix.out)


def test_mask_layouts():
    prefixes, nodes = torch.tensor([5, 0, 7]), torch.tensor([3, 1, 2])
    qlen = tree_mask_layout(TreeMaskMode.QLEN_ONLY, prefixes, nodes)
    assert qlen.start.tolist() == [0, 9, 10] and qlen.row_stride.tolist() == [3, 1, 2]
    assert qlen.column.tolist() == [0, 0, 0]
    full = tree_mask_layout(TreeMaskMode.FULL_MASK, prefixes, nodes)
    assert full.start.tolist() == [0, 24, 25] and full.row_stride.tolist() == [8, 1, 9]
    assert full.column.tolist() == [5, 0, 7]


def test_bad_shapes_are_refused():
    data = random_batch(7, 2, 4, 3, 32, 8, TreeMaskMode.QLEN_ONLY)
    with pytest.raises(ValueError, match="tree rows"):
        data["tree_c_kv"] = data["tree_c_kv"][:, :16]
        run_tree_part(data, TreeMaskMode.QLEN_ONLY, "cpu")


COMPILE_SCRIPT = textwrap.dedent("""
    from triton import compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sglang_spec.kernels import mla_tree_attention as tree

    kernel = tree._mla_tree_attention_kernel

    def pointers(dtype):
        return {"q_latent_ptr": dtype, "q_rope_ptr": dtype, "c_kv_ptr": dtype, "k_rope_ptr": dtype,
                "qo_indptr_ptr": "*i32", "mask_ptr": "*u8", "mask_start_ptr": "*i64", "mask_row_stride_ptr": "*i64",
                "mask_column_ptr": "*i64", "out_ptr": dtype, "lse_ptr": "*fp32", "scale_log2": "fp32"}

    # DeepSeek-V3's widths in bf16, 1 and 64 tree tokens (the launcher's blocks); and float32, exact (ieee) dots
    for dtype, precision, block_q, block_n in (("*bf16", "tf32", 1, 16), ("*bf16", "tf32", 4, 64),
                                               ("*fp32", "ieee", 1, 16)):
        constants = dict(LATENT=512, ROPE=64, ROPE_PAD=64, BLOCK_Q=block_q, BLOCK_H=16, BLOCK_N=block_n, BLOCK_L=64,
                         DOT_PRECISION=precision)
        names = kernel.arg_names
        signature = {name: pointers(dtype).get(name, "constexpr" if name in constants else "i64") for name in names}
        source = ASTSource(fn=kernel, signature=signature,
                           constexprs={(names.index(name),): value for name, value in constants.items()})
        compiled = compile(source, target=GPUTarget("cuda", 90, 32))
        assert "cubin" in compiled.asm, sorted(compiled.asm)
        print("compiled", dtype[1:], block_n)
""")


def test_the_tree_part_compiles_for_sm90():
    """Triton's compiler is stricter than its interpreter (types of loop-carried values, dot shapes): the kernel
    compiled for an H100 at DeepSeek-V3's widths, in bf16 and float32, on this CPU (no GPU needed to lower to a
    cubin)."""
    pytest.importorskip("triton.backends.nvidia")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["compiled", "bf16", "16", "compiled", "bf16", "64", "compiled", "fp32", "16"]


@pytest.mark.gpu
@pytest.mark.parametrize("max_nodes", [1, 8, 64])
def test_bf16_at_deepseek_widths_on_a_gpu(max_nodes):
    """Compiled on a GPU (SGLANG_SPEC_TEST_GPU=1): bf16 inputs at DeepSeek-V3's widths (128 heads, 512 + 64),
    against the reference in float32."""
    data = random_batch(11, 4, max_nodes, 128, 512, 64, TreeMaskMode.FULL_MASK, dtype=torch.bfloat16)
    out, lse = run_tree_part(data, TreeMaskMode.FULL_MASK, "cuda")
    reference_out, reference_lse = run_tree_part(data, TreeMaskMode.FULL_MASK, "cpu", launcher=tree_part_reference)
    assert torch.allclose(out.float(), reference_out.float(), atol=3e-2, rtol=3e-2)
    assert torch.allclose(lse, reference_lse, atol=3e-2, rtol=1e-2)
