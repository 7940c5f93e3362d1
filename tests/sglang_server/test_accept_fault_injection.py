"""A fault inside the plugin's accept must not take SGLang's scheduler down: the batch is accepted by SGLang's own
path (or its bookkeeping skipped, the accept standing), a counter and one log line say so, and the server goes on.

Faults are injected through launch_server with ``SGLANG_SPEC_INJECT_ACCEPT_FAULT=n`` (every n-th verify step raises
at one stage of the plugin's accept, the server's stages in turn): the fused accept with the plugin's own loop
(sequoia: the fused outputs written, then the fault; the KV commit stopped after its first layer buffer; the rank
counts) and the context drafter with SGLang's accept (hybrid: the rank counts, the drafter's observe of the
accepted paths). The other policies (chain, eagle and specexec with SGLang's accept, lookup) take accept faults
and draft faults (``SGLANG_SPEC_INJECT_DRAFT_FAULT``, as in ``test_draft_faults.py``) on one server each, so that
every policy's server meets both. Greedy output must stay plain decoding's, sampled requests must complete, and the server must
answer afterwards.
"""

from __future__ import annotations

import re

import pytest

from cpu_server_helpers import assert_draft_faults_counted_and_logged, faulty_run, tree_args
from parity_requests import policy_args

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

EVERY = 2  # every second verify step raises: steps with and without faults interleave in every request
DRAFT_EVERY = 3  # the servers that also take draft faults: every third draft raises
# name -> (the accept's stages that server runs, draft faults too)
CONFIGS = {"sequoia-fused": (("accept", "commit", "record"), False), "hybrid": (("record", "observe"), False),
           "chain": (("record",), True), "eagle": (("record",), True), "specexec": (("record",), True),
           "lookup": (("record", "observe"), True)}


def server_options(name: str, profile) -> list[str]:
    """The tree options of server ``name``: sequoia (fused) and hybrid at 15/4/4, the others as the parity suite's
    tree servers (``parity_requests.POLICIES``: chain 7/7, eagle and specexec 15/4/4, lookup 12/5)."""
    if name == "sequoia-fused":
        return tree_args("sequoia", 15, 4, 4, profile) + ["--speculative-tree-accept", "fused"]
    if name == "hybrid":
        return tree_args("hybrid", 15, 4, 4, profile)
    return policy_args(name, profile)


@pytest.fixture(scope="module", params=list(CONFIGS))
def faulty(request, smollm2_cpu, server_logs, smollm2_prompts):
    stages, draft_faults = CONFIGS[request.param]
    extra = server_options(request.param, smollm2_cpu.profile) + ["--enable-metrics"]
    faults = {"SGLANG_SPEC_INJECT_ACCEPT_FAULT": str(EVERY)}
    if draft_faults:
        faults["SGLANG_SPEC_INJECT_DRAFT_FAULT"] = str(DRAFT_EVERY)
    run = faulty_run(smollm2_cpu, server_logs, f"smollm2-accept-faults-{request.param}", extra, smollm2_prompts,
                     faults)
    return {"config": request.param, "stages": stages, "draft_faults": draft_faults, **run}


def test_accept_faults_keep_plain_decodings_output_and_the_server_serving(faulty, smollm2_plain):
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


def test_draft_faults_beside_accept_faults_are_counted_and_logged(faulty):
    if not faulty["draft_faults"]:
        pytest.skip("this server takes accept faults only (its draft path: test_draft_faults.py)")
    assert_draft_faults_counted_and_logged(faulty)
