"""Trees inside SGLang's EAGLE draft loop, as static-shape tensor code (no sglang import, no host sync).

SGLang drafts level by level with ``W`` beams per request (its ``speculative_eagle_topk``): step 0 takes the
root's top-W candidates as beams; step i >= 1 expands the W beams into W*W candidates and picks the next W beams
among them. Candidate slots are level-major: slot s < W is root candidate s; at step i >= 1 the expansion of
beam f with rank r is slot ``W + W*W*(i-1) + f*W + r``. The verified tree is the chosen slots, sorted, handed to
SGLang as ``(parent_list, top_scores_index, draft_tokens)``.

SGLang's own loop ties the width to the branching: every beam keeps W children and at most W nodes of a level
are expanded. The plugin's loop (``DraftLoop``, run by ``head_loop.draft_forward``) separates them: W is a
static maximum of expanded nodes per level and each node's children are its top-K candidates (K <= W; ranks >= K
are never chosen), which lets a Sequoia or SpecExec tree expand more than K nodes on a level:

* ``sequoia``: ``DraftPlan`` lays the DP tree over the slots: the frontier at each step is forced to the plan's
  nodes that have children (``DevicePlan``'s boosts) and the verified tree is exactly the plan's slots.
* ``specexec``: best-first by cumulative draft probability, on the device: each level's frontier is its best W
  candidates and the verified tree is the best ``budget`` of all candidates (with W at least the rank of the
  lowest-ranked node of a level that has a child in the final tree, this is exactly SpecExec's tree; see
  ``TreePolicy`` ``width`` and ``growable_beams``).
* beams that can grow: SGLang's attention metadata forwards W beams a request at every step, but only the first
  ``live[s]`` beams of step s can have children in the verified tree (the root's K candidates at step 1; for
  specexec the ranks ``growable_beams`` bounds, for sequoia the plan's expanded nodes). The others are masked
  (their children may not be chosen) and ``draft_forward`` computes the head's logits for the live beams only.
* ``ancestry_permutation``: beam j drafts into KV column [j][0..steps) and beams are re-chosen every step, so a
  beam whose parent was another beam would read that beam's history; copying column parent(j) into column j
  for the steps drafted so far gives every beam exactly its own ancestors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_spec.errors import SpecError
from sglang_spec.tree.token_tree import TokenTree

_FORCED = 4.0  # above any probability product, so forced frontier entries sort first
_UNUSED = -1.0  # the score of a candidate that may not be chosen (rank >= K, or a child of an unused beam)


@dataclass(frozen=True)
class DraftPlan:
    """A static tree over SGLang's draft slots.

    Fields:
      width, steps:     SGLang's speculative_eagle_topk (beams per step) and speculative_num_steps.
      frontier:         per step i in 1..steps-1, the expansion positions (f*W + r in the step's W*W grid) the
                        plan needs in the next frontier, in frontier order; at most W each.
      slots:            sorted slot ids of the plan's draft nodes (length = budget = num_draft_tokens - 1).
      live:             per forwarded step s in 1..steps-1, the beams that hold the plan's nodes with children
                        (a prefix: the root's candidates by rank at step 1, the forced frontier first after it).
    """

    width: int
    steps: int
    frontier: tuple[tuple[int, ...], ...]
    slots: tuple[int, ...]
    live: tuple[int, ...] = ()

    @classmethod
    def from_tree(cls, tree: TokenTree, width: int, steps: int) -> DraftPlan:
        """Lays ``tree`` (ranks = child order) over SGLang's draft loop; one clear error line when it cannot."""
        if tree.depth > steps:
            raise SpecError(f"the tree is {tree.depth} deep but SGLang drafts {steps} steps")
        children = tree.children()
        ranks = tree.ranks.tolist()
        depths = tree.depths.tolist()
        if any(rank >= width for rank in ranks[1:]):
            raise SpecError(f"a tree node has sibling rank >= the draft width {width}; raise --speculative-tree-width")
        slot_of: dict[int, int] = {}
        # frontier order of the plan's expanded nodes at each depth; depth 1 is all root candidates (beam = rank)
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
                    position = frontier_order[node] * width + ranks[child]
                    slot_of[child] = width + width * width * (depth - 1) + position
                    positions.append((child, position))
            # the next frontier: the plan's depth-(depth+1) nodes that have children
            needed = [(child, position) for child, position in positions if children[child]]
            if len(needed) > width:
                raise SpecError(
                    f"the tree expands {len(needed)} nodes at depth {depth + 1} but SGLang's frontier holds "
                    f"{width}; raise --speculative-tree-width or pick a narrower tree"
                )
            for order, (child, _) in enumerate(needed):
                frontier_order[child] = order
            frontier.append(tuple(position for _, position in needed))
        slots = tuple(sorted(slot_of[node] for node in range(1, tree.num_nodes)))
        expanded_roots = [ranks[node] for node in children[0] if children[node]]
        live = (max(expanded_roots, default=0) + 1, *(max(len(positions), 1) for positions in frontier[:-1]))
        return cls(width=width, steps=steps, frontier=tuple(frontier), slots=slots, live=live[: max(steps - 1, 0)])


def usable_slots(width: int, children: int, steps: int, live: tuple[int, ...] | None = None) -> int:
    """The candidate slots the draft loop can choose, counted the way ``DraftLoop`` marks them: the root level
    holds W candidates of which the K best are usable; each later level holds the K best children of the beams
    drafted from the level above, and a level yields at most W beams (fewer when it has fewer usable candidates;
    the others are dead, score -1, and so are their children); ``live``: the beams that may grow per forwarded
    step (``DraftLoop.live``; all W when None). With W = K this is SGLang's K + (D-1)·K·K."""
    usable = beams = min(children, width)
    for step in range(1, steps):
        growing = beams if live is None else min(beams, live[step - 1])
        usable += growing * children
        beams = min(width, growing * children)
    return usable


def growable_beams(budget: int, steps: int, topk: int) -> tuple[int, ...]:
    """Per forwarded draft step s = 1 .. steps - 1, the most beams (a level's best candidates, best first) of which
    one can have a child in a best-``budget`` tree (SpecExec's): a level-s node ranked r with a child in the tree
    brings the r - 1 nodes ranked above it on its level (each scores at least as much as the child), their
    ancestors (at least ceil(r / K^(s - d)) on each level d < s, K children a node) and the child, so
    r + 1 + sum_d ceil(r / K^(s - d)) <= budget; and r <= K^s. Lower-ranked beams never grow in the tree."""
    bounds = []
    for step in range(1, steps):
        rank = 0
        for candidate in range(1, topk ** step + 1):
            nodes = candidate + 1 + sum(-(-candidate // topk ** (step - level)) for level in range(1, step))
            if nodes > budget:
                break
            rank = candidate
        bounds.append(max(rank, 1))
    return tuple(bounds)


def live_beams(width: int, children: int, steps: int, budget: int | None = None,
               plan: DraftPlan | None = None) -> tuple[int, ...]:
    """Per forwarded step s = 1 .. steps - 1, the beams (a prefix of the W) that can grow in the verified tree: the
    plan's (sequoia), else ``growable_beams`` for ``budget`` nodes (specexec), else all W; at step 1 at most the
    root's K usable candidates."""
    if budget is None:
        counts: tuple[int, ...] = (width,) * (steps - 1)
    elif plan is not None:
        counts = plan.live
    else:
        counts = growable_beams(budget, steps, children)
    return tuple(min(count, width, children if step == 0 else width) for step, count in enumerate(counts))


def specexec_width(budget: int, steps: int, topk: int) -> int:
    """The static width W that draws exactly SpecExec's tree: every beam that can grow (``growable_beams``), and
    at least topk (the root level holds the root's K children). Specexec 15/4/4: 11 (the budget was the default)."""
    return max([topk, *growable_beams(budget, steps, topk)])


def widest_level(tree: TokenTree) -> int:
    """The most nodes with children on one level (root excluded): the beams the tree needs per step."""
    counts: dict[int, int] = {}
    for node, kids in enumerate(tree.children()):
        if node and kids:
            depth = int(tree.depths[node])
            counts[depth] = counts.get(depth, 0) + 1
    return max(counts.values(), default=0)


@dataclass(frozen=True, eq=False)
class DevicePlan:
    """A DraftPlan as static device tensors, built once per draft worker so drafting copies nothing from the host
    (a host-to-device copy cannot be captured in SGLang's draft CUDA graph).

    Fields:
      frontier_boost: [steps - 1, W * W] float32. Row i - 1 lifts the plan's frontier positions at step i above
                      every probability product, first in frontier order; all zeros where the plan forces nothing.
      forces:         per step i in 1..steps-1 (host constants), whether the plan forces that step's frontier.
      slots:          [budget] int64. The plan's draft slots, sorted (SGLang's top_scores_index row).
    """

    frontier_boost: torch.Tensor
    forces: tuple[bool, ...]
    slots: torch.Tensor

    @classmethod
    def build(cls, plan: DraftPlan, device: torch.device | str) -> DevicePlan:
        grid = plan.width * plan.width
        boost = torch.zeros(max(plan.steps - 1, 1), grid, dtype=torch.float32)
        for step, positions in enumerate(plan.frontier):
            for order, position in enumerate(positions):
                boost[step, position] = _FORCED + len(positions) - order
        forces = tuple(bool(plan.frontier[step]) if step < len(plan.frontier) else False
                       for step in range(plan.steps - 1))
        return cls(boost.to(device), forces, torch.tensor(plan.slots, dtype=torch.int64).to(device))


@dataclass(frozen=True, eq=False)
class Level:
    """One level of drafted candidates for a batch of b requests (W beams, K children a node).

    Fields:
      scores:      [b, W * W] float32 (root level: [b, W]). Cumulative draft probability of each candidate slot
                   of the level; -1 where the candidate may not be chosen (rank >= K, or an unused beam's).
      tokens:      [b, W * W] int64 (root level: [b, W]). The candidates' tokens.
      parents:     [b, W] int64 (root level: [b, W + 1], SGLang's arange(-1, W)). The slot ids of the beams
                   chosen from this level (root level: -1, then the root candidates), SGLang's parents_list entry.
      beam_scores: [b, W] float32. Scores of the chosen beams (-1 for an unused beam).
      beam_tokens: [b * W] int64. Their tokens: the next forward's input ids.
      parent_beam: [b, W] int64. For each chosen beam, the beam of the previous step it descends from (root
                   level: its own index).
    """

    scores: torch.Tensor
    tokens: torch.Tensor
    parents: torch.Tensor
    beam_scores: torch.Tensor
    beam_tokens: torch.Tensor
    parent_beam: torch.Tensor


@dataclass(frozen=True, eq=False)
class DraftLoop:
    """The static description of the plugin's draft loop for one worker (built once, at start-up).

    Fields:
      width:     W, beams per step (SGLang's speculative_eagle_topk).
      children:  K <= W, candidates a node may keep as children.
      steps:     draft steps (tree depth).
      rank_ok:   [W] bool device buffer, rank < K.
      plan:      sequoia's forced frontier and slots; None for best-first selection (specexec).
      live:      per forwarded step s in 1..steps-1, the beams (a prefix of the W) that can grow: only their
                 candidates may be chosen, and only their logits are computed (``head_loop.draft_forward``).
      beam_live: [max(steps - 1, 1), W] bool device buffer, row s - 1: beam < live[s - 1].
    """

    width: int
    children: int
    steps: int
    rank_ok: torch.Tensor
    plan: DevicePlan | None
    live: tuple[int, ...]
    beam_live: torch.Tensor

    @classmethod
    def build(cls, width: int, children: int, steps: int, plan: DraftPlan | None,
              device: torch.device | str, budget: int | None = None) -> DraftLoop:
        """``budget``: the verified nodes; with it, beams that cannot grow in the tree are masked (sequoia: the
        plan's; specexec: ``growable_beams``). Without it every beam is live (any budget up to the capacity)."""
        if not 1 <= children <= width:
            raise SpecError(f"a node keeps at most the draft width {width} children, got {children}")
        rank_ok = (torch.arange(width) < children).to(device)
        live = live_beams(width, children, steps, budget, plan)
        beam_live = torch.arange(width)[None, :] < torch.tensor((*live, width)[: max(steps - 1, 1)])[:, None]
        return cls(width, children, steps, rank_ok, None if plan is None else DevicePlan.build(plan, device), live,
                   beam_live.to(device))

    def root_level(self, topk_p: torch.Tensor, topk_index: torch.Tensor) -> Level:
        """topk_p, topk_index: [b, W] the root's candidates, best first. Every root candidate is a beam of step 0
        (SGLang's first step), the ones of rank >= K with score -1 so nothing below them is ever chosen."""
        batch = topk_p.shape[0]
        scores = torch.where(self.rank_ok, topk_p.float(), torch.full_like(topk_p, _UNUSED, dtype=torch.float32))
        parents = torch.arange(-1, self.width, dtype=torch.int64, device=topk_p.device).expand(batch, -1)
        own = torch.arange(self.width, dtype=torch.int64, device=topk_p.device).expand(batch, -1)
        return Level(scores, topk_index, parents, scores, topk_index.reshape(-1), own)

    def next_level(self, step: int, beam_scores: torch.Tensor, topk_p: torch.Tensor,
                   topk_index: torch.Tensor) -> Level:
        """Step ``step`` >= 1: beam_scores [b, W] of the beams forwarded at step - 1; topk_p / topk_index
        [b * W, W] their candidates, best first. Chooses the next W beams: the plan's frontier first (sequoia),
        otherwise the best W candidates by cumulative probability."""
        width = self.width
        batch = beam_scores.shape[0]
        probs = topk_p.float().view(batch, width, width)
        live = (beam_scores >= 0) & self.beam_live[step - 1][None, :]  # beams that may grow at this step
        usable = live[:, :, None] & self.rank_ok[None, None, :]
        scores = torch.where(usable, beam_scores[:, :, None] * probs, torch.full_like(probs, _UNUSED))
        scores = scores.view(batch, width * width)
        ranked = scores
        if self.plan is not None and self.plan.forces[step - 1]:
            ranked = scores + self.plan.frontier_boost[step - 1]
        chosen = torch.topk(ranked, width, dim=-1).indices  # [b, W] positions f * W + r
        tokens = topk_index.view(batch, width * width)
        return Level(
            scores=scores,
            tokens=tokens,
            parents=chosen + (width * width * (step - 1) + width),
            beam_scores=torch.gather(scores, 1, chosen),
            beam_tokens=torch.gather(tokens, 1, chosen).reshape(-1),
            parent_beam=torch.div(chosen, width, rounding_mode="floor"),
        )

    def candidate_grid(self, step: int, topk_p: torch.Tensor, topk_index: torch.Tensor,
                       batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The live beams' candidates at step ``step`` in ``next_level``'s layout: topk_p / topk_index
        [b * live[step - 1], K] (best first) -> [b * W, W], probability 0 and token 0 where a beam is not live or a
        rank is >= K (both masked in ``next_level``)."""
        live, width, children = self.live[step - 1], self.width, self.children
        probs = torch.zeros(batch, width, width, dtype=topk_p.dtype, device=topk_p.device)
        tokens = torch.zeros(batch, width, width, dtype=topk_index.dtype, device=topk_index.device)
        probs[:, :live, :children] = topk_p.view(batch, live, children)
        tokens[:, :live, :children] = topk_index.view(batch, live, children)
        return probs.view(batch * width, width), tokens.view(batch * width, width)

    def organize(self, levels: list[Level], budget: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """SGLang's verify input from the drafted levels: (parent_list [b, W * (steps - 1) + 1], top_scores_index
        [b, budget] sorted slot ids, draft_tokens [b, budget]). The plan's slots (sequoia), else the best
        ``budget`` candidates by cumulative probability (SpecExec's tree; SGLang's organize_draft_results rule)."""
        tokens = torch.cat([level.tokens for level in levels], dim=1)
        batch = tokens.shape[0]
        if self.plan is not None:
            if self.plan.slots.shape[0] != budget:
                raise SpecError(f"the plan has {self.plan.slots.shape[0]} draft nodes but SGLang verifies {budget}")
            top_scores_index = self.plan.slots.expand(batch, -1).contiguous()
        else:
            scores = torch.cat([level.scores for level in levels], dim=1)
            top_scores_index = torch.sort(torch.topk(scores, budget, dim=-1).indices, dim=-1).values
        draft_tokens = torch.gather(tokens, 1, top_scores_index)
        if len(levels) > 1:
            parent_list = torch.cat([level.parents for level in levels[:-1]], dim=1)
        else:
            parent_list = torch.empty(batch, 0, dtype=torch.int64, device=tokens.device)
        return parent_list, top_scores_index, draft_tokens


def ancestry_permutation(parent_beam: torch.Tensor, step_locs: torch.Tensor,
                         steps_done: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(target, source) KV slots that give every new beam its parent beam's history.

    parent_beam: [b, W] the previous-step beam each new beam descends from.
    step_locs:   [steps, b*W] SGLang's per-step draft KV slots (``per_step_draft_out_cache_loc``).
    steps_done:  draft steps whose KV is written (the columns 0..steps_done-1 get permuted).
    Copy with ``pool[target] = pool[source]`` (gather, then scatter), so overlapping permutations are safe."""
    batch, width = parent_beam.shape
    locs = step_locs[:steps_done].view(steps_done, batch, width)
    source = torch.gather(locs, 2, parent_beam.unsqueeze(0).expand(steps_done, batch, width))
    return locs.reshape(-1), source.reshape(-1)

