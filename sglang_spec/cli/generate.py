"""``sglang-spec generate``: tree-speculative decoding with the reference decoder, optionally checked against
plain decoding; MTP trees, context-lookup trees, hybrid trees, or ``--auto`` (each step's tree, or none, chosen
from this machine's measured costs and calibrated acceptance); ``--trace`` shows who drafted each token."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any

from sglang_spec.catalog import load_model
from sglang_spec.cli.parser import (
    MAX_SAMPLING_TOP_K,
    TEMPERATURE_HELP,
    integer,
    number,
    path_arg,
    seed,
    temperature,
    text_arg,
)
from sglang_spec.decode.autotune import load_or_measure
from sglang_spec.decode.decoder import (
    GenerationConfig,
    GenerationOutput,
    SpeculativeDecoder,
    compare_with_plain,
    generate_plain,
)
from sglang_spec.gemm.packed_linear import best_backend
from sglang_spec.decode.static_runner import supports as static_runner_supports
from sglang_spec.decode.trace import TracedRequest, render_html, render_terminal
from sglang_spec.errors import SpecError
from sglang_spec.files import check_output_path, write_text_atomic
from sglang_spec.models.cache_dir import cache_root
from sglang_spec.models.loading import LoadedModel, load_head_for, shipped_profile_path
from sglang_spec.mtp.head import MTPHead
from sglang_spec.sampling import SamplingParams
from sglang_spec.tree.sizing import AutoChoice, choose_auto
from sglang_spec.costs import CostCurve
from sglang_spec.tree.ngram import DEFAULT_MAX_NGRAM
from sglang_spec.tree.policies import CONTEXT_POLICY_NAMES, MAX_TOPK, POLICY_NAMES, TreePolicy
from sglang_spec.tree.profile import SOURCE_NAMES, AcceptanceProfile

# per-policy defaults of --budget / --depth: MTP trees stay small on a CPU; a copied run can be long
DEFAULT_SIZES = {"mtp": (8, 4), "hybrid": (16, 10), "auto": (32, 12)}
MAX_MTP_LEVELS = 16  # head forwards per step: more is a typo (each costs about a fifth of a verify)
# Raise whenever what a step costs changes (the verify rule's work, the attention, the GEMM kernels): a cached cost
# curve of other code mispredicts every --auto choice.
COST_CURVE_VERSION = 3


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    parser = subcommands.add_parser(
        "generate",
        help="decode with tree speculation (reference decoder) and report accept length and speed",
        description="Drafts a token tree per step with the MTP head, verifies it in one target forward and commits "
        "the accepted path. Greedy output equals plain greedy decoding; sampled output has the target's law.",
    )
    parser.add_argument("--model", required=True, type=text_arg,
                        help="smollm2, tiny-deepseek, or a local model folder")
    parser.add_argument("--mtp", default=None, type=text_arg,
                        help="MTP head (.safetensors) or DeepSeek checkpoint folder; "
                        "default: the model's own MTP layer or the shipped head")
    parser.add_argument("--policy", choices=POLICY_NAMES, default=None,
                        help="MTP trees (chain, eagle, sequoia, specexec), context-lookup trees (lookup) or both in "
                        "one tree (hybrid); default sequoia, or hybrid with --auto")
    parser.add_argument("--budget", type=int, default=None, help="draft nodes per step, root excluded (default 8 "
                        "for MTP trees, 16 for lookup / hybrid; with --auto: the most it may use, default 32)")
    parser.add_argument("--depth", type=int, default=None, help="most draft tokens on one path (default 4 for MTP "
                        "trees, 10 for lookup / hybrid, 12 with --auto: the most it may use)")
    parser.add_argument("--topk", type=int, default=None, help="candidates per expanded node (policy default); at "
                        f"most {MAX_TOPK} and the head's draft vocabulary")
    parser.add_argument("--mtp-levels", type=integer(0, MAX_MTP_LEVELS), default=None,
                        help="hybrid: most MTP head forwards per step below the root's children (default 2, at most "
                        f"{MAX_MTP_LEVELS})")
    parser.add_argument("--acceptance", type=path_arg, default=None, metavar="PROFILE.json",
                        help="acceptance profile (`sglang-spec calibrate`): its positional table shapes sequoia trees "
                        "and --auto, its per-source counts rank lookup / hybrid candidates and are learnt further "
                        "online (default: the model's shipped profile, else the built-in one and a generic prior)")
    parser.add_argument("--auto", action="store_true",
                        help="let this machine's measured cost curve (cached) and the calibrated acceptance choose "
                        "each step's tree: context lookup, MTP head, both, or no speculation; with an MTP policy "
                        "(e.g. --policy sequoia): that policy's budget and depth, or no speculation")
    parser.add_argument("--costs", type=path_arg, default=None, metavar="COSTS.json",
                        help="with --auto: cost curve to read, or to measure and write (default: per model and "
                        "machine in the cache folder)")
    parser.add_argument("--prompt", action="append", required=True, type=text_arg,
                        help="prompt text; repeat for a batch")
    parser.add_argument("--max-new-tokens", type=integer(1), default=64,
                        help="at most the model's context minus the longest prompt")
    parser.add_argument("--temperature", type=temperature, default=0.0, help=TEMPERATURE_HELP)
    parser.add_argument("--top-k", type=integer(0, MAX_SAMPLING_TOP_K), default=0,
                        help="sample among the k most likely tokens (0 = off; past the vocabulary = off)")
    parser.add_argument("--top-p", type=number(0, 1, low_open=True), default=1.0,
                        help="nucleus sampling mass in (0, 1] (1 = off)")
    parser.add_argument("--seed", type=seed, default=0)
    parser.add_argument("--allow-model-mismatch", action="store_true",
                        help="use an --mtp head trained for another model (its metadata names the model)")
    parser.add_argument("--no-chat", action="store_true", help="do not apply the tokenizer's chat template")
    parser.add_argument("--check", action="store_true", help="also decode without speculation and compare")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--trace", default=None, type=text_arg, metavar="TRACE.html",
                        help="write an HTML view of each step (accepted draft tokens coloured by the source that "
                        "drafted them, the target's correction); '-' prints a coloured terminal view instead")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # everything that can be checked without the model first, so a typo fails before a model loads
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    name = args.policy or ("hybrid" if args.auto else "sequoia")
    context_shape = name in CONTEXT_POLICY_NAMES
    default_budget, default_depth = DEFAULT_SIZES["auto" if args.auto and context_shape else "hybrid" if context_shape
                                                  else "mtp"]
    budget = default_budget if args.budget is None else args.budget
    depth = default_depth if args.depth is None else args.depth
    if args.mtp_levels is not None and name != "hybrid":
        raise SpecError(f"--mtp-levels sets the head levels of hybrid trees; the {name} policy has none")
    profile_path = args.acceptance
    if profile_path is None and (name == "sequoia" or context_shape or args.auto):
        profile_path = shipped_profile_path(args.model, args.temperature)
    profile = AcceptanceProfile.load(profile_path)
    max_ngram = profile.sources.max_ngram if profile.sources is not None else DEFAULT_MAX_NGRAM
    asked = TreePolicy(name, budget=budget, depth=depth, topk=args.topk, profile=profile, max_ngram=max_ngram,
                       mtp_levels=2 if args.mtp_levels is None else args.mtp_levels)
    if args.mtp is not None and not Path(args.mtp).exists():
        raise SpecError(f"MTP head {args.mtp} does not exist")
    if args.trace is not None and args.trace != "-":
        check_output_path(args.trace, force=True, option="--trace")  # written after decoding: fail now, not after
    if args.auto and args.costs is not None and not args.costs.exists():
        check_output_path(args.costs, option="--costs")  # measured and written there: fail now, not after
    loaded = load_model(args.model, progress=not args.json)
    if name == "lookup":
        head = _optional_head(loaded, args.mtp, args.allow_model_mismatch)
    else:
        head = load_head_for(loaded, args.mtp, allow_model_mismatch=args.allow_model_mismatch)
    topk = 0 if name in ("chain", "lookup") else asked.effective_topk
    if head is not None and topk > head.draft_vocab_size:
        raise SpecError(f"--topk {topk} exceeds the head's draft vocabulary of {head.draft_vocab_size} tokens; use "
                        f"at most {head.draft_vocab_size}")
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed,
                              eos_token_ids=loaded.eos_token_ids)
    prompts = [loaded.encode_prompt(text, chat=False if args.no_chat else None) for text in args.prompt]
    loaded.check_lengths([len(prompt) for prompt in prompts], args.max_new_tokens)
    auto = None
    policy: TreePolicy | None = asked
    if args.auto:
        costs, costs_path = costs_for(loaded, head, args.costs, sampling)
        chosen = choose_auto(asked, costs)
        auto = AutoChoice(chosen.policy, {**chosen.summary, "costs": str(costs_path)})
        policy = auto.policy
    if args.check:  # warm the kernels up first, so neither timed run pays one-time start-up costs
        generate_plain(loaded.model, prompts[:1], GenerationConfig(max_new_tokens=2, sampling=sampling))
    if policy is None:  # the cost model says speculation does not pay here
        output = generate_plain(loaded.model, prompts, config)
    else:
        output = SpeculativeDecoder(loaded.model, head, policy).generate(prompts, config)
    report = _report(loaded, policy, auto, profile, sampling, output)
    if args.check:
        report.update(_check_against_plain(loaded, prompts, config, output))
    if args.trace is not None:
        traced = [TracedRequest.of(text, request) for text, request in zip(args.prompt, output.requests)]
        if args.trace == "-":
            print(render_terminal(traced, loaded.decode), end="")
        else:
            write_text_atomic(args.trace, render_html(traced, loaded.decode, title=f"sglang-spec {report['policy']} "
                                                    f"on {loaded.name}"))
            report["trace"] = args.trace
    if args.json:
        print(json.dumps(report))
    else:
        _print_table(args.prompt, loaded, report, output, sampling)
    return 0


def _optional_head(loaded: LoadedModel, mtp: str | None, allow_model_mismatch: bool) -> MTPHead | None:
    """The lookup policy runs without a head; one is still loaded when asked for or shipped (``--auto`` cost
    curves time a head level)."""
    try:
        return load_head_for(loaded, mtp, allow_model_mismatch=allow_model_mismatch)
    except SpecError:
        if mtp is not None:
            raise
        return None


def _report(
    loaded: LoadedModel,
    policy: TreePolicy | None,
    auto: AutoChoice | None,
    profile: AcceptanceProfile,
    sampling: SamplingParams,
    output: GenerationOutput,
) -> dict[str, Any]:
    requests = output.requests
    sources: dict[str, int] = {}
    for request in requests:  # the tokens kept: a step may run past max_new_tokens or an EOS
        for source in [source for step in request.steps for source in step.sources][: len(request.tokens)]:
            sources[SOURCE_NAMES[source]] = sources.get(SOURCE_NAMES[source], 0) + 1
    return {
        "model": loaded.name,
        "policy": policy.name if policy else "none",
        "budget": policy.budget if policy else 0,
        "depth": policy.depth if policy else 0,
        "auto": auto.summary if auto else None,
        "profile": profile.source if policy is not None and policy.name == "sequoia" else None,
        "temperature": sampling.temperature,
        "tokens": requests[0].tokens if len(requests) == 1 else [request.tokens for request in requests],
        "text": [loaded.decode(request.tokens) for request in requests],
        "finish_reasons": [request.finish_reason for request in requests],
        "accept_length_mean": output.accept_length_mean,
        "accept_length_histogram": output.accept_length_histogram(),
        "steps": output.stats.steps,
        "draft_seconds": output.stats.draft_seconds,
        "verify_seconds": output.stats.verify_seconds,
        "total_seconds": output.stats.total_seconds,
        "tokens_per_second": output.tokens_per_second,
        "tokens_by_source": sources,
        "plain_steps": sum(1 for request in requests for step in request.steps[1:] if step.tree_nodes == 1),
    }


def _check_against_plain(
    loaded: LoadedModel, prompts: list[list[int]], config: GenerationConfig, output: GenerationOutput
) -> dict[str, Any]:
    """``--check``: plain decoding of the same prompts, its speed, and (greedy) whether the outputs are identical."""
    baseline = generate_plain(loaded.model, prompts, config)
    comparisons = [compare_with_plain(ours, theirs) for ours, theirs in zip(output.requests, baseline.requests)]
    result: dict[str, Any] = {
        "baseline_tokens_per_second": baseline.tokens_per_second,
        "speedup": output.tokens_per_second / baseline.tokens_per_second if baseline.tokens_per_second else None,
    }
    if config.sampling.greedy:
        result["identical_to_baseline"] = all(c.identical for c in comparisons)
        result["near_tie_divergences"] = sum(c.excused for c in comparisons)
    else:
        # sampled runs draw different random numbers; equality is in distribution, not token by token
        result["identical_to_baseline"] = None
    return result


def _print_table(
    prompt_texts: list[str], loaded: LoadedModel, report: dict[str, Any], output: GenerationOutput,
    sampling: SamplingParams,
) -> None:
    for index, (prompt_text, request) in enumerate(zip(prompt_texts, output.requests)):
        print(f"--- prompt {index}: {prompt_text!r}")
        print(loaded.decode(request.tokens))
    auto = report["auto"]
    if auto is not None and "predicted_speedup" in auto:
        print(f"--- auto: predicted speedup {auto['predicted_speedup']:.2f}x with budget {auto['budget']}, depth "
              f"{auto['depth']} on {auto['device']}" + (" -> no speculation" if report["policy"] == "none" else ""))
    elif auto is not None:
        print(f"--- auto: each step's tree chosen from the cost curve on {auto['device']} (at most {auto['budget']} "
              f"nodes, depth {auto['depth']}); {report['plain_steps']} of {output.stats.steps} steps without a tree")
    print(f"--- {report['policy']} budget {report['budget']} depth {report['depth']} on {loaded.name}, temperature "
          f"{sampling.temperature}")
    print("tokens by source: " + ", ".join(f"{k} {v}" for k, v in sorted(report["tokens_by_source"].items())))
    print(f"accept length mean {report['accept_length_mean']:.3f} tokens/step (bonus included) over "
          f"{output.stats.steps} steps; histogram {report['accept_length_histogram']}")
    print(f"draft {output.stats.draft_seconds:.2f} s, verify {output.stats.verify_seconds:.2f} s, "
          f"{report['tokens_per_second']:.1f} tokens/s")
    if "baseline_tokens_per_second" in report:
        print(f"plain decoding {report['baseline_tokens_per_second']:.1f} tokens/s, speedup {report['speedup']:.2f}x")
        if sampling.greedy:
            verdict = "identical" if report["identical_to_baseline"] else "DIFFERENT"
            ties = report["near_tie_divergences"]
            print(f"greedy output {verdict} to plain decoding"
                  + (f" ({ties} divergence(s) at near-ties < 1e-4)" if ties else ""))
        else:
            print("sampling: outputs are compared in distribution (tests), not token by token")


def costs_for(loaded: LoadedModel, head: MTPHead | None, costs_path: Path | None,
              sampling: SamplingParams) -> tuple[CostCurve, Path]:
    """This machine's cost curve for the runner the decoder uses (measured once, cached per model, dtype,
    sampling mode, runner and its GEMM backend, and host)."""
    if head is None:
        raise SpecError("--auto measures a head level too; give --mtp (or use a model with a shipped head)")
    dtype = str(next(loaded.model.parameters()).dtype).replace("torch.", "")
    mode = "greedy" if sampling.greedy else "sampled"
    # the static runner's GEMM backend is part of the name: a curve timed on another backend misleads --auto
    runner = f"static-{best_backend()}" if static_runner_supports(loaded.model) else "transformers"
    # COST_CURVE_VERSION names what a curve was timed on, so a curve timed on other code is never reused
    name = f"{loaded.name}-{dtype}-{mode}-{runner}-v{COST_CURVE_VERSION}-{platform.node() or 'host'}.json"
    path = costs_path or cache_root() / "costs" / name
    # our own cache may be rebuilt when it is damaged; a file the user named is theirs: a problem there is refused
    warn = None if costs_path is not None else (lambda message: print(f"warning: {message}", file=sys.stderr))
    return load_or_measure(path, loaded.model, head, sampling, on_bad_cache=warn), path
