"""``HostContextDrafter``: ``lookup`` and ``hybrid`` trees built on the host inside SGLang's EAGLE v2 draft step.

Each request's tree is grown by the reference decoder's builder (``tree/best_first.BestFirstBuilder``: the context's
n-gram continuations and the MTP head's top-k under one budget, ranked by the calibrated per-source counts), on
the host. The builders of all the batch's requests advance in lock-step: each head round's nodes (all at one
depth, at most W a request) become the beams of one SGLang draft forward, run exactly as the plugin's own loop
runs it (``beams.forward_beams``: same backends, per-step KV slots, hot-token map, softmax; every beam's
KV column rewritten with its parent's history first, so each node sees its own ancestors only). The trees are then
padded to the budget (SGLang verifies a fixed number of tokens per request) and handed to SGLang in the UNO encoding
(``tree/encode_sglang.encode_sglang_draft``), which takes any tree.

The host reads the roots, the root candidates and each round's candidates (one copy each, ``to_host``), so this
path syncs once at the start and once per head round and cannot run inside a CUDA graph: the plugin runs it eagerly
(see ``options.validate_speculative``).
``lookup`` and ``hybrid`` trees can instead grow on the device (``device_context``; --speculative-tree-context-on
device).
Each request's context is ``RequestContexts``: an n-gram index per request, extended by the tokens SGLang has
committed for it since the last step (with the overlap scheduler, its output ids completed from the last verify:
``committed``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch

from sglang_spec.sglang_plugin.committed import CommittedOutputs, forget_finished
from sglang_spec.sglang_plugin.drafters.base import DraftCall, SGLangDraft, VerifyOutcome
from sglang_spec.sglang_plugin.drafters.beams import head_round, pad_head_rounds
from sglang_spec.sglang_plugin.drafters.context import ContextDrafter
from sglang_spec.sglang_plugin.drafters.head_guard import NonFiniteHeadOutput
from sglang_spec.sglang_plugin.drafters.padding import pad_to_budget
from sglang_spec.sglang_plugin.level_costs import LevelCosts
from sglang_spec.sglang_plugin.metrics import SourceMetrics
from sglang_spec.tree.candidates import Candidates
from sglang_spec.tree.proposal import DraftSources, DraftTree
from sglang_spec.tree.encode_sglang import encode_sglang_draft
from sglang_spec.tree.best_first import BestFirstBuilder, BestFirstRounds, build_best_first
from sglang_spec.tree.ngram import NgramIndex
from sglang_spec.tree.policies import TreePolicy


# the last tokens an index holds that a step compares with the request's history before extending it: a history
# rewritten further back (SGLang keeps a retracted request's output ids) would keep stale n-grams, weaker trees,
# never a wrong token
AGREE_TOKENS = 16


@dataclass(frozen=True)
class History:
    """A request's committed tokens as SGLang holds them, in pieces never concatenated (a step reads only the few
    it needs: contexts run to tens of thousands of tokens).

    pieces: the prompt, the output ids and a spliced tail (``CommittedOutputs.tail``), each a sequence of token
            ids, the root last (appended as a piece of its own where the others do not end with it); no piece empty."""

    pieces: tuple[Sequence[int], ...]

    @classmethod
    def of(cls, pieces: Sequence[Sequence[int]], root: int) -> History:
        held = tuple(piece for piece in pieces if len(piece))
        if not held or held[-1][-1] != root:
            held += ((root,),)
        return cls(held)

    @property
    def length(self) -> int:
        """The history's tokens in all."""
        return sum(len(piece) for piece in self.pieces)

    def tokens(self, begin: int, end: int) -> list[int]:
        """Tokens ``begin`` up to ``end`` (0 <= begin <= end <= length) of the history."""
        out: list[int] = []
        offset = 0
        for piece in self.pieces:
            if offset >= end:
                break
            if begin < offset + len(piece):
                out.extend(piece[max(begin - offset, 0): end - offset])
            offset += len(piece)
        return out


@dataclass
class RequestContexts:
    """rid -> an n-gram index over the request's committed tokens (prompt + output, the root included);
    ``built_seconds``: the time spent building indexes from scratch (new requests) since it was last reset."""

    max_ngram: int
    indexes: dict[str, NgramIndex] = field(default_factory=dict)
    built_seconds: float = 0.0

    def index(self, rid: str, history: History) -> NgramIndex:
        """The request's index, extended to ``history``. A step reads the tokens past the index's and the
        ``AGREE_TOKENS`` before them, whatever the context's length; a history that shrank or disagrees there (a
        retracted request re-run) is indexed again from its start."""
        index = self.indexes.get(rid)
        held, length = (0 if index is None else len(index)), history.length
        if index is None or held > length or \
                index.tokens[-AGREE_TOKENS:] != history.tokens(max(held - AGREE_TOKENS, 0), held):
            start = time.perf_counter()
            index = self.indexes[rid] = NgramIndex(history.tokens(0, length), max_ngram=self.max_ngram)
            self.built_seconds += time.perf_counter() - start
            return index
        index.extend(history.tokens(held, length))
        return index

    def keep_only(self, rids: Sequence[str]) -> None:
        forget_finished(self.indexes, rids)


class HostContextDrafter(ContextDrafter):
    """lookup / hybrid on the host: the requests' contexts (``RequestContexts``), the trees of the last draft until
    their accept is observed, and tree auto's level prices.

    Priced levels (tree auto: ``level_costs``): each draft prices a head level at the batch's measured costs, and a
    request's builder runs one only where its predicted gain pays (``tree/best_first``); the draft records how many
    rounds it ran and their seconds (``rounds``, ``rounds_seconds``: each round ends with the host reading its
    candidates, so its time is the device's too) for the step's observer."""

    reads_outputs = True
    reports_reach = True
    ragged_trees = True

    def __init__(self, policy: TreePolicy, steps: int, budget: int, metrics: SourceMetrics | None = None) -> None:
        super().__init__(policy, steps, budget, metrics)
        self.contexts = RequestContexts(policy.max_ngram)
        self.proposed: list[DraftTree] = []
        self._reach: dict[str, list[float]] = {}  # rid -> its last tree's reach, best first, until read
        self._outcome: tuple[list[DraftTree], torch.Tensor, int] | None = None
        self.outputs: CommittedOutputs | None = None  # set with the overlap scheduler (its output ids lag a step)
        self.level_costs: LevelCosts | None = None  # set under tree auto: head levels priced per batch size
        self.rounds = 0  # head rounds the last draft ran
        self.rounds_seconds = 0.0  # and their seconds
        self.priced_out = 0  # requests whose trees left a head level out because it did not pay (all drafts)

    def draft(self, call: DraftCall) -> SGLangDraft:
        assert call.requests is not None, "host-built trees are drafted eagerly, never in a draft graph capture"
        try:
            return context_draft_forward(call.worker, call.forward_batch, call.requests, self, call.budget, call.steps,
                                         call.depth, call.budgets)
        finally:
            if self.outputs is not None:
                self.outputs.report_first_unknown()

    def drafted_reach(self) -> dict[str, list[float]]:
        reach, self._reach = self._reach, {}
        return reach

    def verify_lengths(self) -> list[int] | None:
        return [len(tree.tree.parents) for tree in self.proposed]

    def estimate_reach(self, requests: list[Any], budget: int) -> dict[str, list[float]]:
        """Each request's lookup tree from its context as SGLang holds it (the output ids may lag a step under the
        overlap scheduler: an estimate), merged with the head's likeliest chain as the counts rate it (a hybrid
        tree holds both), the best ``budget`` reach values."""
        shape = replace(self.drafter.policy.best_first_shape(), uses_head=False, budget=budget)
        head_chain = self.prior_reach(budget) if self.uses_head else []
        estimates = {}
        for req in requests:
            prompt, output = req.origin_input_ids_unpadded, req.output_ids
            if not len(prompt) and not len(output):
                continue
            last = int(output[-1] if len(output) else prompt[-1])
            index = self.contexts.index(req.rid, History.of((prompt, output), last))
            lookup = build_best_first(shape, last, DraftSources(context=index), self.drafter.counts)
            estimates[req.rid] = sorted([*lookup.best_reach(), *head_chain], reverse=True)[:budget]
        return estimates

    @property
    def setup_seconds(self) -> float:  # type: ignore[override]
        """The last draft's time building new requests' context indexes."""
        return self.contexts.built_seconds

    def use_outputs(self, outputs: CommittedOutputs) -> None:
        self.outputs = outputs

    def committed_history(self, req: Any, kv_length: int, root: int) -> History:
        """The request's prompt and committed output at a decode step whose KV holds ``kv_length`` of its tokens
        and which verifies from ``root``: its output ids, completed from the last verify where they lag
        (``committed``; not known whole: as they are, the root after them)."""
        tail = None if self.outputs is None else self.outputs.tail(req, kv_length, root)
        return History.of((req.origin_input_ids_unpadded, req.output_ids, tail or ()), root)

    def record_outcome(self, outcome: VerifyOutcome) -> None:
        if self.proposed:
            self._outcome = (self.proposed, outcome.accept_index, outcome.verify_tokens)
            self.proposed = []

    def forget_proposal(self) -> None:
        self.proposed = []

    def observe_outcome(self) -> None:
        """Teaches the counts what the last verified trees accepted (filler nodes are nobody's candidates)."""
        if self._outcome is None:
            return
        trees, accept_index, verify_tokens = self._outcome
        self._outcome = None
        self._observe(trees, accept_index, verify_tokens)


def context_draft_forward(worker: Any, forward_batch: Any, reqs: Sequence[Any], drafter: HostContextDrafter,
                          budget: int, steps: int, depth: int, budgets: Sequence[int] | None = None) -> SGLangDraft:
    """``draft_forward`` for ``worker`` (an EagleDraftWorker) over ``reqs`` (the ScheduleBatch's requests, in
    batch order), each tree of at most ``budget`` draft nodes (``budgets[row]`` where given: a ragged plan's share)
    and ``depth`` levels, its head rounds within SGLang's
    ``steps`` draft steps, padded to the budget: SGLang's (parent_list,
    top_scores_index, draft_tokens, draft_probs=None). The caller has had the drafter observe the last accepted
    paths (``HostContextDrafter.observe_outcome``)."""
    from sglang.srt.speculative.eagle_utils import per_step_draft_out_cache_loc

    drafter.rounds, drafter.rounds_seconds = 0, 0.0
    drafter.contexts.built_seconds = 0.0
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
        index = drafter.contexts.index(req.rid, drafter.committed_history(req, kv_lengths[row], roots[row]))
        builder = drafter.drafter.propose_rounds(roots[row], index, costs,
                                                 budget if budgets is None else min(budgets[row], budget), depth)
        builders.append(builder)
        rounds.append(builder.rounds())
        _advance(rounds, trees, pending, row, None)
    drafter.contexts.keep_only([req.rid for req in reqs])
    for row, nodes in list(pending.items()):  # the root's candidates come with the previous commit
        assert nodes == [0]
        _advance(rounds, trees, pending, row, Candidates(root_candidates.tokens[row: row + 1],
                                                           root_candidates.probs[row: row + 1]))

    step_locs = per_step_draft_out_cache_loc(forward_batch.out_cache_loc, batch, width, steps)
    beam_of: list[dict[int, int]] = [{0: 0} for _ in range(batch)]  # node -> its beam in the last forward
    state = spec_info.hidden_states
    for step in range(1, steps):
        if not pending:
            break
        start = time.perf_counter()
        tokens = torch.zeros(batch, width, dtype=torch.int64)
        parent_beam = torch.arange(width, dtype=torch.int64).repeat(batch, 1)
        node_beams = []
        for row, nodes in sorted(pending.items()):
            tree = builders[row].tree
            for beam, node in enumerate(nodes):
                tokens[row, beam] = tree.tokens[node]
                parent_beam[row, beam] = beam_of[row][tree.parents[node]]
                node_beams.append(row * width + beam)
        output, topk_p, topk_index = head_round(worker, forward_batch, step, tokens.to(device),
                                                parent_beam.to(device), state, step_locs, topk,
                                                torch.tensor(node_beams, dtype=torch.int64).to(device))
        state = output.hidden_states
        topk_p, topk_index = to_host(topk_p.float(), topk_index)
        topk_p, topk_index = _finite(topk_p).view(batch, width, topk), topk_index.view(batch, width, topk)
        drafter.rounds += 1
        drafter.rounds_seconds += time.perf_counter() - start
        for row, nodes in list(pending.items()):
            beam_of[row] = {node: beam for beam, node in enumerate(nodes)}
            count = len(nodes)
            _advance(rounds, trees, pending, row, Candidates(topk_index[row, :count], topk_p[row, :count]))
    assert not pending, "a tree asked for more head rounds than SGLang's draft steps hold (draft_steps)"
    if drafter.all_head_rounds and drafter.uses_head:
        start = time.perf_counter()
        padded_rounds = pad_head_rounds(worker, forward_batch, drafter.rounds, steps, state, step_locs)
        drafter.rounds += padded_rounds
        drafter.rounds_seconds += time.perf_counter() - start

    assert all(tree is not None for tree in trees)
    drafter.priced_out += sum(builder.priced_out for builder in builders)
    drafter.proposed = [tree for tree in trees if tree is not None]
    drafter._reach = {req.rid: tree.best_reach() for req, tree in zip(reqs, drafter.proposed)}
    padded = [pad_to_budget(tree.tree, budget, width, depth) for tree in drafter.proposed]
    encoding = encode_sglang_draft(padded, width, steps, depth)
    return (encoding.parent_list.to(device), encoding.top_scores_index.to(device),
            encoding.draft_tokens.to(device), None)


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
    is a draft fault (the draft hook verifies a filler tree for the batch), not a tree."""
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
