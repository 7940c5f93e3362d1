"""A non-finite head output in the own draft loop: per request, on the device, the filler tree instead of drafts."""

import pytest
import torch

from sglang_spec.errors import SpecError
from sglang_spec.sglang_plugin.drafters.head_guard import HeadGuard, finite_rows
from sglang_spec.sglang_plugin.faults import HEAD_POISON_ENV as INJECT_ENV
from sglang_spec.sglang_plugin.faults import FaultInjection, HeadPoison
from sglang_spec.tree.encode_sglang import encode_sglang_draft
from sglang_spec.sglang_plugin.drafters.padding import pad_to_budget
from sglang_spec.tree.token_tree import TokenTree

TOPK, STEPS, BUDGET = 2, 3, 5


def filler():
    tree = pad_to_budget(TokenTree.from_parents([-1], tokens=[0]), BUDGET, TOPK, STEPS)
    return encode_sglang_draft([tree], TOPK, STEPS)


def test_rows_are_read_per_request():
    probs = torch.tensor([[0.5, 0.2], [0.3, 0.1], [float("nan"), 0.1], [0.3, 0.1], [0.2, float("inf")], [0.1, 0.1]])
    assert finite_rows(probs, 3).tolist() == [True, False, False]  # two rows a request
    assert finite_rows(probs[:2], 1).tolist() == [True]


def test_a_request_with_a_non_finite_head_output_verifies_the_filler_and_is_counted_once():
    encoding = filler()
    guard = HeadGuard.build(encoding, "cpu")
    drafts = [torch.arange(3 * part.shape[1]).view(3, -1) + 100
              for part in (encoding.parent_list, encoding.top_scores_index, encoding.draft_tokens)]
    finite = torch.tensor([True, False, True])
    parent_list, top_scores_index, draft_tokens = guard.select(finite, *drafts)
    for got, draft, fill in zip((parent_list, top_scores_index, draft_tokens), drafts,
                                (encoding.parent_list, encoding.top_scores_index, encoding.draft_tokens)):
        assert torch.equal(got[[0, 2]], draft[[0, 2]]) and torch.equal(got[1], fill[0])
    assert guard.new_faults(now=0.0) == 1 and guard.new_faults(now=0.0) == 0  # read every call on a CPU
    guard.select(torch.tensor([False, False, True]), *drafts)
    assert guard.new_faults(now=0.1) == 2 and int(guard.count) == 3


def test_the_poison_turns_every_nth_forward_nan_for_the_first_request_only(monkeypatch):
    poison = HeadPoison(every=2)
    probs = torch.full((4, 2), 0.5)  # two requests, two rows each
    assert torch.equal(poison.apply(probs, 2), probs)
    poisoned = poison.apply(probs, 2)
    assert finite_rows(poisoned, 2).tolist() == [False, True] and torch.isfinite(probs).all()
    monkeypatch.setenv(INJECT_ENV, "0")
    assert FaultInjection.from_environment(rank=0) is None
    monkeypatch.setenv(INJECT_ENV, "often")
    with pytest.raises(SystemExit, match=f"{INJECT_ENV}='often': give a whole number"):
        FaultInjection.from_environment(rank=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_guard_is_captured_in_a_cuda_graph_and_replayed_with_new_probabilities():
    """The own loop's check runs inside SGLang's draft graph: finite_rows + select captured once, replayed on new
    probabilities (static input), equal to eager runs, and the device counter advances on every replay."""
    encoding = filler()
    guard = HeadGuard.build(encoding, "cuda")
    batch = 3
    probs = torch.full((batch * 2, TOPK), 0.5, device="cuda")  # static input: two rows a request
    drafts = [(torch.arange(batch * part.shape[1]).view(batch, -1) + 100).cuda()
              for part in (encoding.parent_list, encoding.top_scores_index, encoding.draft_tokens)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        guard.select(finite_rows(probs, batch), *drafts)  # warm-up, as SGLang's capture does
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = guard.select(finite_rows(probs, batch), *drafts)
    guard.count.zero_()
    for bad in ([1], [0, 2], []):
        fresh = torch.full_like(probs, 0.5)
        for request in bad:
            fresh[2 * request + 1, 0] = float("nan")
        probs.copy_(fresh)
        graph.replay()
        eager = HeadGuard.build(encoding, "cuda").select(finite_rows(fresh, batch), *drafts)
        assert all(torch.equal(got, want) for got, want in zip(outputs, eager))
    assert guard.new_faults(now=10.0) == 3
