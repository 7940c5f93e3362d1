"""One speculative step on static buffers: tree metadata -> target forward -> verify + accept -> KV commit.

Every shape is fixed at construction (batch bucket, node budget, vocabulary, context length), every output lives
in a preallocated buffer, and nothing on the step path reads a tensor on the host (no ``.item()``, ``.cpu()``,
``.tolist()``) or allocates, so ``SpecStep.run`` can be captured in a CUDA graph and replayed: the caller copies new
inputs into ``SpecStep.inputs`` and replays. Padded requests (``num_nodes == 0``) are no-ops throughout.

The target forward is the caller's: a function ``(buffers, inputs) -> None`` that reads the tree metadata
(input ids, positions, tree mask / FlashInfer mask and indptrs), writes the logits of every tree node into
``buffers.logits`` and the tree nodes' KV into the caller's KV buffers at ``inputs.tree_slots``.

``backend="reference"`` runs the same chain with the pure-torch references (one dispatch table), which is what
the kernel path is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Sequence

import torch

from sglang_spec.tree.batch import FlashInferIndptrs
from sglang_spec.verify.relaxed import RelaxedAcceptance

# relative: this folder installs as sglang_spec.kernels, and is type-checked from the checkout as `kernels`
from sglang_spec.kernels import kv_commit, tree_metadata, verify_accept
from sglang_spec.kernels.tree_metadata import TreeMetadata
from sglang_spec.kernels.verify_accept import AcceptMode, AcceptOutputs, MatchMode, RelaxedMode


@dataclass(frozen=True)
class StepOps:
    """One back-end of the step: each op's launcher, or its pure-torch reference (same signatures)."""

    build_tree_metadata: Callable[..., TreeMetadata]
    flashinfer_indptrs: Callable[..., FlashInferIndptrs]
    pack_flashinfer_mask: Callable[..., torch.Tensor]
    target_tokens: Callable[..., torch.Tensor]
    top_n_probs: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    accept_walk: Callable[..., AcceptOutputs]
    commit_kv: Callable[..., torch.Tensor]


_MODULE_OF = {
    "build_tree_metadata": tree_metadata,
    "flashinfer_indptrs": tree_metadata,
    "pack_flashinfer_mask": tree_metadata,
    "target_tokens": verify_accept,
    "top_n_probs": verify_accept,
    "accept_walk": verify_accept,
    "commit_kv": kv_commit,
}


def _backend(suffix: str) -> StepOps:
    """Every op's launcher (suffix ""), or the reference named ``<op>_reference`` beside it."""
    return StepOps(**{op: getattr(module, op + suffix) for op, module in _MODULE_OF.items()})


BACKENDS = {"kernel": _backend(""), "reference": _backend("_reference")}


@dataclass(frozen=True)
class StepConfig:
    """Static shape of one step (one CUDA-graph bucket).

    batch_size: requests per step (padded requests included); max_nodes: N = budget + 1 tree slots per request;
    topk: candidates drafted per node; max_depth: deepest tree; max_context_len: longest prefix (sizes the packed
    FlashInfer mask); mode: greedy | sample | relaxed (relaxed needs ``relaxed``; it is LOSSY);
    output_capacity: tokens each request's output buffer holds.
    """

    batch_size: int
    max_nodes: int
    topk: int
    max_depth: int
    vocab_size: int
    max_context_len: int
    mode: str = "greedy"
    relaxed: RelaxedAcceptance | None = None
    output_capacity: int = 256
    page_size: int = 1
    block_v: int = 1024

    def __post_init__(self) -> None:
        if self.mode not in verify_accept.MODES:
            raise ValueError(f"mode must be one of {verify_accept.MODES}, got {self.mode!r}")
        if (self.mode == "relaxed") != (self.relaxed is not None):
            raise ValueError("relaxed mode needs a RelaxedAcceptance, and a RelaxedAcceptance needs mode='relaxed'")
        if min(self.batch_size, self.max_nodes, self.topk, self.max_depth, self.vocab_size) < 1:
            raise ValueError("batch_size, max_nodes, topk, max_depth and vocab_size must be >= 1")

    @property
    def packed_mask_bytes(self) -> int:
        nodes = self.max_nodes
        return self.batch_size * ((nodes * (self.max_context_len + nodes) + 7) // 8)


@dataclass(frozen=True, eq=False)
class StepInputs:
    """Static input buffers; fill them in place before each ``run`` (or graph replay).

    Fields (B = batch_size, N = max_nodes, K = topk):
      parents, ranks:   [B, N] int64 topology (parents -1 for root and padding; ranks index the parent's candidates).
      topk_tokens:      [B, N, K] int64 candidates drafted at each node; topk_probs [B, N, K] float32.
      root_tokens, prefix_lens, num_nodes: [B] int64 (num_nodes 0 = padded request).
      tree_slots:       [B, N] int64 KV slot of tree position i (prefix + i).
      temperature, top_p: [B] float32; top_k: [B] int64 (sample mode).
      coins:            [B * N] float32 uniform draws, one per node (sample mode).
      thinking:         [B] int8 thinking state at the root (relaxed mode).
      output_ids:       [B, output_capacity] int64 output buffer, appended to; output_lens [B] int64.
    """

    parents: torch.Tensor
    ranks: torch.Tensor
    topk_tokens: torch.Tensor
    topk_probs: torch.Tensor
    root_tokens: torch.Tensor
    prefix_lens: torch.Tensor
    num_nodes: torch.Tensor
    tree_slots: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    coins: torch.Tensor
    thinking: torch.Tensor
    output_ids: torch.Tensor
    output_lens: torch.Tensor

    @classmethod
    def allocate(cls, config: StepConfig, device: torch.device | str) -> StepInputs:
        batch, nodes, k = config.batch_size, config.max_nodes, config.topk

        def ints(*shape: int, fill: int = 0) -> torch.Tensor:
            return torch.full(shape, fill, dtype=torch.int64, device=device)

        return cls(
            parents=ints(batch, nodes, fill=-1),
            ranks=ints(batch, nodes),
            topk_tokens=ints(batch, nodes, k),
            topk_probs=torch.zeros(batch, nodes, k, device=device),
            root_tokens=ints(batch),
            prefix_lens=ints(batch),
            num_nodes=ints(batch),
            tree_slots=ints(batch, nodes),
            temperature=torch.zeros(batch, device=device),
            top_k=ints(batch),
            top_p=torch.ones(batch, device=device),
            coins=torch.zeros(batch * nodes, device=device),
            thinking=torch.zeros(batch, dtype=torch.int8, device=device),
            output_ids=ints(batch, config.output_capacity, fill=-1),
            output_lens=ints(batch),
        )

    def copy_(self, other: StepInputs) -> StepInputs:
        """Copies ``other`` into these buffers (what a caller does before a graph replay)."""
        for field in fields(self):
            getattr(self, field.name).copy_(getattr(other, field.name))
        return self


@dataclass(frozen=True, eq=False)
class StepBuffers:
    """Everything one step writes. ``logits`` [B * N, V] float32 is written by the target forward.

    ``packed_mask`` [config.packed_mask_bytes] uint8 is sized for the longest context; a step writes its first
    ``indptrs.packed_mask_indptr[-1]`` bytes, and the bytes past them keep an earlier step's (FlashInfer reads a
    request's block through the indptr only, so a memset of the tail on every step would buy nothing).
    """

    metadata: TreeMetadata
    indptrs: FlashInferIndptrs
    packed_mask: torch.Tensor
    logits: torch.Tensor
    target: torch.Tensor
    top_tokens: torch.Tensor
    top_probs: torch.Tensor
    accept: AcceptOutputs
    freed_slots: torch.Tensor

    @classmethod
    def allocate(cls, config: StepConfig, device: torch.device | str) -> StepBuffers:
        batch, nodes = config.batch_size, config.max_nodes
        top_n = config.relaxed.top_n if config.relaxed else 1
        return cls(
            metadata=TreeMetadata.empty(batch, nodes, device),
            indptrs=FlashInferIndptrs.empty(batch, device),
            packed_mask=torch.zeros(config.packed_mask_bytes, dtype=torch.uint8, device=device),
            logits=torch.zeros(batch * nodes, config.vocab_size, device=device),
            target=torch.zeros(batch * nodes, dtype=torch.int64, device=device),
            top_tokens=torch.zeros(batch * nodes, top_n, dtype=torch.int64, device=device),
            top_probs=torch.zeros(batch * nodes, top_n, device=device),
            accept=AcceptOutputs.empty(batch, config.max_depth, device),
            freed_slots=torch.full((batch, nodes), -1, dtype=torch.int64, device=device),
        )


TargetForward = Callable[[StepBuffers, StepInputs], None]


class SpecStep:
    """Preallocated inputs and buffers plus ``run``, the capturable step."""

    def __init__(
        self,
        config: StepConfig,
        target_forward: TargetForward,
        kv_buffers: Sequence[torch.Tensor] = (),
        stacked_kv: bool = False,
        device: torch.device | str = "cpu",
        backend: str = "kernel",
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
        self.config = config
        self.target_forward = target_forward
        self.kv_buffers = list(kv_buffers)
        self.stacked_kv = stacked_kv
        self.ops = BACKENDS[backend]
        self.inputs = StepInputs.allocate(config, device)
        self.buffers = StepBuffers.allocate(config, device)
        # the accept walk's mode over the static buffers, built once (a graph replays the same pointers)
        self.accept_mode: AcceptMode = (
            RelaxedMode(self.buffers.top_tokens, self.buffers.top_probs, self.inputs.thinking, config.relaxed)
            if config.relaxed is not None
            else MatchMode(self.buffers.target)
        )

    def run(self) -> StepBuffers:
        config, inputs, buffers, ops = self.config, self.inputs, self.buffers, self.ops
        ops.build_tree_metadata(
            inputs.parents,
            inputs.ranks,
            inputs.topk_tokens,
            inputs.topk_probs,
            inputs.root_tokens,
            inputs.prefix_lens,
            inputs.num_nodes,
            max_depth=config.max_depth,
            out=buffers.metadata,
        )
        ops.flashinfer_indptrs(inputs.prefix_lens, config.max_nodes, config.page_size, out=buffers.indptrs)
        ops.pack_flashinfer_mask(
            buffers.metadata.tree_mask, inputs.prefix_lens, buffers.indptrs.packed_mask_indptr, buffers.packed_mask
        )
        self.target_forward(buffers, inputs)
        if config.relaxed is not None:
            top = (buffers.top_tokens, buffers.top_probs)
            ops.top_n_probs(buffers.logits, config.relaxed.top_n, out=top, block_v=config.block_v)
        else:
            ops.target_tokens(
                buffers.logits,
                config.max_nodes,
                inputs.temperature,
                inputs.top_k,
                inputs.top_p,
                inputs.coins,
                config.mode == "sample",
                out=buffers.target,
                block_v=config.block_v,
            )
        metadata = buffers.metadata
        ops.accept_walk(
            metadata.tokens,
            metadata.parents,
            inputs.num_nodes,
            config.max_depth,
            inputs.output_ids,
            inputs.output_lens,
            self.accept_mode,
            out=buffers.accept,
        )
        ops.commit_kv(
            self.kv_buffers,
            inputs.tree_slots,
            buffers.accept.accepted_nodes,
            buffers.accept.accept_length,
            inputs.num_nodes,
            buffers.freed_slots,
            stacked=self.stacked_kv,
        )
        return buffers
