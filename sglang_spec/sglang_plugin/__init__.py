"""The SGLang plugin: the only part of sglang_spec that imports sglang.

SGLang calls ``register`` (entry point ``sglang.srt.plugins: sglang_spec``) early in every process, then applies
the registered hooks. Registering is cheap: it checks the installed sglang version and records hook targets by
name; SGLang imports the target modules when it applies them. Unset, the tree options leave SGLang's behaviour
unchanged. ``cpu/`` runs SGLang's real server on a CPU (the project's test bed); ``models/`` holds the draft
model classes the plugin adds to SGLang; ``export`` writes draft-model folders for them.
"""

from __future__ import annotations

import os
from importlib import metadata

SUPPORTED_SGLANG = ("0.5.23",)

_WORKER = "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker"
_REGISTRY = "sglang.srt.models.registry._ModelRegistry"
HOOKS = (
    ("sglang.srt.server_args.ServerArgs.add_cli_args", "add_cli_args_after", "AFTER"),
    ("sglang.srt.server_args.ServerArgs.from_cli_args", "from_cli_args_after", "AFTER"),
    (f"{_REGISTRY}.resolve_model_cls", "registry_lookup_before", "BEFORE"),
    (f"{_REGISTRY}.is_arch_supported", "registry_lookup_before", "BEFORE"),
    (f"{_WORKER}.__init__", "draft_worker_init_after", "AFTER"),
    (f"{_WORKER}.alloc_memory_pool", "alloc_memory_pool_after", "AFTER"),
    (f"{_WORKER}.draft_forward", "draft_forward_around", "AROUND"),
    ("sglang.srt.speculative.spec_utils.select_top_k_tokens", "select_top_k_tokens_around", "AROUND"),
    ("sglang.srt.managers.schedule_batch.Req.update_spec_correct_drafts_histogram", "correct_drafts_after", "AFTER"),
    ("sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.__init__", "eagle_worker_init_after", "AFTER"),
    ("sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.verify", "verify_around", "AROUND"),
    ("sglang.srt.speculative.eagle_utils.eagle_sample", "eagle_sample_around", "AROUND"),
    ("sglang.srt.speculative.spec_utils.move_accept_tokens_to_target_kvcache", "move_accept_tokens_around", "AROUND"),
    ("sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.execute",
     "graph_execute_around", "AROUND"),
)
RESOLUTION_HOOKS = (
    ("handle_speculative_decoding", "handle_speculative_decoding_wrapper"),
    ("handle_model_capability_adjustments", "capability_adjustments_wrapper"),
)

_registered = False


class UnsupportedSGLangVersion(RuntimeError):
    pass


def check_sglang_version(version: str | None = None) -> str:
    installed = version if version is not None else metadata.version("sglang")
    if installed not in SUPPORTED_SGLANG:
        raise UnsupportedSGLangVersion(
            f"sglang_spec supports sglang {', '.join(SUPPORTED_SGLANG)}, found {installed}; install a supported "
            f"sglang or an sglang_spec release made for {installed}"
        )
    return installed


def register() -> None:
    """The entry point. Idempotent."""
    global _registered
    if _registered:
        return
    check_sglang_version()
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_spec.sglang_plugin import hooks
    from sglang_spec.sglang_plugin.cpu import ENABLE_FLAG, claim_amx_platform

    for target, name, kind in HOOKS:
        HookRegistry.register(target, getattr(hooks, name), getattr(HookType, kind))
    for step, name in RESOLUTION_HOOKS:
        register_resolution_hook(step)(getattr(hooks, name))
    from sglang.srt.entrypoints import engine

    engine.Engine.server_args_class = hooks.EngineServerArgs  # see EngineServerArgs for why not a HookRegistry hook
    if os.environ.get(ENABLE_FLAG) == "1":
        from sglang_spec.sglang_plugin.cpu import patches

        for target, name, kind in patches.HOOKS:
            HookRegistry.register(target, getattr(patches, name), getattr(HookType, kind))
        patches.install_attributes()
        claim_amx_platform()
    _registered = True
