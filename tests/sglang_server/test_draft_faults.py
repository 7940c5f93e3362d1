"""A draft that raises inside the plugin must not take SGLang's scheduler down: that batch verifies a filler tree
(no head, no context: the target's own token), a counter and one log line say so, and the server goes on.

Faults are injected through launch_server with ``SGLANG_SPEC_INJECT_DRAFT_FAULT=n`` (every n-th draft raises), for
each draft path: the plugin's own loop (sequoia) and the context drafter (hybrid); SGLang's loop under the plugin's
hooks (chain, eagle), specexec and lookup take draft faults beside accept faults in
``test_accept_fault_injection.py``. The same servers take ``SGLANG_SPEC_INJECT_NONFINITE_HEAD=n`` (every n-th head
forward of the plugin's draft returns NaN probabilities for the batch's first request, ``head_guard``). Greedy
output must stay plain decoding's, sampled requests must complete, and the server must answer afterwards.
"""

from __future__ import annotations

import pytest

from cpu_server_helpers import assert_draft_faults_counted_and_logged, counted_draft_faults, faulty_run, tree_args
from sglang_spec.sglang_plugin.head_guard import ERROR as HEAD_FAULT
from sglang_spec.sglang_plugin.head_guard import INJECT_ENV

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

EVERY = 3  # every third draft raises: steps with and without faults interleave in every request
POISON_EVERY = 5  # and every fifth head forward of the plugin's draft returns NaN for the batch's first request


@pytest.fixture(scope="module", params=["sequoia", "hybrid"])
def faulty(request, smollm2_cpu, server_logs, smollm2_prompts):
    policy = request.param
    extra = tree_args(policy, 15, 4, 4, smollm2_cpu.profile) + ["--enable-metrics"]
    run = faulty_run(smollm2_cpu, server_logs, f"smollm2-faults-{policy}", extra, smollm2_prompts,
                     {"SGLANG_SPEC_INJECT_DRAFT_FAULT": str(EVERY), INJECT_ENV: str(POISON_EVERY)})
    return {"policy": policy, **run}


def test_faulty_drafts_keep_plain_decodings_output_and_the_server_serving(faulty, smollm2_plain):
    assert [answer["output_ids"] for answer in faulty["greedy"]] == smollm2_plain, faulty["policy"]
    assert all(len(answer["output_ids"]) == 8 for answer in faulty["sampled"])
    assert faulty["after"][0]["output_ids"] == smollm2_plain[0][:4]


def test_each_fault_is_counted_and_logged_in_one_line(faulty):
    assert_draft_faults_counted_and_logged(faulty, also=[HEAD_FAULT])


def test_a_non_finite_head_output_is_counted_and_logged(faulty):
    """The own loop (sequoia) swaps the request's drafts for the filler on the device and counts requests; the
    context drafter (hybrid) reads the probabilities on the host and turns its batch into a draft fault."""
    lines = [line for line in faulty["log"].splitlines() if f"({HEAD_FAULT}" in line]
    counted = counted_draft_faults(faulty["metrics"], HEAD_FAULT)
    assert lines and counted is not None, faulty["metrics"][-2000:]
    assert counted >= 1
    expected = "request(s) whose head output was not finite" if faulty["policy"] == "sequoia" else "verified without"
    assert all(expected in line for line in lines), lines[:3]
