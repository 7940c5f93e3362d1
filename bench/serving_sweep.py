"""Serving throughput and latency across workload x concurrency x method, with SGLang's own benchmark client.

Methods: ``plain`` (no speculation) and ``plain-sync`` (no speculation, SGLang's overlap scheduler off: the
scheduler our context policies run under, and on a 2-core CPU the faster plain decoding on long prompts, where the
overlap loop's host work competes with the forward for the cores); SGLang's own speculation as a user would pick
it instead, ``sglang-chain`` (EAGLE / NEXTN, one candidate a step, 3 steps), ``sglang-tree`` (its topk-4 tree
with the same number of draft tokens as ours) and ``sglang-ngram`` (its n-gram corpus, no draft model); ours,
``chain``, ``eagle``, ``sequoia``, ``specexec``, ``lookup``, ``hybrid`` (``--speculative-tree-policy``), ``auto``
(hybrid with ``--speculative-tree-auto``), ``auto-batch`` (the same planner, the whole batch on or off),
``auto-sync`` and ``auto-batch-sync`` (the same two with the overlap scheduler off, as ``plain-sync``),
``lookup-device`` and ``hybrid-device`` (lookup / hybrid with ``--speculative-tree-context-on device``: the same
trees, grown on the device). For every method and budget the
script launches ``python -m sglang.launch_server``, waits for ``/health``, runs ``python -m sglang.bench_serving``
per workload and concurrency, stops the server (its whole process group), and collects the client's JSON lines
into a CSV and a plot: output tokens/s and its ratio over plain in the same run (the faster of ``plain`` and
``plain-sync`` where both ran), mean accept length and p50 / p99 inter-token latency (speculation makes tokens
arrive in bursts: p50 ITL falls while p99 can rise). With ``--rounds N`` every server runs N times in rotated
order and each figure is its median; the table's ``rounds x`` gives the range of each round's ratio over that
round's faster plain (servers of one round share the machine's phase), the JSON every round's figures. With
``--servers-together`` the servers start once and stay up (each on its own port, sleeping when idle), and a round
runs each workload on every server back to back, so the figures a ratio compares are minutes closer in time.

Workloads: ``heldout`` (HumanEval 134-163, never in the shipped heads' training), or ``serving``: three held-out
sets no part of the project trained or tuned on, 32 distinct requests each: code (HumanEval 150-163, 134-149,
132-133), extraction (passages of the report in SGLang's ``test/long_prompt.txt`` with copy-out questions) and chat
(``bench/workloads/serving/chat.jsonl``); more requests than that cycle them (with a warning); or a
user's own file, ``--prompts FILE.jsonl`` (``{"prompt": ...}`` or ``{"messages": [...]}`` lines, an optional
``"domain"`` names the workload).

    # this CPU, through the project's harness (SmolLM2-135M + shipped head, or the tiny DeepSeek-V3):
    python bench/serving_sweep.py --cpu-model smollm2 --policies plain,chain,sequoia --budgets 15 \\
        --concurrency 1,2,4 --num-prompts 8 --random-input-len 64 --random-output-len 32
    # the same on a machine running nothing else: every server's prompt prefills on two threads
    python bench/serving_sweep.py --cpu-model smollm2 --prefill-threads 2 ...
    # ... and every server's drafter multiplies by bfloat16-rounded weights, as a GPU serves its draft model
    python bench/serving_sweep.py --cpu-model smollm2 --prefill-threads 2 --draft-weights bfloat16 ...
    # every server up at once, each workload's runs back to back (a machine whose speed drifts within minutes)
    python bench/serving_sweep.py --cpu-model smollm2 --servers-together --rounds 5 ...
    # a GPU host:
    python bench/serving_sweep.py --model-path deepseek-ai/DeepSeek-R1 --server-args "--tp 8 --attention-backend fa3" \\
        --policies plain,chain,sequoia,specexec --budgets 4,8,16 --concurrency 1,4,16,64 \\
        --acceptance-profile r1-profile.json
    python bench/serving_sweep.py --dry-run ...     # print the commands only
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from sglang_spec.errors import SpecError, exit_status
from sglang_spec.files import check_output_path, write_text_atomic
from sglang_spec_testbed.linear import DRAFT_WEIGHT_DTYPES, DRAFT_WEIGHTS_ENV
from sglang_spec_testbed.server import CPU_MODELS
from sglang_spec_testbed.threads import PREFILL_THREADS_ENV
from sglang_spec.sglang_plugin.options import default_depth
from sglang_spec.sglang_plugin.step_planner import PLAN_LOG_ENV
from sglang_spec.train.prompts import PromptSpec, humaneval_prompts, load_prompts

REPO = Path(__file__).resolve().parents[1]
FIELDS = ["policy", "budget", "concurrency", "request_throughput", "output_throughput", "mean_ttft_ms",
          "mean_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "p99_tpot_ms", "accept_length", "workload",
          "tp_size", "speedup_over_plain"]
MEASURED = FIELDS[3:FIELDS.index("workload")]  # the figures bench_serving reports, accept length last
OUR_POLICIES = ("chain", "eagle", "sequoia", "specexec", "lookup", "hybrid")
SGLANG_METHODS = ("sglang-chain", "sglang-tree", "sglang-ngram")
AUTO = "auto"  # hybrid with --speculative-tree-auto: each step's verify size planned for its batch
AUTO_BATCH = "auto-batch"  # the same planner choosing only a plain step or the full tree for the whole batch
SYNC = "-sync"  # auto-sync, auto-batch-sync: the same with SGLang's overlap scheduler off (as plain-sync)
LOOKUP_DEVICE = "lookup-device"  # lookup with --speculative-tree-context-on device
HYBRID_DEVICE = "hybrid-device"  # hybrid with --speculative-tree-context-on device
PLAIN_METHODS = ("plain", "plain-sync")  # no speculation: with SGLang's overlap scheduler, and without
POLICIES = (*PLAIN_METHODS, *OUR_POLICIES, AUTO, AUTO_BATCH, AUTO + SYNC, AUTO_BATCH + SYNC, LOOKUP_DEVICE,
            HYBRID_DEVICE, *SGLANG_METHODS)
TOGETHER_MEMORY_FRACTION = "0.9"  # the bed's servers started together: see extra_server_args
SGLANG_CHAIN_STEPS = 3  # SGLang's usual EAGLE chain for NEXTN: 3 steps, 4 verified tokens
SGLANG_TREE_TOPK = 4
SERVING_WORKLOADS = ("code", "extraction", "chat")
MIXED = "mixed"  # the three arriving together: code, extraction and chat requests in turn
WORKLOADS_DIR = REPO / "bench" / "workloads" / "serving"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--cpu-model", choices=CPU_MODELS, default=None,
                        help="serve on this CPU through the project's harness (smollm2-split: SmolLM2 with zero "
                             "attention heads added, the same outputs, for --tp-sizes 2)")
    target.add_argument("--model-path", default=None, help="a model for launch_server on a GPU host")
    parser.add_argument("--server-args", default="", help="extra launch_server arguments")
    parser.add_argument("--policies", default="plain,chain,eagle,sequoia,specexec")
    parser.add_argument("--budgets", default="4,8,16")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--hybrid-depth", type=int, default=None,
                        help="hybrid / lookup / auto: their tree depth (default the budget, as the server's: copies "
                             "run deeper than the head's branches)")
    parser.add_argument("--mtp-levels", type=int, default=None, help="hybrid / auto: head levels below the root's "
                        "children (default 2)")
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--tp-sizes", default="1", metavar="N[,N...]",
                        help="run every method at each tensor-parallel size (--tp-size), its ratio over plain decoding "
                             "at the same size: whether a method's gain holds when the model is split (on the CPU "
                             "bed: --cpu-model smollm2-split or tiny-deepseek)")
    parser.add_argument("--workloads", default=None,
                        help="heldout, serving (code, extraction, chat), or a comma list of those three and mixed "
                             "(their requests in turn, arriving together); default: heldout, or the domains of "
                             "--prompts")
    parser.add_argument("--prompts", type=Path, default=None, metavar="FILE.jsonl",
                        help="your own prompts, one JSON object a line ({\"prompt\": ...} or {\"messages\": ...}, "
                             "optional \"domain\" = workload, default general; also a .txt file, one prompt a line)")
    parser.add_argument("--num-prompts", default="200",
                        help="requests a run sends: one number, or one per --concurrency value (e.g. 6,16,32 for "
                             "1,4,16: a concurrency-1 run needs fewer requests than a full batch of 16 twice over)")
    parser.add_argument("--dataset", default="heldout",
                        help="heldout (HumanEval 134-163 as chat requests, never in the shipped heads' training; "
                             "written as a ShareGPT file, no download) or any bench_serving --dataset-name")
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=1024, help="output tokens per request")
    parser.add_argument("--output-len-spread", type=float, default=0.0, metavar="S",
                        help="give each request of a workload its own output length, spread evenly over "
                             "(1 +- S) x --random-output-len (the same request the same length on every server; "
                             "0: all alike). With one length, a closed-loop client's requests all end at the same "
                             "step under plain decoding and its prefills fall between decode steps, while "
                             "speculation's requests end apart and its prefills land mid-stream: p99 inter-token "
                             "latency then compares that placement, not the methods")
    parser.add_argument("--acceptance-profile", default=None,
                        help="sequoia's profile (default on the CPU: the one shipped with the head)")
    parser.add_argument("--prefill-threads", type=int, default=None,
                        help="CPU bed: run each server's prefills on this many threads (decode steps keep one; "
                             "every server alike); for a machine running nothing else, where a prompt's prefill on "
                             "one core otherwise takes tens of decode steps' time (a GPU's takes one or two)")
    parser.add_argument("--draft-weights", choices=tuple(DRAFT_WEIGHT_DTYPES), default=None,
                        help="CPU bed: the dtype every server's draft model packs its own weights in (default "
                             "float32; bfloat16 streams half the bytes, as a GPU serves a bf16 draft model: the "
                             "proposals may change, never the output); the target stays float32")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--start-timeout", type=float, default=1800.0)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "serving_sweep.csv")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every server this many times, round by round (each server fresh; round r runs "
                             "them in the order rotated by r, so each takes every place in turn); the table, CSV "
                             "and plot give each figure's median over the rounds, the JSON every round's tokens/s, "
                             "place and ratio over that round's faster plain too (a 2-core CPU drifts 5-20%% "
                             "between runs of one server)")
    parser.add_argument("--servers-together", action="store_true",
                        help="start every server once, each on its own port from --port up, with SGLang's "
                             "--sleep-on-idle (an idle scheduler otherwise spins a core), and run each round "
                             "workload by workload, the servers back to back in the round's rotated order: one "
                             "workload's figures for every server are taken within a minute or two of each other "
                             "instead of a whole round apart, and rounds cost no restarts (the servers learn and "
                             "keep state across rounds, as a deployment's do)")
    parser.add_argument("--plan-logs", type=Path, default=None, metavar="DIR",
                        help="every tree-auto server writes each planned step to DIR/<server>.jsonl "
                             "(SGLANG_SPEC_PLAN_LOG; bench/planner_projection.py reads them)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    for policy in args.policies.split(","):
        if policy not in POLICIES:
            parser.error(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    if args.prompts is not None and args.workloads is not None:
        parser.error("--prompts brings its own workloads (their \"domain\" field); drop --workloads")
    if args.prompts is not None and not args.prompts.is_file():
        parser.error(f"--prompts {args.prompts}: no such file")
    if args.workloads is not None:
        names = args.workloads.split(",")
        known = ("heldout", "serving", *SERVING_WORKLOADS, MIXED)
        if any(name not in known for name in names) or ("heldout" in names and len(names) > 1):
            parser.error(f"--workloads {args.workloads!r}: give heldout, serving, or a comma list of "
                         f"{', '.join((*SERVING_WORKLOADS, MIXED))}")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give 1 or more")
    if not 0.0 <= args.output_len_spread < 1.0:
        parser.error(f"--output-len-spread {args.output_len_spread}: give a fraction in [0, 1)")
    if args.output_len_spread and args.dataset != "heldout":
        parser.error(f"--output-len-spread: the project's workloads only (--dataset {args.dataset} sets its own "
                     f"lengths)")
    if args.prefill_threads is not None and (args.prefill_threads < 1 or args.cpu_model is None):
        parser.error(f"--prefill-threads {args.prefill_threads}: give 1 or more, with --cpu-model (the CPU bed's "
                     f"setting)")
    if args.draft_weights is not None and args.cpu_model is None:
        parser.error(f"--draft-weights {args.draft_weights}: the CPU bed's setting; give it with --cpu-model")
    concurrencies = args.concurrency.split(",")
    counts = args.num_prompts.split(",")
    if not all(count.strip().isdigit() and int(count) > 0 for count in counts) or \
            len(counts) not in (1, len(concurrencies)):
        parser.error(f"--num-prompts {args.num_prompts!r}: give one positive number, or one per --concurrency value "
                     f"({len(concurrencies)})")
    args.prompts_at = dict(zip(concurrencies, counts * len(concurrencies) if len(counts) == 1 else counts))
    args.prompts_at = {int(concurrency): int(count) for concurrency, count in args.prompts_at.items()}
    sizes = args.tp_sizes.split(",")
    if not all(size.strip().isdigit() and int(size) > 0 for size in sizes) or len(set(sizes)) != len(sizes):
        parser.error(f"--tp-sizes {args.tp_sizes!r}: give distinct positive numbers, e.g. 1,2")
    args.tp_sizes = [int(size) for size in sizes]
    if max(args.tp_sizes) > 1 and args.cpu_model == "smollm2":
        parser.error("--tp-sizes: SmolLM2's 9 query heads do not split over ranks; use --cpu-model smollm2-split "
                     "(the same model with zero heads added)")
    if args.tp_sizes != [1] and any(arg.split("=")[0] in ("--tp-size", "--tp", "--tensor-parallel-size")
                                    for arg in shlex.split(args.server_args)):
        parser.error("--server-args names a --tp-size and --tp-sizes sets one per server; give one of the two")
    if args.cpu_model is None and args.model_path is None:
        args.model_path = "deepseek-ai/DeepSeek-R1"
    return args


def bed_environment(args) -> dict[str, str]:
    """What a CPU bed's server gets in its environment beyond this process's: ``--prefill-threads`` and
    ``--draft-weights``."""
    environment = {} if args.prefill_threads is None else {PREFILL_THREADS_ENV: str(args.prefill_threads)}
    if args.draft_weights is not None:
        environment[DRAFT_WEIGHTS_ENV] = args.draft_weights
    return environment


def tree_arguments(args, policy: str, budget: int, profile: str | None) -> list[str]:
    """launch_server options of one method; ``budget`` draft tokens besides the root for the tree methods."""
    if policy == "plain":
        return []
    if policy == "plain-sync":
        return ["--disable-overlap-schedule"]
    if policy == "sglang-chain":
        return ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", str(SGLANG_CHAIN_STEPS),
                "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(SGLANG_CHAIN_STEPS + 1)]
    if policy == "sglang-tree":
        return ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", str(args.depth),
                "--speculative-eagle-topk", str(SGLANG_TREE_TOPK), "--speculative-num-draft-tokens", str(budget + 1)]
    if policy == "sglang-ngram":
        return ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(budget + 1)]
    if policy == AUTO:
        return tree_arguments(args, "hybrid", budget, profile) + ["--speculative-tree-auto"]
    if policy == AUTO_BATCH:
        return tree_arguments(args, AUTO, budget, profile) + ["--speculative-tree-verify-sizes", f"1,{budget + 1}"]
    if policy in (AUTO + SYNC, AUTO_BATCH + SYNC):
        return tree_arguments(args, policy.removesuffix(SYNC), budget, profile) + ["--disable-overlap-schedule"]
    if policy in (LOOKUP_DEVICE, HYBRID_DEVICE):
        on_host = policy.removesuffix("-device")
        return tree_arguments(args, on_host, budget, profile) + ["--speculative-tree-context-on", "device"]
    # a tree of `budget` draft tokens is at most that deep (the server refuses deeper): a budget sweep caps it
    if policy in ("lookup", "hybrid"):
        depth = min(args.hybrid_depth or default_depth(policy, budget), budget)
    else:
        depth = min(args.depth, budget)
    arguments = ["--speculative-algorithm", "NEXTN", "--speculative-tree-policy", policy,
                 "--speculative-tree-budget", str(budget), "--speculative-tree-depth", str(depth)]
    if policy == "hybrid" and args.mtp_levels is not None:
        arguments += ["--speculative-tree-mtp-levels", str(min(args.mtp_levels, depth - 1))]
    if policy not in ("chain", "lookup"):
        arguments += ["--speculative-tree-topk", str(args.topk)]
    if policy == "sequoia" and not profile:
        raise SystemExit("error: the sequoia policy needs --acceptance-profile (sglang-spec calibrate)")
    if policy in ("sequoia", "lookup", "hybrid") and profile:  # lookup / hybrid: the per-source counts
        arguments += ["--speculative-acceptance-profile", profile]
    return arguments


def launch_command(args, policy: str, budget: int, profile: str | None = None, port: int | None = None,
                   tp_size: int = 1) -> list[str]:
    """launch_server arguments on a GPU host (the CPU path builds them with the harness), on ``port`` (default
    ``--port``)."""
    command = [sys.executable, "-m", "sglang.launch_server", "--model-path", args.model_path, "--port",
               str(args.port if port is None else port)]
    return command + tree_arguments(args, policy, budget, profile or args.acceptance_profile) + \
        parallel_arguments(tp_size) + extra_server_args(args)


def parallel_arguments(tp_size: int) -> list[str]:
    """launch_server's tensor-parallel size of a server of the sweep (none at 1, SGLang's default)."""
    return [] if tp_size == 1 else ["--tp-size", str(tp_size)]


def extra_server_args(args) -> list[str]:
    """``--server-args``, with SGLang's decode log every step unless they set its interval: SGLang adds a window's
    accepted tokens to the totals that /get_server_info reports only when it logs the window (every 40 decode steps
    by default), so a run of fewer steps reported no accept length and a longer one left its last window out. With
    ``--servers-together`` every server also sleeps when idle (``--sleep-on-idle``), and on the CPU bed each may
    count the memory its peers hold as its own (``TOGETHER_MEMORY_FRACTION``): SGLang's CPU start-up refuses a
    server when the memory others use exceeds ``1 - --mem-fraction-static``, though the bed's KV pool is capped
    by ``--max-total-tokens``, not by that fraction."""
    extra = shlex.split(args.server_args)
    if not any(arg.split("=")[0] == "--decode-log-interval" for arg in extra):
        extra += ["--decode-log-interval", "1"]
    if args.servers_together and "--sleep-on-idle" not in extra:
        extra += ["--sleep-on-idle"]
    if args.servers_together and args.cpu_model and not any(arg.split("=")[0] == "--mem-fraction-static"
                                                            for arg in extra):
        extra += ["--mem-fraction-static", TOGETHER_MEMORY_FRACTION]
    return extra


def server_port(args, index: int) -> int:
    """The port of the ``index``-th server (its place in the sweep's list): all share ``--port`` one at a time, or
    take one each from it up with ``--servers-together``."""
    return args.port + index if args.servers_together else args.port


def bench_command(args, concurrency: int, output: Path, dataset: Path | None = None,
                  port: int | None = None) -> list[str]:
    """bench_serving at one concurrency over ``dataset`` (a ShareGPT file of one workload), against the server on
    ``port`` (default ``--port``)."""
    command = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--host", "127.0.0.1",
               "--port", str(args.port if port is None else port), "--num-prompts", str(args.prompts_at[concurrency]),
               "--max-concurrency", str(concurrency), "--output-file", str(output),
               # SGLang's accept length is its counters' total since they were last reset: without a flush after
               # the warm-up request, a server's second workload would report the mean over both
               "--flush-cache"]
    if args.dataset == "heldout":  # with a spread, each request's length is its placeholder reply's
        fixed = [] if args.output_len_spread else ["--sharegpt-output-len", str(args.random_output_len)]
        return command + ["--dataset-name", "sharegpt", "--dataset-path", str(dataset or "heldout.json"), *fixed,
                          "--apply-chat-template"]
    return command + ["--dataset-name", args.dataset, "--random-input-len", str(args.random_input_len),
                      "--random-output-len", str(args.random_output_len), "--random-range-ratio", "1.0"]


def write_sharegpt(path: Path, questions: list[str], replies: list[str] | None = None) -> Path:
    """Single-turn requests in ShareGPT's format, what bench_serving reads. The reply is a placeholder: the output
    length comes from --sharegpt-output-len, or without it from the reply's tokens (``replies``, one a question)."""
    replies = replies or ["."] * len(questions)
    path.write_text(json.dumps([{"conversations": [{"from": "human", "value": question},
                                                   {"from": "gpt", "value": reply}]}
                                for question, reply in zip(questions, replies, strict=True)]))
    return path


GOLDEN_FRACTION = 0.6180339887498949  # the golden ratio's fraction: successive multiples spread evenly over [0, 1)


def output_lengths(count: int, mean: int, spread: float) -> list[int]:
    """``count`` output lengths spread evenly over ``(1 +- spread) * mean`` (a low-discrepancy sequence: any run of
    consecutive requests covers the range, and the lengths average about ``mean``), each at least 4 (bench_serving's
    least)."""
    return [max(4, round(mean * (1 - spread + 2 * spread * ((index * GOLDEN_FRACTION) % 1.0))))
            for index in range(count)]


def placeholder_replies(tokenizer, lengths: list[int]) -> list[str]:
    """Replies bench_serving counts as ``lengths`` tokens (``tokenizer.encode``, as it counts them); SpecError when
    the tokenizer does not count one token a word."""
    replies = [" ".join(["x"] * length) for length in lengths]
    for reply, length in zip(replies, lengths):
        counted = len(tokenizer.encode(reply))
        if counted != length:
            raise SpecError(f"--output-len-spread: this tokenizer counts {counted} tokens in a reply of {length} "
                            f"words; run without the spread")
    return replies


def heldout_questions() -> list[str]:
    """HumanEval 134-163 (held out from the shipped heads' traffic), the ``heldout`` workload."""
    return [spec.messages[0]["content"] for spec in humaneval_prompts(134, 163)]


EXTRACTION_QUESTIONS = (
    "Copy, word for word, every sentence of this passage that names a year.",
    "List every commission or body this passage names, each with the sentence that names it, quoted exactly.",
    "Quote the first and the last sentence of this passage exactly, then say in one line what it is about.",
)


DISTINCT_PROMPTS = 32  # distinct requests a serving workload holds (concurrency 16 twice over, no repeats)


def serving_questions(workload: str) -> list[str]:
    """The held-out ``serving`` workloads (module doc): nothing in the project trained or tuned on them, 32
    distinct requests each. The first ones are the earlier, smaller sets in their order (code: HumanEval 150-163;
    extraction: six passages with one question each; chat: eight prompts), so runs with few prompts stay
    comparable with the earlier results."""
    if workload == MIXED:  # a stream of all three: the requests of each in turn
        streams = [serving_questions(name) for name in SERVING_WORKLOADS]
        return [question for group in zip(*streams) for question in group][:DISTINCT_PROMPTS]
    if workload == "code":
        tasks = [*range(150, 164), *range(134, 150), 132, 133]  # 134+: never in the shipped heads' traffic
        return [spec.messages[0]["content"] for task in tasks for spec in humaneval_prompts(task, task)]
    if workload == "extraction":
        import importlib.resources

        report = importlib.resources.files("sglang").joinpath("test", "long_prompt.txt").read_text()
        # the report alone: the file opens with a summarising instruction of its own
        words = report.replace("\\n", "\n").split("Report:", 1)[-1].strip().split(" ")
        passages = [" ".join(words[start : start + 350]) for start in range(0, len(words) - 350, 350)]
        # passage i with question i mod 3 first (the earlier six), then the other questions on each passage
        pairs = [(index, index % len(EXTRACTION_QUESTIONS)) for index in range(len(passages))]
        pairs += [(index, question) for question in range(len(EXTRACTION_QUESTIONS)) for index in range(len(passages))
                  if question != index % len(EXTRACTION_QUESTIONS)]
        ordered = pairs[:6] + sorted(pairs[6:], key=lambda pair: pair[0] >= 6)  # stable: the first six passages first
        return [f"{passages[index]}\n\n{EXTRACTION_QUESTIONS[question]}"
                for index, question in ordered[:DISTINCT_PROMPTS]]
    return [_question(spec) for spec in load_prompts(str(WORKLOADS_DIR / f"{workload}.jsonl"))]


def _question(spec: PromptSpec) -> str:
    """The request text of one prompt (its last user message, for chat prompts)."""
    return spec.prompt if spec.prompt is not None else spec.messages[-1]["content"]


def workload_names(args) -> list[str]:
    """The workloads a sweep runs (``--prompts``: named by the file's domains once it is read)."""
    if args.prompts is not None:
        return ["prompts"]
    names = (args.workloads or "heldout").split(",")
    return list(SERVING_WORKLOADS) if names == ["serving"] else names


def workload_datasets(args, scratch: Path, tokenizer=None) -> dict[str, Path]:
    """Workload name -> its ShareGPT file for bench_serving (``tokenizer``: the served model's, needed for
    ``--output-len-spread``)."""
    def write(path: Path, questions: list[str]) -> Path:
        if not args.output_len_spread:
            return write_sharegpt(path, questions)
        lengths = output_lengths(len(questions), args.random_output_len, args.output_len_spread)
        return write_sharegpt(path, questions, placeholder_replies(tokenizer, lengths))

    if args.prompts is not None:
        by_domain: dict[str, list[str]] = {}
        for spec in load_prompts(str(args.prompts)):  # the project's prompt-file reader: one line per bad input
            by_domain.setdefault(spec.domain, []).append(_question(spec))
        return {name: write(scratch / f"prompts-{name}.json", repeated(questions, max(args.prompts_at.values())))
                for name, questions in by_domain.items()}
    names = workload_names(args)
    if names == ["heldout"]:
        return {"heldout": write(scratch / "heldout.json", heldout_questions())}
    return {name: write(scratch / f"serving-{name}.json",
                        repeated(serving_questions(name), max(args.prompts_at.values())))
            for name in names}


def repeated(questions: list[str], count: int) -> list[str]:
    """The questions in order, cycled to ``count`` at least: bench_serving sends each dataset entry once, so a
    workload with fewer prompts than ``--num-prompts`` would never fill a batch of the asked concurrency. Cycled
    prompts repeat whole requests, which a cross-request corpus (SGLang's NGRAM) answers from the earlier copy's
    output: the sweep says so on stderr, and such a method's numbers there are not a fair comparison."""
    if count > len(questions):
        print(f"warning: {len(questions)} distinct prompts repeated to {count} requests: a method with a "
              f"cross-request corpus (sglang-ngram) sees earlier answers to the same prompt", file=sys.stderr)
    return [questions[index % len(questions)] for index in range(max(count, len(questions)))]


def row_from_result(policy: str, budget: int, concurrency: int, result: dict, workload: str = "heldout",
                    tp_size: int = 1) -> dict:
    """One CSV row from bench_serving's JSON result line (accept length when the server reports it)."""
    budget = 0 if policy in PLAIN_METHODS else SGLANG_CHAIN_STEPS if policy == "sglang-chain" else budget
    return {"policy": policy, "budget": budget, "concurrency": concurrency,
            **{name: result.get(name) for name in MEASURED}, "workload": workload, "tp_size": tp_size,
            "speedup_over_plain": None}


def server_name(policy: str, budget: int, tp_size: int = 1) -> str:
    """A server's name in logs and progress lines: the policy, with its budget where it has one, and its
    tensor-parallel size where above 1."""
    name = policy if policy in PLAIN_METHODS else f"{policy}-{budget}"
    return name if tp_size == 1 else f"{name}-tp{tp_size}"


def method_label(row: dict) -> str:
    """A row's method in the table and plot: its server's name, the budget spelt apart."""
    label = row["policy"] if row["policy"] in PLAIN_METHODS else f"{row['policy']} {row['budget']}"
    return label if row.get("tp_size", 1) == 1 else f"{label} TP{row['tp_size']}"


def round_order(shapes: list, round_index: int) -> list:
    """The servers of round ``round_index`` (0-based): ``shapes`` rotated by it, so over as many rounds as servers
    each runs once in every position. On this machine a server's speed drifts with its place in the run (the
    one started later was the slower in both orders tried, sixteenth session): a fixed order puts that drift on
    the last server's figures in every round."""
    shift = round_index % len(shapes) if shapes else 0
    return shapes[shift:] + shapes[:shift]


def median_over_rounds(rows: list[dict]) -> list[dict]:
    """One row per method, workload and concurrency: every measured figure's median over the rounds (each row a
    round's, in order; ``output_throughput_rounds`` keeps every round's tokens/s)."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["policy"], row["budget"], row.get("tp_size", 1), row["workload"], row["concurrency"]),
                          []).append(row)
    merged = []
    for group in groups.values():
        row = dict(group[0])
        for name in MEASURED:
            values = [member[name] for member in group if member[name] is not None]
            row[name] = statistics.median(values) if values else None
        row["output_throughput_rounds"] = [member["output_throughput"] for member in group]
        row["position_rounds"] = [member.get("position") for member in group]  # its place in each round's order
        merged.append(row)
    return merged


def add_speedups(rows: list[dict]) -> None:
    """Each row's output tokens/s over plain decoding's at the same workload, concurrency and tensor-parallel size,
    in this run: the faster of ``plain`` and ``plain-sync`` where both ran (a speedup is over the best plain decoding
    measured).
    Rows merged over rounds also get ``speedup_over_plain_rounds``: round r's tokens/s over the faster plain's in
    round r (the servers of one round share the machine's phase, which moves tokens/s by 10-20% between rounds
    here), so the spread of a median's ratio is in the JSON and the table."""
    plain: dict[tuple, float] = {}
    plain_rounds: dict[tuple, list[float]] = {}
    for row in rows:
        if row["policy"] in PLAIN_METHODS and row["output_throughput"] is not None:
            key = (row["workload"], row["concurrency"], row.get("tp_size", 1))
            plain[key] = max(plain.get(key, 0.0), row["output_throughput"])
            rounds = [value or 0.0 for value in row.get("output_throughput_rounds") or []]  # None: not measured
            best = plain_rounds.setdefault(key, [0.0] * len(rounds))
            plain_rounds[key] = [max(a, b) for a, b in zip(best, rounds)]
    for row in rows:
        key = (row["workload"], row["concurrency"], row.get("tp_size", 1))
        base = plain.get(key)
        if base and row["output_throughput"] is not None:
            row["speedup_over_plain"] = row["output_throughput"] / base
        rounds, bases = row.get("output_throughput_rounds"), plain_rounds.get(key)
        if rounds and bases and len(rounds) == len(bases) and all(bases) and None not in rounds:
            row["speedup_over_plain_rounds"] = [value / base for value, base in zip(rounds, bases)]


def write_csv_and_plot(rows: list[dict], out: Path) -> None:
    from sglang_spec.files import atomic_write

    with atomic_write(out) as handle:
        writer = csv.DictWriter(handle, fieldnames=FIELDS, extrasaction="ignore")  # rounds: in the JSON
        writer.writeheader()
        writer.writerows(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("output_throughput", "output tokens/s"), ("accept_length", "mean accept length"),
              ("median_itl_ms", "p50 inter-token latency (ms)"), ("p99_itl_ms", "p99 inter-token latency (ms)"))
    if len({row["concurrency"] for row in rows}) == 1:
        figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2))
        _bars(axes, panels, rows)
    else:
        workloads = list(dict.fromkeys(row.get("workload", "") for row in rows))
        figure, axes = plt.subplots(len(workloads), len(panels), figsize=(5 * len(panels), 3.6 * len(workloads)),
                                    squeeze=False)
        for row_axes, workload in zip(axes, workloads):
            _lines(row_axes, panels, [row for row in rows if row.get("workload", "") == workload], workload)
    figure.tight_layout()
    figure.savefig(out.with_suffix(".png"), dpi=110, bbox_inches="tight")  # the legend stands right of the panels
    plt.close(figure)


def _colour(index: int, count: int):
    """Method ``index`` of ``count``'s colour: matplotlib's cycle, which repeats after ten, or tab20 beyond."""
    import matplotlib

    return f"C{index}" if count <= 10 else matplotlib.colormaps["tab20"](index % 20)


def _lines(axes, panels, rows: list[dict], workload: str) -> None:
    """Several concurrencies, one workload (a row of panels): one line per method over concurrency, each method in
    the same colour in every row; one legend, right of the last panel."""
    methods = sorted({method_label(row) for row in rows})
    for index, label in enumerate(methods):
        points = sorted(((row["concurrency"], row) for row in rows if method_label(row) == label),
                        key=lambda point: point[0])
        for axis, (field, _) in zip(axes, panels):
            values = [row[field] or (1.0 if field == "accept_length" else 0.0) for _, row in points]
            axis.plot([c for c, _ in points], values, marker="o", label=label, color=_colour(index, len(methods)))
    for axis, (_, label) in zip(axes, panels):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrency")
        axis.set_ylabel(label)
        axis.set_title(workload or "prompts", fontsize=9)
    axes[-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))


def _bars(axes, panels, rows: list[dict]) -> None:
    """One concurrency: a group of bars per workload, one bar per method (a line over one x says nothing); the
    throughput bars carry their ratio over plain decoding."""
    workloads = list(dict.fromkeys(row.get("workload", "") for row in rows))
    methods = list(dict.fromkeys(method_label(row) for row in rows))
    width = 0.8 / len(methods)
    for axis, (field, label) in zip(axes, panels):
        for index, method in enumerate(methods):
            found = {row.get("workload", ""): row for row in rows if method_label(row) == method}
            positions = [w + (index - (len(methods) - 1) / 2) * width for w in range(len(workloads))]
            values = [(found[name][field] if name in found else None) or (1.0 if field == "accept_length" else 0.0)
                      for name in workloads]
            bars = axis.bar(positions, values, width, label=method, color=_colour(index, len(methods)))
            if field == "output_throughput":
                ratios = [found[name].get("speedup_over_plain") if name in found else None for name in workloads]
                axis.bar_label(bars, labels=[f"{r:.2f}x" if r else "" for r in ratios], fontsize=6,
                               rotation=90 if len(methods) > 4 else 0, padding=2)
        axis.set_xticks(range(len(workloads)), workloads)
        axis.set_xlabel(f"workload (concurrency {rows[0]['concurrency']})")
        axis.set_ylabel(label)
    axes[0].margins(y=0.15)  # room for the ratio labels
    axes[-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))


def print_table(rows: list[dict]) -> None:
    """One line a row; with rounds, ``rounds x`` gives the lowest and highest of the row's per-round ratios over
    the faster plain (``add_speedups``) beside the ratio of the medians."""
    spread = any(row.get("speedup_over_plain_rounds") for row in rows)

    def rounds_column(row: dict | None) -> str:
        if not spread:
            return ""
        if row is None:
            return f"{'rounds x':>12}"
        ratios = row.get("speedup_over_plain_rounds")
        return f"{f'{min(ratios):.2f}-{max(ratios):.2f}' if ratios else '':>12}"

    parallel = any(row.get("tp_size", 1) > 1 for row in rows)  # a TP column only where a sweep ran several

    def tp_column(row: dict | None) -> str:
        return "" if not parallel else f"{'TP':>4}" if row is None else f"{row.get('tp_size', 1):>4}"

    print(f"{'workload':<11}{'policy':<13}{'budget':>7}{tp_column(None)}{'conc':>6}{'out tok/s':>11}{'x plain':>8}"
          f"{rounds_column(None)}{'AL':>6}{'p50 ITL':>10}{'p99 ITL':>10}")
    for row in rows:
        ratio = row.get("speedup_over_plain")
        print(f"{row.get('workload', ''):<11}{row['policy']:<13}{row['budget']:>7}{tp_column(row)}"
              f"{row['concurrency']:>6}"
              f"{row['output_throughput'] or 0:>11.2f}{'' if ratio is None else f'{ratio:.2f}x':>8}"
              f"{rounds_column(row)}"
              f"{row['accept_length'] or 1.0:>6.2f}{row['median_itl_ms'] or 0:>10.1f}{row['p99_itl_ms'] or 0:>10.1f}")


def run_record(args, argv: list[str] | None, rows: list[dict]) -> dict:
    """The JSON a sweep writes: its command (as typed, the script's path from the repository root), the machine it
    ran on (no commit, no date: the results page shows what and where, git keeps when) and its rows."""
    import platform

    import sglang

    given = sys.argv[1:] if argv is None else argv
    model = f"CPU test bed, {args.cpu_model}" if args.cpu_model is not None else args.model_path
    return {"command": "python bench/serving_sweep.py " + shlex.join(given),
            "environment": {"device": f"{platform.machine()}, {os.cpu_count()} cores" + (
                ", CPU" if args.cpu_model is not None else ""), "model": model, "sglang": sglang.__version__,
                "python": platform.python_version()},
            "rows": rows}


def main(argv=None) -> int:
    args = parse_args(argv)
    policies = args.policies.split(",")
    budgets = [int(b) for b in args.budgets.split(",")]
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    # plain decoding and SGLang's chain have no budget to sweep
    # a server of the sweep: (policy, budget, tensor-parallel size)
    shapes = [(policy, budget, tp_size) for tp_size in args.tp_sizes for policy in policies
              for budget in (budgets[:1] if policy in (*PLAIN_METHODS, "sglang-chain") else budgets)]
    if args.dry_run:
        for index, (policy, budget, tp_size) in enumerate(shapes):
            port = server_port(args, index)
            launch = launch_command(args, policy, budget, port=port, tp_size=tp_size) if args.cpu_model is None else \
                [*(f"{name}={value}" for name, value in bed_environment(args).items()), sys.executable, "-m",
                 "sglang_spec_testbed", "--model", args.cpu_model, "--port", str(port),
                 *(["--no-speculation"] if policy in PLAIN_METHODS else []),
                 *tree_arguments(args, policy, budget, args.acceptance_profile or "<shipped profile>"),
                 *parallel_arguments(tp_size), *extra_server_args(args)]
            print(" ".join(shlex.quote(part) for part in launch))
            for workload in workload_names(args):
                for concurrency in concurrencies:
                    command = bench_command(args, concurrency, Path("out.jsonl"), Path(f"{workload}.json"), port)
                    print("  " + " ".join(shlex.quote(p) for p in command))
        return 0
    from sglang_spec_testbed.server import SGLangServer, cpu_launch_args, prepare_model

    check_output_path(args.out, force=True)  # a bad --out fails now, not after the run
    if args.cpu_model is None:
        import torch

        if not torch.cuda.is_available():
            print("error: no GPU here; use --cpu-model smollm2 to sweep through the CPU harness, or --dry-run",
                  file=sys.stderr)
            return 2
    model = prepare_model(args.cpu_model) if args.cpu_model else None
    profile = args.acceptance_profile or (str(model.profile) if model and model.profile else None)
    scratch = REPO / "runs" / "serving_sweep"  # server logs and the workload datasets (gitignored)
    scratch.mkdir(parents=True, exist_ok=True)
    tokenizer = None
    if args.output_len_spread:  # the served model's tokenizer counts each placeholder reply, as bench_serving will
        from transformers import AutoTokenizer

        source = str(model.target_dir) if model else args.model_path
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError) as error:
            raise SpecError(f"--output-len-spread counts each reply with the served model's tokenizer, and {source} "
                            f"has none that loads ({str(error).splitlines()[0][:120]}); "
                            "run without the spread") from None
    datasets: dict[str, Path | None] = dict(workload_datasets(args, scratch, tokenizer)) \
        if args.dataset == "heldout" else {args.dataset: None}

    if args.plan_logs is not None:
        args.plan_logs.mkdir(parents=True, exist_ok=True)

    def start(index: int, policy: str, budget: int, tp_size: int) -> SGLangServer:
        """The started server of one method (SpecError naming it when it does not start)."""
        name, port = server_name(policy, budget, tp_size), server_port(args, index)
        plan_log = {} if args.plan_logs is None else {PLAN_LOG_ENV: str(args.plan_logs / f"{name}.jsonl")}
        if model is not None:
            launch = cpu_launch_args(model, port, speculative=policy not in PLAIN_METHODS,
                                     extra=tree_arguments(args, policy, budget, profile) + parallel_arguments(tp_size)
                                     + extra_server_args(args))
            server = SGLangServer(launch, port, scratch / f"{name}.log",
                                  env=dict(os.environ, **bed_environment(args), **plan_log))
        else:
            launch = launch_command(args, policy, budget, profile, port, tp_size)[3:]
            server = SGLangServer(launch, port, scratch / f"{name}.log", env=dict(os.environ, **plan_log), cpu=False)
        try:
            return server.start(timeout=args.start_timeout)
        except SpecError as error:
            raise SpecError(f"{name}: {error}") from None

    def measure(server: SGLangServer, shape: tuple[str, int, int], position: int, workload: str,
                dataset: Path | None, concurrency: int) -> dict:
        """One bench_serving run against a started server: its row (SpecError when the client fails)."""
        policy, budget, tp_size = shape
        name = server_name(policy, budget, tp_size)
        stem = f"{name}-{workload}-c{concurrency}"
        output = scratch / f"{stem}.jsonl"
        output.unlink(missing_ok=True)
        with (scratch / f"{stem}.client.log").open("w") as client_log:
            finished = subprocess.run(bench_command(args, concurrency, output, dataset, server.port), env=server.env,
                                      stdout=client_log, stderr=subprocess.STDOUT)
        if finished.returncode != 0:
            raise SpecError(f"bench_serving failed for {name} on {workload} at concurrency {concurrency}; see "
                            f"{client_log.name}")
        result = json.loads(output.read_text().strip().splitlines()[-1])
        row = dict(row_from_result(policy, budget, concurrency, result, workload, tp_size), position=position)
        print(f"{name} {workload} concurrency {concurrency}: {row['output_throughput']:.2f} tok/s", flush=True)
        return row

    def announce(round_index: int) -> None:
        if args.rounds > 1:
            order = ", ".join(server_name(*shape) for shape in round_order(shapes, round_index))
            print(f"round {round_index + 1} of {args.rounds}: {order}", flush=True)

    rows = []
    servers: dict[tuple[str, int, int], SGLangServer] = {}
    try:
        if args.servers_together:
            for index, shape in enumerate(shapes):
                servers[shape] = start(index, *shape)
            for round_index in range(args.rounds):
                announce(round_index)
                for workload, dataset in datasets.items():
                    for concurrency in concurrencies:
                        for position, shape in enumerate(round_order(shapes, round_index)):
                            rows.append(measure(servers[shape], shape, position, workload, dataset, concurrency))
        else:
            for round_index in range(args.rounds):
                announce(round_index)
                for position, shape in enumerate(round_order(shapes, round_index)):
                    servers[shape] = start(0, *shape)
                    for workload, dataset in datasets.items():
                        for concurrency in concurrencies:
                            rows.append(measure(servers[shape], shape, position, workload, dataset, concurrency))
                    servers.pop(shape).stop()
    except SpecError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    finally:
        for server in servers.values():
            server.stop()
    if args.rounds > 1:
        rows = median_over_rounds(rows)
    add_speedups(rows)
    print_table(rows)
    write_csv_and_plot(rows, args.out)
    write_text_atomic(args.out.with_suffix(".json"), json.dumps(run_record(args, argv, rows), indent=1) + "\n")
    print(f"wrote {args.out}, {args.out.with_suffix('.json')} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(exit_status(main))
