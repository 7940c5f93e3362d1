"""``lookup`` and ``hybrid`` trees inside SGLang's EAGLE v2 draft step (``EagleDraftWorker.draft_forward`` replaced
for these policies).

Each request's tree is grown by the reference decoder's builder (``tree/hybrid.BestFirstBuilder``: the context's
n-gram continuations and the MTP head's top-k under one budget, ranked by the calibrated per-source counts), on
the host. The builders of all the batch's requests advance in lock-step: each head round's nodes (all at one
depth, at most W a request) become the beams of one SGLang draft forward, run exactly as the plugin's own loop
runs it (``draft_forward.forward_beams``: same backends, per-step KV slots, hot-token map, softmax; every beam's
KV column rewritten with its parent's history first, so each node sees its own ancestors only). The trees are then padded
to the budget (SGLang verifies a fixed number of tokens per request) and handed to SGLang in the UNO encoding
(``tree/encode_sglang.encode_sglang_draft``), which takes any tree.

The host reads the roots, the root candidates and each round's candidates (one copy each, ``to_host``), so this
path syncs once at the start and once per head round and cannot run inside a CUDA graph: the plugin runs it eagerly
(see ``options.validate_speculative``).
``lookup`` and ``hybrid`` trees can instead grow on the device (``device_lookup_draft_forward``,
``device_hybrid_draft_forward``; --speculative-tree-context-on device): the same trees from each request's device
history (``device_history``), the head's rounds as padded beams, no host read.
Each request's context is ``RequestContexts``: an n-gram index per request, extended by the tokens SGLang has
committed for it since the last step (with the overlap scheduler, its output ids completed from the last verify:
``committed``).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from sglang_spec.kernels.hybrid_tree import (HybridGrowth, HybridShape, HybridTrees, SourceEstimates,
                                             build_hybrid_trees, hybrid_draft_trees)
from sglang_spec.kernels.lookup_tree import (LookupTrees, NgramMatch, build_lookup_trees, lookup_draft_trees,
                                             lookup_estimates)
from sglang_spec.kernels.ngram_match import ngram_match, ngram_match_reference
from sglang_spec.sglang_plugin.committed import CommittedOutputs, forget_finished
from sglang_spec.sglang_plugin.device_history import DeviceHistory
from sglang_spec.sglang_plugin.draft_forward import forward_beams
from sglang_spec.sglang_plugin.draft_loop import ancestry_permutation
from sglang_spec.sglang_plugin.head_guard import HeadGuard, NonFiniteHeadOutput, finite_rows
from sglang_spec.sglang_plugin.level_costs import LevelCosts
from sglang_spec.sglang_plugin.metrics import SourceMetrics
from sglang_spec.tree.candidates import Candidates
from sglang_spec.tree.draft import DraftTree
from sglang_spec.tree.drafter import TreeDrafter
from sglang_spec.tree.encode_sglang import encode_sglang_draft, encode_sglang_draft_device
from sglang_spec.tree.hybrid import BestFirstBuilder, BestFirstRounds
from sglang_spec.tree.ngram import NgramIndex
from sglang_spec.tree.policies import TreePolicy
from sglang_spec.tree.token_tree import TokenTree

@dataclass
class RequestContexts:
    """rid -> an n-gram index over the request's committed tokens (prompt + output, the root included)."""

    max_ngram: int
    indexes: dict[str, NgramIndex] = field(default_factory=dict)

    def index(self, rid: str, committed: Sequence[int], root: int) -> NgramIndex:
        """The request's index, extended to ``committed`` (prompt + output ids as SGLang holds them), which must
        end with ``root``; a history that shrank (a retracted request re-run) is rebuilt."""
        tokens = list(committed)
        if not tokens or tokens[-1] != root:
            tokens.append(root)
        index = self.indexes.get(rid)
        if index is None or len(index) > len(tokens) or index.tokens != tokens[: len(index)]:
            index = self.indexes[rid] = NgramIndex(max_ngram=self.max_ngram)
        index.extend(tokens[len(index):])
        return index

    def keep_only(self, rids: Sequence[str]) -> None:
        forget_finished(self.indexes, rids)


class ContextDrafter:
    """Per draft worker: the one drafter (``tree/drafter.TreeDrafter``: the policy, with SGLang's width W as its
    bound, and the per-source counts it learns online from the served traffic), the requests' contexts, and
    SGLang's static draft shape (``steps`` draft steps, ``budget`` verified nodes a request).

    Live calibration: the trees of a draft step are kept (``proposed``) until SGLang's accept gives their
    accepted paths (``record_outcome``, device tensors, no sync), and are observed at the next draft step,
    which reads the host anyway; what they taught goes to ``metrics`` (``SourceMetrics``) when it is enabled.

    Priced levels (tree auto: ``level_costs``): each draft prices a head level at the batch's measured costs, and a
    request's builder runs one only where its predicted gain pays (``tree/hybrid``); the draft records how many
    rounds it ran and their seconds (``rounds``, ``rounds_seconds``: each round ends with the host reading its
    candidates, so its time is the device's too) for the step's observer."""

    def __init__(self, policy: TreePolicy, steps: int, budget: int, metrics: SourceMetrics | None = None) -> None:
        self.drafter = TreeDrafter(policy)
        self.metrics = metrics
        self._exported = {name: tuple(cell) for name, cell in self.drafter.counts.named_cells().items()}
        self.contexts = RequestContexts(policy.max_ngram)
        self.steps = steps
        self.budget = budget
        self.proposed: list[DraftTree] = []
        self._outcome: tuple[list[DraftTree], torch.Tensor, int] | None = None
        self.outputs: CommittedOutputs | None = None  # set with the overlap scheduler (its output ids lag a step)
        self.level_costs: LevelCosts | None = None  # set under tree auto: head levels priced per batch size
        self.rounds = 0  # head rounds the last draft ran
        self.rounds_seconds = 0.0  # and their seconds
        self.priced_out = 0  # requests whose trees left a head level out because it did not pay (all drafts)
        # ``lookup`` trees grown on the device (--speculative-tree-context-on device): set with that option, its
        # history made at the first draft (it needs SGLang's request table)
        self.on_device = False
        self.history: DeviceHistory | None = None
        self.proposed_on_device: LookupTrees | HybridTrees | None = None
        self.proposed_finite: torch.Tensor | None = None  # [bs] bool: hybrid rows drafted from a finite head output
        self.guard: HeadGuard | None = None  # hybrid on the device: a non-finite head output verifies the filler
        self._device_outcomes: deque[tuple[LookupTrees | HybridTrees, torch.Tensor | None, torch.Tensor, int,
                                           Any]] = deque()

    @property
    def uses_head(self) -> bool:
        """False for ``lookup``: its trees never ask the head (the server then skips the head's forwards)."""
        return self.drafter.policy.uses_head

    def committed_tokens(self, req: Any, kv_length: int, root: int) -> list[int]:
        """The request's prompt and committed output at a decode step whose KV holds ``kv_length`` of its tokens
        and which verifies from ``root``: its output ids, completed from the last verify where they lag
        (``committed``; not known whole: as they are, and ``RequestContexts.index`` appends the root)."""
        output = None if self.outputs is None else self.outputs.output(req, kv_length, root)
        return list(req.origin_input_ids_unpadded) + (list(req.output_ids) if output is None else output)

    @property
    def has_proposal(self) -> bool:
        """Whether the last draft proposed trees whose accepted paths the next accept should report."""
        return bool(self.proposed) or self.proposed_on_device is not None

    def record_outcome(self, accept_index: torch.Tensor, verify_tokens: int) -> None:
        """accept_index: SGLang's accepted paths for the trees last proposed, [bs, steps + 1] global node
        indices (row * verify_tokens + node), -1 padded. Trees grown on the device are observed once the
        device has finished the accept (``observe_outcome`` never waits for it): a CUDA event marks that point."""
        if self.proposed_on_device is not None:
            accepted = accept_index.clone()  # SGLang may reuse its buffer before the outcome is read
            event = None
            if accepted.is_cuda:
                event = torch.cuda.Event()
                event.record()
            self._device_outcomes.append((self.proposed_on_device, self.proposed_finite, accepted, verify_tokens,
                                          event))
            self.proposed_on_device, self.proposed_finite = None, None
            return
        self._outcome = (self.proposed, accept_index, verify_tokens)
        self.proposed = []

    def learnt(self) -> dict[str, tuple[float, ...]]:
        """What the counts hold now (and what of it was exported), for ``restore``: a few dozen cells."""
        cells = {name: tuple(cell) for name, cell in self.drafter.counts.named_cells().items()}
        return {**cells, **{f"exported:{name}": cell for name, cell in self._exported.items()}}

    def restore(self, learnt: dict[str, tuple[float, ...]]) -> None:
        """The counts (and export marks) as ``learnt`` had them; the outcome they were to observe stays unobserved."""
        for name, cell in self.drafter.counts.named_cells().items():
            cell[:] = learnt[name]
        self._exported = {name: learnt[f"exported:{name}"] for name in self._exported}

    def observe_outcome(self) -> None:
        """Teaches the counts what the last verified trees accepted (filler nodes are nobody's candidates)."""
        while self._device_outcomes:  # the device's, oldest first, as far as the device has finished them
            grown, finite, accepted, tokens, event = self._device_outcomes[0]
            if event is not None and not event.query():
                break
            self._device_outcomes.popleft()
            if isinstance(grown, HybridTrees):
                rows = None if finite is None else finite.tolist()
                self._observe(hybrid_draft_trees(grown, self.drafter.counts, rows), accepted, tokens)
            else:
                self._observe(lookup_draft_trees(grown, self.drafter.counts), accepted, tokens)
        if self._outcome is None:
            return
        trees, accept_index, verify_tokens = self._outcome
        self._outcome = None
        self._observe(trees, accept_index, verify_tokens)

    def _observe(self, trees: Sequence[DraftTree | None], accept_index: torch.Tensor, verify_tokens: int) -> None:
        """Each tree's accepted path observed (a None tree, a request that verified the filler: nothing)."""
        for row, path in enumerate(accept_index.reshape(len(trees), -1).tolist()):
            tree = trees[row]
            if tree is None:
                continue
            nodes = [index - row * verify_tokens for index in path if index >= 0]
            self.drafter.observe(tree, nodes)
        if self.metrics is not None and self.metrics.enabled:
            observed = {}
            for name, cell in self.drafter.counts.named_cells().items():
                accepted, offered = self._exported[name]
                if cell[1] != offered:  # outcomes are whole: round off the prior's fraction
                    observed[name] = (round(cell[0] - accepted), round(cell[1] - offered))
                    self._exported[name] = (cell[0], cell[1])
            self.metrics.add(observed)


def pad_to_budget(tree: TokenTree, budget: int, width: int, steps: int) -> TokenTree:
    """``tree`` with filler leaves added until it has ``budget`` draft nodes: first under the shallowest nodes that
    keep fewer than ``width`` children, never deeper than ``steps``. A filler token differs from its siblings'
    (the smallest such id), so it is one more deterministic proposal: verification stays exact whatever it is."""
    parents = tree.parents.tolist()
    tokens = tree.tokens.tolist()
    depths = tree.depths.tolist()
    children: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents[1:], start=1):
        children[parent].append(tokens[node])
    node = 0
    while len(parents) - 1 < budget:
        if node == len(parents):
            raise AssertionError(f"no room for {budget} nodes with width {width} and {steps} steps")
        if depths[node] >= steps or len(children[node]) >= width:
            node += 1
            continue
        used = set(children[node])
        filler = next(token for token in range(len(used) + 1) if token not in used)
        parents.append(node)
        tokens.append(filler)
        depths.append(depths[node] + 1)
        children[node].append(filler)
        children.append([])
    return TokenTree.from_parents(parents, tokens=tokens)


def pad_to_budget_device(parents: torch.Tensor, tokens: torch.Tensor, num_nodes: torch.Tensor, budget: int,
                         width: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``pad_to_budget`` for a batch of trees held as device tensors, with no host read: parents / tokens
    [bs, >= budget + 1] int64 (node 0 the root, parents first, -1 past ``num_nodes`` [bs]) -> the padded
    (parents, tokens) [bs, budget + 1], the same fillers in the same places. Node by node, as the host form
    walks them: a node above ``steps`` keeps fewer than ``width`` children gets the smallest tokens its children
    do not hold, while the tree is short."""
    batch_size = parents.shape[0]
    columns = budget + 1
    device = parents.device
    rows = torch.arange(batch_size, device=device)
    spare = torch.full((batch_size, 1), -1, dtype=torch.int64, device=device)
    parents = torch.cat([parents[:, :columns], spare], 1)  # a spare column takes the writes that do not happen
    tokens = torch.cat([tokens[:, :columns], spare], 1)
    nodes = torch.arange(columns + 1, device=device)
    depths = torch.zeros_like(parents)
    for node in range(1, columns):
        depths[:, node] = depths[rows, parents[:, node].clamp(min=0)] + 1
    count = num_nodes.clone()
    candidates = torch.arange(2 * width + 1, device=device)
    for node in range(columns):
        children = (parents == node) & (nodes[None, :] < count[:, None])
        held = children.long().sum(1)
        room = torch.where((node < count) & (depths[:, node] < steps), (width - held).clamp(min=0), 0)
        added = torch.minimum(room, columns - count)
        # the smallest tokens its children do not hold, in order
        used = ((tokens[:, None, :] == candidates[None, :, None]) & children[:, None, :]).any(2)
        free_rank = (~used).long().cumsum(1) - 1  # [bs, candidates]
        take = ~used & (free_rank < added[:, None])
        target = torch.where(take, count[:, None] + free_rank, columns)
        parents.scatter_(1, target, torch.full_like(target, node))
        tokens.scatter_(1, target, candidates[None, :].expand(batch_size, -1))
        depths.scatter_(1, target, (depths[:, node] + 1)[:, None].expand_as(target))
        count = count + added
    return parents[:, :columns], tokens[:, :columns]


def context_draft_forward(worker: Any, forward_batch: Any, reqs: Sequence[Any], drafter: ContextDrafter,
                          permute_kv: Callable) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
    """``draft_forward`` for ``worker`` (an EagleDraftWorker) over ``reqs`` (the ScheduleBatch's requests, in
    batch order): SGLang's (parent_list, top_scores_index, draft_tokens, draft_probs=None). The caller has had the
    drafter observe the last accepted paths (``ContextDrafter.observe_outcome``)."""
    from sglang.srt.speculative.eagle_utils import per_step_draft_out_cache_loc

    drafter.rounds, drafter.rounds_seconds = 0, 0.0
    policy = drafter.drafter.policy
    width = worker.topk
    topk = policy.effective_topk
    spec_info = forward_batch.spec_info
    batch = forward_batch.batch_size
    device = spec_info.topk_p.device
    root_index = spec_info.topk_index[:, :topk]
    if worker.hot_token_id is not None:
        root_index = worker.hot_token_id[root_index]
    host_roots, host_lengths, root_index, root_probs = to_host(spec_info.bonus_tokens, forward_batch.seq_lens,
                                                               root_index, spec_info.topk_p[:, :topk].float())
    roots, kv_lengths = host_roots.tolist(), host_lengths.tolist()
    root_candidates = Candidates(tokens=root_index, probs=_finite(root_probs))

    costs = None if drafter.level_costs is None else drafter.level_costs.curve(batch)
    builders: list[BestFirstBuilder] = []
    rounds: list[BestFirstRounds] = []
    pending: dict[int, list[int]] = {}  # request row -> the nodes its builder asks the head to expand
    trees: list[DraftTree | None] = [None] * batch
    for row, req in enumerate(reqs):
        index = drafter.contexts.index(req.rid, drafter.committed_tokens(req, kv_lengths[row], roots[row]),
                                       roots[row])
        builder = drafter.drafter.propose_rounds(roots[row], index, costs)
        builders.append(builder)
        rounds.append(builder.rounds())
        _advance(rounds, trees, pending, row, None)
    drafter.contexts.keep_only([req.rid for req in reqs])
    for row, nodes in list(pending.items()):  # the root's candidates come with the previous commit
        assert nodes == [0]
        _advance(rounds, trees, pending, row, Candidates(root_candidates.tokens[row: row + 1],
                                                           root_candidates.probs[row: row + 1]))

    step_locs = per_step_draft_out_cache_loc(forward_batch.out_cache_loc, batch, width, drafter.steps)
    beam_of: list[dict[int, int]] = [{0: 0} for _ in range(batch)]  # node -> its beam in the last forward
    state = spec_info.hidden_states
    for step in range(1, drafter.steps):
        if not pending:
            break
        start = time.perf_counter()
        tokens = torch.zeros(batch, width, dtype=torch.int64)
        parent_beam = torch.arange(width, dtype=torch.int64).repeat(batch, 1)
        for row, nodes in pending.items():
            tree = builders[row].tree
            for beam, node in enumerate(nodes):
                tokens[row, beam] = tree.tokens[node]
                parent_beam[row, beam] = beam_of[row][tree.parents[node]]
        output, topk_p, topk_index = head_round(worker, forward_batch, step, tokens.to(device),
                                                parent_beam.to(device), state, step_locs, permute_kv, topk)
        state = output.hidden_states
        topk_p, topk_index = to_host(topk_p.float(), topk_index)
        topk_p, topk_index = _finite(topk_p).view(batch, width, topk), topk_index.view(batch, width, topk)
        drafter.rounds += 1
        drafter.rounds_seconds += time.perf_counter() - start
        for row, nodes in list(pending.items()):
            beam_of[row] = {node: beam for beam, node in enumerate(nodes)}
            count = len(nodes)
            _advance(rounds, trees, pending, row, Candidates(topk_index[row, :count], topk_p[row, :count]))
    assert not pending, "a tree asked for a head round deeper than SGLang drafts (its depth is the step count)"

    assert all(tree is not None for tree in trees)
    drafter.priced_out += sum(builder.priced_out for builder in builders)
    drafter.proposed = [tree for tree in trees if tree is not None]
    padded = [pad_to_budget(tree.tree, drafter.budget, width, drafter.steps) for tree in drafter.proposed]
    encoding = encode_sglang_draft(padded, width, drafter.steps)
    return (encoding.parent_list.to(device), encoding.top_scores_index.to(device),
            encoding.draft_tokens.to(device), None)


def head_round(worker: Any, forward_batch: Any, step: int, tokens: torch.Tensor, parent_beam: torch.Tensor,
               state: torch.Tensor, step_locs: torch.Tensor, permute_kv: Callable, topk: int
               ) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """One head level of a context tree over the batch's W beams, as both context paths run it: beam (r, w) is
    node token ``tokens[r, w]`` ([R, W], on the device); at step 1 every beam reads its request's root state
    (``state`` [R, H]), past it the state of its parent beam ``parent_beam[r, w]`` in the last forward (``state``
    [R * W, H]), whose KV history its own column takes first. Returns ``forward_beams``' output and top-``topk``."""
    batch, width = tokens.shape
    requests = torch.arange(batch, device=tokens.device)
    if step == 1:
        hidden_rows = requests.repeat_interleave(width)
    else:
        hidden_rows = (parent_beam + (requests * width)[:, None]).reshape(-1)
        target, source = ancestry_permutation(parent_beam, step_locs, step - 1)
        permute_kv(worker.draft_runner.token_to_kv_pool, target, source)
    return forward_beams(worker, forward_batch, step, tokens.reshape(-1), state[hidden_rows], step_locs[step - 1],
                         topk)


def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors on the host, through one device-to-host copy (on a GPU one sync, not one a tensor): packed as
    float64, which holds token ids and lengths (below 2**53) and float32 probabilities exactly. Host tensors are
    returned as they are."""
    if all(tensor.device.type == "cpu" for tensor in tensors):
        return list(tensors)
    return unpack(pack(tensors).cpu(), tensors)


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``to_host``'s one tensor: every tensor flattened into float64, in order."""
    return torch.cat([tensor.reshape(-1).to(torch.float64) for tensor in tensors])


def unpack(packed: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``pack``'s inverse: tensors of ``like``'s shapes and dtypes, on ``packed``'s device."""
    host, start = [], 0
    for tensor in like:
        host.append(packed[start: start + tensor.numel()].view(tensor.shape).to(tensor.dtype))
        start += tensor.numel()
    return host


def _finite(probs: torch.Tensor) -> torch.Tensor:
    """The head's top-k probabilities, checked on the host copy the builder reads anyway: a non-finite head output
    is a draft fault (``hooks.draft_forward_around`` verifies a filler tree for the batch), not a tree."""
    if not bool(torch.isfinite(probs).all()):
        raise NonFiniteHeadOutput("the MTP head's top-k probabilities are not finite")
    return probs


def _advance(rounds: list[BestFirstRounds], trees: list[DraftTree | None], pending: dict[int, list[int]],
             row: int, candidates: Candidates | None) -> None:
    """One step of request ``row``'s builder: its next round's nodes go to ``pending``, or its finished tree to
    ``trees``."""
    pending.pop(row, None)
    try:
        nodes = next(rounds[row]) if candidates is None else rounds[row].send(candidates)
    except StopIteration as done:
        trees[row] = done.value
        return
    pending[row] = nodes


def _device_contexts(worker: Any, forward_batch: Any, reqs: Sequence[Any], drafter: ContextDrafter
                     ) -> tuple[torch.Tensor, torch.Tensor, NgramMatch]:
    """The requests' device histories, admitted and ready to match (history table, lengths, the n-gram kernel or
    its reference): on a CPU only as many columns as the longest history (the reference scans every column)."""
    spec_info = forward_batch.spec_info
    device = spec_info.bonus_tokens.device
    if drafter.history is None:
        table = worker.draft_runner.req_to_token_pool.req_to_token
        drafter.history = DeviceHistory(table.shape[0], table.shape[1] + drafter.budget + 2, device)
    history = drafter.history
    history.admit(reqs, getattr(forward_batch, "seq_lens_cpu", None), spec_info.bonus_tokens)
    match = ngram_match if device.type == "cuda" else ngram_match_reference
    tokens = history.tokens
    if device.type == "cpu":  # the CPU bed: lengths are host memory, and the reference scans every column it gets
        tokens = tokens[:, : int(history.lengths.max()) + 1]
    return tokens, history.lengths, match


def device_lookup_draft_forward(worker: Any, forward_batch: Any, reqs: Sequence[Any],
                                drafter: ContextDrafter) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
    """``draft_forward`` for a ``lookup`` server with --speculative-tree-context-on device: the batch's trees grown
    on the device (``kernels/lookup_tree``, the host builder's trees) from the requests' device histories, padded
    and encoded there; the host reads nothing (the requests new to their rows are written from host lists).
    The caller has had the drafter observe what the device has finished accepting."""
    tokens, lengths, match = _device_contexts(worker, forward_batch, reqs, drafter)
    policy = drafter.drafter.policy
    device = tokens.device
    # the growth keeps every continuation a node has: SGLang's encoding needs width * (depth - 1) >= budget with
    # depth <= budget, so the width is at least 2, the policy's lookup width (``options._width``)
    assert worker.topk >= policy.lookup_width
    trees = build_lookup_trees(tokens, lengths, forward_batch.req_pool_indices.long(),
                               lookup_estimates(drafter.drafter.counts, device), policy.budget, policy.depth,
                               policy.lookup_width, match=match)
    drafter.proposed_on_device = trees
    parents, tokens = pad_to_budget_device(trees.parents, trees.tokens, trees.num_nodes, drafter.budget,
                                           worker.topk, drafter.steps)
    parent_list, top_scores_index, draft_tokens = encode_sglang_draft_device(parents, tokens, worker.topk,
                                                                             drafter.steps)
    return parent_list, top_scores_index, draft_tokens, None


def device_hybrid_draft_forward(worker: Any, forward_batch: Any, reqs: Sequence[Any], drafter: ContextDrafter,
                                permute_kv: Callable) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
    """``draft_forward`` for a ``hybrid`` server with --speculative-tree-context-on device: the batch's trees grown
    on the device (``kernels/hybrid_tree``, the host builder's trees), the head's rounds run as the host path runs
    them (``forward_beams``: a round's nodes are its beams, each beam's KV column given its parent's history
    first), padded and encoded there, with no host read. Every head level the policy allows runs (a request
    whose tree stops asking gets its slots masked), so the step's shape is fixed. A request whose head
    probabilities are not all finite verifies the filler tree (``head_guard``; not observed)."""
    from sglang.srt.speculative.eagle_utils import per_step_draft_out_cache_loc

    contexts, lengths, match = _device_contexts(worker, forward_batch, reqs, drafter)
    policy = drafter.drafter.policy
    spec_info = forward_batch.spec_info
    batch, width, topk = forward_batch.batch_size, worker.topk, policy.effective_topk
    device = contexts.device
    shape = HybridShape(budget=policy.budget, depth=policy.depth, width=policy.width, topk=topk,
                        mtp_levels=policy.mtp_levels, lookup_width=policy.lookup_width, max_ngram=policy.max_ngram)
    assert shape.round_width <= width and shape.head_rounds < drafter.steps
    root_index = spec_info.topk_index[:, :topk]
    if worker.hot_token_id is not None:
        root_index = worker.hot_token_id[root_index]
    root_probs = spec_info.topk_p[:, :topk].float()
    finite = finite_rows(root_probs, batch)
    step_locs = per_step_draft_out_cache_loc(forward_batch.out_cache_loc, batch, width, drafter.steps)
    beams = torch.arange(width, device=device)
    carried = {"state": spec_info.hidden_states, "finite": finite}
    beam_of: list[torch.Tensor] = []  # [R, C + 1]: each node's beam in the last head round (the root: 0)

    def head(level: int, nodes: torch.Tensor, growth: HybridGrowth) -> tuple[torch.Tensor, torch.Tensor]:
        step = level + 1
        if not beam_of:
            beam_of.append(torch.zeros_like(growth.tokens))
        listed = nodes >= 0
        slots = nodes.shape[1]
        node_ids = nodes.clamp(min=0)
        tokens = torch.zeros(batch, width, dtype=torch.int64, device=device)
        tokens[:, :slots] = torch.where(listed, torch.gather(growth.tokens, 1, node_ids), 0)
        parent_beam = beams.repeat(batch, 1)  # a beam of no node reads its own column, as the host path's
        parents = torch.gather(growth.parents, 1, node_ids).clamp(min=0)
        parent_beam[:, :slots] = torch.where(listed, torch.gather(beam_of[0], 1, parents), beams[:slots])
        output, topk_p, topk_index = head_round(worker, forward_batch, step, tokens, parent_beam, carried["state"],
                                                step_locs, permute_kv, topk)
        carried["state"] = output.hidden_states
        probs = topk_p.float().view(batch, width, topk)[:, :slots]
        carried["finite"] = carried["finite"] & torch.where(listed[..., None], torch.isfinite(probs), True).view(
            batch, -1).all(1)
        spare = growth.tokens.shape[1] - 1
        beam_of[0] = torch.zeros_like(growth.tokens).scatter_(1, torch.where(listed, nodes, spare),
                                                              beams[:slots].expand(batch, -1).contiguous())
        return topk_index.view(batch, width, topk)[:, :slots], probs

    trees = build_hybrid_trees(contexts, lengths, forward_batch.req_pool_indices.long(), root_index, root_probs,
                               head, SourceEstimates.of(drafter.drafter.counts, device), shape, match=match)
    drafter.proposed_on_device = trees
    drafter.proposed_finite = carried["finite"]
    parents, tokens = pad_to_budget_device(trees.parents, trees.tokens, trees.num_nodes, drafter.budget, width,
                                           drafter.steps)
    parent_list, top_scores_index, draft_tokens = encode_sglang_draft_device(parents, tokens, width, drafter.steps)
    if drafter.guard is not None:
        parent_list, top_scores_index, draft_tokens = drafter.guard.select(carried["finite"], parent_list,
                                                                           top_scores_index, draft_tokens)
    return parent_list, top_scores_index, draft_tokens, None
