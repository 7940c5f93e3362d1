"""The filler tree a faulty draft's batch verifies (``hooks._filler_draft``): SGLang's draft outputs for the
configured shape that SGLang's own tree decoding reads back as a tree of ``budget`` nodes, no deeper than the step
count, no wider than topk, with tokens distinct among siblings (deterministic proposals: verification stays exact).
The server path, with faults injected through launch_server, is ``tests/sglang_server/test_fault_injection.py``."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from sglang_spec.sglang_plugin import hooks  # noqa: E402
from sglang_spec.sglang_plugin.context_draft import _finite  # noqa: E402
from sglang_spec.tree.encode_sglang import decode_sglang_draft  # noqa: E402


@pytest.mark.parametrize("budget, topk, steps", [(15, 4, 4), (15, 16, 2), (4, 1, 4), (63, 8, 6)])
def test_the_filler_tree_fills_the_configured_shape(budget, topk, steps):
    worker = SimpleNamespace(speculative_num_draft_tokens=budget + 1, topk=topk, speculative_num_steps=steps)
    setup = hooks.DraftSetup(None, exact_ancestry=False, width=topk, steps=steps)
    bonus = torch.tensor([5, 7, 9])
    forward_batch = SimpleNamespace(batch_size=3, spec_info=SimpleNamespace(bonus_tokens=bonus))
    parent_list, top_scores_index, draft_tokens, draft_probs = hooks._filler_draft(worker, forward_batch, setup)
    assert draft_probs is None and draft_tokens.shape == (3, budget)
    trees = decode_sglang_draft(parent_list, top_scores_index, draft_tokens, bonus, topk)
    for row, tree in enumerate(trees):
        assert tree.num_nodes == budget + 1 and tree.depth <= steps and int(tree.tokens[0]) == int(bonus[row])
        parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
        for node in range(tree.num_nodes):
            siblings = [tokens[child] for child in range(1, tree.num_nodes) if parents[child] == node]
            assert len(siblings) <= topk and len(set(siblings)) == len(siblings)
    assert hooks._filler_draft(worker, forward_batch, setup)[2].data_ptr() != draft_tokens.data_ptr()  # no aliasing


def test_a_non_finite_head_output_is_a_draft_fault():
    assert _finite(torch.tensor([[0.5, 0.25]])).shape == (1, 2)
    with pytest.raises(FloatingPointError, match="not finite"):
        _finite(torch.tensor([[0.5, float("nan")]]))


def test_a_bad_fault_injection_setting_stops_the_launch_in_one_line(monkeypatch):
    monkeypatch.setenv(hooks.FAULT_ENV, "often")
    with pytest.raises(hooks.StartupError, match="whole number"):
        hooks._fault_every()
    monkeypatch.setenv(hooks.FAULT_ENV, "3")
    assert hooks._fault_every() == 3
