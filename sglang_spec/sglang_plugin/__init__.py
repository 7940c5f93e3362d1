"""The SGLang plugin: the only part of sglang_spec that imports sglang.

SGLang calls ``register`` (entry point ``sglang.srt.plugins: sglang_spec``) early in every process, then applies
the registered hooks. Registering is cheap: it checks the installed sglang version and records hook targets by
name (the tables are in ``hooks``); SGLang imports the target modules when it applies them. Importing this package
loads the hook functions and the CPU harness's stand-ins (torch, Triton, the kernels), never sglang: the harness's
``sitecustomize`` imports it before sglang is imported. Unset, the tree options leave SGLang's behaviour
unchanged. ``cpu/`` runs SGLang's real server on a CPU (the project's test bed); ``models/`` holds the draft
model classes the plugin adds to SGLang; ``export`` writes draft-model folders for them.
"""

from __future__ import annotations

import importlib
import os
from importlib import metadata

from sglang_spec.sglang_plugin import hooks
from sglang_spec.sglang_plugin.cpu import ENABLE_FLAG, claim_amx_platform, patches, profile, threads, tree_mask
from sglang_spec.errors import SpecError
from sglang_spec.sglang_plugin.hooks import HOOKS, RESOLUTION_HOOKS
from sglang_spec.sglang_plugin.options import ATTRIBUTE, validate_mla_verify_cache

SUPPORTED_SGLANG = ("0.5.23",)
# --speculative-tree-mla-verify: the target's attention back-end wrapped once SGLang has built it
MLA_TREE_VERIFY_HOOK = ("sglang.srt.model_executor.model_runner_components.attention_backend_setup."
                        "_build_resolved_backend")
MLA_TREE_BACKEND_MODULE = "sglang_spec.sglang_plugin.mla_tree_backend"

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

    for target, name, kind in HOOKS:
        HookRegistry.register(target, getattr(hooks, name), getattr(HookType, kind))
    HookRegistry.register(MLA_TREE_VERIFY_HOOK, mla_tree_verify_backend_after, HookType.AFTER)
    for step, name in RESOLUTION_HOOKS:
        register_resolution_hook(step)(getattr(hooks, name))
    register_resolution_hook("handle_model_capability_adjustments")(mla_verify_cache_check)
    from sglang.srt.entrypoints import engine

    engine.Engine.server_args_class = hooks.EngineServerArgs  # see EngineServerArgs for why not a HookRegistry hook
    if os.environ.get(ENABLE_FLAG) == "1":
        for target, name, kind in patches.hooks(patches.overlap_from_environment()):
            HookRegistry.register(target, getattr(patches, name), getattr(HookType, kind))
        for target, hook, kind in tree_mask.hooks(tree_mask.mode_from_environment()):
            HookRegistry.register(target, hook, getattr(HookType, kind))
        for target, hook, kind in threads.hooks(threads.prefill_threads_from_environment()):
            HookRegistry.register(target, hook, getattr(HookType, kind))
        patches.install_attributes()
        claim_amx_platform()
        if os.environ.get(profile.PROFILE_ENV):
            for target, name, kind in profile.HOOKS:
                HookRegistry.register(target, getattr(profile, name), getattr(HookType, kind))
    _registered = True


def mla_tree_verify_backend_after(result, *args, **kwargs):
    """The hook behind ``--speculative-tree-mla-verify`` (``mla_tree_backend.build_backend_after``), its module
    imported on first use (as ``hooks.MODEL_CLASSES`` are): it subclasses SGLang's AttentionBackend, so it imports
    sglang, which this package must not at import time (the CPU harness imports it first)."""
    return importlib.import_module(MLA_TREE_BACKEND_MODULE).build_backend_after(result, *args, **kwargs)


def mla_verify_cache_check(server_args, previous) -> None:
    """After SGLang's capability adjustments: ``--speculative-tree-mla-verify`` refuses a quantized KV cache in one
    line (``options.validate_mla_verify_cache``), before any worker starts."""
    previous(server_args)
    options = getattr(server_args, ATTRIBUTE, None)
    if options is None or options.mla_verify is None:
        return
    from sglang.srt.arg_groups.overrides import resolving_view

    try:
        validate_mla_verify_cache(options, getattr(resolving_view(server_args), "kv_cache_dtype", None))
    except SpecError as error:
        raise hooks.StartupError(error) from None
