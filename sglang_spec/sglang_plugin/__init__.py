"""The SGLang plugin: the only part of sglang_spec that imports sglang.

SGLang calls ``register`` (entry point ``sglang.srt.plugins: sglang_spec``) early in every process, then applies
the registered hooks. Registering is cheap: it checks the installed sglang version and records hook targets by
name (the table is ``hooks.HOOKS``); SGLang imports the target modules when it applies them. Importing this package
loads the hook functions (torch, Triton, the kernels), never sglang. Unset, the tree options leave SGLang's
behaviour unchanged. ``models/`` holds the draft model classes the plugin adds to SGLang; ``export`` writes
draft-model folders for them. The CPU test bed (``sglang_spec_testbed``) is a plugin of its own: nothing here
imports it.
"""

from __future__ import annotations

from importlib import metadata

from sglang_spec.sglang_plugin.hooks import HOOKS, RESOLUTION_HOOKS, startup

SUPPORTED_SGLANG = ("0.5.23",)

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

    for target, hook, kind in HOOKS:
        HookRegistry.register(target, hook, getattr(HookType, kind))
    for step, wrapper in RESOLUTION_HOOKS:
        register_resolution_hook(step)(wrapper)
    from sglang.srt.entrypoints import engine

    engine.Engine.server_args_class = startup.EngineServerArgs  # see EngineServerArgs for why not a HookRegistry hook
    _registered = True
