"""Trees at page size 4 through launch_server on this CPU: SGLang's own eagle loop (with the plugin's ancestry hook)
and the plugin's own loop (specexec, wider than topk, with ``--speculative-tree-accept fused``).

SGLang lays each beam's draft slots out on its own pages at page size > 1 (``prepare_for_draft``, the prefix's
partial tail page copied into every branch) and refuses it on ``intel_amx``, whose sgl-kernel draft metadata op
assumes page size 1; the bed reads the paged layout (``sglang_spec_testbed/patches.py``) and lets that refusal through
for ``intel_amx``. Greedy output must equal the plain server's (page size 1; the attention reads token slots, so the
page size changes no number), drafts must be accepted, SGLang must run at page size 4 (``/server_info``) and the
log must say that the draft decode read the paged layout.
"""

from __future__ import annotations

import re

import pytest

from cpu_server_helpers import SMOLLM2_NEW_TOKENS, accept_lengths, running_server, tree_args

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

PAGE_SIZE = 4
SERVERS = {
    "eagle": tree_args("eagle", 10, 4, 4),
    "specexec-fused": tree_args("specexec", 12, 4, 4) + ["--speculative-tree-accept", "fused", "--enable-metrics"],
}


@pytest.fixture(scope="module", params=sorted(SERVERS))
def paged_run(request, smollm2_cpu, server_logs, smollm2_prompts):
    name = request.param
    extra = SERVERS[name] + ["--page-size", str(PAGE_SIZE)]
    with running_server(smollm2_cpu, server_logs, f"smollm2-paged-{name}", extra) as server:
        answers = server.generate(smollm2_prompts, {"temperature": 0, "max_new_tokens": SMOLLM2_NEW_TOKENS})
        info = server.request("/server_info")
        metrics = server.request("/metrics") if "fused" in name else ""
    return {"name": name, "answers": answers, "info": info, "metrics": metrics,
            "log": server.log_path.read_text(errors="replace")}


def test_greedy_output_at_page_size_4_equals_plain_decoding(paged_run, smollm2_plain):
    assert [answer["output_ids"] for answer in paged_run["answers"]] == smollm2_plain, paged_run["name"]
    assert max(accept_lengths(paged_run["answers"])) >= 3
    assert paged_run["info"]["page_size"] == PAGE_SIZE and paged_run["info"]["speculative_eagle_topk"] >= 4
    assert f"draft decode reads SGLang's paged draft layout (page size {PAGE_SIZE}" in paged_run["log"]


def test_the_fused_accept_commits_at_page_size_4(paged_run):
    if "fused" not in paged_run["name"]:
        pytest.skip("the fused accept runs on the specexec server")
    found = re.search(r'^sglang_spec_fused_accept_batches_total\{outcome="fused"\} ([0-9.]+)$', paged_run["metrics"],
                      re.M)
    assert found and float(found.group(1)) > 0
