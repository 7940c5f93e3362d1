"""What each server check of ``bench/gpu_server_checks.py`` sends and holds a server to (``KINDS``: plain, policy,
auto, faults, capture-fault), given its ``Run`` (servers, problems, data) and model.

Requests (``Requests``, ``build_requests``): a model with a tokenizer gets the CPU tests' own set
(``sglang_spec_testbed/parity.py``: held-out HumanEval chat prompts 130-133, the repeat-context prompts, every kind
of /generate request as 32 concurrent requests); a model without one (``--skip-tokenizer-init``: the tiny
DeepSeek-V3) gets seeded token-id prompts. Every server also answers the first held-out prompt alone (batch 1) and
the held-out prompts twice in one call (batch 8), each timed per decode step (``judging.step_times``).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_server_judging import (CannotRun, Finding, accept_summary, compare_answer, describe, last_error_line,
                                metric, step_times, summarize)

HELDOUT = (130, 133)  # HumanEval tasks never in the shipped head's training traffic (conftest.smollm2_prompts)
HELDOUT_TOKENS = 40  # the CPU server tests' greedy tokens per held-out prompt
REPEAT_TOKENS = 32  # parity.REPEAT_NEW_TOKENS
SAMPLED = {"temperature": 0.7, "max_new_tokens": 16}  # the first request a server answers (see policy_run)
DIAGNOSTIC_TOP = 5  # top logprobs plain decoding reports for each request, to judge a difference
TOKEN_PROMPTS = 4  # a tokenizer-less model's prompts: this many, TOKEN_PROMPT_LENGTH ids each, seeded
TOKEN_PROMPT_LENGTH = 24
DRAFT_FAULT_ENV = "SGLANG_SPEC_INJECT_DRAFT_FAULT"
CAPTURE_FAULT_EVERY = 3  # the first graph capture is the third draft: see capture_fault_run
PLAIN, POLICY, AUTO, FAULTS, CAPTURE = "plain", "policy", "auto", "faults", "capture-fault"
# what a host-tree server logs at its first decode step (``sglang_plugin/ragged_verify.decide``): ragged verify on
# or off, and on its graphs
RAGGED_SAID = "ragged verify: "
RAGGED_GRAPHS = "SGLang's ragged verify graphs"


# ---------------------------------------------------------------------------------------------- requests
@dataclass
class Requests:
    """The requests every check sends: ``heldout`` token-id prompts (4), ``repeat`` texts and the parity ``cases``
    (both empty without a tokenizer)."""

    tokenizer: Any
    heldout: list[list[int]]
    repeat: list[str]
    cases: list[Any]  # parity.Case

    @property
    def summary(self) -> str:
        return (f"{len(self.heldout)} held-out and {len(self.repeat)} repeat-context prompts, {len(self.cases)} kinds "
                "of request")


def build_requests(model: Any) -> Requests:
    if "--skip-tokenizer-init" in model.model_args:
        vocab = json.loads((Path(model.target_dir) / "config.json").read_text())["vocab_size"]
        generator = random.Random(0)
        prompts = [[generator.randrange(vocab) for _ in range(TOKEN_PROMPT_LENGTH)] for _ in range(TOKEN_PROMPTS)]
        return Requests(None, prompts, [], [])
    from sglang_spec_testbed.parity import REPEAT_CONTEXT_PROMPTS
    from sglang_spec_testbed.parity import chat_ids, request_set
    from transformers import AutoTokenizer

    from sglang_spec.train.prompts import humaneval_prompts

    tokenizer = AutoTokenizer.from_pretrained(model.target_dir)
    heldout = [chat_ids(tokenizer, spec.messages[0]["content"]) for spec in humaneval_prompts(*HELDOUT)]
    return Requests(tokenizer, heldout, list(REPEAT_CONTEXT_PROMPTS), request_set(tokenizer, heldout))


def with_top_logprobs(body: dict[str, Any]) -> dict[str, Any]:
    return {**body, "return_logprob": True, "top_logprobs_num": DIAGNOSTIC_TOP}


def greedy(tokens: int) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": tokens}


def plain_answers(server: Any, requests: Requests) -> dict[str, Any]:
    """The oracle: the sampled requests first (as every check sends them), then the held-out and repeat-context
    prompts batched, parity.plain_oracle (each request of the set alone, the penalised one unpenalised,
    the bad bodies), and each request again alone with its top logprobs (``diagnostic``: what judges a
    difference)."""
    from sglang_spec_testbed.parity import Case, answer_or_error, plain_oracle

    def alone(body: dict[str, Any]) -> Any:
        return answer_or_error(server.port, Case("diagnostic", with_top_logprobs(body)))

    answers = shared_answers(server, requests)
    answers["parity"] = plain_oracle(server.port, requests.tokenizer, requests.heldout) if requests.cases else {}
    answers["diagnostic"] = {
        "heldout": [alone({"input_ids": ids, "sampling_params": greedy(HELDOUT_TOKENS)}) for ids in requests.heldout],
        "repeat": [alone({"text": text, "sampling_params": greedy(REPEAT_TOKENS)}) for text in requests.repeat],
        "single": {case.name: alone(case.body) for case in requests.cases},
    }
    return answers


def shared_answers(server: Any, requests: Requests) -> dict[str, Any]:
    """What every server answers, plain or tree, in this order (the sampled requests first: with the same
    --random-seed and nothing sampled before, two servers draw the same coins): sampled, held-out (a batch of 4),
    repeat-context, the first held-out prompt alone (batch 1) and the held-out prompts twice in one call (batch
    8)."""
    return {"sampled": server.generate(requests.heldout[:2], SAMPLED),
            "heldout": server.generate(requests.heldout, greedy(HELDOUT_TOKENS)),
            "repeat": server.generate(requests.repeat, greedy(REPEAT_TOKENS)) if requests.repeat else [],
            "alone": server.generate(requests.heldout[:1], greedy(HELDOUT_TOKENS)),
            "batch8": server.generate(requests.heldout * 2, greedy(HELDOUT_TOKENS))}


def tree_answers(server: Any, requests: Requests) -> dict[str, Any]:
    """A tree server's answers to what the oracle answered (the sampled requests first: with the same
    --random-seed and nothing sampled before, two servers draw the same coins), the parity set as 32 concurrent
    requests."""
    from sglang_spec_testbed.parity import concurrent

    answers = shared_answers(server, requests)
    answers["concurrent"] = concurrent(server.port, requests.cases) if requests.cases else []
    return answers


def compare_with_oracle(run: Any, answers: dict[str, Any], oracle: dict[str, Any]) -> list[Finding]:
    """Each answer against plain decoding's to the same prompt (batch 1 and 8 against the batch of 4's)."""
    check = run.check
    diagnostic = oracle["diagnostic"]
    findings = []
    for part in ("heldout", "repeat"):
        for index, (got, expected) in enumerate(zip(answers.get(part, []), oracle[part])):
            findings += compare_answer(f"{part}[{index}]", got, expected, diagnostic[part][index], check.dtype)
    for part in ("alone", "batch8"):
        for index, got in enumerate(answers.get(part, [])):
            prompt = index % len(oracle["heldout"])
            findings += compare_answer(f"{part}[{index}]", got, oracle["heldout"][prompt],
                                       diagnostic["heldout"][prompt], check.dtype)
    for name, got in answers.get("concurrent", []):
        findings += compare_answer(name, got, oracle["parity"]["single"][name], diagnostic["single"].get(name),
                                   check.dtype)
    return findings


# ---------------------------------------------------------------------------------------------- the checks
def plain_run(run: Any, model: Any, requests: Requests) -> str:
    server, launch = run.server("plain", False, model)
    answers = plain_answers(server, requests)
    run.finish(server, launch, speculative=False)
    run.answers_path(run.check.name).write_text(json.dumps(answers))
    sent = sum(len(answers[part]) for part in ("sampled", "heldout", "repeat", "alone", "batch8"))
    text = f"answered {sent + len(requests.cases)} requests, each greedy one again alone with its top logprobs"
    if requests.cases:
        penalised = answers["parity"]["single"]["frequency_penalty"]
        if penalised.get("output_ids") == answers["parity"]["unpenalised"].get("output_ids"):
            run.notes.append("the frequency penalty did not change plain decoding's answer (its comparison is "
                             "vacuous)")
        near = answers["parity"]["single"]["near_context_limit"]
        text += f" (near-limit prompt: {near.get('meta_info', {}).get('completion_tokens', near)} tokens)"
    return text + "; " + record_steps(run, launch, answers, speculative=False)


def record_steps(run: Any, launch: Any, answers: dict[str, Any], speculative: bool) -> str:
    """Per-step times at batch 1 and 8 into ``run.data``, and the graph replays counted in the log; one phrase."""
    times = {"batch1": step_times(answers["alone"], speculative), "batch8": step_times(answers["batch8"], speculative)}
    run.data["step_times"] = times
    evidence = launch.evidence
    parts = [f"{evidence.get('graph_batches', 0)} decode batches replayed in a CUDA graph, "
             f"{evidence.get('eager_batches', 0)} eager"]
    for batch, time in times.items():
        if time.get("ms_per_step") is not None:
            parts.append(f"{batch} {time['ms_per_step']:.2f} ms/step")
    return ", ".join(parts)


def policy_run(run: Any, model: Any, requests: Requests) -> str:
    check = run.check
    oracle = run.load_answers(check.oracle or "")
    reference = None
    if check.reference and run.answers_path(check.reference).exists():
        reference = run.load_answers(check.reference)
    server, launch = run.server(check.policy or "tree", True, model)
    answers = tree_answers(server, requests)
    metrics = server.request("/metrics")
    run.finish(server, launch, speculative=True)
    run.answers_path(check.name).write_text(json.dumps({"sampled": answers["sampled"]}))
    findings = compare_with_oracle(run, answers, oracle)
    return _judge_tree(run, findings, answers, metrics, reference) + "; " + record_steps(run, launch, answers, True)


def _judge_tree(run: Any, findings: list[Finding], answers: dict[str, Any], metrics: str,
                reference: dict[str, Any] | None) -> str:
    check = run.check
    summary = summarize(findings)
    run.data["comparison"] = summary
    counts = summary["counts"]
    if counts["differs"]:
        first = next(finding for finding in findings if finding.verdict == "differs")
        run.problems.append(f"{counts['differs']} answers differ from plain decoding (first: {first.request}, "
                            f"{first.note}, gap {first.gap})")
    every = [answers[part] for part in ("heldout", "repeat", "alone", "batch8") if part in answers]
    every += [[answer for _, answer in answers.get("concurrent", [])]]
    accepted = accept_summary([one for part in every for one in part])
    run.data["accept_length"] = accepted
    if accepted["max"] < 2:
        run.problems.append(f"no draft was accepted ({accepted['steps']} verify steps)")
    sampled = answers["sampled"]
    if not all(len(answer["output_ids"]) == SAMPLED["max_new_tokens"] for answer in sampled):
        run.problems.append("a sampled request did not complete its tokens")
    text = f"{describe(counts)}; accept length {accepted['mean']:.2f} (max {accepted['max']})"
    if "fused" in (check.policy or ""):
        fused = metric(metrics, "sglang_spec_fused_accept_batches_total", outcome="fused")
        run.data["fused_batches"] = fused
        text += f"; {fused:.0f} batches fused"
        if not fused:
            run.problems.append("no batch took the fused accept")
    if reference is not None:
        same = [answer["output_ids"] for answer in sampled] == [answer["output_ids"] for answer in reference["sampled"]]
        text += f"; seeded sampled answers {'equal' if same else 'NOT equal'} to {check.reference}'s"
        if not same:
            run.problems.append(f"the seeded sampled answers differ from {check.reference}'s (SGLang's accept, same "
                                "seed, same coins)")
    elif check.reference:
        run.notes.append(f"sampled answers not compared: {check.reference} has no answers")
    return text


def auto_run(run: Any, model: Any, requests: Requests) -> str:
    """--speculative-tree-auto with decode CUDA graphs: each verify size's graph state captured at start-up
    (``verify_shapes``), the planner's steps replayed from them; greedy held to plain decoding, the sizes the
    planner chose counted from /metrics, graph replays and per-step times as ``policy_run`` records them."""
    check = run.check
    oracle = run.load_answers(check.oracle or "")
    server, launch = run.server("auto-graphs", True, model, extra=("--speculative-tree-auto",))
    answers = tree_answers(server, requests)
    metrics = server.request("/metrics")
    log = run.finish(server, launch, speculative=True)
    table = re.search(r"tree auto: verify sizes .*", log)
    if table is None:
        run.problems.append("no start-up table in the log ('tree auto: verify sizes ...')")
    else:
        run.data["cost_table"] = table.group(0)
        if not run.cpu_bed and "graphs captured" not in table.group(0):
            run.problems.append("the verify sizes' runtime states hold no captured graphs")
    buckets = {float(size): float(count) for size, count in re.findall(
        r'sglang_spec_planner_verify_tokens_bucket\{[^}]*le="([\d.]+)"[^}]*\} ([\d.e+]+)', metrics)}
    chosen, previous = {}, 0.0
    for size in sorted(buckets):  # the histogram's buckets are cumulative
        if buckets[size] > previous:
            chosen[int(size)] = buckets[size] - previous
        previous = buckets[size]
    run.data["planned_sizes"] = chosen
    if not chosen:
        run.problems.append("the planner planned no decode step (sglang_spec_planner_verify_tokens is empty)")
    ragged = _judge_ragged(run, log, metrics) if RAGGED_SAID in log else ""
    findings = compare_with_oracle(run, answers, oracle)
    sizes = ", ".join(f"{size}: {count:.0f}" for size, count in chosen.items())
    return (_judge_tree(run, findings, answers, metrics, None) + f"; steps by verify size {sizes or 'none'}{ragged}; "
            + record_steps(run, launch, answers, True))


def _judge_ragged(run: Any, log: str, metrics: str) -> str:
    """A host-tree server's ragged verify (``ragged_verify``): on (said once at the first decode step; with CUDA
    graphs, on SGLang's ragged verify graphs) and its forwards computing fewer tokens than SGLang's width, or the
    reason it is off. A server whose check expects it (``ServerCheck.ragged``) and logs it off is a problem."""
    computed, dense = (metric(metrics, f"sglang_spec_verify_tokens_{kind}_total") for kind in ("computed", "dense"))
    run.data["verify_tokens"] = {"computed": computed, "dense": dense}
    off = re.search(r"ragged verify: off.*", log)
    if off is not None:
        if run.check.ragged:
            run.problems.append(off.group(0))
        return f"; {off.group(0)}"
    if run.check.ragged and not (run.cpu_bed or RAGGED_GRAPHS in log):
        run.problems.append("ragged verify ran eager: the decode graphs were not SGLang's ragged verify graphs")
    if run.check.ragged and not 0 < computed < dense:
        run.problems.append(f"ragged verify computed {computed:.0f} verify tokens of {dense:.0f} at SGLang's width")
    return f"; ragged verify: {computed:.0f} verify tokens computed of {dense:.0f} at SGLang's width"


def faults_run(run: Any, model: Any, requests: Requests) -> str:
    """Draft and accept faults together. Under CUDA graphs the draft's Python runs only where SGLang drafts
    eagerly: the captures' warm-ups and captures (each captured batch size runs the draft twice, then captures it:
    with sizes 1, 2, 4 the captures are drafts 3, 6 and 9, and every 4th draft faults in a warm-up, which recovers,
    never in a capture) and batches above the largest captured size (the held-out prompts twice: a batch of 8) or
    any batch of the context trees (drafted eagerly). The accept's faults fire at verify steps, graphs or not."""
    check = run.check
    oracle = run.load_answers(check.oracle or "")
    server, launch = run.server(f"{check.policy}-faults", True, model)
    before = server.request("/metrics")
    sampled = server.generate(requests.heldout[:2], SAMPLED)
    twice = server.generate(requests.heldout * 2, greedy(HELDOUT_TOKENS))
    repeat = server.generate(requests.repeat, greedy(REPEAT_TOKENS))
    metrics = server.request("/metrics")
    after = server.generate(requests.heldout[:1], greedy(4))
    log = run.finish(server, launch, speculative=True)
    answers = {"heldout": twice[:len(requests.heldout)], "repeat": repeat}
    findings = compare_with_oracle(run, answers, oracle)
    findings += [finding for index, (got, expected) in enumerate(zip(twice[len(requests.heldout):], oracle["heldout"]))
                 for finding in compare_answer(f"heldout-again[{index}]", got, expected,
                                               oracle["diagnostic"]["heldout"][index], check.dtype)]
    summary = summarize(findings)
    run.data["comparison"] = summary
    if summary["counts"]["differs"]:
        run.problems.append(f"{summary['counts']['differs']} answers differ from plain decoding")
    if after[0]["output_ids"] != oracle["heldout"][0]["output_ids"][:4]:
        run.problems.append("the request after the faults differs from plain decoding")
    if not all(len(answer["output_ids"]) == SAMPLED["max_new_tokens"] for answer in sampled):
        run.problems.append("a sampled request did not complete its tokens")
    drafts = metric(metrics, "sglang_spec_draft_faults_total") - metric(before, "sglang_spec_draft_faults_total")
    draft_lines = len(re.findall(r"\[sglang_spec\] draft fault, batch of", log))
    stages = ("accept", "commit", "record") if "fused" in (check.policy or "") else ("record", "observe")
    accepts = {stage: metric(metrics, "sglang_spec_accept_faults_total", stage=stage) for stage in stages}
    logged = {stage: len(re.findall(rf"accept fault in {stage},", log)) for stage in stages}
    run.data.update(draft_faults=drafts, draft_fault_lines=draft_lines, accept_faults=accepts,
                    accept_fault_lines=logged)
    if drafts <= 0:
        run.problems.append("no draft fault while serving (the eager drafts never reached an injected fault)")
    if draft_lines < metric(metrics, "sglang_spec_draft_faults_total"):
        run.problems.append(f"{draft_lines} draft-fault log lines for more counted faults")
    for stage in stages:
        if not accepts[stage] or logged[stage] < accepts[stage]:
            run.problems.append(f"accept faults in {stage}: {accepts[stage]:.0f} counted, {logged[stage]} logged")
    return (f"{describe(summary['counts'])}; {drafts:.0f} draft faults while serving, accept faults "
            + ", ".join(f"{stage} {accepts[stage]:.0f}" for stage in stages))


def capture_fault_run(run: Any, model: Any, requests: Requests) -> str:
    """Every 3rd draft raises: drafts 1 and 2 are the first captured size's warm-ups, draft 3 its capture. The
    plugin must re-raise it (a filler recorded into the graph would be replayed for every later batch), so the
    launch fails with the injected fault, and no 'draft fault' line is logged for draft 3."""
    from sglang_spec.errors import SpecError

    if run.cpu_bed:
        raise CannotRun("draft_fault_in_capture needs CUDA graphs (the CPU bed captures none)")
    marker = f"InjectedFault: draft {CAPTURE_FAULT_EVERY} ({DRAFT_FAULT_ENV}={CAPTURE_FAULT_EVERY})"
    try:
        server, launch = run.server("sequoia-capture-fault", True, model)
    except SpecError:
        log = Path(run.launches[-1].log).read_text(errors="replace")
        filler = re.search(rf"draft fault, batch of \d+ verified without speculation \(InjectedFault: draft "
                           rf"{CAPTURE_FAULT_EVERY} ", log)
        if marker not in log:
            run.problems.append(f"the launch failed, but not on the injected fault ({last_error_line(log)})")
        if filler:
            run.problems.append("a filler tree was recorded for the fault in the capture")
        return f"the launch failed on the injected fault in the draft graph's capture ({marker}), as it must"
    run.finish(server, launch, speculative=True)
    run.problems.append("the server started although a draft fault was injected into its first graph capture")
    return "the server started"


KINDS = {PLAIN: plain_run, POLICY: policy_run, AUTO: auto_run, FAULTS: faults_run, CAPTURE: capture_fault_run}
