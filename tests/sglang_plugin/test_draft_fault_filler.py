"""The filler tree a faulty draft's batch verifies (``drafters.filler``): SGLang's draft outputs for the
configured shape that SGLang's own tree decoding reads back as a tree of ``budget`` nodes, no deeper than the step
count, no wider than topk, with tokens distinct among siblings (deterministic proposals: verification stays exact).
The server path, with faults injected through launch_server, is ``tests/sglang_server/test_fault_injection.py``."""

import pytest
import torch

pytest.importorskip("sglang")

from sglang_spec.sglang_plugin.drafters.filler import filler_draft, filler_encoding  # noqa: E402
from sglang_spec.sglang_plugin.drafters.host_context import _finite  # noqa: E402
from sglang_spec.sglang_plugin.faults import FAULT_ENV, FaultInjection  # noqa: E402
from sglang_spec.sglang_plugin.messages import StartupError  # noqa: E402
from sglang_spec.tree.encode_sglang import decode_sglang_draft  # noqa: E402


@pytest.mark.parametrize("budget, topk, steps", [(15, 4, 4), (15, 16, 2), (4, 1, 4), (63, 8, 6)])
def test_the_filler_tree_fills_the_configured_shape(budget, topk, steps):
    filler = filler_encoding(budget, topk, steps)
    bonus = torch.tensor([5, 7, 9])
    parent_list, top_scores_index, draft_tokens, draft_probs = filler_draft(filler, 3, bonus.device)
    assert draft_probs is None and draft_tokens.shape == (3, budget)
    trees = decode_sglang_draft(parent_list, top_scores_index, draft_tokens, bonus, topk)
    for row, tree in enumerate(trees):
        assert tree.num_nodes == budget + 1 and tree.depth <= steps and int(tree.tokens[0]) == int(bonus[row])
        parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
        for node in range(tree.num_nodes):
            siblings = [tokens[child] for child in range(1, tree.num_nodes) if parents[child] == node]
            assert len(siblings) <= topk and len(set(siblings)) == len(siblings)
    assert filler_draft(filler, 3, bonus.device)[2].data_ptr() != draft_tokens.data_ptr()  # no aliasing


def test_a_non_finite_head_output_is_a_draft_fault():
    assert _finite(torch.tensor([[0.5, 0.25]])).shape == (1, 2)
    with pytest.raises(FloatingPointError, match="not finite"):
        _finite(torch.tensor([[0.5, float("nan")]]))


def test_a_bad_fault_injection_setting_stops_the_launch_in_one_line(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "often")
    with pytest.raises(StartupError, match="whole number"):
        FaultInjection.from_environment(rank=0)
    monkeypatch.setenv(FAULT_ENV, "3")
    injection = FaultInjection.from_environment(rank=0)
    assert injection is not None and injection.draft_every == 3
