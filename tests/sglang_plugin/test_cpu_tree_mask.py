"""The CPU bed's tree-mask switch (``sglang_spec_testbed/tree_mask.py``) and the extend-attention stand-in in both of
SGLang's layouts: FULL_MASK (the GPU's, ``n x (prefix + n)`` per request) and QLEN_ONLY (the CPU's, ``n x n``), each
against an explicit masked softmax on random trees, prefixes and head groupings. The server tests through launch_server
are ``tests/sglang_server/test_full_mask.py``."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from helpers import random_tree
from optional_packages import require_sglang
from sglang_spec.errors import SpecError
from sglang_spec_testbed import attention, tree_mask
from sglang_spec.tree import TokenTree
from sglang_spec.tree.encode_sglang import TreeMaskMode, encode_sglang_verify


def masked_attention(q, k, v, allowed, scaling):
    """The reference: q [Q, H, D], k / v [T, Hkv, D], allowed [Q, T] bool -> [Q, H, Dv], an explicit softmax over
    the allowed keys with the KV heads repeated per query-head group."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,thd->hqt", q, k) * scaling
    weights = torch.softmax(scores.masked_fill(~allowed[None], float("-inf")), dim=-1)
    return torch.einsum("hqt,thd->qhd", weights, v)


class Verify:
    """A random tree verify: ``batch`` requests of ``n`` tree tokens after random prefixes, their KV in a shuffled
    cache, random queries; ``prefix_visible[b]`` [n, prefix_b] marks which prefix keys each tree token may see (all
    True in SGLang's masks; random here, so a FULL_MASK read that ignored its prefix columns would show)."""

    def __init__(self, seed: int, batch: int, n: int, heads: int, kv_heads: int, hidden_prefix: bool) -> None:
        rng = np.random.default_rng(seed)
        torch.manual_seed(seed)
        self.trees = [random_tree(rng, n, max_fanout=int(rng.integers(1, 5)), max_depth=n) for _ in range(batch)]
        self.prefixes = [int(p) for p in rng.integers(1, 25, size=batch)]
        self.n = n
        slots = sum(self.prefixes) + batch * n + 7
        dim = 8
        self.k_buffer, self.v_buffer = torch.randn(slots, kv_heads, dim), torch.randn(slots, kv_heads, dim)
        self.req_to_token = torch.zeros(batch + 2, 64, dtype=torch.int32)
        order = torch.randperm(slots)
        self.rows = torch.randperm(batch + 2)[:batch]  # requests in arbitrary pool rows
        used = 0
        for row, prefix in zip(self.rows.tolist(), self.prefixes):
            self.req_to_token[row, :prefix + n] = order[used:used + prefix + n].to(torch.int32)
            used += prefix + n
        self.q = torch.randn(batch * n, heads, dim)
        self.prefix_visible = [torch.from_numpy(rng.random((n, prefix)) < 0.7) if hidden_prefix
                               else torch.ones(n, prefix, dtype=torch.bool) for prefix in self.prefixes]

    def mask(self, mode: TreeMaskMode, spare: int = 0) -> torch.Tensor:
        """The trees' mask in ``mode`` from the project's SGLang-ABI encoder (checked equal to SGLang's build-tree
        kernel in test_cpu_harness.py), FULL_MASK's prefix columns set to ``prefix_visible``; ``spare`` cells of
        padding after it (SGLang sizes some masks by an upper bound)."""
        built = encode_sglang_verify(self.trees, torch.tensor(self.prefixes), mode).tree_mask.clone()
        if mode == TreeMaskMode.FULL_MASK:
            offset = 0
            for prefix, visible in zip(self.prefixes, self.prefix_visible):
                block = built[offset:offset + self.n * (prefix + self.n)].view(self.n, prefix + self.n)
                block[:, :prefix] = visible
                offset += block.numel()
        return torch.cat([built, torch.zeros(spare, dtype=built.dtype)])

    def attend(self, mask: torch.Tensor, mode: TreeMaskMode | None, sliding_window: int = 0) -> torch.Tensor:
        """The stand-in as the intel_amx backend calls it in TARGET_VERIFY (``mode`` None: the op's own default)."""
        batch, n = len(self.trees), self.n
        out = torch.empty_like(self.q)
        seq_lens = torch.tensor([prefix + n for prefix in self.prefixes])
        args = (self.q, None, None, out, self.k_buffer, self.v_buffer, 1.0, 1.0, self.req_to_token, self.rows,
                seq_lens, torch.full((batch,), n), torch.arange(0, batch * n, n), n, 0.3, 0.0, False,
                sliding_window, None, None, mask, True)
        if mode is None:
            attention.extend_attention_cpu(*args)
        else:
            attention.extend_attention_cpu(*args, tree_mask_mode=mode)
        return out

    def expected(self, sliding_window: int = 0) -> torch.Tensor:
        """Per request: tree token i sees its prefix keys where ``prefix_visible`` says so and its ancestors (and
        itself) among the tree tokens; within ``sliding_window`` positions when one is given."""
        n = self.n
        out = []
        for index, (tree, prefix, row) in enumerate(zip(self.trees, self.prefixes, self.rows.tolist())):
            allowed = torch.cat([self.prefix_visible[index], tree.ancestor_mask()], dim=1)
            if sliding_window:
                positions = torch.arange(prefix + n)
                allowed &= positions[None, :] > (prefix + torch.arange(n))[:, None] - sliding_window
            keys = self.req_to_token[row, :prefix + n].long()
            out.append(masked_attention(self.q[index * n:(index + 1) * n], self.k_buffer[keys], self.v_buffer[keys],
                                        allowed, 0.3))
        return torch.cat(out)


SHAPES = [(0, 1, 6, 4, 2), (1, 3, 9, 6, 2), (2, 4, 16, 4, 4), (3, 2, 5, 3, 1), (4, 5, 12, 8, 2)]  # seed, b, n, H, Hkv


@pytest.mark.parametrize("seed, batch, n, heads, kv_heads", SHAPES)
@pytest.mark.parametrize("sliding_window", [0, 6])
def test_extend_attention_reads_a_full_mask_like_an_explicit_masked_softmax(seed, batch, n, heads, kv_heads,
                                                                           sliding_window):
    verify = Verify(seed, batch, n, heads, kv_heads, hidden_prefix=True)
    got = verify.attend(verify.mask(TreeMaskMode.FULL_MASK, spare=37), TreeMaskMode.FULL_MASK, sliding_window)
    assert torch.allclose(got, verify.expected(sliding_window), atol=1e-5)


@pytest.mark.parametrize("seed, batch, n, heads, kv_heads", SHAPES)
def test_qlen_only_and_full_masks_of_the_same_trees_attend_alike(seed, batch, n, heads, kv_heads):
    """SGLang's two layouts of one tree batch (prefix always visible) give one result, and QLEN_ONLY is still the
    op's default (what sgl-kernel's CPU op reads)."""
    verify = Verify(seed, batch, n, heads, kv_heads, hidden_prefix=False)
    expected = verify.expected()
    qlen = verify.mask(TreeMaskMode.QLEN_ONLY)
    assert torch.allclose(verify.attend(qlen, None), expected, atol=1e-5)
    assert torch.allclose(verify.attend(qlen, TreeMaskMode.QLEN_ONLY), expected, atol=1e-5)
    assert torch.allclose(verify.attend(verify.mask(TreeMaskMode.FULL_MASK), TreeMaskMode.FULL_MASK), expected,
                          atol=1e-5)


def test_a_mask_read_in_the_wrong_mode_is_refused_or_wrong():
    """Negative controls: a QLEN_ONLY mask is too small for the FULL_MASK layout (refused, one line); a FULL_MASK
    mask read as QLEN_ONLY has room enough and reads the wrong cells (which is why the backend binds the mode)."""
    verify = Verify(5, 3, 8, 4, 2, hidden_prefix=False)
    with pytest.raises(ValueError, match=r"a FULL_MASK tree mask .* has \d+ cells, got \d+: built in another mode"):
        verify.attend(verify.mask(TreeMaskMode.QLEN_ONLY), TreeMaskMode.FULL_MASK)
    misread = verify.attend(verify.mask(TreeMaskMode.FULL_MASK), TreeMaskMode.QLEN_ONLY)
    assert not torch.allclose(misread, verify.expected(), atol=1e-3)
    with pytest.raises(NotImplementedError, match="QLEN_ONLY or FULL_MASK"):
        verify.attend(verify.mask(TreeMaskMode.QLEN_ONLY_BITPACKING), TreeMaskMode.QLEN_ONLY_BITPACKING)


def test_one_token_verifies_and_causal_extends_ignore_the_mode():
    """A verify of one token a request (a plain step under tree auto) reads no mask cell but still steps over its
    block; an extend without a tree mask (prefill, draft extend) is causal whatever the mode."""
    for n, tree_mask_given in ((1, True), (5, False)):
        verify = Verify(6 + n, 3, n, 4, 2, hidden_prefix=False)
        verify.trees = [TokenTree.from_parents(list(range(-1, n - 1)))] * 3  # a chain: causal visibility
        expected = verify.expected()
        for mode in (TreeMaskMode.FULL_MASK, TreeMaskMode.QLEN_ONLY):
            mask = verify.mask(mode) if tree_mask_given else None
            assert torch.allclose(verify.attend(mask, mode), expected, atol=1e-5)


def test_the_switch_is_read_from_the_environment_and_a_bad_name_is_one_line():
    env = tree_mask.TREE_MASK_ENV
    assert tree_mask.mode_from_environment({}) is None
    assert tree_mask.mode_from_environment({env: " "}) is None
    assert tree_mask.mode_from_environment({env: "full"}) == TreeMaskMode.FULL_MASK
    assert tree_mask.mode_from_environment({env: "qlen"}) == TreeMaskMode.QLEN_ONLY
    with pytest.raises(SpecError, match=r"^SGLANG_SPEC_CPU_TREE_MASK='FULL' is not a tree-mask mode; use one of "
                                        r"qlen, full or unset it$"):
        tree_mask.mode_from_environment({env: "FULL"})


def test_the_hooks_follow_the_mode():
    """The backend's binding always; SGLang's choice replaced only when the switch names a mode; NGRAM's
    prefix-wide mask only under FULL_MASK."""
    def targets(mode):
        return [target.rsplit(".", 2)[-2:] for target, _, _ in tree_mask.hooks(mode)]

    assert targets(None) == [["IntelAMXAttnBackend", "__init__"]]
    assert targets(TreeMaskMode.QLEN_ONLY) == [["IntelAMXAttnBackend", "__init__"],
                                               ["eagle_utils", "default_tree_mask_mode"]]
    assert targets(TreeMaskMode.FULL_MASK) == [["IntelAMXAttnBackend", "__init__"],
                                               ["eagle_utils", "default_tree_mask_mode"],
                                               ["NGRAMWorker", "__init__"]]
    assert [kind for _, _, kind in tree_mask.hooks(TreeMaskMode.FULL_MASK)] == ["AFTER", "REPLACE", "BEFORE"]


def test_the_replaced_choice_and_the_backend_binding_speak_sglangs_mode(monkeypatch):
    """``default_tree_mask_mode`` on the bed returns SGLang's own enum member; the backend binds its extend
    attention to whatever SGLang's (replaced or not) ``default_tree_mask_mode()`` returns at its construction."""
    require_sglang()
    from sglang.srt.speculative import eagle_utils

    _, replace, _ = tree_mask.hooks(TreeMaskMode.FULL_MASK)[1]
    assert replace() is eagle_utils.TreeMaskMode.FULL_MASK
    for mode in (TreeMaskMode.FULL_MASK, TreeMaskMode.QLEN_ONLY):
        monkeypatch.setattr(eagle_utils, "default_tree_mask_mode", lambda mode=mode: eagle_utils.TreeMaskMode(mode))
        backend = types.SimpleNamespace(extend_attention_fwd=attention.extend_attention_cpu)
        assert tree_mask.amx_backend_init_after(None, backend, None) is None
        assert backend.extend_attention_fwd.func is attention.extend_attention_cpu
        assert backend.extend_attention_fwd.keywords == {"tree_mask_mode": mode}
