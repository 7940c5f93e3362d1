"""How many tokens a step could take by copying one span of the context, against what the context lookup proposes: a
copy drafter's ceiling on a workload, read off the target's own output (no timing).

    python bench/copy_ceiling.py                                  # SmolLM2, the serving sweep's held-out workloads
    python bench/copy_ceiling.py --prompts mine.jsonl --depth 11  # your prompts, one workload per "domain"
    python bench/copy_ceiling.py --quick                          # tiny-deepseek on toy prompts (seconds)

Per prompt, the target's greedy output (the project's plain decoding: what every lossless method emits, EOS
ignored as the sweep's requests do) is replayed step by step. At each step the context is the prompt and the output
so far; a drafter proposes up to ``--depth`` tokens, the target keeps the longest run that matches its output and
adds its own token. Three drafters:

* ``best-copy``: the longest run of the output's next tokens that the context holds right after an earlier occurrence
  of its last token: a drafter that copies one span and always knew the best place to copy it from (from prompt
  lookup's weakest signal, a one-token match);
* ``lookup-chain``: the context lookup's first candidate at every depth (``tree/ngram.NgramIndex``: the longest
  n-gram match, its most frequent then most recent follower), what prompt-lookup decoding drafts;
* ``lookup-tree``: any of its first ``--lookup-width`` candidates at every depth: a lookup tree of unbounded budget
  (the trees the plugin serves hold fewer nodes, and also the head's branches). Its depths may follow different
  occurrences, so on some prompts it accepts more than ``best-copy``.

Tokens per step = the output's tokens after its first (prefill's) over the steps, as a server's accept length
counts them. ``best-copy`` against ``lookup-tree`` is what a better choice among the context's copies could still
give; a served hybrid tree's accept length (``serving_sweep.py``) above both is the head's. Writes JSON (``--out``)
and prints a table.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from harness import REPO, environment, markdown_table, repeating_toy_prompts

from sglang_spec.cli.parser import OneLineErrorParser, comma_list, integer, one_of
from sglang_spec.errors import exit_status
from sglang_spec.files import check_output_path, write_json_atomic
from sglang_spec.tree.ngram import NgramIndex

if TYPE_CHECKING:
    from sglang_spec.models.loading import LoadedModel

DRAFTERS = ("best-copy", "lookup-chain", "lookup-tree")
SERVING_WORKLOADS = ("code", "extraction", "chat")

# accepted drafts at one step: (context, the output's next tokens, depth) -> how many of them the drafter proposed
Drafter = Callable[[NgramIndex, Sequence[int], int], int]


def copy_run(context: Sequence[int], future: Sequence[int], depth: int) -> int:
    """The longest prefix of ``future`` (at most ``depth`` tokens) that ``context`` holds right after an earlier
    occurrence of its last token."""
    limit = min(depth, len(future))
    last, best = context[-1], 0
    for position in range(len(context) - 1):
        if context[position] != last:
            continue
        run = 0
        while run < limit and position + 1 + run < len(context) and context[position + 1 + run] == future[run]:
            run += 1
        best = max(best, run)
        if best == limit:
            break
    return best


def lookup_run(index: NgramIndex, future: Sequence[int], depth: int, width: int) -> int:
    """How many of ``future``'s tokens (at most ``depth``) the lookup proposes in turn, each among its first
    ``width`` candidates after the context and the tokens before it."""
    tail: list[int] = []
    while len(tail) < min(depth, len(future)):
        candidates = index.continuations(tail, max_candidates=width)
        if future[len(tail)] not in {candidate.token for candidate in candidates}:
            break
        tail.append(future[len(tail)])
    return len(tail)


def drafter(name: str, width: int) -> Drafter:
    if name == "best-copy":
        return lambda index, future, depth: copy_run(index.tokens, future, depth)
    return lambda index, future, depth: lookup_run(index, future, depth, 1 if name == "lookup-chain" else width)


def replay(prompt: Sequence[int], output: Sequence[int], depth: int, draft: Drafter) -> int:
    """Steps to emit ``output`` after its first token (prefill's), each step the drafter's accepted tokens plus
    the target's own."""
    index = NgramIndex([*prompt, *output[:1]])
    emitted, steps = 1, 0
    while emitted < len(output):
        future = output[emitted:]
        step = min(draft(index, future, depth) + 1, len(future))
        index.extend(future[:step])
        emitted += step
        steps += 1
    return steps


@dataclass(frozen=True)
class Row:
    """One workload and drafter: ``tokens_per_step`` = ``tokens`` / ``steps`` over its prompts' outputs (each
    output's first token excluded); ``per_prompt`` each prompt's own."""

    workload: str
    drafter: str
    prompts: int
    tokens: int
    steps: int
    tokens_per_step: float
    per_prompt: list[float]


def rows_for(workload: str, prompts: list[list[int]], outputs: list[list[int]], depth: int, width: int) -> list[Row]:
    rows = []
    tokens = [len(output) - 1 for output in outputs]
    for name in DRAFTERS:
        draft = drafter(name, width)
        steps = [replay(prompt, output, depth, draft) for prompt, output in zip(prompts, outputs)]
        rows.append(Row(workload, name, len(prompts), sum(tokens), sum(steps), sum(tokens) / max(1, sum(steps)),
                        [round(count / max(1, step), 3) for count, step in zip(tokens, steps)]))
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--workloads", type=comma_list(one_of(SERVING_WORKLOADS, "workload")), default=None,
                        help="the serving sweep's held-out workloads, among code, extraction, chat (default: all)")
    parser.add_argument("--prompts", type=Path, default=None, metavar="FILE.jsonl",
                        help="your prompts instead ({\"messages\": [...]} or {\"prompt\": ...} lines; one workload "
                             "per \"domain\")")
    parser.add_argument("--num-prompts", type=integer(1, 1000), default=6,
                        help="prompts a workload (the sweep's first N; 6 is its concurrency-1 run's)")
    parser.add_argument("--max-new-tokens", type=integer(2, 4096), default=48)
    parser.add_argument("--depth", type=integer(1, 64), default=11,
                        help="most draft tokens a step (a lookup / hybrid server's depth is its budget)")
    parser.add_argument("--lookup-width", type=integer(1, 64), default=4, help="candidates a lookup-tree node")
    parser.add_argument("--quick", action="store_true", help="tiny-deepseek on toy prompts that repeat themselves")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "copy_ceiling.json")
    args = parser.parse_args(argv)
    if args.prompts is not None and args.workloads is not None:
        parser.error("argument --workloads: --prompts brings its own workloads (their \"domain\" field); drop one")
    if args.prompts is not None and not args.prompts.is_file():
        parser.error(f"argument --prompts: {args.prompts}: no such file")
    args.workloads = args.workloads or list(SERVING_WORKLOADS)
    return args


def workload_prompts(args: argparse.Namespace, loaded: LoadedModel) -> dict[str, list[list[int]]]:
    """Workload -> prompt token ids (chat-templated where the model has a template, as the sweep's requests are)."""
    from sglang_spec.train.generate_traffic import prompt_tokens
    from sglang_spec.train.prompts import PromptSpec, load_prompts

    if args.quick:
        return {"toy": repeating_toy_prompts(loaded)[:args.num_prompts]}
    if args.prompts is not None:
        by_domain: dict[str, list[list[int]]] = {}
        for spec in load_prompts(str(args.prompts)):
            by_domain.setdefault(spec.domain, []).append(prompt_tokens(loaded, spec))
        return {domain: prompts[:args.num_prompts] for domain, prompts in by_domain.items()}
    from serving_sweep import serving_questions

    return {name: [prompt_tokens(loaded, PromptSpec(f"{name}-{number}", name,
                                                    messages=({"role": "user", "content": question},)))
                   for number, question in enumerate(serving_questions(name)[:args.num_prompts])]
            for name in args.workloads}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = check_output_path(args.out)
    from sglang_spec.catalog import load_model
    from sglang_spec.decode.decoder import GenerationConfig, generate_plain

    loaded = load_model("tiny-deepseek" if args.quick else args.model)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)  # no EOS: every output runs its full length
    rows: list[Row] = []
    for workload, prompts in workload_prompts(args, loaded).items():
        print(f"{workload}: decoding {len(prompts)} prompts, {args.max_new_tokens} tokens each", file=sys.stderr,
              flush=True)
        outputs = [request.tokens for request in generate_plain(loaded.model, prompts, config).requests]
        rows += rows_for(workload, prompts, outputs, args.depth, args.lookup_width)
    table = markdown_table(["workload", "drafter", "prompts", "tokens", "steps", "tokens / step", "per prompt"],
                           [[row.workload, row.drafter, row.prompts, row.tokens, row.steps,
                             f"{row.tokens_per_step:.2f}", " / ".join(f"{value:.2f}" for value in row.per_prompt)]
                            for row in rows])
    print("\n".join(table))
    command = "python bench/copy_ceiling.py " + " ".join(sys.argv[1:] if argv is None else argv)
    write_json_atomic(out, {"command": command.strip(), "environment": environment(model=loaded.name),
                            "depth": args.depth, "lookup_width": args.lookup_width,
                            "max_new_tokens": args.max_new_tokens, "rows": [asdict(row) for row in rows]})
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(exit_status(main))
