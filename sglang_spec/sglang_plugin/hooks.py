"""The functions the plugin hooks into SGLang 0.5.23 (registered by ``sglang_spec.sglang_plugin.register``).

| target | type | what it does |
|---|---|---|
| ``ServerArgs.add_cli_args`` / ``from_cli_args`` | AFTER | the ``--speculative-tree-*`` options; tree shape -> draft shape |
| ``Engine.server_args_class`` (``EngineServerArgs``) | attribute | the same options as ``sgl.Engine`` keywords |
| resolution ``handle_speculative_decoding`` | wrap | checks against the resolved speculative settings |
| resolution ``handle_model_capability_adjustments`` | wrap | the resolved attention backends can run trees |
| ``_ModelRegistry.resolve_model_cls`` / ``is_arch_supported`` | BEFORE | our draft model classes (``models/``) |
| ``EagleDraftWorker.__init__`` | AFTER | the draft loop's static device state, once per worker; metrics |
| ``EagleDraftWorker.alloc_memory_pool`` | AFTER | the draft KV pool can give every branch its own ancestry |
| ``EagleDraftWorker.draft`` | AROUND | lookup / hybrid: the batch's requests for the context; the draft runs eagerly; sequoia / specexec: requests drafted from a non-finite head output counted (``head_guard``) |
| ``EagleDraftWorker.draft_forward`` | AROUND | sequoia / specexec: the plugin's own loop (``draft_forward``); lookup / hybrid: host-built trees (``context_draft``); eagle: SGLang's; a draft that raises: a filler tree for that batch (counted, one log line) |
| ``EagleDraftWorker._draft_extend_for_prefill`` / ``_for_decode`` | AROUND | lookup (its trees never ask the head) and tree auto's cold steps and cold prefills: skipped, the stub of the next draft input SGLang's 0-step path uses in their place |
| ``spec_utils.select_top_k_tokens`` | AROUND | eagle in SGLang's loop: exact ancestry by KV column copy |
| ``LogitsMetadata.from_forward_batch`` | AFTER | sequoia / specexec: the draft head's logits for the beams that can grow only |
| ``EAGLEWorkerV2.forward_batch_generation`` | AROUND | ``--speculative-tree-auto``: start-up costs (``step_costs``) before the first decode step; then a tree step, a plain step (SGLang's own 0-step path) or a cold one (the target's DECODE forward, SGLang's draft-extend stub), timed |
| ``EAGLEWorkerV2.__init__`` / ``.verify`` | AFTER / AROUND | ``--speculative-tree-accept fused``: the worker's FusedAccept; with the overlap scheduler, its ``CommittedOutputs`` (``committed``); the verify step's state on every tree server |
| ``eagle_utils.eagle_sample`` | AROUND | every tree server: penalties per node, as plain decoding applies them (``penalties``; output ids completed where they lag); fused: our verify + accept kernels, or SGLang's path (counted; also after a fault in ours); per-rank counts; with the overlap scheduler, the tokens each request committed |
| ``spec_utils.move_accept_tokens_to_target_kvcache`` | AROUND | fused: the accepted path's KV moved by our kernel, layer buffer by buffer (a fault: the rest by torch) |
| ``DecodeCudaGraphRunner.execute`` | AROUND | fused under CUDA graphs: static tree links in, greedy accept out |
| ``Req.update_spec_correct_drafts_histogram`` | AFTER | per-position acceptance metrics |
| ``TokenizerManager.__init__`` | AFTER | the context a tree server reserves: none where the model's positions hold the tree past it |
| ``KVCacheConfigurator._build_req_to_token_pool``, ``allocation_sizing.get_req_to_token_extra_context_len`` | AROUND | a tree server's req_to_token rows hold a decode step's draft slots past the context |

Every hot-path hook reads its settings from the worker it runs for (set at construction), never from globals.
Start-up failures end the launch with one ``error:`` line.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from sglang_spec.errors import SpecError
from sglang_spec.sglang_plugin.batch_switch import COLD, PLAIN, TREE, BatchSwitches
from sglang_spec.sglang_plugin.committed import CommittedOutputs
from sglang_spec.sglang_plugin.context_draft import (ContextDrafter, context_draft_forward, device_hybrid_draft_forward,
                                                     device_lookup_draft_forward, pad_to_budget)
from sglang_spec.sglang_plugin.draft_forward import LOGIT_ROWS, draft_forward
from sglang_spec.sglang_plugin.draft_loop import DraftLoop, ancestry_permutation
from sglang_spec.sglang_plugin.faults import ACCEPT, AUTO, COMMIT, COUNTS, OBSERVE, RECORD
from sglang_spec.sglang_plugin.faults import AcceptFaults, InjectedFault
from sglang_spec.sglang_plugin.fused_accept import (ACCEPT_KERNELS_ENV, TRITON_KERNELS, FusedAccept, KVCommit,
                                                    SGLangAccept, accept_kernels)
from sglang_spec.sglang_plugin.head_guard import ERROR as HEAD_FAULT
from sglang_spec.sglang_plugin.head_guard import HeadGuard, HeadPoison
from sglang_spec.sglang_plugin.level_costs import LevelCosts
from sglang_spec.sglang_plugin.metrics import METRICS, RANKS, SOURCES
from sglang_spec.sglang_plugin.options import (
    ATTRIBUTE,
    BACKEND_FIELDS,
    KEYWORDS,
    TreeServerOptions,
    add_arguments,
    apply_to_server_args,
    from_namespace,
    from_values,
    validate_backends,
    validate_model,
    validate_requested,
    validate_speculative,
)
from sglang_spec.sglang_plugin.penalties import RequestPenalties, tree_penalties
from sglang_spec.sglang_plugin.step_costs import measure_step_costs
from sglang_spec.tree.encode_sglang import SGLangDraftEncoding, encode_sglang_draft
from sglang_spec.tree.token_tree import TokenTree

# our draft model classes, by the architecture name a draft folder's config.json gives (imported on first use)
MODEL_CLASSES = {"LlamaForCausalLMNextN": "sglang_spec.sglang_plugin.models.llama_nextn"}

# (target, function here, HookType) for SGLang's HookRegistry; (resolution step, wrapper here)
_WORKER = "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker"
_REGISTRY = "sglang.srt.models.registry._ModelRegistry"
HOOKS = (
    ("sglang.srt.server_args.ServerArgs.add_cli_args", "add_cli_args_after", "AFTER"),
    ("sglang.srt.server_args.ServerArgs.from_cli_args", "from_cli_args_after", "AFTER"),
    (f"{_REGISTRY}.resolve_model_cls", "registry_lookup_before", "BEFORE"),
    (f"{_REGISTRY}.is_arch_supported", "registry_lookup_before", "BEFORE"),
    (f"{_WORKER}.__init__", "draft_worker_init_after", "AFTER"),
    (f"{_WORKER}.alloc_memory_pool", "alloc_memory_pool_after", "AFTER"),
    (f"{_WORKER}.draft", "draft_around", "AROUND"),
    (f"{_WORKER}.draft_forward", "draft_forward_around", "AROUND"),
    (f"{_WORKER}._draft_extend_for_prefill", "draft_extend_for_prefill_around", "AROUND"),
    (f"{_WORKER}._draft_extend_for_decode", "draft_extend_for_decode_around", "AROUND"),
    ("sglang.srt.speculative.spec_utils.select_top_k_tokens", "select_top_k_tokens_around", "AROUND"),
    ("sglang.srt.layers.logits_processor.LogitsMetadata.from_forward_batch", "logits_metadata_after", "AFTER"),
    ("sglang.srt.managers.schedule_batch.Req.update_spec_correct_drafts_histogram", "correct_drafts_after", "AFTER"),
    ("sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.__init__", "eagle_worker_init_after", "AFTER"),
    ("sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.forward_batch_generation", "forward_batch_generation_around",
     "AROUND"),
    ("sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.verify", "verify_around", "AROUND"),
    ("sglang.srt.managers.scheduler.Scheduler.run_batch", "scheduler_run_batch_before", "BEFORE"),
    ("sglang.srt.speculative.eagle_utils.eagle_sample", "eagle_sample_around", "AROUND"),
    ("sglang.srt.speculative.spec_utils.move_accept_tokens_to_target_kvcache", "move_accept_tokens_around", "AROUND"),
    ("sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.execute",
     "graph_execute_around", "AROUND"),
    ("sglang.srt.managers.tokenizer_manager.TokenizerManager.__init__", "tokenizer_manager_init_after", "AFTER"),
    ("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_req_to_token_pool",
     "build_req_to_token_pool_around", "AROUND"),
    ("sglang.srt.mem_cache.allocation_sizing.get_req_to_token_extra_context_len", "req_to_token_headroom_around",
     "AROUND"),
)
RESOLUTION_HOOKS = (
    ("handle_speculative_decoding", "handle_speculative_decoding_wrapper"),
    ("handle_model_capability_adjustments", "capability_adjustments_wrapper"),
)


class StartupError(SystemExit):
    """Ends a launch with one ``error: ...`` line (SystemExit: launch_server prints it without a traceback)."""

    def __init__(self, error: SpecError | str) -> None:
        super().__init__(f"error: {error}")


# ---------------------------------------------------------------------------------------------- options
def add_cli_args_after(result, parser):
    add_arguments(parser)
    return result


def from_cli_args_after(result, cls, args):
    try:
        options = from_namespace(args)
        if options is not None:
            apply_to_server_args(options, result)
    except SpecError as error:
        raise StartupError(error) from None
    return result


class EngineServerArgs:
    """``sgl.Engine(..., speculative_tree_policy=...)``: the Engine builds its ServerArgs through
    ``Engine.server_args_class(**kwargs)``, and SGLang's ServerArgs has no tree fields. ``register`` points that
    attribute here: the tree keywords are taken out, SGLang's ServerArgs is built from the rest, and the options
    are applied to it exactly as on the command line. (A plain attribute assignment, not a HookRegistry class
    REPLACE: that would rebind ServerArgs in every module that imported it.)"""

    def __new__(cls, **kwargs):
        from sglang.srt.server_args import ServerArgs

        given = {name: kwargs.pop(name) for name in KEYWORDS if name in kwargs}
        try:
            options = from_values(given)
        except SpecError as error:
            raise StartupError(error) from None
        server_args = ServerArgs(**kwargs)
        if options is not None:
            _apply(options, server_args)
        return server_args


def _apply(options: TreeServerOptions, server_args) -> None:
    try:
        apply_to_server_args(options, server_args)
    except SpecError as error:
        raise StartupError(error) from None


# ---------------------------------------------------------------------------------------------- start-up checks
def handle_speculative_decoding_wrapper(server_args, previous) -> None:
    options = getattr(server_args, ATTRIBUTE, None)
    if options is not None:
        try:
            validate_requested(options, server_args)
        except SpecError as error:
            raise StartupError(error) from None
    previous(server_args)
    if options is None:
        return
    from sglang.srt.arg_groups.overrides import resolving_view

    missing = unapplied_hooks()
    if missing:
        raise StartupError(f"sglang_spec could not hook {', '.join(missing)} in this sglang; tree speculation "
                           f"needs every hook (see the log above), so the launch stops")
    try:
        validate_speculative(options, resolving_view(server_args))
    except SpecError as error:
        raise StartupError(error) from None


def capability_adjustments_wrapper(server_args, previous) -> None:
    previous(server_args)
    options = getattr(server_args, ATTRIBUTE, None)
    if options is None:
        return
    from sglang.srt.arg_groups.overrides import resolving_view

    config = resolving_view(server_args)
    backends = {field: getattr(config, field, None) for field in BACKEND_FIELDS}
    try:
        validate_model(options, _is_dsa(server_args))
        validate_backends(options, backends, _is_mla(server_args), str(config.device))
        if options.accept == "fused":  # the kernels it will launch, checked before any worker starts
            accept_kernels(os.environ.get(ACCEPT_KERNELS_ENV, ""), "cpu" if str(config.device) == "cpu" else "cuda")
    except SpecError as error:
        raise StartupError(error) from None


def _is_mla(server_args) -> bool:
    from sglang.srt.arg_groups.overrides import model_config_of

    try:
        model_config = model_config_of(server_args)
    except Exception:  # dummy launches have no model config: no MLA check applies
        return False
    # AttentionArch is an IntEnum: str() of a member is its number on Python 3.11, so compare the name
    return getattr(getattr(model_config, "attention_arch", None), "name", None) == "MLA"


def _is_dsa(server_args) -> bool:
    from sglang.srt.arg_groups.overrides import model_config_of
    from sglang.srt.configs.model_config import is_deepseek_dsa

    try:
        model_config = model_config_of(server_args)
    except Exception:  # dummy launches have no model config: no DSA check applies
        return False
    return bool(is_deepseek_dsa(model_config.hf_config))


def unapplied_hooks() -> list[str]:
    """Targets of ours that SGLang's HookRegistry failed to patch in this process."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    return [target for target, _, _ in HOOKS if target not in HookRegistry._patched]


# ---------------------------------------------------------------------------------------------- model classes
def registry_lookup_before(registry, *args, **kwargs):
    """Puts our draft model classes into SGLang's model registry the first time it is consulted."""
    for architecture, module_name in MODEL_CLASSES.items():
        if architecture not in registry.models:
            registry.models[architecture] = getattr(importlib.import_module(module_name), architecture)
    return None


# ---------------------------------------------------------------------------------------------- context limit
def tokenizer_manager_init_after(result, manager, *args, **kwargs):
    """The context a tree server reserves for its trees (``TreeServerOptions.reserved_context``): none where the
    model's positions hold the tree past the context length, so it takes every prompt a plain server takes."""
    options: TreeServerOptions | None = getattr(manager.server_args, ATTRIBUTE, None)
    if options is not None:
        config = getattr(manager.model_config, "hf_text_config", None)
        max_positions = getattr(config, "max_position_embeddings", None)
        manager.num_reserved_tokens = options.reserved_context(manager.context_len, max_positions,
                                                               manager.num_reserved_tokens)
    return result


_TREE_POOL: contextvars.ContextVar[bool] = contextvars.ContextVar("sglang_spec_tree_pool", default=False)


def build_req_to_token_pool_around(original, configurator, *args, **kwargs):
    """Marks the req_to_token pool a tree server builds (``req_to_token_headroom_around`` widens its rows)."""
    token = _TREE_POOL.set(getattr(configurator.server_args, ATTRIBUTE, None) is not None)
    try:
        return original(configurator, *args, **kwargs)
    finally:
        _TREE_POOL.reset(token)


def req_to_token_headroom_around(original, *args, **kwargs):
    """A tree server's req_to_token rows hold a request's committed tokens plus what SGLang maps past them each
    decode step (``get_alloc_reserve_per_decode``: twice max(W * D, budget + 1)). SGLang sizes the headroom to
    budget + 5, enough only while its tokenizer keeps every request max(W * D, budget + 1) short of the context;
    with W * D past it (specexec 15/4/4: 60 slots, a 120-slot reserve) a request near the end of the context ran
    its row over, and with no reservation (``tokenizer_manager_init_after``) any tree could."""
    extra = original(*args, **kwargs)
    if not _TREE_POOL.get():
        return extra
    from sglang.srt.mem_cache.allocation_sizing import get_alloc_reserve_per_decode

    return max(extra, get_alloc_reserve_per_decode())


# ---------------------------------------------------------------------------------------------- draft worker
@dataclass
class DraftSetup:
    """Built once per draft worker: the plugin's draft loop (sequoia / specexec) or context drafter (lookup /
    hybrid), None for both keeps SGLang's loop; whether beams keep exact ancestry (decided when the draft pool
    exists, in alloc_memory_pool)."""

    loop: DraftLoop | None
    exact_ancestry: bool
    width: int
    steps: int
    context: ContextDrafter | None = None
    fault_every: int = 0  # tests: every fault_every-th draft raises (FAULT_ENV, read at start-up); 0: never
    drafts: int = 0  # drafts run, for fault_every
    filler: SGLangDraftEncoding | None = None  # the filler tree a faulty draft's batch verifies (built on first use)
    accept_faults: AcceptFaults | None = None  # tests: the target worker's injected accept faults (OBSERVE fires here)
    guard: HeadGuard | None = None  # the own loop: a non-finite head output verifies the filler (head_guard)
    poison: HeadPoison | None = None  # tests: head forwards whose probabilities turn NaN (head_guard.INJECT_ENV)
    peers: Peers | None = None  # tensor parallelism: the ranks whose drafts fall back together


def draft_worker_init_after(result, worker, *args, **kwargs):
    options: TreeServerOptions | None = getattr(worker.server_args, ATTRIBUTE, None)
    if options is None:
        return result
    loop = None
    if options.own_loop:
        try:
            plan = options.draft_plan()
        except SpecError as error:  # validated at start-up already; a mismatch here is a bug, said plainly
            raise StartupError(error) from None
        # under DP attention the logits processor gathers every rank's rows: the head runs over all the beams
        budget = None if _dp_attention() else worker.speculative_num_draft_tokens - 1
        loop = DraftLoop.build(worker.topk, options.topk, worker.speculative_num_steps, plan, worker.device,
                               budget=budget)
    context = None
    if options.uses_context:
        context = ContextDrafter(options.tree_policy(), worker.speculative_num_steps,
                                 worker.speculative_num_draft_tokens - 1, SOURCES)
        if options.auto:  # head levels priced per batch size from the served steps (``level_costs``)
            context.level_costs = LevelCosts()
        context.on_device = options.context_on == "device"
    # the draft KV pool is allocated later (Scheduler.init_memory_pools): ancestry is decided in alloc_memory_pool
    try:
        poison = HeadPoison.from_environment()
    except SpecError as error:
        raise StartupError(error) from None
    setup = worker._sglang_spec = DraftSetup(loop, exact_ancestry=False, width=worker.topk,
                                             steps=worker.speculative_num_steps, context=context,
                                             fault_every=_fault_every() if _injects_here() else 0, poison=poison,
                                             peers=Peers.of_worker())
    if loop is not None:  # before any draft graph is captured: the guard's tensors live on the device
        setup.guard = HeadGuard.build(_filler_encoding(worker, setup), worker.device)
    if context is not None and context.on_device and context.uses_head:  # hybrid on the device: its own guard
        context.guard = HeadGuard.build(_filler_encoding(worker, setup), worker.device)
    claim_acceptance_metrics(worker.server_args, _attn_tp_rank())
    return result


def _dp_attention() -> bool:
    from sglang.srt.layers.dp_attention import is_dp_attention_enabled

    return bool(is_dp_attention_enabled())


def claim_acceptance_metrics(server_args, rank: int) -> bool:
    """At worker start-up: attention-TP rank 0 counts acceptance (and registers its counters with
    ``--enable-metrics``); every attention-TP rank runs the same requests through the same verify, so the others
    count nothing (else SGLang's multiprocess metrics would sum each total TP times). Returns whether this
    process counts."""
    METRICS.counting = rank == 0
    if METRICS.counting and getattr(server_args, "enable_metrics", False):
        METRICS.enable_prometheus()
        RANKS.enable(prometheus=True)  # per-(depth, rank) acceptance, once per step (calibrate --from-server)
        SOURCES.enable()  # per-source outcomes of lookup / hybrid trees (calibrate --from-server)
    return METRICS.counting


def _attn_tp_rank() -> int:
    from sglang.srt.runtime_context import get_parallel

    try:
        return int(get_parallel().attn_tp_rank)
    except Exception:  # parallel state not published (single-process tests): the only rank
        return 0


def alloc_memory_pool_after(result, worker, *args, **kwargs):
    setup: DraftSetup | None = getattr(worker, "_sglang_spec", None)
    if setup is None or setup.width == 1:
        return result
    pool = worker.draft_runner.token_to_kv_pool
    if not supports_row_permutation(pool):
        raise StartupError(
            f"the draft KV pool ({type(pool).__name__}, layout {getattr(pool, 'kv_cache_layout', 'unknown')}) does "
            f"not hold one token a row, so tree branches cannot each keep their own ancestry; use the NHD layout "
            f"(unset SGLANG_USE_HND_KVCACHE and the vectorized_5d / page-major layouts), or "
            f"--speculative-tree-policy chain"
        )
    setup.exact_ancestry = True
    return result


def supports_row_permutation(pool) -> bool:
    """True for pools whose layer buffers hold one token slot a row, ``[size + page_size, heads, dim]`` (MHA k / v in
    the NHD layout, MLA's latent), at any page size: a page is then ``page_size`` consecutive rows, a row copy
    moves one token's KV, and SGLang's paged draft layout (each beam on its own pages, ``prepare_for_draft``) gives
    every beam its own rows to permute. Pools whose rows are pages (HND, vectorized_5d) are refused."""
    if getattr(pool, "use_hnd", False) or getattr(pool, "kv_cache_layout", "nhd") != "nhd":
        return False
    buffers = [buffer for name in ("k_buffer", "v_buffer", "kv_buffer") for buffer in getattr(pool, name, None) or ()]
    rows = getattr(pool, "size", None)
    if not buffers or rows is None:
        return False
    rows += int(getattr(pool, "page_size", 1) or 1)
    return all(buffer.dim() == 3 and buffer.shape[0] == rows for buffer in buffers)


@dataclass
class DraftContext:
    """What one draft_forward call exposes to the inner hooks."""

    setup: DraftSetup
    step_locs: torch.Tensor  # [steps, bs*topk] per-step draft KV slots
    pool: Any  # the draft model's KV pool (an SGLang KVCache)


_DRAFT: contextvars.ContextVar[DraftContext | None] = contextvars.ContextVar("sglang_spec_draft", default=None)
# the requests of the draft step in progress (lookup / hybrid read their context), in batch order
_REQS: contextvars.ContextVar[list | None] = contextvars.ContextVar("sglang_spec_reqs", default=None)


def draft_around(original, worker, batch, *args, **kwargs):
    setup = getattr(worker, "_sglang_spec", None)
    if setup is not None and setup.guard is not None:  # the own loop, eager or replayed from its graph
        verify_input = original(worker, batch, *args, **kwargs)
        _report_head_faults(setup.guard)
        return verify_input
    if setup is None or setup.context is None:
        return original(worker, batch, *args, **kwargs)
    # host-built trees cannot replay a captured draft graph: this step drafts eagerly
    graph_runner, worker.cuda_graph_runner = worker.cuda_graph_runner, None
    token = _REQS.set(list(batch.reqs))
    try:
        verify_input = original(worker, batch, *args, **kwargs)
        if setup.context.has_proposal:  # the accept reports its paths to the drafter (live calibration)
            verify_input._sglang_spec_context = setup.context
        if setup.context.guard is not None:
            _report_head_faults(setup.context.guard)
        return verify_input
    finally:
        worker.cuda_graph_runner = graph_runner
        _REQS.reset(token)


# set while a batch runs without the head's draft extend: tree auto's cold steps and cold prefills
_HEAD_SKIPPED: contextvars.ContextVar[bool] = contextvars.ContextVar("sglang_spec_head_skipped", default=False)


def _head_free(worker) -> bool:
    """The head's forwards (the draft extend over a prompt and over each step's accepted tokens, which fill its KV
    and give the next root's candidates) are skipped: always on a ``lookup`` server, whose trees never ask the head;
    under tree auto for a cold batch (``_HEAD_SKIPPED``)."""
    if _HEAD_SKIPPED.get():
        return True
    setup = getattr(worker, "_sglang_spec", None)
    return setup is not None and setup.context is not None and not setup.context.uses_head


def _stub_draft_input(worker, batch_size: int) -> dict:
    """The next draft input's head fields where the head did not run: zeros of the shapes SGLang's own stub for a
    skipped draft extend gives (``EAGLEWorkerV2._stub_skipped_draft_extend``); neither a lookup tree nor a plain
    step reads them."""
    from sglang.srt.speculative.eagle_utils import get_draft_recurrent_hidden_state_spec

    fields = {"topk_p": torch.zeros((batch_size, worker.topk), dtype=torch.float32, device=worker.device),
              "topk_index": torch.zeros((batch_size, worker.topk), dtype=torch.int64, device=worker.device)}
    hidden_size, hidden_dtype = get_draft_recurrent_hidden_state_spec(worker.draft_runner)
    if hidden_size is not None:
        fields["hidden_states"] = torch.zeros((batch_size, hidden_size), dtype=hidden_dtype, device=worker.device)
    return fields


def draft_extend_for_prefill_around(original, worker, batch, target_hidden_states, next_token_ids, *args, **kwargs):
    if not _head_free(worker):
        return original(worker, batch, target_hidden_states, next_token_ids, *args, **kwargs)
    from sglang.srt.speculative.eagle_info import EagleDraftInput

    return EagleDraftInput(bonus_tokens=next_token_ids, num_tokens_per_req=1, num_tokens_for_logprob_per_req=1,
                           **_stub_draft_input(worker, batch.seq_lens.shape[0]))


def draft_extend_for_decode_around(original, worker, batch, batch_output, *args, **kwargs):
    if not _head_free(worker):
        return original(worker, batch, batch_output, *args, **kwargs)
    # verify already set the bonus tokens, the one field a lookup draft or a plain step reads
    for name, value in _stub_draft_input(worker, batch.seq_lens.shape[0]).items():
        setattr(batch_output.next_draft_input, name, value)
    return None


def draft_forward_around(original, worker, forward_batch, *args, **kwargs):
    setup = getattr(worker, "_sglang_spec", None)
    if setup is None or forward_batch.forward_mode.is_idle():
        return original(worker, forward_batch, *args, **kwargs)
    setup.drafts += 1
    error: Exception | None = None
    inject = bool(setup.fault_every) and setup.drafts % setup.fault_every == 0
    try:
        # injected before the draft on one rank; with peers once it ran (a rank that skipped the head's forward
        # would leave the others waiting in its all-reduce: see Peers)
        if inject and setup.peers is None:
            raise InjectedFault(f"draft {setup.drafts} ({FAULT_ENV}={setup.fault_every})")
        drafted = _draft_forward(original, worker, forward_batch, setup, *args, **kwargs)
        if inject:
            raise InjectedFault(f"draft {setup.drafts} ({FAULT_ENV}={setup.fault_every}, once drafted)")
    except Exception as caught:  # one batch's draft must not take the scheduler down: it verifies a filler tree
        if _capturing():  # a failed graph capture must fail, not record a filler tree
            raise
        error = caught
    if setup.peers is not None and not _capturing() and setup.peers.any_rank(error is not None) \
            and error is None:
        error = FaultOnAnotherRank("another tensor-parallel rank's draft of this batch faulted")
    if error is None:
        return drafted
    if setup.context is not None:  # nothing was proposed: the accept teaches the counts nothing
        setup.context.proposed, setup.context.proposed_on_device, setup.context.proposed_finite = [], None, None
    METRICS.record_draft_fault(type(error).__name__)
    log(f"draft fault, batch of {forward_batch.batch_size} verified without speculation "
        f"({type(error).__name__}: {error}; sglang_spec_draft_faults_total)")
    return _filler_draft(worker, forward_batch, setup)


class FaultOnAnotherRank(RuntimeError):
    """This rank's draft or fused accept went well, another rank's of its tensor-parallel group did not: every rank
    takes the fallback (the filler tree; SGLang's accept)."""


@dataclass(frozen=True)
class Peers:
    """The ranks that verify one batch together (SGLang's attention-TP group), more than one. Their drafts must
    agree, because the verify forward's all-reduces add up every rank's part of the same tokens (a rank that
    verified its filler tree beside the others' real trees would corrupt every rank's logits); and on a sampled
    batch their accepts must take one path, because the fused accept and SGLang's broadcast rank 0's accept in
    different layouts.

    ``any_rank`` is called by every rank at the same points of every step outside a graph capture (after each
    draft; before a sampled batch's accept broadcast), and SGLang's scheduler runs its steps on one thread, so the
    calls pair up in order: one int summed over the group's gloo group, on the host, no device sync. This covers
    faults after a draft's last collective (the trees' organisation and encoding, the host's reads) and in the
    accept; a rank that raises in the middle of the head's forward leaves its peers waiting in that forward's
    all-reduce, which no rank-local fallback can undo (SGLang's watchdog ends such a server)."""

    cpu_group: Any

    @classmethod
    def of_worker(cls) -> Peers | None:
        group = _accept_tp_group()
        return None if group is None else cls(group.cpu_group)

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank of the group."""
        total = torch.tensor([int(flag)], dtype=torch.int32)
        torch.distributed.all_reduce(total, group=self.cpu_group)
        return bool(total.item())


FAULT_ENV = "SGLANG_SPEC_INJECT_DRAFT_FAULT"
ACCEPT_FAULT_ENV = "SGLANG_SPEC_INJECT_ACCEPT_FAULT"


def _fault_every(name: str = FAULT_ENV) -> int:
    text = os.environ.get(name, "0")
    if not text.isdigit():
        what = "draft" if name == FAULT_ENV else "verify step's accept"
        raise StartupError(f"{name}={text!r}: give a whole number n (every n-th {what} raises) or 0")
    return int(text)


FAULT_RANK_ENV = "SGLANG_SPEC_INJECT_FAULT_RANK"


def _injects_here() -> bool:
    """Tests: whether this rank injects draft and accept faults (``SGLANG_SPEC_INJECT_FAULT_RANK``: one
    attention-TP rank; unset: every rank)."""
    text = os.environ.get(FAULT_RANK_ENV, "").strip()
    if not text:
        return True
    if not text.isdigit():
        raise StartupError(f"{FAULT_RANK_ENV}={text!r}: give the tensor-parallel rank that injects faults, or unset it")
    return int(text) == _attn_tp_rank()


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _observe_accepted(setup: DraftSetup, batch_size: int) -> None:
    """The context drafter learns what the last verified trees accepted; a fault there is an accept fault: the
    drafter's counts keep what they learnt before it (they shape trees, never the output) and this batch drafts."""
    assert setup.context is not None
    # with tensor parallelism every rank builds the same trees from the same counts: a fault on one rank alone
    # would leave its counts behind the others' (and a fault half-way, part-taught), so all keep what they had
    before = setup.context.learnt() if setup.peers is not None else None
    failed = False
    try:
        if setup.accept_faults is not None:
            setup.accept_faults.fire(OBSERVE)
        setup.context.observe_outcome()
    except Exception as error:
        failed = True
        accept_fault(OBSERVE, error, batch_size, "its drafter did not learn from the last accepted paths")
    if before is not None and setup.peers is not None and setup.peers.any_rank(failed):
        setup.context.restore(before)
        if not failed:
            accept_fault(OBSERVE, FaultOnAnotherRank("another tensor-parallel rank's drafter did not learn"),
                         batch_size, "its drafter did not learn from the last accepted paths, as on that rank")


def _report_head_faults(guard: HeadGuard) -> None:
    """The own loop's requests drafted from a non-finite head output since the last read: counted, one log line."""
    new = guard.new_faults(time.monotonic())
    if new:
        METRICS.record_draft_fault(HEAD_FAULT, new)
        log(f"draft fault, {new} request(s) whose head output was not finite verified without speculation "
            f"({HEAD_FAULT}; sglang_spec_draft_faults_total)")


def _filler_encoding(worker, setup: DraftSetup) -> SGLangDraftEncoding:
    """The filler tree in the configured shape, one request's rows (host tensors; built once per worker): a root
    and filler tokens, proposals of no head and no context."""
    if setup.filler is None:
        root = TokenTree.from_parents([-1], tokens=[0])
        tree = pad_to_budget(root, worker.speculative_num_draft_tokens - 1, worker.topk, worker.speculative_num_steps)
        setup.filler = encode_sglang_draft([tree], worker.topk, worker.speculative_num_steps)
    return setup.filler


def _filler_draft(worker, forward_batch, setup: DraftSetup):
    """SGLang's draft outputs for a tree of filler tokens in the configured shape, one per request: deterministic
    proposals (no head, no context), so verification stays exact and the step emits the target's own token (and,
    rarely, a filler that happens to match)."""
    filler = _filler_encoding(worker, setup)
    rows = forward_batch.batch_size
    device = forward_batch.spec_info.bonus_tokens.device

    def per_request(part: torch.Tensor) -> torch.Tensor:
        return part.to(device).expand(rows, -1).contiguous()

    return (per_request(filler.parent_list), per_request(filler.top_scores_index), per_request(filler.draft_tokens),
            None)


def _draft_forward(original, worker, forward_batch, setup: DraftSetup, *args, **kwargs):
    if setup.loop is not None:
        return draft_forward(worker, forward_batch, setup.loop, permute_kv, setup.guard)
    if setup.context is not None:
        reqs = _REQS.get()
        if reqs is None:  # a draft graph capture: SGLang's loop fills the graph, which context trees never replay
            return original(worker, forward_batch, *args, **kwargs)
        _observe_accepted(setup, forward_batch.batch_size)
        if setup.context.on_device and setup.context.uses_head:
            return device_hybrid_draft_forward(worker, forward_batch, reqs, setup.context, permute_kv)
        if setup.context.on_device:
            return device_lookup_draft_forward(worker, forward_batch, reqs, setup.context)
        try:
            return context_draft_forward(worker, forward_batch, reqs, setup.context, permute_kv)
        finally:
            _report_unknown(setup.context.outputs)
    from sglang.srt.speculative.eagle_utils import per_step_draft_out_cache_loc

    step_locs = per_step_draft_out_cache_loc(forward_batch.out_cache_loc, forward_batch.batch_size, setup.width,
                                             setup.steps)
    token = _DRAFT.set(DraftContext(setup, step_locs, worker.draft_runner.token_to_kv_pool))
    try:
        return original(worker, forward_batch, *args, **kwargs)
    finally:
        _DRAFT.reset(token)


def select_top_k_tokens_around(original, i, topk_p, topk_index, hidden_states, scores, topk):
    """SGLang's own selection (eagle), then every new beam's KV column gets its parent beam's history."""
    result = original(i, topk_p, topk_index, hidden_states, scores, topk)
    context = _DRAFT.get()
    if context is None or i == 0 or not context.setup.exact_ancestry or i >= context.setup.steps - 1:
        return result  # the last selection runs no further forward
    parent_beam = torch.div(result[3][2] - (topk * topk * (i - 1) + topk), topk, rounding_mode="floor")
    target, source = ancestry_permutation(parent_beam, context.step_locs, i)
    permute_kv(context.pool, target, source)
    return result


def logits_metadata_after(result, cls, *args, **kwargs):
    """Inside the plugin's draft forward (``draft_forward.LOGIT_ROWS`` set): the logits processor computes the
    head over those rows only, through SGLang's own row selection (``draft_extend_select_index``, which it applies
    in decode mode too); its last hidden states are those rows' as well."""
    rows = LOGIT_ROWS.get()
    if rows is not None:
        result.draft_extend_select_index = rows
    return result


def permute_kv(pool, target, source) -> None:
    """pool[target] = pool[source] for every layer buffer, as a gather then a scatter (safe for permutations).
    Slot-major pools only (MHA k/v buffers, MLA latent); others are refused at start-up."""
    target, source = target.long(), source.long()
    for name in ("k_buffer", "v_buffer", "kv_buffer"):
        for buffer in getattr(pool, name, None) or ():
            buffer[target] = buffer[source]


# ---------------------------------------------------------------------------------------------- tree auto
COLD_MARK = "_sglang_spec_cold"  # set on a Req that took a cold step (its head skipped that position)
# the decode batch the prefill being run will join (its requests, the running ones and those waiting, up to the
# running cap), set by the scheduler before each batch (None for a decode batch): tree auto's cold admission
_JOINS: contextvars.ContextVar[int | None] = contextvars.ContextVar("sglang_spec_joins", default=None)


def scheduler_run_batch_before(scheduler, batch, *args, **kwargs):
    """Tree auto: before a prompt prefill, the size of the decode batch its requests will join (``_JOINS``)."""
    options: TreeServerOptions | None = getattr(scheduler.server_args, ATTRIBUTE, None)
    if options is None or not options.auto:
        return None
    joins = None
    if batch.forward_mode.name == "EXTEND":  # a prompt prefill (not mixed with decode rows, not split)
        joins = scheduler.running_batch.batch_size() + batch.batch_size() + len(scheduler.waiting_queue)
        joins = min(joins, scheduler.max_running_requests or joins)
    _JOINS.set(joins)
    return None


def forward_batch_generation_around(original, worker, batch, *args, **kwargs):
    """--speculative-tree-auto: a decode batch the switch calls plain goes through SGLang's own 0-step path (the
    root alone verified: a plain decode, the draft KV kept warm by the draft extend), or cold (``_zero_steps``);
    every decode step is timed with the tokens it emitted. A prefill whose requests join a batch that is cold by
    prediction skips the head's pass over their prompts (``_admit``)."""
    options: TreeServerOptions | None = getattr(worker.server_args, ATTRIBUTE, None)
    if options is None or not options.auto or batch.forward_mode.is_idle():
        return original(worker, batch, *args, **kwargs)
    if batch.forward_mode.is_extend() or batch.is_extend_in_batch:
        return _admit(original, worker, batch, *args, **kwargs)
    switches = getattr(worker, "_sglang_spec_switches", None)
    if switches is None:
        switches = worker._sglang_spec_switches = _start_switches(worker)
    size = len(batch.reqs)
    try:
        warm = sum(1 for request in batch.reqs if not getattr(request, COLD_MARK, False))
        kind = switches.decide(size, [request.rid for request in batch.reqs], warm=warm)
    except Exception as error:  # SGLang's own plain step (the head's KV kept warm): exact whatever the switch
        accept_fault(AUTO, error, size, "decoded by a plain step")
        kind = PLAIN
    plain = kind != TREE
    start = time.perf_counter()
    if plain:
        with _zero_steps(worker, cold=kind == COLD):
            output = original(worker, batch, *args, **kwargs)
    else:
        output = original(worker, batch, *args, **kwargs)
    try:
        _observe_step(switches, batch, kind, output, start, _context_drafter(worker))
    except Exception as error:  # the step's output stands; the switch learns nothing from it
        accept_fault(AUTO, error, size, "decoded; tree auto did not learn from its time")
    return output


def _admit(original, worker, batch, *args, **kwargs):
    """A prefill under tree auto: where the decode batch its requests join (``_JOINS``) is cold by prediction
    (``BatchSwitches.admit``), it runs without the head's draft extend (SGLang's stub of the next draft input, as
    for a ``lookup`` server) and its requests are cold from the start. Only a prompt prefill (EXTEND: no decode
    rows mixed in, see ``scheduler_run_batch_before``) goes cold; a later chunk of a cold prompt may run the head
    again, the request stays cold."""
    switches: BatchSwitches | None = getattr(worker, "_sglang_spec_switches", None)
    joins = _JOINS.get()
    cold = False
    if switches is not None and joins is not None:
        try:
            cold = switches.admit(len(batch.reqs), joins)
        except Exception as error:  # the head's pass runs: warm, as without tree auto
            accept_fault(AUTO, error, len(batch.reqs), "prefilled with the head's pass")
    if not cold:
        return original(worker, batch, *args, **kwargs)
    token = _HEAD_SKIPPED.set(True)
    try:
        output = original(worker, batch, *args, **kwargs)
    finally:
        _HEAD_SKIPPED.reset(token)
    for request in batch.reqs:  # no head KV for the prompt: its tree steps teach the accept length nothing
        setattr(request, COLD_MARK, True)
    if switches.cold_admissions == len(batch.reqs):
        log(f"tree auto: prompts joining a batch of {joins} skip the head's pass (cold: trees predicted at "
            f"{switches.predicted_speedup(joins, floor=True):.2f}x there)")
    return output


def _context_drafter(worker) -> ContextDrafter | None:
    setup: DraftSetup | None = getattr(worker.draft_worker, "_sglang_spec", None)
    return None if setup is None else setup.context


def _observe_step(switches: BatchSwitches, batch, kind: str, output, start: float,
                  context: ContextDrafter | None = None) -> None:
    """Tree auto's bookkeeping of a decoded step: its time per emitted token, the cold marks, and (a tree step
    of a context server) the prices of its head levels."""
    size = len(batch.reqs)
    accept_lens = output.accept_lens.tolist()  # reads the step's result: the time below is the step's own
    seconds = time.perf_counter() - start
    if kind == TREE and context is not None and context.level_costs is not None:
        _price_levels(context, size, seconds)
    rids = [request.rid for request in batch.reqs]
    warm = {rid: accept_lens[index] for index, (rid, request) in enumerate(zip(rids, batch.reqs))
            if not getattr(request, COLD_MARK, False)}
    message = switches.observe(size, kind != TREE, seconds, sum(accept_lens), rids=rids, request_tokens=warm)
    if kind == COLD:
        for request in batch.reqs:  # its head now lacks KV for this position: its tree steps teach nothing
            setattr(request, COLD_MARK, True)
    if message is not None:
        log(message)


def _price_levels(context: ContextDrafter, size: int, seconds: float) -> None:
    """Tree auto: a tree step's time and its head rounds' into the drafter's level prices (logged once, when trees
    first leave a level out)."""
    costs = context.level_costs
    assert costs is not None, "priced only on a tree auto context server"
    priced_out = context.priced_out
    costs.observe(size, seconds, context.rounds, context.rounds_seconds)
    if priced_out and not costs.logged:
        costs.logged = True
        log(f"tree auto: head levels priced at batch {size} ({costs.describe(size)}): trees leave a level out "
            f"where its predicted gain does not pay ({priced_out} so far)")


def _start_switches(worker) -> BatchSwitches:
    """Tree auto's state, with the target's verify forward timed per batch size (before the first decode step)."""
    start = time.perf_counter()
    try:
        costs = measure_step_costs(worker)
    except Exception as error:  # a backend whose dummy forward fails: the switch still measures served steps
        log(f"tree auto: start-up costs not measured ({type(error).__name__}: {error}); deciding from served steps")
        return BatchSwitches()
    log(f"tree auto: verify forward of {costs.tokens} tokens a request over 1, by batch size: {costs.describe()} "
        f"(measured in {time.perf_counter() - start:.1f} s)")
    return BatchSwitches(costs=costs)


@contextlib.contextmanager
def _zero_steps(worker, cold: bool = False):
    """SGLang's drafting-disabled state for one step: 0 draft steps, 1 verified token (its trivial verify input),
    on the worker and its draft worker, restored after; the target's forward runs in DECODE mode (``_as_decode``:
    a one-token TARGET_VERIFY costs 10-15% more than a decode step on the CPU bed). Warm, its hidden states feed
    the draft extend as a verify's would; ``cold``: the draft extend is skipped (``_HEAD_SKIPPED``: the stub of the
    next draft input that SGLang's SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND gives every 0-step)."""
    draft = worker.draft_worker
    saved = (worker.speculative_num_steps, worker.speculative_num_draft_tokens, draft.speculative_num_steps,
             draft.speculative_num_draft_tokens)
    worker.speculative_num_steps = draft.speculative_num_steps = 0
    worker.speculative_num_draft_tokens = draft.speculative_num_draft_tokens = 1
    target = worker.target_worker
    # instance attributes over the methods for this step; deleting them shows the methods again
    forward = target.forward_batch_generation
    target.forward_batch_generation = lambda **kwargs: forward(**_as_decode(keep_hidden=not cold, **kwargs))
    skipped = _HEAD_SKIPPED.set(cold)
    try:
        yield
    finally:
        (worker.speculative_num_steps, worker.speculative_num_draft_tokens, draft.speculative_num_steps,
         draft.speculative_num_draft_tokens) = saved
        del target.forward_batch_generation
        _HEAD_SKIPPED.reset(skipped)


def _as_decode(forward_batch, is_verify: bool = False, keep_hidden: bool = True, **kwargs) -> dict:
    """A plain step's target forward as SGLang's DECODE forward, not a one-token TARGET_VERIFY: the same token
    (the previous bonus token, at position ``seq_len``) and KV slot, but the decode attention path (no tree
    mask, no extend kernels). DECODE counts the new token in ``seq_lens``; verify counts it through its
    draft-token count. The logits come out the same, one row a request, and so do the hidden states with
    ``keep_hidden`` (the capture mode verify asked for: the draft extend's input); without it none are captured
    (a cold step's draft extend is stubbed)."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode

    if is_verify and forward_batch.forward_mode.is_target_verify():
        size = forward_batch.batch_size
        forward_batch.forward_mode = ForwardMode.DECODE
        forward_batch.spec_info = None
        if not keep_hidden:
            forward_batch.capture_hidden_mode = CaptureHiddenMode.NULL
        forward_batch.seq_lens = forward_batch.seq_lens + 1
        if forward_batch.seq_lens_cpu is not None:
            forward_batch.seq_lens_cpu = forward_batch.seq_lens_cpu + 1
        if forward_batch.seq_lens_sum is not None:
            forward_batch.seq_lens_sum += size
    return dict(kwargs, forward_batch=forward_batch, is_verify=is_verify)


# ---------------------------------------------------------------------------------------------- fused accept
def eagle_worker_init_after(result, worker, *args, **kwargs):
    options: TreeServerOptions | None = getattr(worker.server_args, ATTRIBUTE, None)
    if options is None:
        return result
    _start_accept_faults(worker, options)
    _start_committed_outputs(worker)
    if options.accept != "fused":
        return result
    from sglang.srt.utils import is_hip

    claim_acceptance_metrics(worker.server_args, _attn_tp_rank())
    kernels = accept_kernels(os.environ.get(ACCEPT_KERNELS_ENV, ""), worker.device)
    fused = FusedAccept(worker.speculative_num_draft_tokens, worker.speculative_num_steps, worker.device, METRICS,
                        tp_group=_accept_tp_group(), broadcast_greedy=is_hip(), kernels=kernels)
    if kernels is not TRITON_KERNELS:
        log(f"fused accept: the kernels' pure-torch references ({ACCEPT_KERNELS_ENV}={kernels.name})")
    worker._sglang_spec_fused = fused
    worker._sglang_spec_peers = Peers.of_worker()
    if str(worker.device).startswith("cuda"):
        worker.target_worker.model_runner.capture_tail_hooks.append(fused.capture_tail)  # before graph capture
    return result


def _start_committed_outputs(worker) -> None:
    """With the overlap scheduler (a step's result processed after the next step is launched) the requests' output
    ids lag a step: every verify's committed tokens are kept (``committed``) for the next step's exact penalties and
    context trees."""
    from sglang.srt.runtime_context import get_schedule

    if get_schedule().disable_overlap_schedule:  # the resolved loop (SGLang turns it off on a CPU, for one)
        return
    setup: DraftSetup | None = getattr(getattr(worker, "draft_worker", None), "_sglang_spec", None)
    # a context drafter on the host reads every step's output; one on the device keeps its own history
    context = setup is not None and setup.context is not None and not setup.context.on_device
    committed = worker._sglang_spec_committed = CommittedOutputs(every_step=context)
    if context:
        setup.context.outputs = committed
    log("overlap scheduler: each verify's committed tokens complete the next step's penalties"
        + (" and context trees" if context else "") + " (SGLang's output ids lag a step)")


def _start_accept_faults(worker, options: TreeServerOptions) -> None:
    """The worker's injected accept faults (``ACCEPT_FAULT_ENV``, tests), over the stages its server runs; the draft
    worker fires the context drafter's (OBSERVE)."""
    every = _fault_every(ACCEPT_FAULT_ENV)
    if not every or not _injects_here():
        return
    stages = ((ACCEPT, COMMIT) if options.accept == "fused" else ()) + (RECORD,)
    stages += (OBSERVE,) if options.uses_context else ()
    faults = worker._sglang_spec_accept_faults = AcceptFaults(every, stages)
    setup: DraftSetup | None = getattr(getattr(worker, "draft_worker", None), "_sglang_spec", None)
    if setup is not None:
        setup.accept_faults = faults


def accept_fault(stage: str, error: Exception, batch_size: int, outcome: str) -> None:
    """One fault in the plugin's accept (raised at ``stage``, see ``faults``) that the caller recovers from as
    ``outcome`` says: counted (sglang_spec_accept_faults_total), one log line. While a CUDA graph is being captured
    it raises instead (a capture must fail, not record a fallback)."""
    if _capturing():
        raise error
    METRICS.record_accept_fault(stage, type(error).__name__)
    log(f"accept fault in {stage}, batch of {batch_size}: {outcome} ({type(error).__name__}: {error}; "
        f"sglang_spec_accept_faults_total)")


def _accept_tp_group():
    """The group eagle_sample broadcasts its accept over (attention TP under DP attention), or None with one rank."""
    from sglang.srt.layers.dp_attention import is_dp_attention_enabled
    from sglang.srt.runtime_context import get_parallel

    try:
        group = get_parallel().attn_tp_group if is_dp_attention_enabled() else get_parallel().tp_group
    except RuntimeError:  # parallel state not published (single-process tests): the only rank
        return None
    return group if group.world_size > 1 else None


@dataclass
class VerifyStep:
    """A tree server's verify step: set by the worker's verify, gone when it returns. ``fused``: the worker's fused
    accept (``--speculative-tree-accept fused``), None for SGLang's."""

    fused: FusedAccept | None
    replayed: SGLangAccept | None = None  # the greedy accept of the verify graph this step replayed
    accepted: bool = False  # whether the fused path accepted the batch (its KV commit follows it)
    faults: AcceptFaults | None = None  # tests: the worker's injected accept faults, armed for this step
    fused_fault: bool = False  # a fault before the accept (the replay's links): SGLang's accept serves the batch
    peers: Peers | None = None  # tensor parallelism with the fused accept: a sampled batch's accept path agreed
    committed: CommittedOutputs | None = None  # the overlap scheduler: what each verify committed (``committed``)
    context: ContextDrafter | None = None  # a context server's drafter (its device history takes each verify's tokens)

    def fire(self, stage: str) -> None:
        if self.faults is not None:
            self.faults.fire(stage)


_STEP: contextvars.ContextVar[VerifyStep | None] = contextvars.ContextVar("sglang_spec_verify_step", default=None)


def verify_around(original, worker, *args, **kwargs):
    fused = getattr(worker, "_sglang_spec_fused", None)  # set only on tree servers
    if fused is None and getattr(getattr(worker, "server_args", None), ATTRIBUTE, None) is None:
        return original(worker, *args, **kwargs)
    faults: AcceptFaults | None = getattr(worker, "_sglang_spec_accept_faults", None)
    if faults is not None:
        faults.arm()
    setup: DraftSetup | None = getattr(getattr(worker, "draft_worker", None), "_sglang_spec", None)
    token = _STEP.set(VerifyStep(fused, faults=faults, peers=getattr(worker, "_sglang_spec_peers", None),
                                 committed=getattr(worker, "_sglang_spec_committed", None),
                                 context=None if setup is None else setup.context))
    try:
        return original(worker, *args, **kwargs)
    finally:
        _STEP.reset(token)


def eagle_sample_around(original, verify_input, batch, logits_output, *args, **kwargs):
    """On a tree server: penalties per node as plain decoding applies them (``penalties``), then SGLang's or the
    fused accept; then the accepted paths to a context drafter (lookup / hybrid) and (with --enable-metrics) the
    per-(depth, rank) counts on the device."""
    if _STEP.get() is not None and not batch.forward_mode.is_idle():
        original = functools.partial(_with_exact_penalties, original)
    result = _eagle_sample(original, verify_input, batch, logits_output, *args, **kwargs)
    if batch.forward_mode.is_idle():
        return result
    try:  # bookkeeping on an accept already made: a fault skips it, the batch's result stands
        context: ContextDrafter | None = getattr(verify_input, "_sglang_spec_context", None)
        if context is not None:
            context.record_outcome(result[2], verify_input.draft_token_num)
        step = _STEP.get()
        if step is not None and step.context is not None and step.context.history is not None:
            step.context.history.append(batch.req_pool_indices, result[0], result[2], result[1])
        if step is not None and step.committed is not None and (step.committed.every_step or _penalised(batch)):
            step.committed.record([req.rid for req in batch.reqs], batch.seq_lens, result[0], result[2], result[1])
        if step is not None:
            step.fire(RECORD)
        if RANKS.enabled and len(result[2]):
            RANKS.record(verify_input.retrieve_next_token, verify_input.retrieve_next_sibling, result[2])
    except Exception as error:
        accept_fault(RECORD, error, len(batch.reqs), "accepted; its bookkeeping after the accept not finished")
    return result


def _penalised(batch) -> bool:
    """Whether the batch's requests carry penalties (SGLang's accumulated penalties are set only then)."""
    info = batch.sampling_info
    return info.acc_additive_penalties is not None or info.acc_scaling_penalties is not None


def _with_exact_penalties(original, verify_input, batch, logits_output, *args, **kwargs):
    """SGLang's eagle_sample, with a penalised batch's penalties applied per node first (``penalties``) and SGLang's
    relaxed ones (the root's, for every node) held back for the call. The fused accept never gets here with
    penalties: it leaves such batches to SGLang's path."""
    if not _penalised(batch):
        return original(verify_input, batch, logits_output, *args, **kwargs)
    info = batch.sampling_info
    logits = logits_output.next_token_logits
    bs = len(batch.reqs)
    nodes = verify_input.draft_token_num
    additive = info.acc_additive_penalties
    stop_tokens = (torch.isneginf(additive) if additive is not None
                   else torch.zeros(bs, logits.shape[-1], dtype=torch.bool, device=logits.device))
    tokens = verify_input.draft_token.view(bs, nodes)
    step = _STEP.get()
    outputs = _committed_outputs(batch, step.committed if step is not None else None, tokens[:, 0])
    exact = tree_penalties([RequestPenalties.of(req, output) for req, output in zip(batch.reqs, outputs)], tokens,
                           verify_input.retrieve_next_token, verify_input.retrieve_next_sibling, stop_tokens,
                           logits.shape[-1])
    if exact is None:  # a request's output not known whole (``committed``): SGLang's relaxed penalties
        return original(verify_input, batch, logits_output, *args, **kwargs)
    exact.apply(logits)
    saved = info.acc_additive_penalties, info.acc_scaling_penalties
    info.acc_additive_penalties = info.acc_scaling_penalties = None
    try:
        return original(verify_input, batch, logits_output, *args, **kwargs)
    finally:
        info.acc_additive_penalties, info.acc_scaling_penalties = saved


def _committed_outputs(batch, committed: CommittedOutputs | None, roots: torch.Tensor) -> list[list[int] | None]:
    """Each request's committed output for this verify (None: its ``output_ids`` as they are, complete without the
    overlap scheduler); a first output not known whole is logged once (SGLang's relaxed penalties serve it)."""
    if committed is None:
        return [None] * len(batch.reqs)
    outputs = [committed.output(req, kv_length, root)
               for req, kv_length, root in zip(batch.reqs, batch.seq_lens.tolist(), roots.tolist())]
    _report_unknown(committed)
    return outputs


def _report_unknown(committed: CommittedOutputs | None) -> None:
    """The first output ``committed`` could not complete, in one log line (the tests assert there is none)."""
    if committed is not None and committed.unknown and not committed.reported:
        committed.reported = True
        log("overlap scheduler: a request's committed output could not be completed from its last verify; its "
            "tree falls back to the output ids SGLang has processed (penalties: SGLang's relaxed ones)")


def _eagle_sample(original, verify_input, batch, logits_output, grammar_mask=None, uno_target_max_top_k=None,
                  **kwargs):
    step = _STEP.get()
    if step is None or step.fused is None or batch.forward_mode.is_idle():
        return original(verify_input, batch, logits_output, grammar_mask, uno_target_max_top_k, **kwargs)
    fused = step.fused
    accepted = None
    if not step.fused_fault:
        try:
            accepted = _fused_accept(step, verify_input, batch, logits_output, grammar_mask, uno_target_max_top_k,
                                     **kwargs)
        except Exception as error:  # the fused accept wrote only its own buffers: SGLang's accept starts afresh
            accept_fault(ACCEPT, error, len(batch.reqs), "accepted by SGLang's eagle_sample")
            fused.count("fault")
    broadcasts = fused.broadcasts(sampled=not batch.sampling_info.is_all_greedy)
    if broadcasts and step.peers is not None and step.peers.any_rank(accepted is None) and accepted is not None:
        accept_fault(ACCEPT, FaultOnAnotherRank("another tensor-parallel rank's accept of this batch is SGLang's"),
                     len(batch.reqs), "accepted by SGLang's eagle_sample on every rank")
        accepted = None
    if accepted is None:
        return original(verify_input, batch, logits_output, grammar_mask, uno_target_max_top_k, **kwargs)
    if broadcasts:
        fused.agree(accepted)
    fused.count("fused")
    step.accepted = True
    return accepted.predict, accepted.accept_lens, accepted.accept_index


def _fused_accept(step: VerifyStep, verify_input, batch, logits_output, grammar_mask, uno_target_max_top_k,
                  **kwargs) -> SGLangAccept | None:
    """The fused accept of one batch, or None where SGLang's path must serve it (counted by reason)."""
    fused = step.fused
    assert fused is not None
    from sglang.srt.runtime_context import get_spec
    from sglang.srt.speculative import eagle_utils, spec_utils
    from sglang.srt.utils.async_probe import sanitize_nan_logits

    reason = fused.fallback_reason(batch, verify_input, grammar_mask, uno_target_max_top_k,
                                   kwargs.get("watermark_state"), get_spec())
    if reason is None and spec_utils.SIMULATE_ACC_LEN > 0:
        reason = "simulated_acceptance"
    if reason is not None:
        fused.count(reason)
        return None
    logits = logits_output.next_token_logits
    sanitize_nan_logits(logits, "verify: target model logits")
    coins = None
    if not batch.sampling_info.is_all_greedy:  # SGLang's own coins, drawn as eagle_sample draws them
        bs = len(batch.seq_lens)
        candidates = verify_input.draft_token.reshape(bs, verify_input.draft_token_num)
        coins = eagle_utils._verify_coins(sampling_info=batch.sampling_info, seq_lens=batch.seq_lens,
                                          draft_token_num=verify_input.draft_token_num, candidates=candidates,
                                          device=batch.device)
    accepted = fused.sample(verify_input, batch, logits, coins, step.replayed)
    step.fire(ACCEPT)  # tests: a fault with the fused outputs written
    return accepted


def move_accept_tokens_around(original, batch, accept_index, num_correct_drafts, token_to_kv_pool_allocator):
    if batch.out_cache_loc.shape[0] == len(batch.seq_lens):
        # one verified slot a request (a plain step: tree auto's, SGLang's 0-step path): each accepted token is its
        # window's root, whose KV already sits at the window's front; SGLang's move copies every layer's rows onto
        # themselves (~1 ms a step at batch 16 on the CPU bed)
        return None
    step = _STEP.get()
    pool = token_to_kv_pool_allocator.get_kvcache()
    if step is None or not step.accepted or not supports_row_permutation(pool):
        return original(batch, accept_index, num_correct_drafts, token_to_kv_pool_allocator)
    nodes = batch.out_cache_loc.shape[0] // len(batch.seq_lens)
    assert step.fused is not None  # only the fused path accepts
    bs = len(batch.seq_lens)
    try:
        commit = KVCommit.of(pool, batch.out_cache_loc, accept_index, num_correct_drafts + 1, nodes,
                             step.fused.kernels)
    except Exception as error:  # nothing moved yet
        accept_fault(COMMIT, error, bs, "its KV moved by SGLang's move_accept_tokens_to_target_kvcache")
        return original(batch, accept_index, num_correct_drafts, token_to_kv_pool_allocator)
    try:
        commit.run(between=lambda: step.fire(COMMIT))  # tests: a fault with the first layer buffer moved
    except Exception as error:  # each buffer moved whole or not at all: the rest by torch, none twice
        accept_fault(COMMIT, error, bs, f"its KV moved by the kernel in {commit.done} of {len(commit.buffers)} "
                                        f"layer buffers, by torch in the rest")
        commit.finish()
    return None


def graph_execute_around(original, runner, forward_batch, *args, **kwargs):
    """Under CUDA graphs: the verify replay's static tree links before it; after it, the greedy accept of the graph
    SGLang replayed, for this verify step only."""
    step = _STEP.get()
    if (step is None or step.fused is None or runner.model_runner.is_draft_worker
            or not forward_batch.forward_mode.is_target_verify()):
        return original(runner, forward_batch, *args, **kwargs)
    try:
        step.fused.before_replay(forward_batch)
    except Exception as error:  # the graph's links may be half written: its accept is not read
        accept_fault(ACCEPT, error, forward_batch.batch_size, "accepted by SGLang's eagle_sample")
        step.fused.count("fault")
        step.fused_fault = True
    output = original(runner, forward_batch, *args, **kwargs)
    if not step.fused_fault:
        try:
            step.replayed = step.fused.replayed(runner, forward_batch)
        except Exception as error:
            accept_fault(ACCEPT, error, forward_batch.batch_size, "accepted by SGLang's eagle_sample")
            step.fused.count("fault")
            step.fused_fault = True
    return output


def correct_drafts_after(result, request, num_correct_drafts):
    try:
        METRICS.record(num_correct_drafts)  # counts on attention-TP rank 0 only (METRICS.counting)
    except Exception as error:
        accept_fault(COUNTS, error, 1, "its acceptance counts skipped")
    return result


def log(message: str) -> None:
    sys.stderr.write(f"[sglang_spec] {message}\n")
