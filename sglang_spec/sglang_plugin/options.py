"""Tree-speculation server options: parsed by SGLang's own argparse parser (or taken as ``sgl.Engine`` keyword
arguments), attached to its ServerArgs, checked against the resolved configuration at start-up.

    --speculative-tree-policy {chain,eagle,sequoia,specexec,lookup,hybrid}   default: unset, SGLang's behaviour
    --speculative-tree-budget N          draft nodes per request (SGLang's num_draft_tokens = N + 1)
    --speculative-tree-depth D           draft tokens on a path at most (default: lookup / hybrid the budget); head
                                         trees draft it in D steps (SGLang's speculative_num_steps), context trees
                                         in their head rounds (``TreeServerOptions.draft_steps``)
    --speculative-tree-topk K            children per expanded node (the node's top-K draft candidates)
    --speculative-tree-width W           most nodes expanded on one level (SGLang's speculative_eagle_topk):
                                         eagle W = K; sequoia: its tree's widest level; specexec: a static
                                         bound, by default the most beams that can grow (exact SpecExec)
    --speculative-acceptance-profile P   JSON profile for sequoia (``sglang-spec calibrate``)
    --speculative-tree-accept {sglang,fused}   who accepts the verified tree: SGLang's eagle_sample (default)
                                         or the project's fused verify + accept kernels and KV commit
    --speculative-tree-mla-verify flashinfer   MLA models (DeepSeek): the target verifies trees with FlashInfer's
                                         MLA decode over the prefix + the tree kernel, merged by lse
                                         (``mla_tree_backend``); with --attention-backend flashinfer
    --speculative-tree-context-on {host,device}   lookup / hybrid: where their trees grow (default host); device
                                         keeps each request's history on the device and grows, pads and encodes
                                         the trees there, the head's rounds included, with no host read in the
                                         draft step (``device_history``)
    --speculative-tree-auto              each decode step verifies the size the planner chooses for its batch
                                         (``step_planner``); with it:
    --speculative-tree-verify-sizes S    the verify sizes a step may take, a comma list of tokens a request
                                         (default: every size without decode graphs, a few tiers with
                                         them; "1,N" with N the full tree is the whole batch on or off,
                                         never a share per request)
    --speculative-tree-step-cap C        a tree step's predicted time at most C plain steps' (default 2)
    --speculative-tree-head-rest N       after N plain steps in a row, plain steps leave the head's draft extend
                                         out until a tree is chosen (``step_planner``, the head at rest; default
                                         8; 0: never)

This module imports no sglang; the checks that need resolved values take a view of the ServerArgs.
"""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from sglang_spec.errors import SpecError
from sglang_spec.sglang_plugin.drafters.beam_selection import (DraftPlan, live_beams, specexec_width, usable_slots,
                                                               widest_level)
from sglang_spec.tree.encode_sglang import fewest_spec_steps
from sglang_spec.tree.policies import CONTEXT_POLICY_NAMES, HEAD_FREE_POLICY_NAMES, POLICY_NAMES, TreePolicy
from sglang_spec.tree.profile import AcceptanceProfile

TREE_ALGORITHMS = ("EAGLE", "NEXTN")
DEFAULTS = {"budget": 8, "depth": 4, "topk": 4}
DEFAULT_STEP_CAP = 2.0  # --speculative-tree-step-cap: a tree step's predicted time at most this many plain steps'
# --speculative-tree-head-rest: plain steps in a row after which plain steps leave the head's draft extend out. A
# tree chosen after a rest waits one warm-up step, so resting after fewer would delay the trees of traffic whose
# plain and tree steps alternate; where trees do not pay, the runs are hundreds of steps long
DEFAULT_HEAD_REST = 8

# specexec's default width is the most beams that can grow (``draft_loop.specexec_width``): SpecExec expands
# every node of its best-``budget`` set with children, and levels get wide (held-out HumanEval 130-133, shipped
# SmolLM2 head, K = 4, depth 5-6: up to 12 / 20 / 47 nodes on one level at budgets 16 / 32 / 64), but a node ranked
# below budget-dependent bounds on its level never has a child in the tree (12 / 23 / 48 beams at those shapes,
# 11 at 15/4/4), so that width is exact for every request; a smaller W trades accept length for rows per step
# policies that run the plugin's own draft loop (the others run SGLang's)
OWN_LOOP_POLICIES = ("sequoia", "specexec")
# attention backends whose target-verify and draft-decode paths take a tree (sglang-internals §9); MLA models
# only fa3 / triton on a GPU. intel_amx is SGLang's CPU backend (QLEN_ONLY tree mask; the CPU bed's stand-in
# also reads FULL_MASK, sglang_spec_testbed/tree_mask.py), CPU only.
MHA_TREE_BACKENDS = ("flashinfer", "fa3", "triton", "fa4")
MLA_TREE_BACKENDS = ("fa3", "triton")
CPU_TREE_BACKENDS = ("intel_amx",)
# ServerArgs fields holding an attention backend; None means "falls back to attention_backend"
BACKEND_FIELDS = ("attention_backend", "decode_attention_backend", "prefill_attention_backend",
                  "speculative_draft_attention_backend")
# the Python-side names of the options (sgl.Engine keyword arguments == argparse dests)
KEYWORDS = ("speculative_tree_policy", "speculative_tree_budget", "speculative_tree_depth", "speculative_tree_topk",
            "speculative_tree_width", "speculative_acceptance_profile", "speculative_tree_accept",
            "speculative_tree_auto", "speculative_tree_mtp_levels", "speculative_tree_mla_verify",
            "speculative_tree_context_on", "speculative_tree_verify_sizes", "speculative_tree_step_cap",
            "speculative_tree_head_rest")
ACCEPT_CHOICES = ("sglang", "fused")
# --speculative-tree-mla-verify: the target's MLA tree verify as a cascade on FlashInfer (``mla_tree_backend``)
MLA_VERIFY_CHOICES = ("flashinfer",)
# --speculative-tree-context-on: where lookup / hybrid trees grow (``drafters.host_context``;
# ``drafters.device_context``)
CONTEXT_ON_CHOICES = ("host", "device")
# the target backends it serves under: FlashInfer's MLA back-end on a GPU (prefill / decode stay SGLang's), the
# CPU bed's intel_amx (prefill / decode the bed's stand-ins, the verify through the CPU twin of FlashInfer)
MLA_VERIFY_TARGET_BACKENDS = {"cpu": ("intel_amx",), "gpu": ("flashinfer",)}
TARGET_BACKEND_FIELDS = ("attention_backend", "decode_attention_backend", "prefill_attention_backend")


@dataclass(frozen=True)
class TreeServerOptions:
    """policy, budget (draft nodes), depth (draft tokens on a path at most; ``draft_steps``), topk (K, children
    per expanded node), width (W, SGLang's speculative_eagle_topk: nodes expanded per level), profile_path
    (sequoia), accept (who accepts: sglang or fused), auto (each step's verify size chosen by the planner:
    ``step_planner``), verify_sizes (the sizes it may choose, tokens a request; None: the default for the device),
    step_cap (a tree step at most this many plain steps' predicted time), head_rest (plain steps in a row after
    which plain steps leave the head's draft extend out; 0: never; None: ``DEFAULT_HEAD_REST``, off under DP
    attention), mtp_levels (hybrid: head forwards below
    the root's children; None = the policy's default), mla_verify (None: the
    attention back-end's own verify; "flashinfer": the MLA cascade of ``mla_tree_backend``), context_on (lookup /
    hybrid: their trees grown on the host or on the device)."""

    policy: str
    budget: int
    depth: int
    topk: int
    width: int
    profile_path: str | None = None
    accept: str = "sglang"
    auto: bool = False
    mtp_levels: int | None = None
    mla_verify: str | None = None
    context_on: str = "host"
    verify_sizes: tuple[int, ...] | None = None
    step_cap: float = DEFAULT_STEP_CAP
    head_rest: int | None = None

    @property
    def grows_any_size(self) -> bool:
        """Whether its drafter grows trees of any budget a step (lookup / hybrid on the host), so the planner may
        verify sizes between a plain step and the full tree."""
        return self.uses_context and self.context_on == "host"

    @property
    def draft_steps(self) -> int:
        """SGLang's draft steps (speculative_num_steps) for these options. A head tree drafts a level a step:
        ``depth``. A context tree (lookup / hybrid) runs only its head rounds (none for lookup); its depth past them
        comes from the context, and the verify input's accept bound carries it (``hooks.draft``). Its steps are what
        the head rounds and SGLang's tree encoding need (``fewest_spec_steps``), never more than the depth: a request
        holds ``max(width * steps, budget + 1)`` KV slots each decode step (twice under the overlap loop:
        ``hooks.startup.decode_reserve_around``), so steps it would not draft are memory the radix cache loses."""
        if not self.uses_context:
            return self.depth
        policy = self.tree_policy()
        needed = max(policy.best_first_shape().head_rounds + 1, fewest_spec_steps(self.width, self.budget))
        return min(self.depth, needed)

    @property
    def own_loop(self) -> bool:
        """Whether the plugin's device draft loop runs (sequoia, specexec)."""
        return self.policy in OWN_LOOP_POLICIES

    @property
    def uses_context(self) -> bool:
        """Whether trees copy from the request's context (lookup, hybrid: ``drafters.host_context``,
        ``drafters.device_context``)."""
        return self.policy in CONTEXT_POLICY_NAMES

    def load_profile(self) -> AcceptanceProfile | None:
        return None if self.profile_path is None else AcceptanceProfile.from_json(self.profile_path)

    def tree_policy(self) -> TreePolicy:
        """The reference decoder's policy for the same tree (what the tests compare SGLang against)."""
        width = self.width if self.policy == "specexec" or self.uses_context else None
        levels = {} if self.mtp_levels is None else {"mtp_levels": self.mtp_levels}
        return TreePolicy(self.policy, budget=self.budget, depth=self.depth, topk=self.topk,
                          profile=self.load_profile(), width=width, **levels)

    def draft_plan(self) -> DraftPlan | None:
        """The sequoia tree laid over SGLang's draft slots, or None (the other policies select at run time).
        Raises SpecError, one line, when the tree does not fit the draft shape."""
        if self.policy != "sequoia":
            return None
        shape = self.tree_policy().static_shape()
        assert shape is not None  # sequoia's DP tree
        return DraftPlan.from_tree(shape, self.width, self.depth)

    def reserved_context(self, context_len: int, max_positions: int | None, sglang_reserved: int) -> int:
        """Positions a prompt must leave free below the context length (SGLang's tokenizer manager refuses a prompt,
        or a prompt plus max_new_tokens, within them of it). SGLang reserves max(W * D, budget + 1) on every EAGLE
        server, so that a request's draft slots, mapped in its req_to_token row past its tokens, and the tree's
        positions, up to D past its last token, stay inside the context; a plain server reserves nothing and
        takes a prompt up to the last position. The plugin widens the rows for the draft slots
        (``hooks.startup.req_to_token_headroom_around``), which leaves the positions: where the model's position table
        (``max_positions``) holds context_len + D, nothing is reserved and a tree server answers every request a
        plain one answers (a tree node past the context length emits nothing: the request ends at it); where it
        does not (a server run at the model's full context), SGLang's reservation stays."""
        if max_positions is not None and context_len + self.depth <= max_positions:
            return 0
        return sglang_reserved


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("tree speculation (sglang_spec)")
    group.add_argument("--speculative-tree-policy", choices=POLICY_NAMES, default=None,
                       help="shape of the draft tree (lookup / hybrid: the request's context copies, with the MTP "
                            "head's branches for hybrid); unset keeps SGLang's behaviour")
    group.add_argument("--speculative-tree-budget", type=int, default=None,
                       help=f"draft nodes per request, root excluded (default {DEFAULTS['budget']})")
    group.add_argument("--speculative-tree-depth", type=int, default=None,
                       help=f"most draft tokens on one path (default {DEFAULTS['depth']}; lookup / hybrid: the "
                            "budget, as deep as copies run)")
    group.add_argument("--speculative-tree-topk", type=int, default=None,
                       help=f"children per expanded node (default {DEFAULTS['topk']}; chain uses 1)")
    group.add_argument("--speculative-tree-width", type=int, default=None,
                       help="most nodes expanded on one level (SGLang's speculative_eagle_topk); default: topk for "
                            "eagle, the tree's widest level for sequoia, the most beams that can grow for specexec "
                            "(exact SpecExec)")
    group.add_argument("--speculative-acceptance-profile", default=None, metavar="PATH",
                       help="acceptance profile JSON (sglang-spec calibrate); required by sequoia")
    group.add_argument("--speculative-tree-accept", choices=ACCEPT_CHOICES, default=None,
                       help="who accepts the verified tree: SGLang's own eagle_sample (default) or the project's "
                            "fused verify + accept kernels and KV commit (falls back to SGLang's per batch for "
                            "penalties, grammar, top-k / top-p sampling and the like)")
    group.add_argument("--speculative-tree-mtp-levels", type=int, default=None,
                       help="hybrid: most head forwards below the root's children a step (default 2)")
    group.add_argument("--speculative-tree-mla-verify", choices=MLA_VERIFY_CHOICES, default=None,
                       help="MLA models (DeepSeek): the target verifies trees as a cascade, FlashInfer's paged MLA "
                            "decode over each request's prefix and a masked tree kernel over the tree, merged by "
                            "log-sum-exp (FlashInfer's MLA kernels take no tree mask); with --attention-backend "
                            "flashinfer and a tree-capable --speculative-draft-attention-backend (fa3 or triton)")
    group.add_argument("--speculative-tree-context-on", choices=CONTEXT_ON_CHOICES, default=None,
                       help="lookup / hybrid: grow their trees on the host (default) or on the device, from a token "
                            "history kept there, with no host read in the draft step")
    group.add_argument("--speculative-tree-auto", action="store_true", default=None,
                       help="each decode step verifies the tree size a planner chooses for the running batch (the "
                            "most expected tokens a second from each request's tree and the measured costs; a plain "
                            "step under load), the same on every rank")
    group.add_argument("--speculative-tree-verify-sizes", default=None, metavar="S",
                       help="with --speculative-tree-auto: the verify sizes a step may take, a comma list of tokens a "
                            "request, root included, 1 and the full tree (budget + 1) among them (default: every "
                            "size without decode graphs, a few tiers with them)")
    group.add_argument("--speculative-tree-step-cap", type=float, default=None, metavar="C",
                       help=f"with --speculative-tree-auto: a tree step's predicted time at most C plain steps' "
                            f"(bounds the gap between streamed chunks; default {DEFAULT_STEP_CAP:g})")
    group.add_argument("--speculative-tree-head-rest", type=int, default=None, metavar="N",
                       help=f"with --speculative-tree-auto: after N plain steps in a row, plain steps leave the "
                            f"head's draft extend out until the planner chooses a tree, which then waits one plain "
                            f"step that runs it (default {DEFAULT_HEAD_REST}; 0: never)")


def from_values(values: Mapping[str, Any]) -> TreeServerOptions | None:
    """The options given (argparse dests or Engine keyword arguments), checked on their own; None when tree
    speculation is off."""
    policy = values.get("speculative_tree_policy")
    if policy is None:
        given = [name for name in KEYWORDS[1:] if values.get(name) is not None]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise SpecError(f"{flag} needs --speculative-tree-policy (one of {', '.join(POLICY_NAMES)})")
        return None
    if policy not in POLICY_NAMES:
        raise SpecError(f"unknown --speculative-tree-policy {policy!r}; choose one of {', '.join(POLICY_NAMES)}")
    for name in KEYWORDS[1:5]:
        value = values.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise SpecError(f"--{name.replace('_', '-')} takes a whole number, got {value!r}")
    budget = _given(values, "speculative_tree_budget", DEFAULTS["budget"])
    depth = _given(values, "speculative_tree_depth", default_depth(policy, budget))
    given_topk = values.get("speculative_tree_topk")
    if policy == "chain" and given_topk not in (None, 1):
        raise SpecError("the chain policy drafts one candidate per depth; drop --speculative-tree-topk or set it to 1")
    topk = 1 if policy == "chain" else (given_topk or DEFAULTS["topk"])
    if policy == "chain":
        budget = min(budget, depth)
    if policy in CONTEXT_POLICY_NAMES and depth < 2:
        raise SpecError(f"{policy} trees need --speculative-tree-depth >= 2 (SGLang's draft layout of a tree)")
    profile = values.get("speculative_acceptance_profile")
    if profile is not None and not Path(profile).is_file():
        raise SpecError(f"--speculative-acceptance-profile {profile} does not exist")
    profile_path = None if profile is None else str(profile)
    # ranges, sequoia's profile, eagle's slot capacity: checked by the reference policy itself
    TreePolicy(policy, budget=budget, depth=depth, topk=topk,
               profile=AcceptanceProfile.from_json(profile_path) if profile_path else None)
    if depth > budget:  # SGLang's verify sizes its accepted path by the draft steps within the verified tokens
        raise SpecError(f"--speculative-tree-depth {depth} is deeper than a tree of {budget} draft tokens can be; "
                        f"lower the depth to {budget} or raise --speculative-tree-budget to {depth}")
    width = _width(policy, budget, depth, topk, profile_path, values.get("speculative_tree_width"))
    accept = values.get("speculative_tree_accept") or "sglang"
    if accept not in ACCEPT_CHOICES:
        raise SpecError(f"--speculative-tree-accept takes {' or '.join(ACCEPT_CHOICES)}, got {accept!r}")
    auto = values.get("speculative_tree_auto")
    if auto is not None and not isinstance(auto, bool):
        raise SpecError(f"--speculative-tree-auto is a switch (true or false), got {auto!r}")
    mtp_levels = values.get("speculative_tree_mtp_levels")
    if mtp_levels is not None:
        if policy != "hybrid":
            raise SpecError("--speculative-tree-mtp-levels sets hybrid's head levels; drop it or use "
                            "--speculative-tree-policy hybrid")
        if isinstance(mtp_levels, bool) or not isinstance(mtp_levels, int) or not 0 <= mtp_levels < depth:
            raise SpecError(f"--speculative-tree-mtp-levels takes 0..{depth - 1} (below the depth), got {mtp_levels!r}")
    mla_verify = values.get("speculative_tree_mla_verify")
    if mla_verify is not None and mla_verify not in MLA_VERIFY_CHOICES:
        raise SpecError(f"--speculative-tree-mla-verify takes {' or '.join(MLA_VERIFY_CHOICES)}, got {mla_verify!r}")
    context_on = values.get("speculative_tree_context_on") or "host"
    if context_on not in CONTEXT_ON_CHOICES:
        raise SpecError(f"--speculative-tree-context-on takes {' or '.join(CONTEXT_ON_CHOICES)}, got {context_on!r}")
    if context_on == "device" and policy not in CONTEXT_POLICY_NAMES:
        raise SpecError("--speculative-tree-context-on device grows lookup and hybrid trees; use "
                        "--speculative-tree-policy lookup or hybrid, or drop it")
    options = TreeServerOptions(policy, budget, depth, topk, width, profile_path, accept, bool(auto), mtp_levels,
                                mla_verify, context_on)
    return _with_plan_options(options, values)


def _with_plan_options(options: TreeServerOptions, values: Mapping[str, Any]) -> TreeServerOptions:
    """``--speculative-tree-verify-sizes``, ``--speculative-tree-step-cap`` and ``--speculative-tree-head-rest``,
    checked against the tree."""
    sizes_text, cap = values.get("speculative_tree_verify_sizes"), values.get("speculative_tree_step_cap")
    rest = values.get("speculative_tree_head_rest")
    for given, flag in ((sizes_text, "--speculative-tree-verify-sizes"), (cap, "--speculative-tree-step-cap"),
                        (rest, "--speculative-tree-head-rest")):
        if given is not None and not options.auto:
            raise SpecError(f"{flag} sets what --speculative-tree-auto chooses from; add --speculative-tree-auto or "
                            f"drop {flag}")
    full = options.budget + 1
    sizes = None
    if sizes_text is not None:
        words = [word.strip() for word in str(sizes_text).split(",") if word.strip()]
        if not words or not all(word.isdigit() for word in words):
            raise SpecError(f"--speculative-tree-verify-sizes takes whole numbers separated by commas, got "
                            f"{sizes_text!r}")
        sizes = tuple(sorted({int(word) for word in words}))
        if sizes[0] != 1 or sizes[-1] != full:
            raise SpecError(f"--speculative-tree-verify-sizes must run from 1 (a plain step) to {full} (the full "
                            f"tree: budget + 1), got {sizes_text!r}")
        if len(sizes) > 2 and not options.grows_any_size:
            raise SpecError("--speculative-tree-verify-sizes between 1 and the full tree need trees grown to any "
                            "size a step (lookup / hybrid on the host); give 1,{full} or use those policies"
                            .replace("{full}", str(full)))
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap >= 1.0):
        raise SpecError(f"--speculative-tree-step-cap takes a number of plain steps >= 1, got {cap!r}")
    if rest is not None:
        if isinstance(rest, bool) or not isinstance(rest, int) or rest < 0:
            raise SpecError(f"--speculative-tree-head-rest takes a number of plain steps >= 0 (0: never), got "
                            f"{rest!r}")
        if options.policy in HEAD_FREE_POLICY_NAMES:
            raise SpecError(f"--speculative-tree-head-rest: {options.policy} trees never run the head; drop it")
    return replace(options, verify_sizes=sizes, step_cap=DEFAULT_STEP_CAP if cap is None else float(cap),
                   head_rest=rest)


def _width(policy: str, budget: int, depth: int, topk: int, profile_path: str | None, given: int | None) -> int:
    """SGLang's beams per step for this tree (see the module docstring for the rule per policy)."""
    if policy in ("chain", "eagle"):
        if given is not None and given != topk:
            raise SpecError(f"{policy} runs SGLang's own draft loop, whose width is topk ({topk}); drop "
                            f"--speculative-tree-width or use sequoia / specexec")
        return topk
    if policy == "sequoia":
        assert profile_path is not None
        shape = TreePolicy("sequoia", budget=budget, depth=depth, topk=topk,
                           profile=AcceptanceProfile.from_json(profile_path)).static_shape()
        assert shape is not None
        needed = max(topk, widest_level(shape))
        if given is not None and given < needed:
            raise SpecError(f"sequoia's tree for budget {budget} / depth {depth} / topk {topk} expands {needed} nodes "
                            f"on one level; --speculative-tree-width must be at least {needed}")
        return given or needed
    if policy in CONTEXT_POLICY_NAMES:
        # a node's children: the head's topk (hybrid) and the context's continuations; and SGLang's tree encoding
        # gives the nodes with children ids below width * (depth - 1) + 1 (``encode_sglang_draft``)
        lookup_width = TreePolicy(policy, budget=budget, depth=depth, topk=topk).lookup_width
        needed = max((topk if policy == "hybrid" else 0) + lookup_width, -(-budget // (depth - 1)))
        width = given if given is not None else needed
        if given is not None and given * (depth - 1) < budget:
            raise SpecError(f"--speculative-tree-width {given} holds at most {given * (depth - 1)} nodes at depth "
                            f"{depth} in SGLang's tree encoding; raise it to {-(-budget // (depth - 1))} or lower "
                            f"the budget")
        if policy == "hybrid" and width < topk:
            raise SpecError(f"--speculative-tree-width {width} is below topk {topk}: the root keeps its {topk} head "
                            f"candidates")
        return width
    width = given if given is not None else specexec_width(budget, depth, topk)
    if width < topk:
        raise SpecError(f"--speculative-tree-width {width} is below topk {topk}: the root's {topk} children are "
                        f"all expanded at the first step")
    return width


def default_depth(policy: str, budget: int) -> int:
    """``--speculative-tree-depth`` when unset: the budget for context trees (copies run as deep as the budget lets
    them; ``bench/hybrid_shapes.py`` measures the shapes), ``DEFAULTS['depth']`` for head trees."""
    return budget if policy in CONTEXT_POLICY_NAMES else DEFAULTS["depth"]


def _given(values: Mapping[str, Any], name: str, default: int) -> int:
    value = values.get(name)
    return default if value is None else int(value)


def from_namespace(args: argparse.Namespace) -> TreeServerOptions | None:
    return from_values(vars(args))


def apply_to_server_args(options: TreeServerOptions, server_args) -> None:
    """Before resolution: the tree shape becomes SGLang's own draft shape (steps, topk, verify tokens). The caller
    attaches the options themselves (``state.attach_options``)."""
    for name, value in (("speculative_num_steps", options.draft_steps), ("speculative_eagle_topk", options.width),
                        ("speculative_num_draft_tokens", options.budget + 1)):
        current = getattr(server_args, name)
        if current is not None and current != value:
            flag = "--" + name.replace("_", "-")
            raise SpecError(f"{flag} {current} contradicts the tree options (which set it to {value}); drop {flag}")
        setattr(server_args, name, value)


def validate_requested(options: TreeServerOptions, requested) -> None:
    """Before SGLang resolves its speculative settings (``requested``: the ServerArgs as the user gave them; SGLang
    may quietly turn some off, e.g. adaptive steps for topk > 1, but a tree launch refuses them outright)."""
    if getattr(requested, "speculative_adaptive", False):
        raise SpecError("--speculative-adaptive changes the draft step count at run time, but the tree options fix "
                        "it at start-up; drop --speculative-adaptive or the --speculative-tree-* options")


def validate_speculative(options: TreeServerOptions, config) -> None:
    """After SGLang resolves its speculative settings (``config``: its resolved view of ServerArgs)."""
    algorithm = (config.speculative_algorithm or "").upper()
    if algorithm not in TREE_ALGORITHMS:
        raise SpecError(
            f"--speculative-tree-policy needs --speculative-algorithm NEXTN or EAGLE (got {algorithm or 'none'})"
        )
    if getattr(config, "enable_multi_layer_eagle", False):
        raise SpecError("--enable-multi-layer-eagle runs its own draft worker, which the tree options do not reach; "
                        "drop --enable-multi-layer-eagle or the --speculative-tree-* options")
    if options.auto and int(getattr(config, "pp_size", 1) or 1) > 1:
        raise SpecError("--speculative-tree-auto agrees each step's size within one tensor-parallel group, and the "
                        "stages of a pipeline relay a draft shape fixed at start-up; run it with --pp-size 1, or "
                        "drop it")
    if options.head_rest and getattr(config, "enable_dp_attention", False):
        raise SpecError("--speculative-tree-head-rest: under DP attention one rank may prefill while another decodes, "
                        "and every rank's head forwards must pair up, so the head runs every step there; drop it")
    width, steps = config.speculative_eagle_topk, config.speculative_num_steps
    if options.uses_context:
        return  # any tree within its width fits SGLang's encoding (checked with the options); fillers fill the rest
    topk = min(options.topk, width)
    # the beams the loop lets grow (``DraftLoop.live``); a sequoia plan that does not fit fails here first
    capacity = usable_slots(width, topk, steps, live_beams(width, topk, steps, options.budget, options.draft_plan()))
    if options.budget > capacity:
        raise SpecError(
            f"--speculative-tree-budget {options.budget} exceeds the {capacity} draft tokens that topk {topk}, "
            f"width {width} and depth {steps} can produce (topk candidates a node, at most width expanded a "
            f"level); raise --speculative-tree-topk, -width or -depth, or lower the budget"
        )


def validate_model(options: TreeServerOptions, is_dsa: bool) -> None:
    """After the model config is known: DSA models (DeepSeek-V3.2's sparse index) keep index state that the
    plugin's draft loop and its KV permute / commit (``k/v/kv_buffer`` only) do not carry."""
    if is_dsa:
        raise SpecError("DSA models (DeepSeek-V3.2-style index_topk attention) cannot run tree speculation: the "
                        "plugin does not carry their index state; drop the --speculative-tree-* options")


def validate_backends(options: TreeServerOptions, backends: Mapping[str, str | None], is_mla: bool,
                      device: str) -> None:
    """After SGLang's capability adjustments: every attention backend the tree goes through (``backends``: field
    name -> resolved backend, None = falls back to attention_backend) must handle a tree."""
    if options.mla_verify is not None:
        validate_mla_verify(backends, is_mla, device)
    if options.width == 1:
        return  # a chain needs no tree mask
    allowed = MLA_TREE_BACKENDS if is_mla else MHA_TREE_BACKENDS
    if device == "cpu":
        allowed = CPU_TREE_BACKENDS
    for field, backend in backends.items():
        if options.mla_verify is not None and field in TARGET_BACKEND_FIELDS:
            continue  # checked by validate_mla_verify: the cascade verifies, the backend only prefills / decodes
        if backend is not None and backend not in allowed:
            what = "an MLA model (DeepSeek)" if is_mla else "this model"
            where = "on this CPU " if device == "cpu" else ""
            raise SpecError(
                f"{field.replace('_', '-')} {backend} cannot run tree speculation for {what} {where}(topk > 1); "
                f"use {' or '.join(allowed)}, or --speculative-tree-policy chain"
            )


def validate_mla_verify(backends: Mapping[str, str | None], is_mla: bool, device: str) -> None:
    """``--speculative-tree-mla-verify flashinfer``: an MLA model, FlashInfer installed (on a GPU), the target on
    a back-end the cascade sits on (``MLA_VERIFY_TARGET_BACKENDS``), and a draft back-end that takes trees itself
    (the MTP draft decodes its tree on its own back-end: FlashInfer's MLA draft back-end refuses topk > 1)."""
    if not is_mla:
        raise SpecError("--speculative-tree-mla-verify serves MLA models (DeepSeek) only; this model's attention is "
                        "not MLA, drop the option (its back-end verifies trees itself)")
    where = "cpu" if device == "cpu" else "gpu"
    targets = MLA_VERIFY_TARGET_BACKENDS[where]
    if where == "gpu" and importlib.util.find_spec("flashinfer") is None:
        raise SpecError("--speculative-tree-mla-verify flashinfer needs the flashinfer package (pip install "
                        "flashinfer-python), which is not installed")
    for field in TARGET_BACKEND_FIELDS:
        backend = backends.get(field)
        if backend is not None and backend not in targets:
            raise SpecError(f"--speculative-tree-mla-verify flashinfer verifies on FlashInfer's MLA kernels, but "
                            f"{field.replace('_', '-')} is {backend}; use --attention-backend {' or '.join(targets)}"
                            f"{' (this CPU)' if where == 'cpu' else ''}, or drop the option")
    draft = backends.get("speculative_draft_attention_backend") or backends.get("attention_backend")
    drafts = CPU_TREE_BACKENDS if where == "cpu" else MLA_TREE_BACKENDS
    if draft is not None and draft not in drafts:
        raise SpecError(f"--speculative-tree-mla-verify verifies the tree, but the MTP draft decodes it on its own "
                        f"back-end ({draft}), which takes no tree; add --speculative-draft-attention-backend "
                        f"{' or '.join(drafts)}")


# KV cache dtypes the cascade reads as they are (the model's dtype); anything else is a quantized cache
UNQUANTIZED_KV_CACHE = (None, "auto", "bf16", "bfloat16", "fp16", "float16", "float32")


def validate_mla_verify_cache(options: TreeServerOptions, kv_cache_dtype: str | None) -> None:
    """``--speculative-tree-mla-verify``: the tree kernel reads the tree's latent rows as the model's dtype, and
    FlashInfer's cascade is planned without KV scales, so a quantized KV cache is refused at start-up."""
    if options.mla_verify is not None and kv_cache_dtype not in UNQUANTIZED_KV_CACHE:
        raise SpecError(f"--speculative-tree-mla-verify reads the KV cache unquantized, but --kv-cache-dtype is "
                        f"{kv_cache_dtype}; drop --kv-cache-dtype or the option")
