"""SGLang attention back-end for MLA (DeepSeek) tree verify on FlashInfer: ``--speculative-tree-mla-verify
flashinfer``.

FlashInfer's MLA kernels take no custom mask, so SGLang verifies MLA trees only on fa3 / triton (its
``flashinfer_mla`` back-end refuses topk > 1). This back-end wraps the target's own back-end (``base``:
FlashInfer's MLA back-end on a GPU, the bed's intel_amx on this CPU) and takes over its TARGET_VERIFY forward only:

* per verify batch, one plan for every layer (``kernels/mla_tree_verify.plan_tree_verify``): the prefix pages
  of each request, built on the device from ``req_to_token``, and FlashInfer's MLA plan from SGLang's host copy
  of the prefix lengths (``seq_lens_cpu``), so the plan reads nothing back from the device;
* per layer: the tree's latent rows written to the cache, then the cascade (``mla_tree_verify_attention``):
  FlashInfer's batched paged MLA decode over each prefix (n queries a request, no mask, base-2 lse), the tree
  kernel (``kernels/mla_tree_attention``) over the tree's rows with SGLang's ancestor mask read in place, merged by
  ``merge_state``;
* a ragged verify (``ragged_verify``: each request's rows and tree mask cut to its own tree): the plan's query
  offsets and mask blocks follow each request's length, FlashInfer's plan takes the ragged query offsets as they
  are and the tree kernel reads each request's rows from them;
* CUDA graphs: one graph wrapper per captured batch size, planned at capture, re-planned before each replay from
  host arrays into the same buffers (FlashInfer's FA2 / FA3 MLA plans allow re-planning a graph wrapper); the
  tree mask's n x n blocks gathered into a static buffer, since SGLang's FULL_MASK tensor is rebuilt each step.
  A ragged verify replays SGLang's ragged verify graphs (one a tier of total verify tokens, keyed by tier as
  SGLang's FlashInfer MLA back-end keys them): its request slots take the lengths the runner stages
  (``ragged_verify.staged_lengths``, host ints: the plan reads nothing back), each slot's block the top-left of its
  n x n cells.

Every other mode (prefill, decode, draft extend) is the base back-end's. FlashInfer itself is reached through a
namespace: the real package on a GPU, the CPU twin (``attention/flashinfer_mla``) on this CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.environ import envs
from sglang.srt.runtime_context import get_buffer, get_parallel

from sglang_spec.errors import SpecError
from sglang_spec.kernels.mla_tree_attention import TreeMaskLayout
from sglang_spec.sglang_plugin.mla_cascade import (
    MLAShape,
    MLATreeVerifyPlan,
    causal_tree_mask,
    flashinfer_package_namespace,
    mla_tree_verify_attention,
    plan_prefix_wrapper,
    plan_tree_verify,
)
from sglang_spec.attention import flashinfer_mla
from sglang_spec.sglang_plugin.messages import log
from sglang_spec.sglang_plugin.ragged_verify import forward_ragged, staged_lengths, tier_mask
from sglang_spec.sglang_plugin.state import options_of
from sglang_spec.tree.encode_sglang import TreeMaskMode, complete_tree_mask

# a verify carrying SGLang's ragged layout without the plugin's lengths (``ragged_verify``): DSpark's
FOREIGN_LAYOUT = ("MLA tree verify on FlashInfer takes the plugin's ragged verify, not SGLang's own ragged verify "
                  "layouts (DSpark's)")
CPU_WORKSPACE_BYTES = 4096  # the CPU twin's wrappers keep their plan on the host: a token workspace


def flashinfer_namespace(device: str) -> SimpleNamespace:
    """FlashInfer's MLA wrapper, plan metadata and merge: the package on a GPU, the CPU twin elsewhere."""
    return flashinfer_mla.namespace() if str(device) == "cpu" else flashinfer_package_namespace()


@dataclass(frozen=True, eq=False)
class VerifyState:
    """What a verify forward's layers share: the plan, the planned FlashInfer wrapper, the tree mask (flat, in
    ``plan.mask_layout``)."""

    plan: MLATreeVerifyPlan
    wrapper: object
    tree_mask: torch.Tensor


@dataclass(frozen=True, eq=False)
class VerifyBatch:
    """What a verify forward's plan reads off its batch.

    batch:       B, the requests verified.
    width:       n, SGLang's verify width (``draft_token_num``): the most tree tokens a request verifies.
    tree_lens:   per request, the tree tokens its forward computes (host ints): n each, or a ragged verify's
                 lengths (``ragged_verify.RaggedVerify``), each 1..n.
    ragged:      whether the forward is a ragged verify's (its rows and tree mask cut to ``tree_lens``).
    prefix_lens: [B] committed tokens of each request, on the device.
    prefix_host: [B] their host copy (SGLang's ``seq_lens_cpu``)."""

    batch: int
    width: int
    tree_lens: tuple[int, ...]
    ragged: bool
    prefix_lens: torch.Tensor
    prefix_host: torch.Tensor


@dataclass(frozen=True, eq=False)
class GraphBuffers:
    """Static buffers of one captured batch size (a captured graph reads these addresses on every replay):
    FlashInfer's four plan buffers, the plan's device fields, and the tree mask's n x n blocks (QLEN_ONLY)."""

    wrapper: object
    qo_indptr: torch.Tensor  # [B + 1] int32
    kv_indptr: torch.Tensor  # [B + 1] int32
    kv_lens: torch.Tensor  # [B] int32
    tree_mask: torch.Tensor  # [B * n * n] bool
    layout: TreeMaskLayout  # QLEN_ONLY over tree_mask


class MLATreeVerifyBackend(AttentionBackend):
    """The target's back-end with MLA tree verify as a FlashInfer cascade (module docstring)."""

    def __init__(self, model_runner, base: AttentionBackend) -> None:
        super().__init__()
        self.base = base
        for name, value in vars(AttentionBackend).items():  # class-level capability flags: the base's
            if not name.startswith("_") and not callable(value) and not isinstance(value, property):
                setattr(self, name, getattr(base, name, value))
        self.prefill_attention_backend_str = base.prefill_attention_backend_str
        self.decode_attention_backend_str = base.decode_attention_backend_str
        self.supports_ragged_verify_graph = True  # the plugin's ragged verify on SGLang's ragged graphs (_plan_graph)
        self.device = model_runner.device
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.kv_index_translator = getattr(base, "kv_index_translator", None)
        if getattr(model_runner.kv_index_translator, "needs_read_translate", False):
            raise SpecError("--speculative-tree-mla-verify reads the KV pool by slot, but this pool translates slot "
                            "ids (a unified / DCP pool); drop the option")
        self.page_size = model_runner.page_size
        self.max_context_len = model_runner.model_config.context_len
        config = model_runner.model_config
        kv_dtype = getattr(self.token_to_kv_pool, "dtype", model_runner.dtype)  # the cache's dtype, fp8 included
        if kv_dtype != model_runner.dtype:
            raise SpecError(f"--speculative-tree-mla-verify reads the tree's latent rows as {model_runner.dtype}, but "
                            f"the KV cache holds {kv_dtype} (a quantized cache); drop the option or --kv-cache-dtype")
        self.shape = MLAShape(num_heads=config.num_attention_heads // get_parallel().attn_tp_size,
                              latent=config.kv_lora_rank, rope=config.qk_rope_head_dim, scale=config.scaling,
                              q_dtype=model_runner.dtype, kv_dtype=kv_dtype)
        from sglang.srt.speculative import eagle_utils

        self.mask_mode = TreeMaskMode(int(eagle_utils.default_tree_mask_mode()))
        self.flashinfer = flashinfer_namespace(self.device)
        # on a GPU, SGLang's FlashInfer MLA workspace: its wrappers share it (one is planned and run at a time, and
        # a verify forward plans only ours), so the cascade costs no second 128 MiB
        self.workspace = (torch.empty(CPU_WORKSPACE_BYTES, dtype=torch.uint8) if str(self.device) == "cpu" else
                          get_buffer("flashinfer_mla_workspace", lambda: torch.empty(
                              envs.SGLANG_FLASHINFER_WORKSPACE_SIZE.get(), dtype=torch.uint8, device=self.device)))
        self.wrapper = self.flashinfer.BatchMLAPagedAttentionWrapper(self.workspace)
        self.graph_buffers: dict[int | tuple[str, int], GraphBuffers] = {}  # by batch size; ragged: by tier
        self.graph_kv_indices: torch.Tensor | None = None
        self.verify_state: VerifyState | None = None
        self.verify_forwards = 0  # target-verify forwards served (logged once, counted for the tests)
        log(f"MLA tree verify on FlashInfer ({'CPU twin' if str(self.device) == 'cpu' else 'flashinfer'}): "
            f"{self.shape.num_heads} heads, latent {self.shape.latent} + rope {self.shape.rope}, page size "
            f"{self.page_size}, {self.mask_mode.name} tree masks; prefill and decode stay on "
            f"{type(base).__name__}")

    # ------------------------------------------------------------------------------------------ the base's parts
    def __getattr__(self, name: str):
        # only reached for names this object lacks: the base's own attributes and methods (verify_mask buffers,
        # chunked-prefix runners, draft helpers) stay reachable through the wrapper
        base = self.__dict__.get("base")
        if base is None:
            raise AttributeError(name)
        return getattr(base, name)

    @property
    def forward_metadata(self):
        return self.base.forward_metadata

    @forward_metadata.setter
    def forward_metadata(self, value) -> None:
        if "base" in self.__dict__:
            self.base.forward_metadata = value

    @property
    def verify_mask(self):
        return self.base.verify_mask

    def shared_read_ends(self, fm):
        return self.base.shared_read_ends(fm)

    def get_cuda_graph_seq_len_fill_value(self):
        return self.base.get_cuda_graph_seq_len_fill_value()

    def on_after_cuda_graph_warmup(self):
        return self.base.on_after_cuda_graph_warmup()

    def support_triton(self):
        return self.base.support_triton()

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self.base.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if forward_batch.forward_mode.is_target_verify():
            return self._forward_verify(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        return self.base.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if forward_batch.forward_mode.is_target_verify():
            return self._forward_verify(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        return self.base.forward(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)

    # ------------------------------------------------------------------------------------------ metadata
    def init_forward_metadata(self, forward_batch) -> None:
        if forward_batch.forward_mode.is_target_verify():
            self.verify_state = self._plan_eager(forward_batch)
        else:
            self.base.init_forward_metadata(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        if forward_batch.forward_mode.is_target_verify():
            self.verify_state = self._plan_graph(forward_batch, in_capture)
        else:
            self.base.init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        if not forward_batch.forward_mode.is_target_verify():
            self.base.init_forward_metadata_in_graph(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.base.init_cuda_graph_state(max_bs, max_num_tokens)
        self.graph_max_pages = -(-self.max_context_len // self.page_size)
        self.graph_kv_indices = torch.zeros(max_bs * self.graph_max_pages, dtype=torch.int32, device=self.device)

    def _verify_inputs(self, forward_batch) -> VerifyBatch:
        spec_info = forward_batch.spec_info
        if spec_info is None:
            raise RuntimeError("a TARGET_VERIFY batch without spec_info: nothing says how many tokens it verifies")
        ragged = forward_ragged(forward_batch)
        batch = forward_batch.batch_size
        prefix_lens = forward_batch.seq_lens[:batch]
        host = forward_batch.seq_lens_cpu
        # SGLang keeps a host copy of the prefix lengths for exactly this; without one the plan reads them back
        prefix_host = host[:batch] if host is not None else prefix_lens.cpu()
        width = int(spec_info.draft_token_num)
        tree_lens = (width,) * batch if ragged is None else ragged.lengths
        return VerifyBatch(batch, width, tree_lens, ragged is not None, prefix_lens, prefix_host)

    def _tree_mask(self, forward_batch, verify: VerifyBatch) -> tuple[torch.Tensor, TreeMaskMode]:
        """SGLang's tree mask (a ragged forward's: cut to each request's tree) and its layout; a chain (topk 1) or
        a mask-less verify gets the causal chain mask."""
        spec_info = forward_batch.spec_info
        custom_mask = getattr(spec_info, "custom_mask", None)
        if getattr(spec_info, "tree_topk", None) != 1 and custom_mask is not None and custom_mask.numel() > 0:
            return custom_mask, self.mask_mode
        return causal_tree_mask(verify.tree_lens, forward_batch.seq_lens.device), TreeMaskMode.QLEN_ONLY

    def _plan_eager(self, forward_batch) -> VerifyState:
        verify = self._verify_inputs(forward_batch)
        if getattr(forward_batch.spec_info, "ragged_verify_layout", None) is not None and not verify.ragged:
            raise NotImplementedError(FOREIGN_LAYOUT)
        tree_mask, mode = self._tree_mask(forward_batch, verify)
        # a batch DP attention padded after the mask was built: the padding rows' cells, not reads past the mask
        tree_mask = complete_tree_mask(tree_mask, mode, verify.prefix_host.tolist(), verify.tree_lens)
        plan = plan_tree_verify(self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices[:verify.batch],
                                verify.prefix_lens, verify.prefix_host, verify.width, self.page_size, mode,
                                tree_lens=verify.tree_lens)
        plan_prefix_wrapper(self.flashinfer, self.wrapper, plan, self.shape)
        return VerifyState(plan, self.wrapper, tree_mask)

    def _plan_graph(self, forward_batch, in_capture: bool) -> VerifyState:
        """Capture: a graph wrapper and static buffers for this batch size (a ragged verify graph: for its tier).
        Replay: the same buffers re-planned (device copies and FlashInfer's host-array plan; nothing read back from
        the device)."""
        verify = self._verify_inputs(forward_batch)
        layout = getattr(forward_batch.spec_info, "ragged_verify_layout", None)
        if verify.ragged and layout is None:
            raise NotImplementedError("a ragged verify under a captured graph without SGLang's ragged verify layout")
        if layout is not None and not verify.ragged and not in_capture:
            raise NotImplementedError(FOREIGN_LAYOUT)
        batch, tree_tokens = verify.batch, verify.width
        if self.graph_kv_indices is None:
            raise RuntimeError("init_cuda_graph_state was not called before a graph verify")
        key = batch if layout is None else ("ragged", layout.graph_num_tokens)
        if in_capture or key not in self.graph_buffers:
            self.graph_buffers[key] = self._new_graph_buffers(batch, tree_tokens)
        buffers = self.graph_buffers[key]
        tree_mask, mode = self._tree_mask(forward_batch, verify)
        tree_lens = None
        if layout is not None:  # the slots' staged lengths; the mask completed to them (``ragged_verify``)
            tree_lens = staged_lengths(layout, batch, tree_tokens)
            tree_mask = tier_mask(tree_mask if verify.ragged else None, mode, verify.prefix_host.tolist(),
                                  verify.tree_lens if verify.ragged else None, tree_lens, tree_mask.device)
        plan = plan_tree_verify(self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices[:batch],
                                verify.prefix_lens, verify.prefix_host, tree_tokens, self.page_size, mode,
                                kv_indices_out=self.graph_kv_indices, max_pages=self.graph_max_pages,
                                tree_lens=tree_lens)
        # the tree's n x n blocks into the static QLEN_ONLY buffer (SGLang's FULL_MASK tensor changes each step);
        # a replay padded past the live requests has no mask for the padding: its cells read the last one (their
        # rows are never used), not past the tensor
        cells = torch.arange(tree_tokens, device=tree_mask.device)
        layout = plan.mask_layout
        index = (layout.start[:, None, None] + cells[None, :, None] * layout.row_stride[:, None, None]
                 + layout.column[:, None, None] + cells[None, None, :])
        flat_mask = tree_mask.reshape(-1)
        buffers.tree_mask.copy_(flat_mask[index.reshape(-1).clamp(max=flat_mask.numel() - 1)].bool())
        buffers.qo_indptr.copy_(plan.qo_indptr)
        buffers.kv_indptr.copy_(plan.kv_indptr)
        buffers.kv_lens.copy_(plan.kv_lens)
        plan = MLATreeVerifyPlan(buffers.qo_indptr, buffers.kv_indptr, plan.kv_indices, buffers.kv_lens,
                                 buffers.layout, plan.qo_indptr_host, plan.kv_indptr_host, plan.kv_lens_host,
                                 tree_tokens, self.page_size)
        plan_prefix_wrapper(self.flashinfer, buffers.wrapper, plan, self.shape)
        return VerifyState(plan, buffers.wrapper, buffers.tree_mask)

    def _new_graph_buffers(self, batch: int, tree_tokens: int) -> GraphBuffers:
        def ints(size: int) -> torch.Tensor:
            return torch.zeros(size, dtype=torch.int32, device=self.device)

        qo_indptr, kv_indptr, kv_lens = ints(batch + 1), ints(batch + 1), ints(batch)
        wrapper = self.flashinfer.BatchMLAPagedAttentionWrapper(
            self.workspace, use_cuda_graph=True, qo_indptr=qo_indptr, kv_indptr=kv_indptr,
            kv_indices=self.graph_kv_indices, kv_len_arr=kv_lens)
        tree_lens = torch.full((batch,), tree_tokens, dtype=torch.int64, device=self.device)
        layout = TreeMaskLayout(start=torch.arange(batch, device=self.device) * tree_tokens * tree_tokens,
                                row_stride=tree_lens, column=torch.zeros_like(tree_lens))
        tree_mask = torch.zeros(batch * tree_tokens * tree_tokens, dtype=torch.bool, device=self.device)
        return GraphBuffers(wrapper, qo_indptr, kv_indptr, kv_lens, tree_mask, layout)

    # ------------------------------------------------------------------------------------------ the verify forward
    def _forward_verify(self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None, k_rope=None,
                        **kwargs):
        """q: absorbed queries, [T, H * L] with ``q_rope`` [T, H * R] (FlashInfer's form) or [T, H * (L + R)]
        (concatenated, the intel_amx form); k: the new latent rows, [T, 1, L] with ``k_rope``, or [T, 1, L + R].
        Returns [T, H * L]."""
        if kwargs:
            raise NotImplementedError(f"MLA tree verify on FlashInfer takes no {sorted(kwargs)} (sinks, topk "
                                      f"indices: DSA / sink models are not served)")
        state = self.verify_state
        if state is None:
            raise RuntimeError("a tree verify forward before its metadata was planned")
        if save_kv_cache and k is not None:
            location = KVWriteLoc.for_batch(forward_batch)
            if k_rope is not None:
                self.token_to_kv_pool.set_mla_kv_buffer(layer, location, k, k_rope)
            else:
                self.token_to_kv_pool.set_kv_buffer(layer, location, k, v)
        heads, latent = layer.tp_q_head_num, layer.v_head_dim
        if q_rope is not None:
            q_latent = q.view(-1, heads, latent)
            q_rope = q_rope.view(-1, heads, layer.head_dim - latent)
        else:
            packed = q.view(-1, heads, layer.head_dim)
            q_latent, q_rope = packed[..., :latent], packed[..., latent:]
        kv_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        out = mla_tree_verify_attention(self.flashinfer, state.wrapper, state.plan, q_latent, q_rope, kv_buffer,
                                        forward_batch.out_cache_loc, state.tree_mask, layer.scaling)
        if layer.layer_id == 0:
            self.verify_forwards += 1
            if self.verify_forwards == 1:
                log(f"MLA tree verify on FlashInfer: first verify forward ({state.plan.batch_size} requests x "
                    f"{state.plan.tree_tokens} tree tokens)")
        return out.reshape(-1, heads * latent)


def build_backend_after(result, *args, **kwargs):
    """After SGLang's ``_build_resolved_backend``: the target's back-end wrapped when the server runs
    ``--speculative-tree-mla-verify flashinfer`` (draft runners and non-MLA models keep theirs)."""
    model_runner = kwargs.get("model_runner", args[0] if args else None)
    options = options_of(getattr(model_runner, "server_args", None))
    if options is None or options.mla_verify is None or model_runner.is_draft_worker:
        return result
    if not model_runner.use_mla_backend:
        raise SpecError("--speculative-tree-mla-verify serves MLA models only")
    return MLATreeVerifyBackend(model_runner, result)
