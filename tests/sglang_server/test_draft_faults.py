"""A draft that raises inside the plugin must not take SGLang's scheduler down: that batch verifies a filler tree
(no head, no context: the target's own token), a counter and one log line say so, and the server goes on.

Faults are injected through launch_server with ``SGLANG_SPEC_INJECT_DRAFT_FAULT=n`` (every n-th draft raises), for
each draft path: the plugin's own loop (sequoia) and the context drafter (hybrid); SGLang's loop under the plugin's
hooks (chain, eagle), specexec and lookup take draft faults beside accept faults in
``test_accept_fault_injection.py``. Greedy output must stay plain decoding's, sampled requests must complete, and
the server must answer afterwards.
"""

from __future__ import annotations

import pytest

from cpu_server_helpers import assert_draft_faults_counted_and_logged, faulty_run, tree_args

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

EVERY = 3  # every third draft raises: steps with and without faults interleave in every request


@pytest.fixture(scope="module", params=["sequoia", "hybrid"])
def faulty(request, smollm2_cpu, server_logs, smollm2_prompts):
    policy = request.param
    extra = tree_args(policy, 15, 4, 4, smollm2_cpu.profile) + ["--enable-metrics"]
    run = faulty_run(smollm2_cpu, server_logs, f"smollm2-faults-{policy}", extra, smollm2_prompts,
                     {"SGLANG_SPEC_INJECT_DRAFT_FAULT": str(EVERY)})
    return {"policy": policy, **run}


def test_faulty_drafts_keep_plain_decodings_output_and_the_server_serving(faulty, smollm2_plain):
    assert [answer["output_ids"] for answer in faulty["greedy"]] == smollm2_plain, faulty["policy"]
    assert all(len(answer["output_ids"]) == 8 for answer in faulty["sampled"])
    assert faulty["after"][0]["output_ids"] == smollm2_plain[0][:4]


def test_each_fault_is_counted_and_logged_in_one_line(faulty):
    assert_draft_faults_counted_and_logged(faulty)
