"""``committed.CommittedOutputs``: a request's committed output while its output ids lag a step (SGLang's overlap
scheduler), completed from the last verify's tokens, with the count of missing tokens taken from the KV length.

A request of a 5-token prompt decodes: its prefill gave token 7 (the first root); the first verify, from root 7,
accepted drafts 8 and 9 and the bonus 10 (accept length 3); the second, from root 10, accepted the bonus 11 alone.
The synchronous loop has the output ids complete at each step; the overlap loop has them one step behind.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_spec.sglang_plugin.committed import CommittedOutputs

PROMPT = [1, 2, 3, 4, 5]


def request(output: list[int], rid: str = "a") -> SimpleNamespace:
    return SimpleNamespace(rid=rid, origin_input_ids=PROMPT, origin_input_ids_unpadded=PROMPT, output_ids=output)


def first_verify(outputs: CommittedOutputs, kv_length: int = 5) -> None:
    """One request, a 4-node tree (root 7 at node 0, drafts 8 and 9 at nodes 1 and 2): SGLang's predict holds the
    target's token after each node; nodes 0, 1, 2 accepted, so it committed 8, 9 and the bonus 10."""
    predict = torch.tensor([8, 9, 10, 42], dtype=torch.int32)
    accept_index = torch.tensor([[0, 1, 2, -1, -1]], dtype=torch.int32)
    outputs.record(["a"], torch.tensor([kv_length]), predict, accept_index, torch.tensor([3], dtype=torch.int32))


def test_synchronous_loop_output_ids_are_complete_as_they_are():
    outputs = CommittedOutputs()
    assert outputs.output(request([7]), kv_length=5, root=7) == [7]
    first_verify(outputs)
    assert outputs.output(request([7, 8, 9, 10]), kv_length=8, root=10) == [7, 8, 9, 10]
    assert outputs.spliced == 0 and outputs.unknown == 0


def test_overlap_loop_the_last_verify_completes_the_lagging_output():
    outputs = CommittedOutputs()
    # first decode step: the prefill's token is not in the output ids yet; it is the root
    assert outputs.output(request([]), kv_length=5, root=7) == [7]
    first_verify(outputs)
    # second step: the output ids hold the prefill's token only; the first verify committed 8, 9, 10
    assert outputs.output(request([7]), kv_length=8, root=10) == [7, 8, 9, 10]
    assert outputs.records["a"] == (8, [8, 9, 10])
    assert outputs.spliced == 2 and outputs.unknown == 0


def test_the_tail_is_what_the_output_ids_lack_read_without_copying_them():
    outputs = CommittedOutputs()
    assert outputs.tail(request([]), kv_length=5, root=7) == [7]
    first_verify(outputs)
    assert outputs.tail(request([7]), kv_length=8, root=10) == [8, 9, 10]  # the overlap loop's lag
    assert outputs.tail(request([7, 8, 9, 10]), kv_length=8, root=10) == []  # the synchronous loop's: whole
    assert outputs.tail(request([7]), kv_length=9, root=10) is None  # the record is of another KV length


def test_an_output_that_cannot_be_completed_is_unknown_not_guessed():
    outputs = CommittedOutputs()
    first_verify(outputs)
    # the record is of another KV length (a retracted request re-run): three tokens missing, none known
    assert outputs.output(request([7]), kv_length=9, root=10) is None
    # a record that does not end with the root
    assert outputs.output(request([7]), kv_length=8, root=11) is None
    # no record at all, more than the root missing
    assert outputs.output(request([7], rid="b"), kv_length=8, root=10) is None
    # complete by count, but not ending with the root: inconsistent
    assert outputs.output(request([7, 8, 9, 10]), kv_length=8, root=12) is None
    assert outputs.unknown == 3 and outputs.spliced == 0


def test_records_of_finished_requests_are_dropped_past_a_bound():
    outputs = CommittedOutputs()
    predict = torch.tensor([8], dtype=torch.int32)
    accept_index = torch.tensor([[0]], dtype=torch.int32)
    for index in range(300):
        outputs.record([f"r{index}"], torch.tensor([5]), predict, accept_index, torch.tensor([1], dtype=torch.int32))
    assert len(outputs.records) <= 257 and "r299" in outputs.records


@pytest.mark.parametrize("lagging", [False, True])
def test_exact_penalties_see_the_same_output_under_either_loop(lagging):
    """The penalties of a verify (``penalties.RequestPenalties``) read the completed output: the same counts
    whichever loop ran the step."""
    from sglang_spec.sglang_plugin.penalties import RequestPenalties

    outputs = CommittedOutputs()
    first_verify(outputs)
    req = request([7] if lagging else [7, 8, 9, 10])
    req.sampling_params = SimpleNamespace(frequency_penalty=0.5, presence_penalty=0.0, repetition_penalty=1.0,
                                          min_new_tokens=0)
    penalties = RequestPenalties.of(req, outputs.output(req, kv_length=8, root=10))
    assert list(penalties.output_ids) == [7, 8, 9, 10]


def test_a_record_reads_nothing_on_the_host():
    """The verify's record only gathers on the device (a host read would make a GPU's verify wait): with tensors
    that have no data (meta), recording works and any read would raise."""
    outputs = CommittedOutputs()
    meta = {"device": "meta"}
    outputs.record(["a", "b"], torch.empty(2, dtype=torch.int64, **meta), torch.empty(10, dtype=torch.int32, **meta),
                   torch.empty(2, 5, dtype=torch.int32, **meta), torch.empty(2, dtype=torch.int32, **meta))
    assert len(outputs.pending) == 1
    with pytest.raises(NotImplementedError):
        outputs.records  # the read happens here, when an output is asked for


def test_a_record_keeps_its_tokens_when_the_verify_buffers_are_reused():
    """SGLang's and the fused accept's buffers may hold the next step's values before the record is read."""
    outputs = CommittedOutputs()
    predict = torch.tensor([8, 9, 10, 42], dtype=torch.int32)
    accept_index = torch.tensor([[0, 1, 2, -1, -1]], dtype=torch.int32)
    accept_lens, seq_lens = torch.tensor([3], dtype=torch.int32), torch.tensor([5])
    outputs.record(["a"], seq_lens, predict, accept_index, accept_lens)
    for buffer in (predict, accept_index, accept_lens, seq_lens):
        buffer.fill_(0)
    assert outputs.output(request([7]), kv_length=8, root=10) == [7, 8, 9, 10]
    assert not outputs.pending


def test_verifies_nobody_asks_about_are_read_past_a_bound():
    outputs = CommittedOutputs()
    predict, accept_index = torch.tensor([8], dtype=torch.int32), torch.tensor([[0]], dtype=torch.int32)
    for index in range(10):
        outputs.record([f"r{index}"], torch.tensor([5]), predict, accept_index, torch.tensor([1], dtype=torch.int32))
    assert len(outputs.pending) == 4 and set(outputs._records) == {f"r{index}" for index in range(6)}
