"""How ``bench/gpu_server_checks.py`` judges a GPU server: what its log says about CUDA graphs (captures, decode
batches replayed in a graph or run eagerly), its Prometheus counters, each answer against plain decoding's (same,
a near-tie of the two paths' rounding, or a difference that fails the check), accept lengths and per-step times.
Stdlib only at import (the parity helpers are imported where used)."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

# nats between plain decoding's best token and the tree's at the first token that differs, below which the
# difference is a near-tie of the two paths' rounding: float32, the parity test's logprob tolerance; bfloat16, an
# estimate (bf16 keeps 8 bits of a logit: a 30-layer model's logits move by a few hundredths between two kernels;
# the first GPU run lists every gap it saw, which is what to set this from)
TIE_GAP = {"float32": 1e-3, "bfloat16": 0.25}
LOGPROB_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.25}  # logprob values of identical tokens


class CannotRun(Exception):
    """This machine cannot run the check (exit CANNOT_RUN_HERE: skipped)."""


# ---------------------------------------------------------------------------------------------- evidence
def graph_evidence(log: str) -> dict[str, Any]:
    """What a server's log says about CUDA graphs: the target's verify / decode graph and the draft's decode graph
    captured (SGLang's "Capture ... CUDA graph end" lines) and how many logged decode batches ran in a graph."""
    return {"target_graph": bool(re.search(r"Capture target (verify|decode) CUDA graph end", log)),
            "draft_graph": "Capture draft decode CUDA graph end" in log,
            "graph_batches": len(re.findall(r"cuda graph: True", log)),
            "eager_batches": len(re.findall(r"cuda graph: False", log))}


def graph_problems(name: str, evidence: dict[str, Any], speculative: bool, eager: bool) -> list[str]:
    if eager:
        return [f"{name}: {evidence['graph_batches']} decode batches ran in a CUDA graph on an eager server"] \
            if evidence["graph_batches"] else []
    problems = []
    if not evidence["target_graph"]:
        problems.append(f"{name}: no target CUDA graph was captured")
    if speculative and not evidence["draft_graph"]:
        problems.append(f"{name}: no draft CUDA graph was captured")
    if not evidence["graph_batches"]:
        problems.append(f"{name}: no decode batch ran in a CUDA graph (none logged 'cuda graph: True')")
    return problems


def last_error_line(log: str) -> str:
    for line in reversed(log.splitlines()):
        if "Error" in line or "error:" in line or "Exception" in line:
            return line.strip()[:300]
    return "no error line"


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus counter's samples whose labels include ``labels`` (0 when absent)."""
    total = 0.0
    for label_text, value in re.findall(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", text, re.M):
        found = dict(re.findall(r'(\w+)="([^"]*)"', label_text or ""))
        if all(found.get(key) == wanted for key, wanted in labels.items()):
            total += float(value)
    return total


# ---------------------------------------------------------------------------------------------- comparing
@dataclass
class Finding:
    """One answer against plain decoding's. verdict: same | near_tie (parted where plain decoding's top two were
    within TIE_GAP) | differs (fails the check). A penalised request is held to plain decoding's answer under the
    overlap scheduler too: the plugin completes the lagging output ids there (``sglang_plugin/committed.py``). The
    oracle's own penalised answer is SGLang's plain decoding under its overlap loop, which on the CPU bed gave
    other answers than transformers on some prompts (docs/sglang-plugin.md, Parity under load): read a penalised
    difference against that first."""

    request: str
    verdict: str
    position: int | None = None
    gap: float | None = None
    note: str = ""


def first_difference(got: list[int], expected: list[int]) -> int | None:
    for index, (a, b) in enumerate(zip(got, expected)):
        if a != b:
            return index
    return None if len(got) == len(expected) else min(len(got), len(expected))


def plain_gap(diagnostic: dict[str, Any] | None, expected_ids: list[int], position: int, token: int) -> float:
    """Plain decoding's logprob of its own token minus that of ``token`` at ``position`` (inf when ``token`` is not
    among its top logprobs there, or the diagnostic run took another path before it)."""
    if diagnostic is None or "meta_info" not in diagnostic:
        return math.inf
    if diagnostic.get("output_ids", [])[:position + 1] != expected_ids[:position + 1]:
        return math.inf
    tops = diagnostic["meta_info"].get("output_top_logprobs") or []
    if position >= len(tops) or not tops[position]:
        return math.inf
    best = max(entry[0] for entry in tops[position])
    mine = [entry[0] for entry in tops[position] if entry[1] == token]
    return best - mine[0] if mine else math.inf


def compare_answer(request: str, got: Any, expected: Any, diagnostic: Any, dtype: str) -> list[Finding]:
    """``got`` (a tree server's answer) against ``expected`` (plain decoding's), output by output (n > 1 gives
    lists); ``diagnostic``: plain decoding's answer to the same request with its top logprobs."""
    from sglang_spec_testbed.parity import comparable, logprob_values

    if isinstance(expected, list) or isinstance(got, list):
        if not (isinstance(expected, list) and isinstance(got, list) and len(got) == len(expected)):
            return [Finding(request, "differs", note="a different number of outputs")]
        diagnostics = diagnostic if isinstance(diagnostic, list) else [None] * len(expected)
        return [finding for index, (one, other, diag) in enumerate(zip(got, expected, diagnostics))
                for finding in compare_answer(f"{request}[{index}]", one, other, diag, dtype)]
    if "status" in got or "status" in expected:
        return [Finding(request, "same" if got == expected else "differs", note="a refusal")]
    return [_compare_one(request, got, expected, diagnostic, dtype, comparable, logprob_values)]


def _compare_one(request, got, expected, diagnostic, dtype, comparable, logprob_values) -> Finding:
    got_ids, expected_ids = got["output_ids"], expected["output_ids"]
    position = first_difference(got_ids, expected_ids)
    if position is None:
        if comparable(got) != comparable(expected):
            return Finding(request, "differs", note="same tokens, another text, finish reason or logprob token ids")
        got_values, expected_values = logprob_values(got), logprob_values(expected)
        largest = max((abs(a - b) for a, b in zip(got_values, expected_values)), default=0.0)
        if len(got_values) != len(expected_values) or largest > LOGPROB_TOLERANCE[dtype]:
            return Finding(request, "differs", note=f"a logprob differs by {largest:.2e}")
        return Finding(request, "same", gap=largest or None)
    if position >= min(len(got_ids), len(expected_ids)):
        return Finding(request, "differs", position, note="one stopped where the other went on")
    gap = plain_gap(diagnostic, expected_ids, position, got_ids[position])
    verdict = "near_tie" if gap <= TIE_GAP[dtype] else "differs"
    return Finding(request, verdict, position, None if math.isinf(gap) else gap,
                   f"token {got_ids[position]} where plain decoding has {expected_ids[position]}")


def summarize(findings: list[Finding]) -> dict[str, Any]:
    counts = {verdict: sum(finding.verdict == verdict for finding in findings)
              for verdict in ("same", "near_tie", "differs")}
    return {"counts": counts, "not_same": [asdict(finding) for finding in findings if finding.verdict != "same"]}


def describe(counts: dict[str, int]) -> str:
    total = sum(counts.values())
    text = f"{counts['same']} of {total} answers identical to plain decoding"
    for verdict, words in (("near_tie", "parted at a near-tie"), ("differs", "DIFFER")):
        if counts[verdict]:
            text += f", {counts[verdict]} {words}"
    return text


def accept_summary(answers: list[Any]) -> dict[str, Any]:
    from sglang_spec_testbed.parity import accept_lengths

    flat = [one for answer in answers for one in (answer if isinstance(answer, list) else [answer])
            if isinstance(one, dict) and "meta_info" in one]
    lengths = accept_lengths(flat)
    return {"steps": len(lengths), "mean": sum(lengths) / len(lengths) if lengths else 0.0,
            "max": max(lengths, default=0)}


def step_times(answers: list[Any], speculative: bool) -> dict[str, Any]:
    """Per-step time of a batch's answers, from SGLang's meta_info: the slowest request's end-to-end latency over
    its decode steps (verify steps for a tree server, ``spec_verify_ct``; one a token for plain decoding),
    prefill included, so an upper bound of a step; and the batch's tokens per second."""
    metas = [one["meta_info"] for answer in answers for one in (answer if isinstance(answer, list) else [answer])
             if isinstance(one, dict) and "meta_info" in one]
    if not metas:
        return {}
    slowest = max(metas, key=lambda meta: meta.get("e2e_latency") or 0.0)
    seconds = float(slowest.get("e2e_latency") or 0.0)
    steps = int(slowest.get("spec_verify_ct") or 0) if speculative else int(slowest.get("completion_tokens") or 0)
    tokens = sum(int(meta.get("completion_tokens") or 0) for meta in metas)
    return {"requests": len(metas), "seconds": round(seconds, 4), "steps": steps,
            "ms_per_step": round(1e3 * seconds / steps, 3) if steps else None,
            "tokens_per_second": round(tokens / seconds, 1) if seconds else None}
