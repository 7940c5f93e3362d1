"""A fault inside the plugin's draft or accept must not take SGLang's scheduler down, on any policy's server.

* **Draft faults** (``SGLANG_SPEC_INJECT_DRAFT_FAULT=n``: every n-th draft raises): that batch verifies a filler
  tree (no head, no context: the target's own token), a counter and one log line say so.
* **Non-finite head output** (``SGLANG_SPEC_INJECT_NONFINITE_HEAD=n``: every n-th head forward of the plugin's own
  draft returns NaN probabilities for the batch's first request, ``head_guard``), on the servers whose draft is
  the plugin's (sequoia, hybrid).
* **Accept faults** (``SGLANG_SPEC_INJECT_ACCEPT_FAULT=n``: every n-th verify step raises at one stage of the
  plugin's accept, the server's stages in turn): the batch is accepted by SGLang's own path (or its bookkeeping
  skipped, the accept standing), counted and logged: the fused accept with the plugin's own loop (sequoia: the
  fused outputs written, then the fault; the KV commit stopped after its first layer buffer; the rank counts), the
  context drafter with SGLang's accept (hybrid: the rank counts, the drafter's observe of the accepted paths), and
  chain and specexec (SGLang's loop under the plugin's hooks, and the own loop wider than topk). Eagle's trees
  take chain's path with a wider topk, lookup's the hybrid's without the head: neither adds a path of its own.

Every server takes all of its kinds at once (one server per policy), so faults of different kinds meet in the
same requests. Greedy output must stay plain decoding's, sampled requests must complete, and the server must
answer afterwards.
"""

from __future__ import annotations

import re

import pytest

from cpu_server_helpers import assert_draft_faults_counted_and_logged, counted_draft_faults, faulty_run, tree_args
from sglang_spec_testbed.parity import policy_args
from sglang_spec.sglang_plugin.drafters.head_guard import ERROR as HEAD_FAULT
from sglang_spec.sglang_plugin.faults import HEAD_POISON_ENV as INJECT_ENV

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

EVERY = 2  # every second verify step raises: steps with and without faults interleave in every request
DRAFT_EVERY = 3  # every third draft raises
POISON_EVERY = 5  # the plugin's own drafts: every fifth head forward returns NaN for the batch's first request
# name -> (the accept's stages that server runs, whether its draft is the plugin's head forward: poisoned too)
CONFIGS = {"sequoia-fused": (("accept", "commit", "record"), True), "hybrid": (("record", "observe"), True),
           "chain": (("record",), False), "specexec": (("record",), False)}


def server_options(name: str, profile) -> list[str]:
    """The tree options of server ``name``: sequoia (fused) and hybrid at 15/4/4, the others as the parity suite's
    tree servers (``parity.POLICIES``: chain 7/7, specexec 15/4/4)."""
    if name == "sequoia-fused":
        return tree_args("sequoia", 15, 4, 4, profile) + ["--speculative-tree-accept", "fused"]
    if name == "hybrid":
        return tree_args("hybrid", 15, 4, 4, profile)
    return policy_args(name, profile)


@pytest.fixture(scope="module", params=list(CONFIGS))
def faulty(request, smollm2_cpu, server_logs, smollm2_prompts):
    stages, poisoned = CONFIGS[request.param]
    extra = server_options(request.param, smollm2_cpu.profile) + ["--enable-metrics"]
    faults = {"SGLANG_SPEC_INJECT_ACCEPT_FAULT": str(EVERY), "SGLANG_SPEC_INJECT_DRAFT_FAULT": str(DRAFT_EVERY)}
    if poisoned:
        faults[INJECT_ENV] = str(POISON_EVERY)
    run = faulty_run(smollm2_cpu, server_logs, f"smollm2-faults-{request.param}", extra, smollm2_prompts, faults)
    return {"config": request.param, "stages": stages, "poisoned": poisoned, **run}


def test_faults_keep_plain_decodings_output_and_the_server_serving(faulty, smollm2_plain):
    assert [answer["output_ids"] for answer in faulty["greedy"]] == smollm2_plain, faulty["config"]
    assert all(len(answer["output_ids"]) == 8 for answer in faulty["sampled"])
    assert faulty["after"][0]["output_ids"] == smollm2_plain[0][:4]


def test_each_accept_fault_is_counted_and_logged_in_one_line(faulty):
    counted = {}
    for labels, count in re.findall(r"sglang_spec_accept_faults_total\{([^}]*)\} (\S+)", faulty["metrics"]):
        label = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        assert label["error"] == "InjectedFault", labels
        counted[label["stage"]] = int(float(count))
    assert set(counted) == set(faulty["stages"]), faulty["metrics"][-3000:]
    assert all(counted.values())
    lines = [line for line in faulty["log"].splitlines() if "accept fault" in line]
    logged = {stage: sum(f"accept fault in {stage}," in line for line in lines) for stage in faulty["stages"]}
    # the metrics were read before the last request, whose verify steps may have raised too
    assert all(0 < counted[stage] <= logged[stage] for stage in faulty["stages"]), (counted, logged)
    assert all("(InjectedFault: verify step" in line for line in lines), lines[:3]
    assert "Traceback" not in faulty["log"]
    if "accept" in faulty["stages"]:  # the fused accept's own counter sees the batches it handed to SGLang
        handed = re.search(r'sglang_spec_fused_accept_batches_total\{outcome="fault"\} (\S+)', faulty["metrics"])
        assert handed is not None and int(float(handed.group(1))) == counted["accept"]


def test_each_draft_fault_is_counted_and_logged_in_one_line(faulty):
    assert_draft_faults_counted_and_logged(faulty, also=[HEAD_FAULT] if faulty["poisoned"] else [])


def test_a_non_finite_head_output_is_counted_and_logged(faulty):
    """The own loop (sequoia) swaps the request's drafts for the filler on the device and counts requests; the
    context drafter (hybrid) reads the probabilities on the host and turns its batch into a draft fault."""
    if not faulty["poisoned"]:
        pytest.skip("SGLang's draft loop or no head: nothing of the plugin's to poison")
    lines = [line for line in faulty["log"].splitlines() if f"({HEAD_FAULT}" in line]
    counted = counted_draft_faults(faulty["metrics"], HEAD_FAULT)
    assert lines and counted is not None, faulty["metrics"][-2000:]
    assert counted >= 1
    expected = "request(s) whose head output was not finite" if faulty["config"] == "sequoia-fused" \
        else "verified without"
    assert all(expected in line for line in lines), lines[:3]
