"""``drafter_class`` and ``drafter_for``: the one place a server's drafter is chosen (its class before start-up, the
drafter at the draft worker's start-up)."""

from __future__ import annotations

import torch

from sglang_spec.sglang_plugin.drafters.base import ServedDrafter
from sglang_spec.sglang_plugin.drafters.beam_selection import DraftLoop
from sglang_spec.sglang_plugin.drafters.device_context import DeviceHybridDrafter, DeviceLookupDrafter
from sglang_spec.sglang_plugin.drafters.head_guard import HeadGuard
from sglang_spec.sglang_plugin.drafters.head_loop import HeadLoopDrafter
from sglang_spec.sglang_plugin.drafters.host_context import HostContextDrafter
from sglang_spec.sglang_plugin.drafters.sglang_loop import SGLangLoopDrafter
from sglang_spec.sglang_plugin.level_costs import LevelCosts
from sglang_spec.sglang_plugin.metrics import SOURCES
from sglang_spec.sglang_plugin.options import TreeServerOptions
from sglang_spec.tree.encode_sglang import SGLangDraftEncoding


def drafter_class(options: TreeServerOptions) -> type[ServedDrafter]:
    """The drafter a server with ``options`` serves, as a class: what ``drafter_for`` builds, known before the
    draft worker starts (the target's decode graphs are captured first, and ragged trees shape them)."""
    if options.own_loop:
        return HeadLoopDrafter
    if not options.uses_context:
        return SGLangLoopDrafter
    if options.context_on == "device":
        return DeviceHybridDrafter if options.tree_policy().uses_head else DeviceLookupDrafter
    return HostContextDrafter


def drafter_for(options: TreeServerOptions, width: int, steps: int, budget: int, device: torch.device | str,
                filler: SGLangDraftEncoding, dp_attention: bool = False) -> ServedDrafter:
    """The drafter of a server with ``options`` and SGLang's draft shape (``width`` beams, ``steps`` draft steps,
    ``budget`` verified nodes a request); ``filler``: the tree a guarded request verifies. Under DP attention the
    logits processor gathers every rank's rows, so the head runs over all the beams (no live-row budget), and a
    context tree's draft runs every head level (the ranks' head forwards pair up).
    Raises ``SpecError`` (one line) where the options do not fit the shape."""
    chosen = drafter_class(options)
    if chosen is HeadLoopDrafter:
        loop = DraftLoop.build(width, options.topk, steps, options.draft_plan(), device,
                               budget=None if dp_attention else budget)
        return HeadLoopDrafter(loop, HeadGuard.build(filler, device))
    if chosen is SGLangLoopDrafter:
        return SGLangLoopDrafter(width, steps)
    policy = options.tree_policy()
    context: ServedDrafter
    if chosen is DeviceHybridDrafter:
        context = DeviceHybridDrafter(policy, steps, budget, HeadGuard.build(filler, device), SOURCES)
    elif chosen is DeviceLookupDrafter:
        context = DeviceLookupDrafter(policy, steps, budget, SOURCES)
    else:
        context = HostContextDrafter(policy, steps, budget, SOURCES)
        # head levels priced per batch size from the served steps (``level_costs``); not under DP attention,
        # where every rank runs every level anyway (``all_head_rounds``): leaving one out saves nothing
        if options.auto and not dp_attention:
            context.level_costs = LevelCosts()
    context.all_head_rounds = dp_attention
    return context
