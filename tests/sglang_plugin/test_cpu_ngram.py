"""SGLang's NGRAM algorithm on the CPU harness, below the server: the stand-in for sgl-kernel's
``reconstruct_indices_from_tree_mask`` against SGLang's own Triton twin and a hand-checked tree, and SGLang's C++
n-gram corpus (built through tvm-ffi with this machine's g++) feeding it."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from sglang_spec_testbed import ops

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def reconstruct_triton(sglang_with_plugin):
    """SGLang's Triton twin (run under the interpreter). Its module imports the sgl-kernel op at import time off
    CUDA / XPU, so it is imported with a temporary ``sgl_kernel.speculative`` holding our stand-in; the test
    process's ``sys.modules`` is restored afterwards."""
    saved = {name: sys.modules.get(name) for name in ("sgl_kernel", "sgl_kernel.speculative")}
    package, speculative = types.ModuleType("sgl_kernel"), types.ModuleType("sgl_kernel.speculative")
    package.__path__ = []  # type: ignore[attr-defined]
    setattr(speculative, "reconstruct_indices_from_tree_mask", ops.reconstruct_indices_from_tree_mask)
    setattr(package, "speculative", speculative)
    sys.modules.update({"sgl_kernel": package, "sgl_kernel.speculative": speculative})
    try:
        from sglang.kernels.ops.speculative.reconstruct_tree import reconstruct_indices_from_tree_mask_triton
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return reconstruct_indices_from_tree_mask_triton


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[n, n] mask of a tree given each node's parent (-1 for the root, parents before children), diagonal set,
    the way SGLang's corpus writes it."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for node, parent in enumerate(parents):
        if parent >= 0:
            mask[node] |= mask[parent]
    return mask


def run(reconstruct, masks: torch.Tensor, seq_lens: torch.Tensor):
    batch, n, _ = masks.shape
    positions = torch.full((batch * n,), -7, dtype=torch.int64)
    links = torch.full((3, batch, n), -7, dtype=torch.int64)
    reconstruct(masks.reshape(-1).clone(), seq_lens, positions, links[0], links[1], links[2], batch, n)
    return positions, links


def test_reconstruct_on_a_hand_checked_tree():
    # 0 -> {1, 2}, 1 -> {3}, 2 -> {4}, 3 -> {5, 6}
    masks = ancestor_mask([-1, 0, 0, 1, 2, 3, 3])[None]
    positions, (index, next_token, next_sibling) = run(ops.reconstruct_indices_from_tree_mask, masks,
                                                       torch.tensor([10]))
    assert positions.tolist() == [10, 11, 11, 12, 12, 13, 13]
    assert index.tolist() == [[0, 1, 2, 3, 4, 5, 6]]
    assert next_token.tolist() == [[1, 3, 4, 5, -1, -1, -1]]
    assert next_sibling.tolist() == [[-1, 2, -1, -1, -1, 6, -1]]


@pytest.mark.parametrize("n, batch", [(8, 3), (12, 2), (5, 4), (1, 2)])
def test_reconstruct_stand_in_equals_sglangs_triton_twin(reconstruct_triton, n, batch):
    generator = torch.Generator().manual_seed(n * 31 + batch)
    trees = []
    for _ in range(batch):
        parents = [-1] + [int(torch.randint(0, node, (1,), generator=generator)) for node in range(1, n)]
        trees.append(ancestor_mask(parents))
    masks = torch.stack(trees)
    # and masks that are no tree at all: both must still agree entry for entry
    noise = torch.rand(batch, n, n, generator=generator) < 0.4
    seq_lens = torch.randint(1, 100, (batch,), generator=generator)
    for case in (masks, noise):
        ours = run(ops.reconstruct_indices_from_tree_mask, case, seq_lens)
        theirs = run(reconstruct_triton, case, seq_lens)
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


def test_sglangs_cpp_corpus_drafts_a_tree_the_stand_in_links(sglang_with_plugin):
    """SGLang's own corpus (C++ trie, compiled on first use into ~/.cache/sglang/jit) after two sequences: the
    context ``3 44`` drafts the continuation it saw (``55 66 77 ...``) as a chain from the last context token."""
    from sglang.srt.speculative.cpp_ngram.ngram_corpus import NgramCorpus

    n = 8
    corpus = NgramCorpus(max_trie_depth=12, draft_token_num=n)
    corpus.batch_put([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 44, 55, 66, 77, 88, 99, 100]])
    corpus.synchronize()
    drafts, mask = corpus.batch_get(["a", "b"], [[1, 2, 3], [3, 44]], [3, 2])
    assert drafts.shape == (2 * n,) and mask.shape == (2 * n * n,)
    positions, (_, next_token, next_sibling) = run(ops.reconstruct_indices_from_tree_mask,
                                                   torch.from_numpy(mask).bool().view(2, n, n), torch.tensor([3, 2]))
    tokens = drafts.reshape(2, n)
    chain, node = [int(tokens[1, 0])], 0
    while int(next_token[1, node]) != -1:
        node = int(next_token[1, node])
        chain.append(int(tokens[1, node]))
    assert chain[:7] == [44, 55, 66, 77, 88, 99, 100]
    # after "1 2 3" the corpus saw both "4 5 6 ..." and "44 55 ...": the root's first child has a sibling
    first = int(next_token[0, 0])
    assert {int(tokens[0, first]), int(tokens[0, int(next_sibling[0, first])])} == {4, 44}
    assert positions.view(2, n)[:, 0].tolist() == [3, 2]


def test_launch_arguments_take_the_algorithm_from_the_passed_options(tmp_path):
    """One way of choosing the algorithm: ``--speculative-algorithm`` among the launch_server options. NEXTN with
    the model's draft is the default; NGRAM runs without draft arguments; plain decoding refuses an algorithm."""
    from sglang_spec.errors import SpecError
    from sglang_spec_testbed.server import CpuModel, cpu_launch_args, option_value

    draft = ("--speculative-draft-model-path", str(tmp_path / "draft"))
    model = CpuModel("smollm2", tmp_path / "target", draft, None)
    default = cpu_launch_args(model, 1234)
    assert option_value(default, "--speculative-algorithm") == "NEXTN" and draft[1] in default
    ngram = cpu_launch_args(model, 1234, extra=["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens",
                                                "8"])
    assert option_value(ngram, "--speculative-algorithm") == "NGRAM" and draft[0] not in ngram
    assert ngram.count("--speculative-algorithm") == 1
    assert draft[1] in cpu_launch_args(model, 1234, extra=["--speculative-algorithm=EAGLE"])
    plain = cpu_launch_args(model, 1234, speculative=False)
    assert "--speculative-algorithm" not in plain and draft[0] not in plain
    with pytest.raises(SpecError, match="--speculative-algorithm NGRAM"):
        cpu_launch_args(model, 1234, speculative=False, extra=["--speculative-algorithm", "NGRAM"])
