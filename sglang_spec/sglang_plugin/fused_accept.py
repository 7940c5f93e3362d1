"""``--speculative-tree-accept fused``: SGLang's verify accept and KV commit done by the project's kernels.

In place of ``eagle_sample`` the target's verify logits go through ``kernels/verify_accept.py``: greedy batches
take the argmax at every node and follow the matching child (``MatchMode``, SGLang's ``verify_tree_greedy``
rule); temperature-sampled batches draw with SGLang's own coins (``_verify_coins``, seeded when the request is)
and SGLang's own rule (``CandidateSampleMode``: ``tree_speculative_sampling_target_only`` with thresholds 1), so
the outputs equal SGLang's accept for the same coins. The tree arrives in SGLang's layout (candidates, first-child /
next-sibling links) and leaves as exactly what the worker consumes: ``predict [bs * n] int32`` (the token
emitted after each accepted node, at its global id), ``accept_lens [bs] int32`` (accepted drafts + 1) and
``accept_index [bs, steps + 1] int32`` (global node ids, -1 padded). The accepted path's KV is moved by
``kernels/kv_commit.py`` instead of ``move_accept_tokens_to_target_kvcache``.

A batch the fused path does not serve goes to SGLang's own path, counted by reason: penalties, logit bias, grammar,
watermarks, custom logit processors, top-k / top-p / min-p sampling, rejection-sampling or simulated acceptance,
accept thresholds below 1 (lossy), UNO's sparse target sampling.

With CUDA graphs the greedy accept runs inside the captured verify graph: ``capture_tail`` records it on the
graph's static logits and candidates and on this object's static link buffers, under SGLang's own key for the graph
being captured; ``before_replay`` fills the links from the batch's verify input before every replay, and
``replayed`` hands back the outputs of the graph SGLang replayed (its ``_replay_graph_key``, padded to the largest
batch across DP ranks and keyed by LoRA / attention variant too), for that verify step only. That path has not run
on a GPU yet (docs/gpu-validation.md); eager (every CPU run) computes the same kernels after the forward.

With tensor parallelism the sampled accept is broadcast from TP rank 0 as ``eagle_sample`` broadcasts its own
(``broadcast_accept``): ranks whose target probabilities differ in the last bits would otherwise accept different
paths, commit different lengths and hang in the next collective.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import torch

from sglang_spec.errors import SpecError
from sglang_spec.kernels.kv_commit import commit_kv, commit_kv_reference
from sglang_spec.kernels.tree_metadata import parents_from_links, parents_from_links_reference
from sglang_spec.kernels.verify_accept import (
    AcceptOutputs,
    CandidateSampleMode,
    MatchMode,
    accept_walk,
    accept_walk_reference,
    node_normalizers,
    node_normalizers_reference,
    target_tokens,
    target_tokens_reference,
)
from sglang_spec.sglang_plugin.drafters.beams import kv_buffers
from sglang_spec.sglang_plugin.messages import log

ACCEPT_KERNELS_ENV = "SGLANG_SPEC_ACCEPT_KERNELS"  # triton (default) or reference (CPU only); read at worker start


@dataclass(frozen=True)
class AcceptKernels:
    """The kernels the fused accept launches: the Triton ones, or their pure-torch references (same signatures and
    semantics, compared exactly in tests/kernels). The references read values on the host, so they run on CPU
    only; the CPU bed picks them for its servers because the Triton interpreter takes 1.3 s (greedy) to 60 s
    (sampled) for one verify of 16 nodes over SmolLM2's 49k vocabulary."""

    name: str
    parents_from_links: Callable[..., torch.Tensor]
    target_tokens: Callable[..., torch.Tensor]
    node_normalizers: Callable[..., torch.Tensor]
    accept_walk: Callable[..., AcceptOutputs]
    commit_kv: Callable[..., torch.Tensor]


TRITON_KERNELS = AcceptKernels("triton", parents_from_links, target_tokens, node_normalizers, accept_walk, commit_kv)
REFERENCE_KERNELS = AcceptKernels("reference", parents_from_links_reference, target_tokens_reference,
                                  node_normalizers_reference, accept_walk_reference, commit_kv_reference)


def accept_kernels(name: str, device: torch.device | str) -> AcceptKernels:
    """The kernels ``ACCEPT_KERNELS_ENV`` names (empty: Triton) for a worker on ``device``; one line if wrong."""
    name = name.strip() or "triton"
    kernels = {k.name: k for k in (TRITON_KERNELS, REFERENCE_KERNELS)}.get(name)
    if kernels is None:
        raise SpecError(f"{ACCEPT_KERNELS_ENV}={name!r} names no fused-accept kernels; use triton or reference")
    if kernels is REFERENCE_KERNELS and torch.device(device).type != "cpu":
        raise SpecError(f"{ACCEPT_KERNELS_ENV}=reference runs on CPU only (it reads the tree on the host, which a "
                        f"CUDA graph cannot capture); unset it on {device}")
    return kernels


@dataclass(frozen=True, eq=False)
class SGLangAccept:
    """What ``eagle_sample`` returns: predict [bs * n] int32, accept_lens [bs] int32 (drafts + 1), accept_index
    [bs, steps + 1] int32 (global node ids, -1 padded)."""

    predict: torch.Tensor
    accept_lens: torch.Tensor
    accept_index: torch.Tensor


@dataclass(frozen=True, eq=False)
class AcceptBuffers:
    """One batch size's buffers (B requests x N tree nodes, depth D): static under CUDA graphs.

    Fields:
      first_child, next_sibling: [B, N] int64. The tree's links (SGLang's retrieve arrays), -1 padded.
      parents:      [B, N] int64. Derived from the links.
      num_nodes:    [B] int64. N for every request.
      target:       [B * N] int64. The target's token per node (greedy: argmax).
      output_ids:   [B, D + 1] int64; output_lens [B] int64. The walk's output buffer (scratch).
      accept:       the walk's AcceptOutputs.
      predict_with_spare: [B * N + 1] int32. SGLang's predict plus one slot that absorbs the -1 path entries.
      accept_lens, accept_index: SGLang's outputs ([B] int32, [B, D + 1] int32).
    """

    first_child: torch.Tensor
    next_sibling: torch.Tensor
    parents: torch.Tensor
    num_nodes: torch.Tensor
    target: torch.Tensor
    output_ids: torch.Tensor
    output_lens: torch.Tensor
    accept: AcceptOutputs
    predict_with_spare: torch.Tensor
    accept_lens: torch.Tensor
    accept_index: torch.Tensor

    @classmethod
    def allocate(cls, batch: int, nodes: int, depth: int, device: torch.device | str) -> AcceptBuffers:
        def ints(*shape: int, fill: int = 0, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.full(shape, fill, dtype=dtype, device=device)

        return cls(
            first_child=ints(batch, nodes, fill=-1),
            next_sibling=ints(batch, nodes, fill=-1),
            parents=ints(batch, nodes, fill=-1),
            num_nodes=ints(batch, fill=nodes),
            target=ints(batch * nodes),
            output_ids=ints(batch, depth + 1),
            output_lens=ints(batch),
            accept=AcceptOutputs.empty(batch, depth, device),
            predict_with_spare=ints(batch * nodes + 1, dtype=torch.int32),
            accept_lens=ints(batch, dtype=torch.int32),
            accept_index=ints(batch, depth + 1, fill=-1, dtype=torch.int32),
        )

    def outputs(self, batch: int) -> SGLangAccept:
        nodes = self.first_child.shape[1]
        return SGLangAccept(self.predict_with_spare[: batch * nodes], self.accept_lens[:batch],
                            self.accept_index[:batch])


def run_accept(buffers: AcceptBuffers, candidates: torch.Tensor, logits: torch.Tensor, depth: int,
               sample: CandidateSampleMode | None = None, kernels: AcceptKernels = TRITON_KERNELS) -> None:
    """Verify + accept into ``buffers`` (links already in place): candidates [B, N] int64 (node tokens, root
    first); logits [B * N, V]. Greedy unless ``sample`` is given. Device ops only with the Triton kernels:
    capturable."""
    batch, nodes = candidates.shape
    kernels.parents_from_links(buffers.first_child, buffers.next_sibling, out=buffers.parents)
    if sample is None:
        zeros = torch.zeros(batch, device=logits.device)
        kernels.target_tokens(logits, nodes, zeros, zeros.long(), zeros + 1, zeros.repeat_interleave(nodes), False,
                              out=buffers.target)
        mode: MatchMode | CandidateSampleMode = MatchMode(buffers.target)
    else:
        mode = sample
    buffers.output_lens.zero_()
    kernels.accept_walk(candidates, buffers.parents, buffers.num_nodes, depth, buffers.output_ids,
                        buffers.output_lens, mode, out=buffers.accept)
    _to_sglang(buffers, batch, nodes)


def _to_sglang(buffers: AcceptBuffers, batch: int, nodes: int) -> None:
    """The walk's outputs in eagle_sample's format. predict[global id of path node j] = the token emitted after it
    (the next accepted draft, or the bonus): exactly the walk's emitted tokens, scattered to the path's ids."""
    accepted = buffers.accept.accepted_nodes
    base = (torch.arange(batch, device=accepted.device) * nodes)[:, None]
    global_ids = torch.where(accepted >= 0, accepted + base, torch.full_like(accepted, -1))
    buffers.accept_index.copy_(global_ids.to(torch.int32))
    buffers.accept_lens.copy_(buffers.accept.accept_length.to(torch.int32))
    # padded path entries go to the spare slot: a boolean-mask scatter would read the mask on the host
    spare = torch.full_like(global_ids, batch * nodes)
    index = torch.where(accepted >= 0, global_ids, spare).reshape(-1)
    buffers.predict_with_spare.zero_()
    buffers.predict_with_spare.scatter_(0, index, buffers.output_ids.reshape(-1).to(torch.int32))


def broadcast_accept(accepted: SGLangAccept, tp_group: Any) -> None:
    """Rank 0's accept on every rank of ``tp_group`` (a GroupCoordinator), in place: predict, accept_index, then
    the accepted counts, as eagle_sample broadcasts them."""
    for tensor in (accepted.predict, accepted.accept_index, accepted.accept_lens):
        tp_group.broadcast(tensor, src=0)


def capture_graph_key(graph_runner: Any, forward_batch: Any, num_tokens: int) -> Any | None:
    """SGLang's key (``ShapeKey``) for the verify graph ``graph_runner`` is capturing, built as
    ``capture_one_shape`` builds it: its size rule, and the LoRA and attention variants its capture loop has set.
    None where a capture hook cannot tell the key: ragged verify (keyed by token tier over variable-width
    requests) and PDMux (by stream, which the loop passes only as an argument)."""
    if graph_runner.ragged_verify_mode or graph_runner.enable_pdmux:
        return None
    from sglang.srt.model_executor.runner_utils.capture_mode import (
        get_capture_attention_variant,
        get_capture_lora_variant,
    )

    size = graph_runner._capture_graph_size(bs=forward_batch.batch_size, num_tokens=num_tokens)
    return graph_runner._make_graph_key(size, None, get_capture_lora_variant(), get_capture_attention_variant())


class FusedAccept:
    """The fused accept of one target worker: eligibility, eager and in-graph runs, the KV commit, counters.

    ``tp_group``: the group eagle_sample broadcasts its accept over (None without tensor parallelism); sampled
    accepts are broadcast over it, greedy ones too when ``broadcast_greedy`` (SGLang does so on ROCm)."""

    def __init__(self, nodes: int, depth: int, device: torch.device | str, metrics: Any, tp_group: Any = None,
                 broadcast_greedy: bool = False, kernels: AcceptKernels = TRITON_KERNELS) -> None:
        self.nodes = nodes
        self.kernels = kernels
        self.depth = depth
        self.device = device
        self.metrics = metrics
        self.tp_group = tp_group
        self.broadcast_greedy = broadcast_greedy
        self.counts: Counter[str] = Counter()  # "fused" and one entry per fallback reason
        self._eager: dict[int, AcceptBuffers] = {}
        self._graph: dict[Any, AcceptBuffers] = {}  # per SGLang graph key of a captured verify graph (static)
        self._links: AcceptBuffers | None = None  # max captured batch size; the graph buffers view its links
        self._graph_read = False  # an accept was read from a replayed graph (logged once)

    # ------------------------------------------------------------------------------------------ eligibility
    def serves_width(self, tokens_per_request: int) -> bool:
        """Whether a verify of this many tokens a request is the fused accept's: the full tree (tree auto's
        smaller sizes are SGLang's, eager or replayed)."""
        return tokens_per_request == self.nodes

    def fallback_reason(self, batch: Any, verify_input: Any, grammar_mask: Any, uno_target_max_top_k: Any,
                        watermark_state: Any, spec: Any) -> str | None:
        """Why SGLang's own accept must serve this batch, or None when the fused path can."""
        info = batch.sampling_info
        checks = (
            ("penalties", info.acc_additive_penalties is not None or info.acc_scaling_penalties is not None),
            ("logit_bias", info.logit_bias is not None),
            ("grammar", grammar_mask is not None),
            ("watermark", watermark_state is not None and info.has_watermark_candidates),
            ("custom_logit_processor", bool(getattr(info, "has_custom_logit_processor", False))),
            ("uno_sparse_sampling", uno_target_max_top_k is not None),
            ("rejection_sampling", bool(spec.speculative_use_rejection_sampling)),
            ("lossy_thresholds", spec.speculative_accept_threshold_single != 1.0
             or spec.speculative_accept_threshold_acc != 1.0),
            ("top_k_top_p_min_p", not info.is_all_greedy and (info.need_top_k_sampling or info.need_top_p_sampling
                                                               or info.need_min_p_sampling)),
            ("tree_width", not self.serves_width(verify_input.draft_token_num)),
        )
        return next((reason for reason, applies in checks if applies), None)

    def count(self, outcome: str) -> None:
        self.counts[outcome] += 1
        self.metrics.record_accept(outcome)

    # ------------------------------------------------------------------------------------------ eager
    def sample(self, verify_input: Any, batch: Any, logits: torch.Tensor, coins: tuple[torch.Tensor, torch.Tensor]
               | None, replayed: SGLangAccept | None = None) -> SGLangAccept:
        """The fused accept after the forward. ``coins``: SGLang's (per-node, final) verify coins for a sampled
        batch, None for a greedy one. ``replayed``: the greedy accept this step's verify graph computed, if any."""
        if coins is None and replayed is not None:
            return replayed
        return self._eager_accept(verify_input, batch, logits, coins)

    def broadcasts(self, sampled: bool) -> bool:
        """Whether this batch's accept is rank 0's on every rank (tensor parallelism; sampled batches, greedy ones
        too on ROCm), as eagle_sample makes its own."""
        return self.tp_group is not None and (sampled or self.broadcast_greedy)

    def agree(self, accepted: SGLangAccept) -> None:
        """Rank 0's accept on every rank, in place (where ``broadcasts``). Every rank of the group must take the
        fused path for the batch (``peers.Peers``): SGLang's path broadcasts its own accept in another layout."""
        broadcast_accept(accepted, self.tp_group)

    def _eager_accept(self, verify_input: Any, batch: Any, logits: torch.Tensor,
                      coins: tuple[torch.Tensor, torch.Tensor] | None) -> SGLangAccept:
        bs = len(batch.seq_lens)
        buffers = self._eager.get(bs)
        if buffers is None:
            buffers = self._eager[bs] = AcceptBuffers.allocate(bs, self.nodes, self.depth, logits.device)
        buffers.first_child.copy_(verify_input.retrieve_next_token)
        buffers.next_sibling.copy_(verify_input.retrieve_next_sibling)
        candidates = verify_input.draft_token.view(bs, self.nodes).long()
        mode = None
        if coins is not None:
            inverse_temperature = 1.0 / batch.sampling_info.temperatures.view(-1).float()
            normalizers = self.kernels.node_normalizers(logits, self.nodes, inverse_temperature)
            mode = CandidateSampleMode(logits, inverse_temperature, normalizers, coins[0].reshape(-1).float(),
                                       coins[1].float())
        run_accept(buffers, candidates, logits, self.depth, mode, self.kernels)
        return buffers.outputs(bs)

    # ------------------------------------------------------------------------------------------ CUDA graphs
    def capture_tail(self, graph_runner: Any, logits_output: Any, forward_batch: Any, num_tokens: int) -> None:
        """``capture_tail_hooks`` entry: records the greedy accept into the verify graph being captured, on buffers
        kept under SGLang's key for that graph (its warm-up runs use the same ones)."""
        if graph_runner.model_runner.is_draft_worker or not forward_batch.forward_mode.is_target_verify():
            return
        if getattr(logits_output, "next_token_logits", None) is None:
            return
        bs = forward_batch.batch_size
        tokens_per_request, ragged = divmod(forward_batch.input_ids.shape[0], bs)
        if ragged or not self.serves_width(tokens_per_request):
            return  # another verify size's graph (tree auto)
        key = capture_graph_key(graph_runner, forward_batch, num_tokens)
        if key is None:
            return
        device = forward_batch.input_ids.device
        if self._links is None:
            self._links = AcceptBuffers.allocate(graph_runner.max_bs, self.nodes, self.depth, device)
        buffers = self._graph.get(key)
        if buffers is None:
            buffers = self._graph[key] = _with_links(AcceptBuffers.allocate(bs, self.nodes, self.depth, device),
                                                     self._links, bs)
        run_accept(buffers, forward_batch.input_ids.view(bs, self.nodes), logits_output.next_token_logits,
                   self.depth, None, self.kernels)

    def before_replay(self, forward_batch: Any) -> None:
        """Fills the static links for a verify replay. Every row past the batch gets no children (so nothing
        moves there), up to the largest graph: SGLang may pad the batch to any captured size."""
        if self._links is None:
            return
        bs = forward_batch.batch_size
        verify_input = forward_batch.spec_info
        self._links.first_child[:bs].copy_(verify_input.retrieve_next_token)
        self._links.next_sibling[:bs].copy_(verify_input.retrieve_next_sibling)
        self._links.first_child[bs:].fill_(-1)
        self._links.next_sibling[bs:].fill_(-1)

    def replayed(self, graph_runner: Any, forward_batch: Any) -> SGLangAccept | None:
        """After ``graph_runner`` replayed ``forward_batch``: the greedy accept of the graph it replayed (SGLang's
        ``_replay_graph_key``), cut to the batch; None when that graph holds no fused accept."""
        buffers = self._graph.get(graph_runner._replay_graph_key)
        if buffers is None:
            return None
        if not self._graph_read:
            self._graph_read = True
            log(f"fused accept: the greedy accept read from a replayed verify graph (first: a batch of "
                f"{forward_batch.batch_size})")
        return buffers.outputs(forward_batch.batch_size)

    # ------------------------------------------------------------------------------------------ KV commit
    @staticmethod
    def commit_kv(pool: Any, out_cache_loc: torch.Tensor, accept_index: torch.Tensor, accept_lens: torch.Tensor,
                  nodes: int) -> None:
        """Moves each request's accepted path (global ids in accept_index) to the front of its verify window
        (out_cache_loc [bs * n]), in every layer buffer of the target pool: what SGLang's
        move_accept_tokens_to_target_kvcache does, with kernels/kv_commit.py."""
        KVCommit.of(pool, out_cache_loc, accept_index, accept_lens, nodes).run()


@dataclass(eq=False)
class KVCommit:
    """One verify step's KV commit (``FusedAccept.commit_kv``), buffer by buffer, so that a commit interrupted by
    a fault is finished exactly: each launch moves one whole layer buffer (a kernel that starts runs to its end),
    ``done`` counts the buffers moved, and ``finish`` moves the rest with torch ops. No buffer is moved twice (a
    second move would read rows the first one overwrote).

    Fields:
      buffers:    the target pool's layer buffers ([slots, *row] each).
      tree_slots: [bs, n] int64, each request's verify window (node i's KV slot).
      path:       [bs, D + 1] int64 accepted local node ids, root first, -1 padded.
      lengths:    [bs] int64 accepted nodes (drafts + 1).
      num_nodes, freed: the kernel's [bs] node counts and [bs, n] freed-slot output (unread here).
      kernels:    whose ``commit_kv`` moves the buffers.
      done:       buffers moved so far.
    """

    buffers: list[torch.Tensor]
    tree_slots: torch.Tensor
    path: torch.Tensor
    lengths: torch.Tensor
    num_nodes: torch.Tensor
    freed: torch.Tensor
    kernels: AcceptKernels = TRITON_KERNELS
    done: int = 0

    @classmethod
    def of(cls, pool: Any, out_cache_loc: torch.Tensor, accept_index: torch.Tensor, accept_lens: torch.Tensor,
           nodes: int, kernels: AcceptKernels = TRITON_KERNELS) -> KVCommit:
        """Reads the step's outputs and allocates; moves nothing."""
        bs = accept_lens.shape[0]
        path = torch.where(accept_index >= 0, accept_index - (torch.arange(bs, device=accept_index.device)
                                                              * nodes)[:, None], -1).long()
        tree_slots = out_cache_loc[: bs * nodes].view(bs, nodes).long()
        buffers = kv_buffers(pool)
        num_nodes = torch.full((bs,), nodes, dtype=torch.int64, device=accept_lens.device)
        freed = torch.empty(bs, nodes, dtype=torch.int64, device=accept_lens.device)
        return cls(buffers, tree_slots, path, accept_lens.long(), num_nodes, freed, kernels)

    def run(self, between: Callable[[], None] | None = None) -> None:
        """The kernel over the buffers not yet moved; ``between`` runs after each buffer but the last (tests
        inject a fault there: a commit stopped half way)."""
        while self.done < len(self.buffers):
            self.kernels.commit_kv([self.buffers[self.done]], self.tree_slots, self.path, self.lengths,
                                   self.num_nodes, self.freed)
            self.done += 1
            if between is not None and self.done < len(self.buffers):
                between()

    def finish(self) -> None:
        """The buffers the kernel did not move, moved by torch: every accepted row gathered, then scattered to its
        window position (as the kernel's ascending in-place copies: a path's node ids are at least its positions, so
        no source is a target of an earlier position). Padded path entries copy their own slot onto itself."""
        positions = torch.arange(self.path.shape[1], device=self.path.device)[None, :]
        valid = (positions < self.lengths[:, None]) & (self.path >= 0)
        own = self.tree_slots[:, : self.path.shape[1]]
        sources = torch.where(valid, torch.gather(self.tree_slots, 1, self.path.clamp(min=0)), own).reshape(-1)
        targets = own.reshape(-1)
        while self.done < len(self.buffers):
            buffer = self.buffers[self.done]
            buffer[targets] = buffer[sources]
            self.done += 1


def _with_links(buffers: AcceptBuffers, links: AcceptBuffers, bs: int) -> AcceptBuffers:
    """``buffers`` reading its links from the shared static link buffers (rows [0, bs))."""
    return AcceptBuffers(links.first_child[:bs], links.next_sibling[:bs], buffers.parents, buffers.num_nodes,
                         buffers.target, buffers.output_ids, buffers.output_lens, buffers.accept,
                         buffers.predict_with_spare, buffers.accept_lens, buffers.accept_index)
