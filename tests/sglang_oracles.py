"""SGLang's own code as test oracles: the Triton build-tree and greedy-verify twins (run under
TRITON_INTERPRET=1) and the EAGLE-2 draft selection. Imported lazily through the fixtures in conftest.py,
because importing sglang costs seconds and half a gigabyte."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from doubles import SyntheticCandidates
from sglang_spec.tree import SGLangDraftEncoding, TreeMaskMode


@dataclass
class BuiltTree:
    tree_mask: torch.Tensor
    positions: torch.Tensor
    retrieve_index: torch.Tensor
    retrieve_next_token: torch.Tensor
    retrieve_next_sibling: torch.Tensor


class SGLangTreeKernels:
    def __init__(self) -> None:
        from sglang.kernels.ops.speculative import spec_tree

        self.spec_tree = spec_tree

    def build_tree(self, encoding: SGLangDraftEncoding, seq_lens: torch.Tensor, mode: TreeMaskMode) -> BuiltTree:
        """Calls ``sgl_build_tree_kernel_triton`` with buffers allocated exactly as
        ``eagle_utils.build_tree_kernel_efficient`` allocates them (FULL_MASK prefix filled with True). The Triton
        twin stops each node's walk to the root after ``depth`` levels, SGLang's CUDA kernel (``eagle.cuh``) walks
        to the root: a bound of n - 1 levels (no tree of n tokens is deeper) gives the CUDA kernel's trees where
        they run deeper than the draft steps (context trees)."""
        batch, n = encoding.top_scores_index.shape[0], encoding.num_verify_tokens
        if mode == TreeMaskMode.FULL_MASK:
            tree_mask = torch.full((int(seq_lens.sum()) * n + n * n * batch,), True, dtype=torch.bool)
        else:
            tree_mask = torch.full((n * batch * n,), True, dtype=torch.bool)
        retrieve = torch.full((3, batch, n), -1, dtype=torch.long)
        positions = torch.empty((batch * n,), dtype=torch.long)
        self.spec_tree.sgl_build_tree_kernel_triton(
            encoding.parent_list,
            encoding.top_scores_index,
            seq_lens,
            tree_mask,
            positions,
            retrieve[0],
            retrieve[1],
            retrieve[2],
            encoding.topk,
            max(encoding.spec_steps, n - 1),
            n,
            self.spec_tree.TreeMaskMode(int(mode)),
        )
        return BuiltTree(tree_mask, positions, retrieve[0], retrieve[1], retrieve[2])

    def verify_greedy(
        self,
        candidates: torch.Tensor,
        retrieve_index: torch.Tensor,
        retrieve_next_token: torch.Tensor,
        retrieve_next_sibling: torch.Tensor,
        target_predict: torch.Tensor,
        num_speculative_tokens: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``verify_tree_greedy_triton`` with buffers as ``eagle_sample`` allocates them."""
        batch, n = candidates.shape
        predicts = torch.zeros(batch * n, dtype=torch.int32)
        accept_index = torch.full((batch, num_speculative_tokens), -1, dtype=torch.int32)
        accept_token_num = torch.empty(batch, dtype=torch.int32)
        self.spec_tree.verify_tree_greedy_triton(
            predicts,
            accept_index,
            accept_token_num,
            candidates,
            retrieve_index,
            retrieve_next_token,
            retrieve_next_sibling,
            target_predict,
        )
        return predicts, accept_index, accept_token_num


class SGLangEagleSelection:
    """SGLang's EAGLE-2 draft loop (``select_top_k_tokens`` per step, then ``organize_draft_results``) driven by
    a synthetic drafter instead of a model. ``_select_top_k_tokens_later`` is called through ``__wrapped__``
    (the same Python code without torch.compile)."""

    def __init__(self) -> None:
        from sglang.srt.speculative import spec_utils
        from sglang.srt.speculative.eagle_utils import organize_draft_results

        self.first = spec_utils._select_top_k_tokens_first
        self.later = spec_utils._select_top_k_tokens_later.__wrapped__
        self.organize = organize_draft_results

    def run(self, source: SyntheticCandidates, roots: list[int], topk: int, steps: int, num_draft_tokens: int):
        def top(paths):
            distributions = torch.stack([source.distribution(path) for path in paths])
            return torch.topk(distributions, topk, dim=-1)

        batch = len(roots)
        topk_p, topk_index = top([[root] for root in roots])
        beam_paths = [[[root, int(token)] for token in topk_index[row]] for row, root in enumerate(roots)]
        score_list, token_list, parents_list = [], [], []
        scores = None
        for step in range(steps):
            if step == 0:
                input_ids, _, scores, tree_info = self.first(topk_p, topk_index, None, topk)
            else:
                input_ids, _, scores, tree_info = self.later(step, topk_p, topk_index, None, scores, topk)
                chosen = tree_info[2] - (topk * topk * (step - 1) + topk)
                tokens = input_ids.view(batch, topk)
                beam_paths = [
                    [beam_paths[row][int(c) // topk] + [int(tokens[row, j])] for j, c in enumerate(chosen[row])]
                    for row in range(batch)
                ]
            score_list.append(tree_info[0])
            token_list.append(tree_info[1])
            parents_list.append(tree_info[2])
            if step == steps - 1:
                break
            topk_p, topk_index = top([path for row in beam_paths for path in row])
        return self.organize(score_list, token_list, parents_list, num_draft_tokens)
