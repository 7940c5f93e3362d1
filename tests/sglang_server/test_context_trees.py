"""``lookup`` and ``hybrid`` trees through launch_server on this CPU (SmolLM2 + shipped head): the request's
context copies and the MTP head's branches in one tree, built by the reference decoder's builder and verified by
SGLang.

Greedy output must equal plain decoding on held-out chat prompts and on prompts whose continuation repeats their
context; the mean accept length through SGLang must be within 5% of the reference decoder's for the same policy,
tree bounds, head and prompts (both printed); a sampled request goes through the tree. (The trees learn online, so a
sampled request's tree, and with it SGLang's coins per candidate, differs from run to run: the sampling law is SGLang's
target-only rule, checked against its exact law with a biased negative control in
``tests/sglang_plugin/test_cpu_harness.py``, for any candidates.)
"""

from __future__ import annotations

import json
import re

import pytest

from cpu_server_helpers import (REPEAT_CONTEXT_PROMPTS, REPEAT_NEW_TOKENS, SMOLLM2_NEW_TOKENS, accept_lengths, counter,
                                mean, running_server)
from sglang_spec.cli import main as cli_main
from sglang_spec.sglang_plugin.step_planner import PLAN_LOG_ENV
from sglang_spec_testbed.linear import DRAFT_WEIGHTS_ENV
from sglang_spec_testbed.patches import OVERLAP_ENV

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

BUDGET, DEPTH = 12, 5
SAMPLED = {"temperature": 0.7, "max_new_tokens": REPEAT_NEW_TOKENS}


def context_args(policy: str, profile) -> list[str]:
    return ["--speculative-tree-policy", policy, "--speculative-tree-budget", str(BUDGET),
            "--speculative-tree-depth", str(DEPTH), "--speculative-acceptance-profile", str(profile),
            "--enable-metrics"]


@pytest.fixture(scope="module")
def repeat_prompts(smollm2_cpu) -> list[list[int]]:
    """REPEAT_CONTEXT_PROMPTS as token ids, so the server and the reference decoder see the same tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_cpu.target_dir)
    return [tokenizer(prompt, add_special_tokens=False)["input_ids"] for prompt in REPEAT_CONTEXT_PROMPTS]


# lookup-device / hybrid-device: trees grown on the device (--speculative-tree-context-on device), the host's trees,
# under SGLang's overlap scheduler (the GPU's loop, where a request's output ids lag its device history by a step);
# hybrid-overlap: host-built hybrid trees under that loop (the host hybrid server's histograms differ a little
# between the two loops, so the device hybrid compares with it; test_parity_under_load.py serves hybrid in both)
DEVICE_TWIN = {"lookup-device": "lookup", "hybrid-device": "hybrid-overlap"}


@pytest.fixture(scope="module", params=["hybrid-overlap", "lookup", "lookup-device", "hybrid-device"])
def run(request, smollm2_cpu, server_logs, smollm2_prompts, repeat_prompts, tmp_path_factory):
    name = request.param
    policy = name.split("-")[0]
    steps_folder = tmp_path_factory.mktemp(f"steps-{name}")
    on_device = name.endswith("-device")
    extra = ["--speculative-tree-context-on", "device"] if on_device else []
    with pytest.MonkeyPatch.context() as patch:  # the CPU bed's per-batch timings (sglang_spec_testbed/step_timing.py)
        patch.setenv("SGLANG_SPEC_CPU_PROFILE", str(steps_folder))
        if on_device or name.endswith("-overlap"):
            patch.setenv(OVERLAP_ENV, "1")
        with running_server(smollm2_cpu, server_logs, f"smollm2-context-{name}",
                            context_args(policy, smollm2_cpu.profile) + extra) as server:
            heldout = server.generate(smollm2_prompts, {"temperature": 0, "max_new_tokens": SMOLLM2_NEW_TOKENS})
            repeat = server.generate(repeat_prompts, {"temperature": 0, "max_new_tokens": REPEAT_NEW_TOKENS})
            sampled = server.generate(repeat_prompts, SAMPLED)
            info = server.request("/server_info")
            metrics = server.request("/metrics")
            profile = server_logs / f"context-{name}-from-server.json"
            calibrated = cli_main(["calibrate", "--from-server", server.url, "--out", str(profile), "--force"])
    steps = [json.loads(line) for line in (steps_folder / "steps.jsonl").read_text().splitlines()]
    return {"policy": policy, "name": name, "heldout": heldout, "repeat": repeat, "sampled": sampled, "info": info,
            "metrics": metrics, "calibrated": (calibrated, profile), "steps": steps}


@pytest.fixture(scope="module")
def plain_repeat(smollm2_plain_runs) -> list[list[int]]:
    """The plain server's greedy output on REPEAT_CONTEXT_PROMPTS (sent as text there: SmolLM2's tokenizer adds no
    special tokens, so the ids are ``repeat_prompts``)."""
    return smollm2_plain_runs["repeat_context"]


def test_greedy_output_equals_plain_decoding(run, smollm2_plain, plain_repeat):
    assert [answer["output_ids"] for answer in run["heldout"]] == smollm2_plain
    assert [answer["output_ids"] for answer in run["repeat"]] == plain_repeat
    # the overlap scheduler is off (SGLang's rule for speculative servers on a CPU) but where OVERLAP_ENV keeps it,
    # and the width is the policy's: the head's topk plus the context's continuations (hybrid), the budget's spread
    # (lookup)
    assert run["info"]["disable_overlap_schedule"] is not run["name"].endswith(("-device", "-overlap"))
    assert run["info"]["speculative_eagle_topk"] == {"hybrid": 6, "lookup": 3}[run["policy"]]


def test_accept_length_within_5_percent_of_the_reference_decoder(run, smollm2_cpu, smollm2_prompts, repeat_prompts,
                                                                 smollm2):
    from sglang_spec.decode.decoder import GenerationConfig, SpeculativeDecoder
    from sglang_spec.sglang_plugin.options import from_values

    loaded, head = smollm2
    options = from_values({"speculative_tree_policy": run["policy"], "speculative_tree_budget": BUDGET,
                           "speculative_tree_depth": DEPTH,
                           "speculative_acceptance_profile": str(smollm2_cpu.profile)})
    for name, prompts, new_tokens in (("heldout", smollm2_prompts, SMOLLM2_NEW_TOKENS),
                                      ("repeat", repeat_prompts, REPEAT_NEW_TOKENS)):
        decoder = SpeculativeDecoder(loaded.model, head, options.tree_policy())
        reference = decoder.generate(prompts, GenerationConfig(max_new_tokens=new_tokens,
                                                               eos_token_ids=loaded.eos_token_ids))
        through_sglang = mean(accept_lengths(run[name]))
        print(f"\n{run['policy']} {BUDGET}/{DEPTH} width {options.width} on {name}: mean accept length through "
              f"SGLang {through_sglang:.3f}, reference decoder {reference.accept_length_mean:.3f}")
        assert through_sglang == pytest.approx(reference.accept_length_mean, rel=0.05), name


_ACCEPTED: dict[str, list] = {}  # server -> its greedy requests' accept-length histograms


def test_trees_grown_on_the_device_accept_what_the_hosts_accept(run):
    """--speculative-tree-context-on device grows the host builder's trees from a device history: the lookup and
    hybrid servers' greedy requests accept the same tokens at every step whether their trees grew on the host
    (synchronous loop) or on the device (overlap loop: a request's first draft finds its output ids without the
    root, which the history takes from the device; hybrid's head rounds run as device tensors, every level each
    step; the host server, in the same loop, runs first, the device one compares)."""
    _ACCEPTED[run["name"]] = [answer["meta_info"].get("spec_correct_drafts_histogram")
                              for answer in run["heldout"] + run["repeat"]]
    if run["name"] in DEVICE_TWIN:
        host = DEVICE_TWIN[run["name"]]
        if host not in _ACCEPTED:  # pytest runs the module's servers in order; a selection may leave one out
            pytest.skip(f"compares with the host {host} server, which this selection did not run")
        assert _ACCEPTED[run["name"]] == _ACCEPTED[host]
        assert mean(accept_lengths(run["repeat"])) > 1.5  # the copies are found: not a tree of fillers


def test_host_trees_verify_each_requests_own_tree_and_device_trees_the_full_width(run):
    """Ragged verify (``sglang_plugin/ragged_verify.py``): a host-built tree's verify forward computes each request's
    root and real nodes, not the fillers that pad it to SGLang's width, and its requests accept what plain decoding
    gives (above) and what the same trees grown on the device accept at the full width (above: the device servers
    count nothing here, their tree sizes live on the device). A fixed budget leaves fillers only where a lookup
    tree finds fewer copies; under tree auto the planner's per-request budgets leave more
    (``test_planner_matrix.py``)."""
    computed, dense = (counter(run["metrics"], f"sglang_spec_verify_tokens_{kind}_total")
                       for kind in ("computed", "dense"))
    if run["name"].endswith("-device"):
        assert computed == dense == 0
    elif run["policy"] == "lookup":  # a context that offers fewer copies than the budget: a smaller tree
        assert 0 < computed < dense, (computed, dense)
    else:  # the head's branches fill a hybrid tree's budget whatever the context offers
        assert 0 < computed <= dense, (computed, dense)


def test_a_lookup_server_never_runs_the_head_and_a_hybrid_one_does(run):
    """lookup trees never ask the head, so its forwards (the draft extend over each prompt and over each step's
    accepted tokens) are skipped: the bed's per-batch timings see no draft forward in any prefill or decode step.
    A hybrid server's show them in every one (the recorder would catch a skip that reached hybrid too)."""
    batches = [step for step in run["steps"] if step["mode"] in ("EXTEND", "DECODE")]
    assert {step["mode"] for step in batches} == {"EXTEND", "DECODE"}
    if run["policy"] == "lookup":
        assert all(step["draft_s"] == 0 for step in batches), [step for step in batches if step["draft_s"]][:3]
    else:
        assert all(step["draft_s"] > 0 for step in batches)


def test_a_request_holds_one_decode_window_past_its_tokens_without_the_overlap_loop(run):
    """A decode step writes at most one window of KV past a request's committed tokens (SGLang's
    ``get_alloc_len_per_decode``: max(W x D, budget + 1) at page size 1): the synchronous loop holds exactly that
    (``hooks.startup.decode_reserve_around``); the overlap loop, which prepares a step before the last one is
    committed, SGLang's two (a request's first decode step shows both of them)."""
    info = run["info"]
    window = max(info["speculative_eagle_topk"] * info["speculative_num_steps"], info["speculative_num_draft_tokens"])
    ahead = [step["kv_ahead"] for step in run["steps"] if step["mode"] == "DECODE"]
    assert ahead
    if info["disable_overlap_schedule"]:
        assert set(ahead) == {window}
    else:
        assert max(ahead) == 2 * window


def test_sampled_requests_go_through_the_tree(run, plain_repeat):
    assert [answer["output_ids"] for answer in run["sampled"]] != plain_repeat
    assert mean(accept_lengths(run["sampled"])) > 1.0


# prompts whose greedy continuation a frequency penalty changes (PENALTY over every earlier output token)
PENALISED_PROMPTS = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):",
                     "Order list: apple, banana, apple, cherry, banana, apple,")
PENALTY, PENALISED_TOKENS = 0.8, 24
# forty distinct token ids at a fixed stride: nothing for a lookup to copy and little a head predicts; sent beside a
# copy-heavy prompt, one batch's requests predict unlike reach, so a ragged step gives them unlike shares
NOISE_PROMPT = list(range(3001, 3001 + 7 * 40, 7))


def penalised_greedy(model, prompt: list[int], new_tokens: int, frequency: float) -> list[int]:
    """Plain decoding with a frequency penalty, by definition (transformers): each token's logits less
    ``frequency`` times its count among the output tokens before it."""
    import torch

    output: list[int] = []
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(torch.tensor([prompt + output])).logits[0, -1].float()
            if output:
                logits -= frequency * torch.bincount(torch.tensor(output), minlength=logits.shape[0]).float()
            output.append(int(logits.argmax()))
    return output


# the synchronous loop's planned trees: test_planner_matrix.py's sync cells (hybrid, lookup, sequoia)
@pytest.mark.parametrize("loop", ["overlap"])
def test_tree_auto_plans_each_step_and_stays_identical(smollm2_cpu, server_logs, repeat_prompts, plain_repeat,
                                                       tmp_path, monkeypatch, loop, smollm2):
    """--speculative-tree-auto: SGLang's dummy verify forward is timed for every batch size up to the running cap
    at the planner's verify sizes before the first decode step; then each decode step verifies the size the planner
    chose for its batch (plain steps, smaller trees and the full tree, as the batch fills and drains), and every
    one keeps plain decoding's output. A plain step's target forward is SGLang's DECODE forward (the CPU step
    profile records each target forward's mode); /metrics shows the sizes chosen and the predicted against the
    served step time. Head levels are priced from the served tree steps (``level_costs``). ``overlap``: the same
    under SGLang's overlap scheduler (the GPU's default loop; ``OVERLAP_ENV`` keeps it on the CPU bed), where every
    step's output ids lag and the last verify completes them (``committed``): no output left unknown, and requests
    with a frequency penalty get plain decoding's penalised output (transformers, by definition; SGLang's relaxed
    penalties, which an output not completed falls back to, give another). The overlap server's drafter also
    multiplies by its own weights rounded to bfloat16 (``DRAFT_WEIGHTS_ENV``, the sweep's ``--draft-weights``): its
    layers and its token map's LM head, the target's float32; the outputs stay the target's. The head rests after
    one plain step (``--speculative-tree-head-rest 1``): plain steps leave its draft extend out, their tokens' head
    KV zeroed, and a tree chosen right after waits one warm-up step; outputs stay identical and trees still accept
    (/metrics counts both kinds of step). The steps verify ragged (``ragged_verify``): one step gives its requests
    their own shares of the nodes (the plan log shows it; a copy-heavy prompt and one of noise, sent together,
    predict unlike reach)."""
    monkeypatch.setenv("SGLANG_SPEC_CPU_PROFILE", str(tmp_path))
    monkeypatch.setenv(PLAN_LOG_ENV, str(tmp_path / "plans.jsonl"))
    if loop == "overlap":
        monkeypatch.setenv(OVERLAP_ENV, "1")
        monkeypatch.setenv(DRAFT_WEIGHTS_ENV, "bfloat16")
    args = (context_args("hybrid", smollm2_cpu.profile)
            + ["--speculative-tree-auto", "--speculative-tree-head-rest", "1"])
    with running_server(smollm2_cpu, server_logs, f"smollm2-context-auto-{loop}", args) as server:
        answers = server.generate(repeat_prompts * 3, {"temperature": 0, "max_new_tokens": REPEAT_NEW_TOKENS})
        pair = server.generate([repeat_prompts[0], NOISE_PROMPT],
                               {"temperature": 0, "max_new_tokens": REPEAT_NEW_TOKENS})
        penalised = [server.generate([prompt], {"temperature": 0, "max_new_tokens": PENALISED_TOKENS,
                                                "frequency_penalty": PENALTY})[0] for prompt in PENALISED_PROMPTS]
        metrics = server.request("/metrics")
        log = server.log_path.read_text(errors="replace")
    assert [answer["output_ids"] for answer in answers] == plain_repeat * 3
    loaded, _ = smollm2
    assert [answer["output_ids"] for answer in pair] == [
        plain_repeat[0], penalised_greedy(loaded.model, NOISE_PROMPT, REPEAT_NEW_TOKENS, 0.0)]
    for prompt, answer in zip(PENALISED_PROMPTS, penalised):
        ids = loaded.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        expected = penalised_greedy(loaded.model, ids, PENALISED_TOKENS, PENALTY)
        assert expected != penalised_greedy(loaded.model, ids, PENALISED_TOKENS, 0.0)  # the penalty matters here
        assert answer["output_ids"] == expected, prompt
        assert answer["meta_info"]["spec_accept_length"] > 1.0  # trees, not plain steps only
    table = [line for line in log.splitlines() if "tree auto: verify sizes" in line]
    assert len(table) == 1 and all(f" {size}: " in table[0] for size in (1, 2, 4, 8)), table
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    modes = {tuple(step["target_modes"]) for step in steps if step["mode"] == "DECODE"}
    # trees verify; plain steps decode; the start-up table's dummy verifies are not batches
    assert ("TARGET_VERIFY",) in modes and ("DECODE",) in modes, modes
    sizes = {int(float(size)): float(count) for size, count in
             re.findall(r'sglang_spec_planner_verify_tokens_bucket\{.*?le="([\d.]+)".*?\} ([\d.e+]+)', metrics)}
    per_size = {size: sizes[size] - sizes.get(previous, 0.0)  # the histogram's buckets are cumulative
                for previous, size in zip([0, *sorted(sizes)], sorted(sizes))}
    chosen = [size for size, count in per_size.items() if count > 0]
    assert 1 in chosen and len(chosen) >= 3, per_size  # plain steps, and more than one tree size
    # the steps verify ragged: in one step, requests verified their own shares of the nodes (the copy-heavy prompt
    # beside the noise one, if no step of the repeat prompts' batch did)
    plans = [json.loads(line) for line in (tmp_path / "plans.jsonl").read_text().splitlines()]
    assert any(len(set(plan["verify_tokens"])) > 1 for plan in plans), plans[:5]
    predicted = float(re.search(r"sglang_spec_planner_predicted_seconds_total ([\d.e+-]+)", metrics).group(1))
    served = float(re.search(r"sglang_spec_planner_served_seconds_total ([\d.e+-]+)", metrics).group(1))
    assert 0.3 < predicted / served < 3.0, (predicted, served)  # the planner's costs follow the served steps
    rested, warmups = (float(re.search(rf"sglang_spec_planner_head_{kind}_steps_total ([\d.e+-]+)", metrics).group(1))
                       for kind in ("rested", "warmup"))
    assert rested > 0 and warmups > 0, (rested, warmups)
    # head levels are priced from the served tree steps
    priced = re.findall(r"head levels priced at batch \d+ \(a head round ([\d.]+) ms against ([\d.]+) ms", log)
    assert len(priced) <= 1 and all(0 < float(one) < float(rest) for one, rest in priced), priced
    assert ("'disable_overlap_schedule': False" in log) is (loop == "overlap")
    assert "could not be completed from its last verify" not in log
    rounded = [line for line in log.splitlines() if "rounded to bfloat16" in line]
    if loop == "overlap":
        assert len(rounded) == 2 and "weights of the draft model packed" in rounded[0], rounded
        assert "the draft's own LM head (8192 tokens) packed" in rounded[1], rounded
        assert "weights of the target model packed for the" in log
    else:
        assert not rounded, rounded
    print("\n".join(line for line in log.splitlines() if "tree auto" in line))
    print(per_size, predicted, served)


def test_the_server_exports_what_its_trees_learnt_per_source(run, tmp_path):
    """The drafter's online per-source outcomes reach /metrics (rank 0, --enable-metrics), and calibrate
    --from-server's reader turns them into a profile's sources section."""
    from sglang_spec.cli.calibrate import parse_source_counts
    from sglang_spec.sglang_plugin.options import from_values
    from sglang_spec.tree.profile import AcceptanceProfile, SourceCounts

    observed = parse_source_counts(run["metrics"])
    tables = {name.split("/")[0] for name in observed}
    assert "lookup" in tables and ("mtp" in tables) == (run["policy"] == "hybrid")
    offered = sum(count for _, count in observed.values())
    accepted = sum(hits for hits, _ in observed.values())
    assert 0 < accepted < offered
    learnt = SourceCounts.generic().with_observed(observed, "server")
    assert learnt.named_cells() != SourceCounts.generic().named_cells()
    code, path = run["calibrated"]
    assert code == 0
    profile = AcceptanceProfile.load(path)
    # a loaded profile is a prior of bounded weight (counts scaled down per cell), so compare the estimates
    assert profile.sources is not None and estimates(profile.sources) == pytest.approx(estimates(learnt))
    # the profile serves the next launch (and the reference decoder) as its per-source counts
    options = from_values({"speculative_tree_policy": run["policy"], "speculative_tree_budget": BUDGET,
                           "speculative_tree_depth": DEPTH, "speculative_acceptance_profile": str(path)})
    assert estimates(options.tree_policy().source_counts()) == pytest.approx(estimates(learnt))


def estimates(counts) -> dict[str, float]:
    return {name: accepted / offered for name, (accepted, offered) in counts.named_cells().items()}
