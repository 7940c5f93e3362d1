"""The plugin's own draft loop inside SGLang's real worker (sequoia and specexec): trees wider than topk on a
level, each node's top-4 candidates as children, exact per-branch ancestry, through launch_server on this CPU.

Greedy output must equal plain decoding at budgets 16 and 64, and the mean accept length through SGLang must
be within 5% of the reference decoder's for the same policy, budget, head and prompts (both are printed).
"""

from __future__ import annotations

import pytest

from cpu_server_helpers import SMOLLM2_NEW_TOKENS, accept_lengths, mean, running_server, tree_args

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

TOPK = 4
# each policy wider than topk at one budget: sequoia's DP tree from budget 32 on, specexec's (width = budget) always
SHAPES = [("sequoia", 64, 6), ("specexec", 16, 5)]


@pytest.fixture(scope="module", params=SHAPES, ids=lambda shape: "{}-{}-{}".format(*shape))
def run(request, smollm2_cpu, server_logs, smollm2_prompts):
    policy, budget, depth = request.param
    extra = tree_args(policy, budget, depth, TOPK, smollm2_cpu.profile)
    with running_server(smollm2_cpu, server_logs, "smollm2-own-{}-{}-{}".format(*request.param), extra) as server:
        answers = server.generate(smollm2_prompts, {"temperature": 0, "max_new_tokens": SMOLLM2_NEW_TOKENS})
        info = server.request("/server_info")
    return request.param, answers, info


def test_greedy_output_equals_plain_decoding(run, smollm2_plain):
    shape, answers, info = run
    assert [answer["output_ids"] for answer in answers] == smollm2_plain, f"{shape}"
    # the draft width SGLang runs with: wider than topk (levels expanding more than topk nodes) from budget 32 on
    # for sequoia (its DP tree at budget 16 is at most 4 wide), always for specexec (width = budget)
    if shape[0] == "specexec" or shape[1] >= 32:
        assert info["speculative_eagle_topk"] > TOPK


def test_accept_length_within_5_percent_of_the_reference_decoder(run, smollm2_cpu, smollm2_prompts, smollm2):
    from sglang_spec.decode.decoder import GenerationConfig, SpeculativeDecoder
    from sglang_spec.sglang_plugin.options import from_values

    (policy, budget, depth), answers, info = run
    loaded, head = smollm2
    options = from_values({"speculative_tree_policy": policy, "speculative_tree_budget": budget,
                           "speculative_tree_depth": depth, "speculative_tree_topk": TOPK,
                           "speculative_acceptance_profile": str(smollm2_cpu.profile)})
    reference = SpeculativeDecoder(loaded.model, head, options.tree_policy()).generate(
        smollm2_prompts, GenerationConfig(max_new_tokens=SMOLLM2_NEW_TOKENS, eos_token_ids=loaded.eos_token_ids))
    through_sglang = mean(accept_lengths(answers))
    print(f"\n{policy} budget {budget} depth {depth} width {options.width}: mean accept length through SGLang "
          f"{through_sglang:.3f}, reference decoder {reference.accept_length_mean:.3f}")
    assert through_sglang == pytest.approx(reference.accept_length_mean, rel=0.05)

