"""The functions the plugin hooks into SGLang 0.5.23 (registered by ``sglang_spec.sglang_plugin.register``).

| target | type | what it does |
|---|---|---|
| ``ServerArgs.add_cli_args`` | AFTER | adds the ``--speculative-tree-*`` options to SGLang's parser |
| ``ServerArgs.from_cli_args`` | AFTER | checks them, maps the tree shape onto steps / topk / draft tokens |
| resolution step ``handle_speculative_decoding`` | wrap | start-up checks against the resolved configuration |
| ``EagleDraftWorker.__init__`` | AFTER | builds the draft plan once per worker |
| ``EagleDraftWorker.draft_forward`` | AROUND | exposes the plan and the draft KV layout to the two hooks below |
| ``spec_utils.select_top_k_tokens`` | AROUND | plan-forced frontier (sequoia); exact ancestry by KV column permutation |
| ``eagle_utils.organize_draft_results`` | AROUND | the plan's slots as the verified tree (sequoia) |
| ``Req.update_spec_correct_drafts_histogram`` | AFTER | per-position acceptance metrics |

Every hot-path hook reads its settings from the worker it runs for (set at construction), never from globals.
"""

from __future__ import annotations

import contextvars
import sys
from dataclasses import dataclass

from sglang_spec.errors import SpecError
from sglang_spec.sglang_plugin.draft_tree import (
    DraftPlan,
    ancestry_permutation,
    organize_with_plan,
    select_later_with_plan,
)
from sglang_spec.sglang_plugin.metrics import METRICS
from sglang_spec.sglang_plugin.options import (
    ATTRIBUTE,
    TreeServerOptions,
    add_arguments,
    apply_to_server_args,
    from_namespace,
    validate_resolved,
)


def _fail(error: SpecError) -> None:
    """Start-up errors end the launch with one line, not a traceback."""
    raise SystemExit(f"error: {error}")


def add_cli_args_after(result, parser):
    add_arguments(parser)
    return result


def from_cli_args_after(result, cls, args):
    try:
        options = from_namespace(args)
        if options is not None:
            apply_to_server_args(options, result)
    except SpecError as error:
        _fail(error)
    return result


def handle_speculative_decoding_wrapper(server_args, previous) -> None:
    previous(server_args)
    options = getattr(server_args, ATTRIBUTE, None)
    if options is None:
        return
    from sglang.srt.arg_groups.overrides import model_config_of, resolving_view

    config = resolving_view(server_args)
    try:
        model_config = model_config_of(server_args)
        is_mla = "MLA" in str(getattr(model_config, "attention_arch", ""))
    except Exception:  # no model config (dummy launches): the MLA check cannot apply
        is_mla = False
    try:
        validate_resolved(options, _WithMla(config, is_mla))
    except SpecError as error:
        _fail(error)


class _WithMla:
    """The resolved view plus whether the target uses MLA."""

    def __init__(self, config, is_mla: bool) -> None:
        self._config = config
        self._sglang_spec_is_mla = is_mla

    def __getattr__(self, name):
        return getattr(self._config, name)


def current_options() -> TreeServerOptions | None:
    from sglang.srt.runtime_context import get_server_args

    try:
        return getattr(get_server_args(), ATTRIBUTE, None)
    except Exception:  # nothing published in this process
        return None


@dataclass
class DraftSetup:
    """Built once per draft worker: the static plan (sequoia) and whether to keep exact ancestry."""

    plan: DraftPlan | None
    exact_ancestry: bool
    topk: int
    steps: int


def draft_worker_init_after(result, worker, *args, **kwargs):
    options = current_options()
    if options is not None:
        plan = None
        if options.policy == "sequoia":
            from sglang_spec.tree.sequoia import sequoia_plan
            from sglang_spec.tree.token_tree import TokenTree

            sequoia = sequoia_plan(options.load_profile(), options.budget, options.depth, max_branch=worker.topk)
            tree = TokenTree.from_parents(list(sequoia.parents), ranks=list(sequoia.ranks))
            plan = DraftPlan.from_tree(tree, worker.topk, worker.speculative_num_steps)
        exact = worker.topk > 1 and supports_row_permutation(worker.draft_runner.token_to_kv_pool)
        if worker.topk > 1 and not exact:
            log("draft KV pool is not slot-major (HND / paged layout): exact per-branch ancestry is off, "
                "branches keep SGLang's shared-column history")
        worker._sglang_spec = DraftSetup(plan, exact_ancestry=exact, topk=worker.topk,
                                         steps=worker.speculative_num_steps)
    return result


def supports_row_permutation(pool) -> bool:
    """True for pools whose buffers are [slots, ...] per layer (MHA NHD k/v, MLA latent)."""
    if getattr(pool, "use_hnd", False):
        return False
    return any(getattr(pool, name, None) for name in ("k_buffer", "kv_buffer"))


@dataclass
class DraftContext:
    """What one draft_forward call exposes to the inner hooks."""

    setup: DraftSetup
    step_locs: object  # [steps, bs*topk] per-step draft KV slots
    pool: object  # the draft model's KV pool


_DRAFT: contextvars.ContextVar[DraftContext | None] = contextvars.ContextVar("sglang_spec_draft", default=None)


def draft_forward_around(original, worker, forward_batch, *args, **kwargs):
    setup = getattr(worker, "_sglang_spec", None)
    if setup is None or forward_batch.forward_mode.is_idle():
        return original(worker, forward_batch, *args, **kwargs)
    from sglang.srt.speculative.eagle_utils import per_step_draft_out_cache_loc

    step_locs = per_step_draft_out_cache_loc(forward_batch.out_cache_loc, forward_batch.batch_size, setup.topk,
                                             setup.steps)
    token = _DRAFT.set(DraftContext(setup, step_locs, worker.draft_runner.token_to_kv_pool))
    try:
        return original(worker, forward_batch, *args, **kwargs)
    finally:
        _DRAFT.reset(token)


def select_top_k_tokens_around(original, i, topk_p, topk_index, hidden_states, scores, topk):
    context = _DRAFT.get()
    if context is None or i == 0:
        return original(i, topk_p, topk_index, hidden_states, scores, topk)
    setup = context.setup
    if setup.plan is not None:
        result = select_later_with_plan(i, topk_p, topk_index, hidden_states, scores, topk, setup.plan)
    else:
        result = original(i, topk_p, topk_index, hidden_states, scores, topk)
    if setup.exact_ancestry and i < setup.steps - 1:  # the last selection runs no further forward
        parent_beam = (result[3][2] - (topk * topk * (i - 1) + topk)) // topk
        target, source = ancestry_permutation(parent_beam, context.step_locs, i)
        permute_kv(context.pool, target, source)
    return result


def permute_kv(pool, target, source) -> None:
    """pool[target] = pool[source] for every layer buffer, as a gather then a scatter (safe for permutations).
    NHD pools only (MHA k/v buffers, MLA latent); other layouts are refused at start-up."""
    target, source = target.long(), source.long()
    for name in ("k_buffer", "v_buffer", "kv_buffer"):
        for buffer in getattr(pool, name, None) or ():
            buffer[target] = buffer[source]


def organize_draft_results_around(original, score_list, token_list, parents_list, num_draft_token):
    context = _DRAFT.get()
    if context is not None and context.setup.plan is not None:
        return organize_with_plan(score_list, token_list, parents_list, num_draft_token, context.setup.plan)
    return original(score_list, token_list, parents_list, num_draft_token)


def correct_drafts_after(result, request, num_correct_drafts):
    METRICS.record(num_correct_drafts)
    return result


def log(message: str) -> None:
    sys.stderr.write(f"[sglang_spec] {message}\n")
