"""The functions the plugin hooks into SGLang 0.5.23, by concern, and the table ``register`` installs (the index).

| target | type | module: what it does |
|---|---|---|
| ``ServerArgs.add_cli_args`` / ``from_cli_args`` | AFTER | startup: the ``--speculative-tree-*`` options; tree shape -> draft shape |
| ``Engine.server_args_class`` (``EngineServerArgs``) | attribute | startup: the same options as ``sgl.Engine`` keywords |
| resolution ``handle_speculative_decoding`` | wrap | startup: checks against the resolved speculative settings |
| resolution ``handle_model_capability_adjustments`` | wrap | startup: the resolved attention backends can run trees |
| ``_ModelRegistry.resolve_model_cls`` / ``is_arch_supported`` | BEFORE | startup: our draft model classes (``draft_models``) |
| ``attention_backend_setup._build_resolved_backend`` | AFTER | startup: ``--speculative-tree-mla-verify``'s back-end |
| ``TokenizerManager.__init__`` | AFTER | startup: the context a tree server reserves: none where the model's positions hold the tree past it |
| ``http_server.ORJSONRequest.json`` | AROUND | requests: an OpenAI completion body SGLang's request models cannot read (not an object) refused (400, one line), not a 500 |
| ``GenerateReqInput.normalize_batch_and_arguments`` | AROUND | requests: per-prompt lists that do not fit the prompts refused (400, one line), not a 500 |
| ``TokenizerManager._validate_one_request`` | AROUND | requests: a prompt no forward can serve refused (400, one line): empty, token ids outside the vocabulary, top_k or top logprobs past what the sampler holds |
| ``KVCacheConfigurator._build_req_to_token_pool``, ``allocation_sizing.get_req_to_token_extra_context_len`` | AROUND | startup: a tree server's req_to_token rows hold a decode step's draft slots past the context |
| ``allocation_sizing.get_alloc_reserve_per_decode`` | AROUND | startup: without the overlap loop a tree server's request holds one decode step's KV window past its committed tokens, not two |
| ``SchedulerBatchResultProcessor._apply_prefill_grammar`` / ``_accept_grammar_tokens`` | AFTER | requests: a grammar that ends the output before ``min_new_tokens``: the client's abort (400, one line), not a 500 |
| ``EagleDraftWorker.__init__`` | AFTER | draft: the worker's state and its drafter (chosen once); metrics |
| ``EagleDraftWorker.alloc_memory_pool`` | AFTER | draft: the draft KV pool can give every branch its own ancestry |
| ``EagleDraftWorker.draft`` | AROUND | draft: an eager drafter sees the batch's requests; a guard's head faults counted |
| ``EagleDraftWorker.draft_forward`` | AROUND | draft: the server's drafter; a draft that raises: the filler tree for that batch (counted, one log line) |
| ``EagleDraftWorker._draft_extend_for_prefill`` / ``_for_decode`` | AROUND | draft: skipped where no tree reads the head (lookup); an eager decode extend's LM head over the rows SGLang reads |
| ``spec_utils.select_top_k_tokens`` | AROUND | draft: SGLang's loop (chain, eagle) with exact ancestry by KV column copy |
| ``LogitsMetadata.from_forward_batch`` | AFTER | draft: the plugin's loop computes the head's logits for the beams that can grow only |
| ``EAGLEWorkerV2.forward_batch_generation`` | AROUND | auto: each decode step's verify size, planned for the batch, run and timed |
| ``EAGLEWorkerV2.__init__`` / ``.verify`` | AFTER / AROUND | accept: the worker's fused accept and committed outputs; the verify step's state, a ragged step's compacted forward |
| ``IntelAMXAttnBackend._build_extend_metadata`` | AROUND | accept: a ragged verify forward's per-request lengths |
| ``eagle_utils.eagle_sample`` | AROUND | accept: penalties per node; the fused accept or SGLang's; the accept to the drafter and the counts |
| ``spec_utils.move_accept_tokens_to_target_kvcache`` | AROUND | accept: the fused path's KV moved by our kernel |
| ``DecodeCudaGraphRunner.execute`` | AROUND | accept: fused under CUDA graphs: static tree links in, greedy accept out |
| ``DecodeCudaGraphRunner.__init__``, ``ragged_verify_compact_graphs_enabled`` | AROUND | accept: a ragged server's verify graphs in SGLang's compact ragged mode (token tiers) |
| ``DecodeCudaGraphRunner.get_spec_info`` | AFTER | accept: a tier's capture carries its ragged layout |
| ``Req.update_spec_correct_drafts_histogram`` | AFTER | accept: per-position acceptance metrics |
| ``TokenizerManager.__init__``, ``RequestLogger.log_finished_request`` | AFTER | adapt: finished requests' token ids to ``--speculative-tree-traffic-log`` |
| ``SchedulerWeightUpdaterManager.update_weights_from_{tensor,distributed,disk}`` | AFTER | adapt: an update that reached the draft runner is a head swap (``WorkerState.swap_head``, metrics per head) |

Every hot-path hook reads its settings from the worker's state (``state.WorkerState``, set at construction), never
from globals. Start-up failures end the launch with one ``error:`` line. A fault in a hook on a request or a batch
is counted, logged in one line and falls back to SGLang's own behaviour (``faults``); a request no forward can
serve is refused in one line (``requests``).
"""

from __future__ import annotations

from typing import Callable

from sglang_spec.sglang_plugin.hooks import accept, adapt, auto, draft, requests, startup

_WORKER = "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker"
_SPEC_WORKER = "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2"
_REGISTRY = "sglang.srt.models.registry._ModelRegistry"
_RESULTS = "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"
_GRAPHS = "sglang.srt.model_executor.runner.decode_cuda_graph_runner"
_UPDATER = "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"
# (target, function, HookType name) for SGLang's HookRegistry
HOOKS: tuple[tuple[str, Callable, str], ...] = (
    ("sglang.srt.server_args.ServerArgs.add_cli_args", startup.add_cli_args_after, "AFTER"),
    ("sglang.srt.server_args.ServerArgs.from_cli_args", startup.from_cli_args_after, "AFTER"),
    (f"{_REGISTRY}.resolve_model_cls", startup.registry_lookup_before, "BEFORE"),
    (f"{_REGISTRY}.is_arch_supported", startup.registry_lookup_before, "BEFORE"),
    ("sglang.srt.model_executor.model_runner_components.attention_backend_setup._build_resolved_backend",
     startup.mla_tree_verify_backend_after, "AFTER"),
    ("sglang.srt.managers.tokenizer_manager.TokenizerManager.__init__", startup.tokenizer_manager_init_after,
     "AFTER"),
    ("sglang.srt.entrypoints.http_server.ORJSONRequest.json", requests.request_json_around, "AROUND"),
    ("sglang.srt.managers.io_struct.GenerateReqInput.normalize_batch_and_arguments", requests.normalize_around,
     "AROUND"),
    ("sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
     requests.validate_one_request_around, "AROUND"),
    (f"{_RESULTS}._apply_prefill_grammar", requests.grammar_abort_after, "AFTER"),
    (f"{_RESULTS}._accept_grammar_tokens", requests.grammar_abort_after, "AFTER"),
    ("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_req_to_token_pool",
     startup.build_req_to_token_pool_around, "AROUND"),
    ("sglang.srt.mem_cache.allocation_sizing.get_req_to_token_extra_context_len",
     startup.req_to_token_headroom_around, "AROUND"),
    ("sglang.srt.mem_cache.allocation_sizing.get_alloc_reserve_per_decode", startup.decode_reserve_around, "AROUND"),
    (f"{_WORKER}.__init__", draft.draft_worker_init_after, "AFTER"),
    (f"{_WORKER}.alloc_memory_pool", draft.alloc_memory_pool_after, "AFTER"),
    (f"{_WORKER}.draft", draft.draft_around, "AROUND"),
    (f"{_WORKER}.draft_forward", draft.draft_forward_around, "AROUND"),
    (f"{_WORKER}._draft_extend_for_prefill", draft.draft_extend_for_prefill_around, "AROUND"),
    (f"{_WORKER}._draft_extend_for_decode", draft.draft_extend_for_decode_around, "AROUND"),
    ("sglang.srt.speculative.spec_utils.select_top_k_tokens", draft.select_top_k_tokens_around, "AROUND"),
    ("sglang.srt.layers.logits_processor.LogitsMetadata.from_forward_batch", draft.logits_metadata_after, "AFTER"),
    (f"{_SPEC_WORKER}.forward_batch_generation", auto.forward_batch_generation_around, "AROUND"),
    (f"{_SPEC_WORKER}.__init__", accept.eagle_worker_init_after, "AFTER"),
    (f"{_SPEC_WORKER}.verify", accept.verify_around, "AROUND"),
    ("sglang.srt.layers.attention.intel_amx_backend.IntelAMXAttnBackend._build_extend_metadata",
     accept.build_extend_metadata_around, "AROUND"),
    ("sglang.srt.speculative.eagle_utils.eagle_sample", accept.eagle_sample_around, "AROUND"),
    ("sglang.srt.speculative.spec_utils.move_accept_tokens_to_target_kvcache", accept.move_accept_tokens_around,
     "AROUND"),
    (f"{_GRAPHS}.DecodeCudaGraphRunner.execute", accept.graph_execute_around, "AROUND"),
    (f"{_GRAPHS}.DecodeCudaGraphRunner.__init__", accept.graph_runner_init_around, "AROUND"),
    (f"{_GRAPHS}.ragged_verify_compact_graphs_enabled", accept.compact_graphs_around, "AROUND"),
    (f"{_GRAPHS}.DecodeCudaGraphRunner.get_spec_info", accept.graph_spec_info_after, "AFTER"),
    ("sglang.srt.managers.schedule_batch.Req.update_spec_correct_drafts_histogram", accept.correct_drafts_after,
     "AFTER"),
    ("sglang.srt.managers.tokenizer_manager.TokenizerManager.__init__", adapt.tokenizer_manager_init_after, "AFTER"),
    ("sglang.srt.utils.request_logger.RequestLogger.log_finished_request", adapt.finished_request_after, "AFTER"),
    (f"{_UPDATER}.update_weights_from_tensor", adapt.update_from_tensor_after, "AFTER"),
    (f"{_UPDATER}.update_weights_from_distributed", adapt.update_from_distributed_after, "AFTER"),
    (f"{_UPDATER}.update_weights_from_disk", adapt.update_from_disk_after, "AFTER"),
)
# (resolution step, wrapper) for SGLang's register_resolution_hook
RESOLUTION_HOOKS: tuple[tuple[str, Callable], ...] = (
    ("handle_speculative_decoding", startup.handle_speculative_decoding_wrapper),
    ("handle_model_capability_adjustments", startup.capability_adjustments_wrapper),
)

