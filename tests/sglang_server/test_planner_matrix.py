"""``--speculative-tree-auto`` across R1's deployment settings, through launch_server on this CPU: every pair of
settings served together in at least one server (a pairwise cover), each server's greedy output identical to
plain decoding's.

Settings: tensor parallelism 1 or 2, DP attention 2 (``--tp-size 2 --dp-size 2 --enable-dp-attention``), SGLang's
overlap scheduler on or off, page size 1 or 4, the ``lookup`` / ``hybrid`` / ``sequoia`` trees, SGLang's accept or
the fused one, context trees grown on the host or on the device, SmolLM2 (on two ranks ``smollm2-split``, the same
model with zero attention heads appended: its own 9 query heads do not split in two; not under DP attention, which
SGLang's Llama does not implement: its attention is always split over the whole TP group) and the tiny DeepSeek-V3
(MLA + MoE + NEXTN), and decode graphs off or on: SGLang's ``DecodeCudaGraphRunner`` with its bookkeeping (graphs
per batch size and verify size, a batch padded to the next captured size, DP padding, static buffers, a plain step's
one-token verify graph; for ragged verifies SGLang's ragged verify graphs, one a tier of total verify tokens) and
only the graph stood in (``sglang_spec_testbed/graphs.py``: a replay runs the captured forward again on the static
buffers). ``pairwise_cover`` picks the servers; a unit test checks the cover (and that it fails on a cover that
misses a pair); one more server (``RAGGED_GRAPHS``) verifies ragged trees on those graphs, a setting of three factors
no pair holds. The tensor-parallel servers whose trees run the head rest it after one
plain step (``--speculative-tree-head-rest 1``), so their ranks skip its draft extend together.

A host read inside a captured forward stops the capture here as on a GPU (``graphs.HostReadGuard``); a branch a
real capture would freeze is not caught (the stand-in re-runs the forward's host code at each replay):
``scripts/gpu_check.sh --group server`` runs the real graphs on a GPU.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Callable, Iterable, Mapping, Sequence

import pytest

from cpu_server_helpers import (REPEAT_CONTEXT_PROMPTS, REPEAT_NEW_TOKENS, TINY_NEW_TOKENS, counter, running_server,
                               tree_args)
from sglang_spec.sglang_plugin.step_planner import PLAN_LOG_ENV
from sglang_spec_testbed.graphs import GRAPHS_ENV, ragged_replays_in, replays_in
from sglang_spec_testbed.patches import OVERLAP_ENV

FACTORS = {
    "parallel": ("tp1", "tp2", "dp2"),
    "loop": ("sync", "overlap"),
    "page": ("1", "4"),
    "policy": ("lookup", "hybrid", "sequoia"),
    "model": ("smollm2", "tiny"),
    "accept": ("sglang", "fused"),
    "context": ("host", "device"),
    "graphs": ("off", "on"),
}
PARALLEL_ARGS = {"tp1": [], "tp2": ["--tp-size", "2"], "dp2": ["--tp-size", "2", "--dp-size", "2",
                                                              "--enable-dp-attention"]}
BUDGET, DEPTH, TOPK = 6, 3, 2
GRAPH_BATCH_SIZES = ("1", "2", "4")  # the decode graphs captured: a batch of 3 runs on the graph for 4
# the tiny model's requests end at different steps: under DP attention a rank decodes fewer requests than another
# (SGLang pads its verify batch) and then none (an idle rank beside decoding ones), and their collectives must pair
TINY_LENGTHS = [8, TINY_NEW_TOKENS, 16, TINY_NEW_TOKENS]


def servable(cell: Mapping[str, str]) -> bool:
    """SmolLM2 runs without DP attention; trees grown on the device are context trees (lookup / hybrid)."""
    return (cell["model"] == "tiny" or cell["parallel"] != "dp2") and (
        cell["context"] == "host" or cell["policy"] != "sequoia")


def pairs_of(cell: Mapping[str, str]) -> set[tuple[tuple[str, str], tuple[str, str]]]:
    return {((a, cell[a]), (b, cell[b])) for a, b in itertools.combinations(sorted(cell), 2)}


def pairwise_cover(factors: Mapping[str, Sequence[str]], allowed: Callable[[Mapping[str, str]], bool]) -> list[dict]:
    """Settings (one value per factor, each ``allowed``) that together hold every pair of values some allowed
    setting holds: greedy, the setting covering the most pairs not yet covered first (ties: the earliest in the
    factors' product order, so the cover is the same every run)."""
    names = list(factors)
    valid = [cell for cell in (dict(zip(names, values)) for values in itertools.product(*factors.values()))
             if allowed(cell)]
    uncovered = set().union(*(pairs_of(cell) for cell in valid))
    cover = []
    while uncovered:
        best = max(valid, key=lambda cell: len(pairs_of(cell) & uncovered))
        cover.append(best)
        uncovered -= pairs_of(best)
    return cover


def missing_pairs(cover: Sequence[Mapping[str, str]], factors: Mapping[str, Sequence[str]],
                  allowed: Callable[[Mapping[str, str]], bool]) -> set:
    """The pairs some allowed setting holds that no setting of ``cover`` does."""
    every = set().union(*(pairs_of(dict(zip(factors, values))) for values in itertools.product(*factors.values())
                          if allowed(dict(zip(factors, values)))))
    return every - set().union(*(pairs_of(cell) for cell in cover))


COVER = pairwise_cover(FACTORS, servable)
# ragged verify on SGLang's ragged verify graphs is a three-way setting (host trees other than sequoia, graphs on,
# no DP attention) no pair of the cover holds: one more server serves it, in R1's shape otherwise (two ranks, the
# overlap loop, pages of 4, the fused accept, MLA + MoE), with lookup trees (the tiny model's lookup cells serve
# prompts with copies beside prompts without: trees of different sizes in one step)
RAGGED_GRAPHS = {"parallel": "tp2", "loop": "overlap", "page": "4", "policy": "lookup", "model": "tiny",
                 "accept": "fused", "context": "host", "graphs": "on"}
SERVERS = COVER + [RAGGED_GRAPHS]


def cell_name(cell: Mapping[str, str]) -> str:
    return "-".join(cell[name] for name in FACTORS)


def test_the_servers_cover_every_pair_of_settings():
    assert not missing_pairs(COVER, FACTORS, servable)
    assert all(servable(cell) for cell in COVER) and len(COVER) <= 13
    assert missing_pairs(COVER[:-1], FACTORS, servable)  # the last server covers a pair no other does


def test_plain_runs_count_each_steps_plan_once():
    # two ranks' interleaved logs of steps 0-4: tree, plain, plain, tree, plain
    plans = [{"step": step, "tokens": tokens} for step, tokens in [(0, 4), (0, 4), (1, 1), (2, 1), (1, 1), (2, 1),
                                                                    (3, 4), (4, 1), (3, 4), (4, 1)]]
    assert plain_runs(plans) == [2, 1]  # in log order the runs would read 4, 1, 1
    assert plain_runs([]) == []


def ragged(cell: Mapping[str, str]) -> bool:
    """Whether the cell's steps verify ragged (``sglang_plugin/ragged_verify.py``): trees built on the host, on
    SGLang's CPU back-end (with graphs on: SGLang's ragged verify graphs) without DP attention."""
    return cell["context"] == "host" and cell["policy"] != "sequoia" and cell["parallel"] != "dp2"


def launch_args(cell: Mapping[str, str], profile) -> list[str]:
    args = tree_args(cell["policy"], BUDGET, DEPTH, TOPK, profile) + [
        "--speculative-tree-auto", "--enable-metrics", "--speculative-tree-accept", cell["accept"],
        "--page-size", cell["page"], *PARALLEL_ARGS[cell["parallel"]]]
    if cell["policy"] != "sequoia":
        args += ["--speculative-acceptance-profile", str(profile)]
    if cell["context"] == "device":
        args += ["--speculative-tree-context-on", "device"]
    if resting(cell):
        args += ["--speculative-tree-head-rest", "1"]
    if cell["policy"] == "lookup" and cell["model"] == "tiny":
        # the tiny model's plain step is a few milliseconds and a tree's host work more: under the default cap a
        # tree step that emits four tokens a request is priced out after its first try, and the cell would verify
        # one tree a request
        args += ["--speculative-tree-step-cap", "4"]
    if cell["graphs"] == "on":
        args += ["--cuda-graph-backend-decode", "full", "--cuda-graph-bs-decode", *GRAPH_BATCH_SIZES]
    return args


def tiny_requests(cell: Mapping[str, str], toy: Sequence[Sequence[int]], copy: Sequence[Sequence[int]],
                  plain_runs: Mapping[str, list]) -> tuple[list, list]:
    """(prompts, plain outputs) of a tiny-model cell. Lookup trees find next to nothing to copy in the toy prompts
    (their predicted reach alone would leave a step's trees to the start-up timings), so a lookup cell takes two
    prompts of the model's likeliest text beside two toy ones: trees that are accepted, beside trees with no match
    in one batch."""
    if cell["policy"] != "lookup":
        return list(toy), list(plain_runs["toy"])
    return [toy[0], copy[0], toy[1], copy[1]], [plain_runs["toy"][0], plain_runs["copy"][0], plain_runs["toy"][1],
                                                plain_runs["copy"][1]]


def plain_runs(plans: Iterable[Mapping]) -> list[int]:
    """The lengths of the runs of plain steps (one verify token) in a plan log, each step once (the ranks of a
    group log the same plan under the same ``step``)."""
    tokens = {plan["step"]: plan["tokens"] for plan in plans}
    return [len(list(run)) for plain, run in itertools.groupby(tokens[step] == 1 for step in sorted(tokens)) if plain]


def resting(cell: Mapping[str, str]) -> bool:
    """Tensor-parallel servers whose trees run the head rest it after one plain step: the ranks skip its draft
    extend at the same steps (``StepPlanner.take``), or their collectives would not pair."""
    return cell["parallel"] == "tp2" and cell["policy"] != "lookup"


@pytest.mark.slow
@pytest.mark.sglang
@pytest.mark.parametrize("cell", SERVERS, ids=cell_name)
def test_tree_auto_answers_as_plain_decoding(cell, smollm2_cpu, smollm2_split_cpu, tiny_cpu, server_logs, tmp_path,
                                             smollm2_plain_runs, tiny_prompts, tiny_copy_prompts, tiny_plain_runs):
    """Greedy output equal to a one-rank plain server's (for SmolLM2 on two ranks: of the original, unpadded
    model, served by the padded one); the planner planned the decode steps (its requests
    counted on /metrics) and verified trees for some, with its start-up table logged; drafts were counted accepted
    exactly where a plan committed more than one token a request; where steps verify ragged,
    the forwards computed fewer tokens than SGLang's width where a plan (the plan log) gave a request a share below
    its step's width (which shares a plan cuts follows this machine's timings); where a resting cell's plans hold
    two plain steps in a row the head rested (else it did not); no rank logged a fault.
    Under DP attention a rank decoded none beside a decoding one, and (where the head runs) fewer than another."""
    smollm2 = cell["model"] == "smollm2"
    model = (smollm2_split_cpu if cell["parallel"] == "tp2" else smollm2_cpu) if smollm2 else tiny_cpu
    if smollm2:
        prompts, lengths = list(REPEAT_CONTEXT_PROMPTS), [REPEAT_NEW_TOKENS] * len(REPEAT_CONTEXT_PROMPTS)
        expected = smollm2_plain_runs["repeat_context"]
    else:
        prompts, outputs = tiny_requests(cell, tiny_prompts, tiny_copy_prompts, tiny_plain_runs)
        lengths = TINY_LENGTHS
        expected = [output[:length] for output, length in zip(outputs, lengths)]
    plan_log = tmp_path / "plans.jsonl"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(PLAN_LOG_ENV, str(plan_log))
        if cell["loop"] == "overlap":
            patch.setenv(OVERLAP_ENV, "1")
        if cell["graphs"] == "on":
            patch.setenv(GRAPHS_ENV, "1")
        with running_server(model, server_logs, f"matrix-{cell_name(cell)}",
                            launch_args(cell, smollm2_cpu.profile)) as server:
            answers = server.generate(prompts, [{"temperature": 0, "max_new_tokens": length} for length in lengths],
                                      timeout=300)
            metrics = server.request("/metrics")
            info = server.request("/server_info")
    log = server.log_path.read_text(errors="replace")
    plans = [json.loads(line) for line in plan_log.read_text().splitlines()]
    assert [answer["output_ids"] for answer in answers] == expected
    assert info["page_size"] == int(cell["page"])
    assert info["disable_overlap_schedule"] is (cell["loop"] == "sync")
    planned, plain = (counter(metrics, f"sglang_spec_planner_{name}_total") for name in ("requests", "plain_requests"))
    assert 0 <= plain < planned, metrics[-1500:]  # trees were verified: plain decoding alone would match trivially
    # the accepted drafts counted on /metrics are the ones the plans committed: none exactly where no plan committed
    # more than one token a request (whether a tree step lands on a copy follows which steps this machine's timings
    # made trees; that lookup trees accept as the reference decoder's do is test_context_trees.py's)
    committed_drafts = any(tokens > 1 for plan in plans for tokens in plan["committed"])
    accepted = counter(metrics, "sglang_spec_tree_accepted_drafts_total")
    assert (accepted > 0) is committed_drafts, (accepted, [plan["committed"] for plan in plans if plan["tokens"] > 1])
    assert "tree auto: verify sizes" in log
    computed, dense = (counter(metrics, f"sglang_spec_verify_tokens_{kind}_total") for kind in ("computed", "dense"))
    if ragged(cell):  # each request's forward covers its share of the step's nodes, not SGLang's width
        assert "ragged verify: each request's verify forward covers its own tree" in log
        trees = [plan for plan in plans if plan["tokens"] > 1]
        # a request's share below its step's width: fewer tokens than SGLang's width (else at most as many: a
        # lookup tree may find fewer copies than its share)
        cut = any(min(plan["verify_tokens"]) < plan["tokens"] for plan in trees)
        assert (0 < computed < dense) if cut else (0 < computed <= dense), (computed, dense, trees[:5])
    else:
        assert computed == dense == 0
    replays, ragged_replays = replays_in(log), ragged_replays_in(log)
    if cell["graphs"] == "off":
        assert not replays and not ragged_replays
    elif ragged(cell):  # tree steps on SGLang's ragged verify graphs (token tiers), plain steps on the 1-token one
        assert "graphs captured" in log and ragged_replays and replays, log[-3000:]
        assert "SGLang's ragged verify graphs" in log and "each priced at its tier of verify tokens" in log
        # the sizes between only price the tiers: runtime states (and graphs) for a plain step and the full tree
        assert "(2 runtime states, graphs captured)" in log, [line for line in log.splitlines() if "sizes" in line]
        # a batch of 3 on the tier of 4 requests' full trees or less: its slots padded past its requests
        assert any(batch < slots for batch, tier, slots in ragged_replays), ragged_replays
    else:  # the steps ran on SGLang's graph runner, and a batch ran padded to a larger captured size
        assert "graphs captured" in log and replays, log[-3000:]
        if not smollm2:  # the tiny model's requests end apart: a batch of 3 (or, per DP rank, 1) is padded
            assert any(batch < captured for batch, captured in replays), replays
    if cell["parallel"] == "dp2":  # the DP attention paths the uneven lengths lead to were taken
        assert "tree auto: a DP attention rank with no request steps at its group's verify sizes" in log
        if cell["policy"] != "lookup":  # the head's draft extend runs every step, over a padded batch
            assert "first extend over a batch DP attention padded" in log
    if resting(cell):
        rested, warmups = (counter(metrics, f"sglang_spec_planner_head_{kind}_steps_total")
                           for kind in ("rested", "warmup"))
        print(cell_name(cell), "head rested", rested, "warm-ups", warmups)
        # the head rests at the second plain step in a row (head rest 1): whether the plans hold such a run follows
        # this machine's timings (a tree every step is a legitimate plan); that the head then rests does not
        runs = plain_runs(plans)
        assert (rested > 0) if max(runs, default=0) >= 2 else (rested == 0), (rested, runs)
    faults = [line for line in log.splitlines() if re.match(r"\[sglang_spec\] \S+ fault", line)]
    assert not faults, faults
