"""Our trees inside SGLang's EAGLE draft loop, as static-shape tensor code (no sglang import, no host sync).

SGLang drafts level by level: step 0 proposes the root's top-k children (all of them are the first frontier);
step i >= 1 expands the k frontier nodes into k*k candidates and picks the next frontier among them. Candidate
slots are level-major: slot s < k is root child s; at step i >= 1 the expansion of frontier beam f with rank r
is slot ``k + k*k*(i-1) + f*k + r``. The final tree is the chosen slots, sorted.

* ``DraftPlan`` lays a static topology (a Sequoia tree) over that loop: at every step it forces the frontier to be
  the plan's nodes that have children (so their children are drafted), and the final selection is exactly the
  plan's slots. Feasible when every node's rank < k and at most k nodes of one level have children.
* ``DevicePlan`` holds a plan as static device tensors, built once per worker (no host copies while drafting).
* ``select_later_with_plan`` is SGLang's ``_select_top_k_tokens_later`` with the plan's frontier first.
* ``organize_with_plan`` replaces ``organize_draft_results`` for a plan.
* ``ancestry_permutation``: SGLang gives beam j the KV column [j][0..steps) and re-ranks beams each step, so a
  beam whose parent was another beam would read that other beam's history. After each frontier choice, copying
  column parent(j) into column j for the steps drafted so far gives every beam exactly its own ancestors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_spec.errors import SpecError
from sglang_spec.tree.profile import AcceptanceProfile
from sglang_spec.tree.sequoia import sequoia_plan
from sglang_spec.tree.token_tree import TokenTree

_FORCED = 4.0  # above any probability product, so forced frontier entries sort first


@dataclass(frozen=True)
class DraftPlan:
    """A static tree over SGLang's draft slots.

    Fields:
      topk, steps:      SGLang's speculative_eagle_topk and speculative_num_steps.
      frontier:         per step i in 1..steps-1, the expansion positions (f*k + r in the step's k*k grid) the
                        plan needs in the next frontier, in frontier order; at most k each.
      slots:            sorted slot ids of the plan's draft nodes (length = budget = num_draft_tokens - 1).
    """

    topk: int
    steps: int
    frontier: tuple[tuple[int, ...], ...]
    slots: tuple[int, ...]

    @classmethod
    def from_tree(cls, tree: TokenTree, topk: int, steps: int) -> DraftPlan:
        """Lays ``tree`` (ranks = child order) over SGLang's draft loop; one clear error line when it cannot."""
        if tree.depth > steps:
            raise SpecError(f"the tree is {tree.depth} deep but SGLang drafts {steps} steps")
        children = tree.children()
        ranks = tree.ranks.tolist()
        depths = tree.depths.tolist()
        if any(rank >= topk for rank in ranks[1:]):
            raise SpecError(f"a tree node has sibling rank >= topk {topk}; raise --speculative-tree-topk")
        slot_of: dict[int, int] = {}
        # frontier order of the plan's expanded nodes at each depth; depth 1 is all root children (slot = rank)
        frontier_order: dict[int, int] = {}
        for node in children[0]:
            slot_of[node] = ranks[node]
            frontier_order[node] = ranks[node]
        frontier = []
        for depth in range(1, steps):
            expanded = [node for node in range(tree.num_nodes) if depths[node] == depth and children[node]]
            positions = []
            for node in expanded:
                for child in children[node]:
                    position = frontier_order[node] * topk + ranks[child]
                    slot_of[child] = topk + topk * topk * (depth - 1) + position
                    positions.append((child, position))
            # the next frontier: the plan's depth-(depth+1) nodes that have children
            needed = [(child, position) for child, position in positions if children[child]]
            if len(needed) > topk:
                raise SpecError(
                    f"the tree expands {len(needed)} nodes at depth {depth + 1} but SGLang's frontier holds topk "
                    f"{topk}; raise --speculative-tree-topk or pick a narrower tree"
                )
            for order, (child, _) in enumerate(needed):
                frontier_order[child] = order
            frontier.append(tuple(position for _, position in needed))
        slots = tuple(sorted(slot_of[node] for node in range(1, tree.num_nodes)))
        return cls(topk=topk, steps=steps, frontier=tuple(frontier), slots=slots)


def sequoia_draft_plan(profile: AcceptanceProfile, budget: int, depth: int, topk: int, steps: int) -> DraftPlan:
    """Sequoia's DP tree for ``profile`` (children limited to topk), laid over SGLang's draft loop."""
    sequoia = sequoia_plan(profile, budget, depth, max_branch=topk)
    tree = TokenTree.from_parents(list(sequoia.parents), ranks=list(sequoia.ranks))
    return DraftPlan.from_tree(tree, topk, steps)


@dataclass(frozen=True, eq=False)
class DevicePlan:
    """A DraftPlan as static device tensors, built once per draft worker so ``draft_forward`` copies nothing from
    the host (a host-to-device copy cannot be captured in SGLang's draft CUDA graph).

    Fields:
      frontier_boost: [steps - 1, k * k] float32. Row i - 1 lifts the plan's frontier positions at step i above
                      every probability product, first in frontier order; all zeros where the plan forces nothing.
      forces:         per step i in 1..steps-1 (host constants), whether the plan forces that step's frontier.
      slots:          [budget] int64. The plan's draft slots, sorted (SGLang's top_scores_index row).
    """

    frontier_boost: torch.Tensor
    forces: tuple[bool, ...]
    slots: torch.Tensor

    @classmethod
    def build(cls, plan: DraftPlan, device: torch.device | str) -> DevicePlan:
        width = plan.topk * plan.topk
        boost = torch.zeros(max(plan.steps - 1, 1), width, dtype=torch.float32)
        for step, positions in enumerate(plan.frontier):
            for order, position in enumerate(positions):
                boost[step, position] = _FORCED + len(positions) - order
        forces = tuple(bool(plan.frontier[step]) if step < len(plan.frontier) else False
                       for step in range(plan.steps - 1))
        return cls(boost.to(device), forces, torch.tensor(plan.slots, dtype=torch.int64).to(device))


def select_later_with_plan(i: int, topk_p, topk_index, hidden_states, scores, topk: int, plan: DevicePlan):
    """SGLang's ``_select_top_k_tokens_later`` with the plan's frontier forced first (same outputs and shapes).

    topk_p, topk_index: [b*k, k] children of the current frontier; scores: [b, k]; hidden_states: [b*k, H]."""
    topk_sq = topk * topk
    expand_scores = scores.unsqueeze(2) * topk_p.view(-1, topk, topk)  # [b, k, k]
    flat = expand_scores.flatten(start_dim=1)  # [b, k*k]
    ranked = flat + plan.frontier_boost[i - 1] if plan.forces[i - 1] else flat
    chosen = torch.topk(ranked, topk, dim=-1).indices
    topk_cs_p = torch.gather(flat, 1, chosen)
    topk_index = topk_index.view(-1, topk_sq)
    input_ids = torch.gather(topk_index, 1, chosen).flatten()
    if hidden_states is not None and hidden_states.shape[0] > 0:
        flat_chosen = chosen.flatten()
        batch_offsets = torch.arange(0, hidden_states.shape[0], step=topk, device=flat_chosen.device)
        hidden_states = hidden_states[flat_chosen // topk + batch_offsets.repeat_interleave(topk)]
    tree_info = (expand_scores, topk_index, chosen + (topk_sq * (i - 1) + topk))
    return input_ids, hidden_states, topk_cs_p, tree_info


def organize_with_plan(score_list, token_list, parents_list, num_draft_token: int, plan: DevicePlan):
    """``organize_draft_results`` for a plan: the plan's slots (the same for every request), their tokens and
    SGLang's parent list."""
    tokens = torch.cat(token_list, dim=1)
    batch = tokens.shape[0]
    if plan.slots.shape[0] != num_draft_token - 1:
        raise SpecError(f"the plan has {plan.slots.shape[0]} draft nodes but SGLang verifies {num_draft_token - 1}")
    top_scores_index = plan.slots.expand(batch, -1).contiguous()
    draft_tokens = torch.gather(tokens, 1, top_scores_index)
    if len(parents_list) > 1:
        parent_list = torch.cat(parents_list[:-1], dim=1)
    else:
        parent_list = torch.empty(batch, 0, dtype=torch.long, device=tokens.device)
    return parent_list, top_scores_index, draft_tokens


def ancestry_permutation(parent_beam: torch.Tensor, step_locs: torch.Tensor, steps_done: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(target, source) KV slots that give every new beam its parent beam's history.

    parent_beam: [b, k] the previous-frontier beam each new frontier beam descends from.
    step_locs:   [steps, b*k] SGLang's per-step draft KV slots (``per_step_draft_out_cache_loc``).
    steps_done:  draft steps whose KV is written (the columns 0..steps_done-1 get permuted).
    Copy with ``pool[target] = pool[source]`` (gather, then scatter), so overlapping permutations are safe."""
    batch, topk = parent_beam.shape
    locs = step_locs[:steps_done].view(steps_done, batch, topk)
    source = torch.gather(locs, 2, parent_beam.unsqueeze(0).expand(steps_done, batch, topk))
    return locs.reshape(-1), source.reshape(-1)
