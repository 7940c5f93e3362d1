"""Hooks of a server's start: the tree options on SGLang's command line and ``sgl.Engine``, the checks against the
resolved configuration, the draft model classes, the context a tree server reserves, the req_to_token rows'
headroom and the KV a request holds past its committed tokens. Every failure ends the launch with one ``error:``
line (``StartupError``)."""

from __future__ import annotations

import importlib
import os

from sglang_spec.errors import SpecError
from sglang_spec.sglang_plugin.fused_accept import ACCEPT_KERNELS_ENV, accept_kernels
from sglang_spec.sglang_plugin.messages import StartupError
from sglang_spec.sglang_plugin.options import (
    BACKEND_FIELDS,
    KEYWORDS,
    TreeServerOptions,
    add_arguments,
    apply_to_server_args,
    from_namespace,
    from_values,
    validate_backends,
    validate_mla_verify_cache,
    validate_model,
    validate_requested,
    validate_speculative,
)
from sglang_spec.sglang_plugin.state import TREE_POOL, attach_options, options_of
from sglang_spec.sglang_plugin import traffic_log

PLUGIN_PACKAGE = "sglang_spec.sglang_plugin"
# our draft model classes, by the architecture name a draft folder's config.json gives (imported on first use)
MODEL_CLASSES = {"LlamaForCausalLMNextN": "sglang_spec.sglang_plugin.draft_models.llama_nextn"}
# --speculative-tree-mla-verify's back-end: it subclasses SGLang's AttentionBackend, so it is imported on first use
MLA_TREE_BACKEND_MODULE = "sglang_spec.sglang_plugin.mla_tree_backend"


# ---------------------------------------------------------------------------------------------- options
def add_cli_args_after(result, parser):
    add_arguments(parser)
    traffic_log.add_arguments(parser)
    return result


def from_cli_args_after(result, cls, args):
    try:
        options = from_namespace(args)
        if options is not None:
            apply_to_server_args(options, result)
            attach_options(result, options)
        path = traffic_log.checked_path(getattr(args, "speculative_tree_traffic_log", None))
        if path is not None:
            setattr(result, traffic_log.ATTRIBUTE, path)
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
            try:
                apply_to_server_args(options, server_args)
            except SpecError as error:
                raise StartupError(error) from None
            attach_options(server_args, options)
        return server_args


# ---------------------------------------------------------------------------------------------- start-up checks
def handle_speculative_decoding_wrapper(server_args, previous) -> None:
    options = options_of(server_args)
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


def unapplied_hooks() -> list[str]:
    """Targets of ours (hooks of this package) that SGLang's HookRegistry failed to patch in this process."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    ours = [target for target, entries in HookRegistry._hooks.items()
            if any(getattr(hook, "__module__", "").startswith(PLUGIN_PACKAGE) for _, hook, _ in entries)]
    return [target for target in ours if target not in HookRegistry._patched]


def capability_adjustments_wrapper(server_args, previous) -> None:
    previous(server_args)
    options = options_of(server_args)
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
        validate_mla_verify_cache(options, getattr(config, "kv_cache_dtype", None))
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


# ---------------------------------------------------------------------------------------------- model classes
def registry_lookup_before(registry, *args, **kwargs):
    """Puts our draft model classes into SGLang's model registry the first time it is consulted."""
    for architecture, module_name in MODEL_CLASSES.items():
        if architecture not in registry.models:
            registry.models[architecture] = getattr(importlib.import_module(module_name), architecture)
    return None


def mla_tree_verify_backend_after(result, *args, **kwargs):
    """``--speculative-tree-mla-verify``: the target's attention back-end wrapped once SGLang has built it
    (``mla_tree_backend.build_backend_after``)."""
    return importlib.import_module(MLA_TREE_BACKEND_MODULE).build_backend_after(result, *args, **kwargs)


# ---------------------------------------------------------------------------------------------- context limit
def tokenizer_manager_init_after(result, manager, *args, **kwargs):
    """The context a tree server reserves for its trees (``TreeServerOptions.reserved_context``): none where the
    model's positions hold the tree past the context length, so it takes every prompt a plain server takes."""
    options: TreeServerOptions | None = options_of(manager.server_args)
    if options is not None:
        config = getattr(manager.model_config, "hf_text_config", None)
        max_positions = getattr(config, "max_position_embeddings", None)
        manager.num_reserved_tokens = options.reserved_context(manager.context_len, max_positions,
                                                               manager.num_reserved_tokens)
    return result


def build_req_to_token_pool_around(original, configurator, *args, **kwargs):
    """Marks the req_to_token pool a tree server builds (``req_to_token_headroom_around`` widens its rows)."""
    token = TREE_POOL.set(options_of(configurator.server_args) is not None)
    try:
        return original(configurator, *args, **kwargs)
    finally:
        TREE_POOL.reset(token)


def req_to_token_headroom_around(original, *args, **kwargs):
    """A tree server's req_to_token rows hold a request's committed tokens plus what SGLang maps past them each
    decode step (``get_alloc_reserve_per_decode``: max(W * D, budget + 1), twice under the overlap loop,
    ``decode_reserve_around``). SGLang sizes the headroom to
    budget + 5, enough only while its tokenizer keeps every request max(W * D, budget + 1) short of the context;
    with W * D past it (specexec 15/4/4: 60 slots, a 120-slot reserve) a request near the end of the context ran
    its row over, and with no reservation (``tokenizer_manager_init_after``) any tree could."""
    extra = original(*args, **kwargs)
    if not TREE_POOL.get():
        return extra
    from sglang.srt.mem_cache.allocation_sizing import get_alloc_reserve_per_decode

    return max(extra, get_alloc_reserve_per_decode())


def decode_reserve_around(original):
    """The KV slots a tree server's request holds past its committed tokens each decode step. SGLang reserves twice
    a step's window (``get_alloc_len_per_decode``: max(W * D, budget + 1)), a double buffer for the overlap loop,
    which prepares the next step before the last one's accepted tokens are committed. Without that loop a step is
    prepared after the last one is committed, so one window holds everything it writes (draft, verify, draft
    extend); the second would only keep cached prefixes out of the pool. SGLang's own speculation is left as it is.
    """
    from sglang.srt.mem_cache.allocation_sizing import get_alloc_len_per_decode
    from sglang.srt.runtime_context import get_schedule, get_server_args

    if options_of(get_server_args()) is None or not get_schedule().disable_overlap_schedule:
        return original()
    return get_alloc_len_per_decode()
