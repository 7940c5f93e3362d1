"""``lookup`` trees grown on the device (--speculative-tree-context-on device): each request's history kept there
(``device_history``), and a draft step that reads nothing on the host
(``drafters.device_context.device_lookup_draft_forward``). The server tests
(``tests/sglang_server/test_context_trees.py``, ``lookup-device``) check that such a server accepts what the host-built
trees accept, step for step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_spec.errors import SpecError
from sglang_spec.sglang_plugin.drafters.device_context import DeviceLookupDrafter, device_lookup_draft_forward
from sglang_spec.sglang_plugin.drafters.device_history import DeviceHistory
from sglang_spec.sglang_plugin.options import from_values
from sglang_spec.tree.policies import TreePolicy


def request(rid: str, row: int, prompt: list[int], output: list[int]) -> SimpleNamespace:
    return SimpleNamespace(rid=rid, kv=SimpleNamespace(req_pool_idx=row), origin_input_ids_unpadded=prompt,
                           output_ids=output)


def test_a_history_takes_new_requests_from_the_host_and_each_verify_from_the_device():
    history = DeviceHistory(rows=4, columns=16, device="cpu")
    # row 2: output ids complete (the synchronous loop); row 0: lagging by the root (the overlap loop)
    reqs = [request("a", 2, [1, 2, 3], [4]), request("b", 0, [5, 6], [])]
    history.admit(reqs, torch.tensor([3, 2]), roots=torch.tensor([4, 7]))
    assert history.tokens[2, :4].tolist() == [1, 2, 3, 4] and history.tokens[0, :3].tolist() == [5, 6, 7]
    assert history.lengths.tolist() == [3, 0, 4, 0] and history.admitted == 2
    # a verify of 3 nodes each: "a" accepted node 1 and the bonus (2 tokens), "b" the bonus alone
    predict = torch.tensor([8, 9, 10, 11, 12, 13])
    accept_index = torch.tensor([[0, 1, -1], [3, -1, -1]])
    history.append(torch.tensor([2, 0]), predict, accept_index, torch.tensor([2, 1], dtype=torch.int32))
    assert history.tokens[2, :6].tolist() == [1, 2, 3, 4, 8, 9] and history.tokens[0, :4].tolist() == [5, 6, 7, 11]
    assert history.lengths.tolist() == [4, 0, 6, 0]
    # known requests are not rewritten from the host (whose output ids may lag); a new owner of a row is
    history.admit([request("a", 2, [1, 2, 3], [4]), request("c", 0, [9], [1])], torch.tensor([5, 1]),
                  roots=torch.tensor([9, 1]))
    assert history.lengths.tolist() == [2, 0, 6, 0] and history.tokens[0, :2].tolist() == [9, 1]


def test_a_full_row_keeps_what_fits_and_drops_the_rest():
    history = DeviceHistory(rows=1, columns=5, device="cpu")
    history.admit([request("a", 0, [1, 2, 3], [4])], torch.tensor([3]), roots=torch.tensor([4]))
    history.append(torch.tensor([0]), torch.tensor([5, 6, 7]), torch.tensor([[0, 1, 2]]), torch.tensor([3]))
    assert history.lengths.tolist() == [5] and history.tokens[0, :5].tolist() == [1, 2, 3, 4, 5]


def test_the_draft_step_reads_nothing_on_the_host():
    """Every tensor of the step on the meta device (no data: a host read raises), the requests' host lists and
    SGLang's host copy of the KV lengths aside: the step runs to its encoded trees."""
    meta = torch.device("meta")
    policy = TreePolicy("lookup", budget=6, depth=3, width=3)
    drafter = DeviceLookupDrafter(policy, steps=3, budget=6)
    worker = SimpleNamespace(topk=3, draft_runner=SimpleNamespace(req_to_token_pool=SimpleNamespace(
        req_to_token=torch.empty(5, 64, dtype=torch.int32, device=meta))))
    batch = SimpleNamespace(spec_info=SimpleNamespace(bonus_tokens=torch.empty(2, dtype=torch.int64, device=meta)),
                            seq_lens_cpu=torch.tensor([4, 2]),
                            req_pool_indices=torch.empty(2, dtype=torch.int64, device=meta))
    reqs = [request("a", 1, [1, 2, 3, 1], [2]), request("b", 3, [4, 5], [])]
    parent_list, top_scores_index, draft_tokens, probs = device_lookup_draft_forward(worker, batch, reqs, drafter)
    assert parent_list.shape == (2, 3 * 2 + 1) and top_scores_index.shape == (2, 6) and draft_tokens.shape == (2, 6)
    assert probs is None and drafter.proposed_on_device is not None
    with pytest.raises(NotImplementedError):
        top_scores_index.tolist()  # meta indeed: a read would have raised inside the step


@pytest.mark.parametrize("values, message", [
    ({"speculative_tree_policy": "specexec"}, "grows lookup and hybrid trees"),
    ({"speculative_tree_policy": "hybrid", "speculative_tree_auto": True, "speculative_tree_verify_sizes": "1,5,9"},
     "need trees grown to any size a step"),
    ({"speculative_tree_policy": "lookup", "speculative_tree_context_on": "gpu"}, "takes host or device"),
])
def test_device_growth_is_refused_where_it_does_not_serve(values, message):
    given = {"speculative_tree_context_on": "device", **values}
    with pytest.raises(SpecError, match=message):
        from_values(given)


def test_the_option_reaches_the_servers_options():
    options = from_values({"speculative_tree_policy": "lookup", "speculative_tree_context_on": "device"})
    assert options is not None and options.context_on == "device"
    assert from_values({"speculative_tree_policy": "lookup"}).context_on == "host"
    hybrid = from_values({"speculative_tree_policy": "hybrid", "speculative_tree_context_on": "device"})
    assert hybrid is not None and hybrid.context_on == "device"
    # tree auto plans a device server's steps whole: a plain step or the full tree
    planned = from_values({"speculative_tree_policy": "hybrid", "speculative_tree_context_on": "device",
                           "speculative_tree_auto": True, "speculative_tree_budget": 12})
    assert planned is not None and planned.auto and not planned.grows_any_size
