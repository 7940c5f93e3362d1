"""Faults in the draft worker's hooks outside the draft itself fail safe, with SGLang's objects stood in: the
head-fault count, the drafter forgetting a faulted proposal, the drafter's learning under tensor parallelism (its
snapshot and its restore) and the stub of a skipped head pass. Each is counted and logged in one line, the batch
goes on (a skipped head pass: SGLang's own draft extend runs), and nothing raises into SGLang's scheduler.

The draft itself and the accept: ``test_hooked_draft_path.py``, ``test_accept_faults.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from doubles import plugin_worker_state
from sglang_spec.sglang_plugin import faults as faults_module
from sglang_spec.sglang_plugin.faults import EXTEND_ROWS, HEAD_FAULTS, HEAD_SKIP, OBSERVE
from sglang_spec.sglang_plugin.hooks import draft as hooks
from sglang_spec.sglang_plugin.metrics import AcceptanceMetrics
from sglang_spec.sglang_plugin.state import attach

pytestmark = pytest.mark.sglang


@pytest.fixture
def metrics(monkeypatch):
    counted = AcceptanceMetrics()
    monkeypatch.setattr(faults_module, "METRICS", counted)
    monkeypatch.setattr(hooks, "METRICS", counted)
    return counted


def fault_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if "fault" in line]


class Drafter:
    """A drafter whose methods raise where asked (``broken``: method names); records what ran."""

    eager = False
    uses_head = True

    def __init__(self, *broken: str, guard=None) -> None:
        self.broken = set(broken)
        self.guard = guard
        self.ran: list[str] = []

    def _run(self, name: str, value=None):
        self.ran.append(name)
        if name in self.broken:
            raise RuntimeError(f"{name} broke")
        return value

    def draft(self, call):
        return self._run("draft")

    def learns(self) -> bool:
        return True

    def observe_outcome(self) -> None:
        self._run("observe_outcome")

    def forget_proposal(self) -> None:
        self._run("forget_proposal")

    def learnt(self) -> dict:
        return self._run("learnt", {"cell": (1.0,)})

    def restore(self, learnt) -> None:
        self._run("restore")


def test_a_fault_reading_the_head_fault_count_leaves_the_draft(metrics, capsys):
    guard = SimpleNamespace(new_faults=lambda now: 1 / 0)
    worker = SimpleNamespace()
    attach(worker, plugin_worker_state(drafter=Drafter(guard=guard)))
    batch = SimpleNamespace(reqs=[object(), object()])
    assert hooks.draft_around(lambda worker, batch: "the draft", worker, batch) == "the draft"
    assert metrics.accept_faults == {(HEAD_FAULTS, "ZeroDivisionError"): 1}
    lines = fault_lines(capsys)
    assert len(lines) == 1 and "fault in head_faults, batch of 2: drafted" in lines[0]


def test_a_faulted_draft_whose_drafter_cannot_forget_still_verifies_the_filler(metrics, capsys):
    drafter = Drafter("learnt", "draft", "forget_proposal")
    worker = SimpleNamespace(speculative_num_steps=4)  # this step's draft steps (the plan's shape sets them)
    attach(worker, plugin_worker_state(drafter=drafter))
    forward_batch = SimpleNamespace(forward_mode=SimpleNamespace(is_idle=lambda: False), batch_size=3,
                                    spec_info=SimpleNamespace(bonus_tokens=torch.tensor([5, 6, 7])))
    _, _, draft_tokens, _ = hooks.draft_forward_around(lambda *args: None, worker, forward_batch)
    assert draft_tokens.shape[0] == 3  # the filler tree, one row a request
    assert drafter.ran == ["observe_outcome", "draft", "forget_proposal"]
    assert metrics.draft_faults == {"RuntimeError": 1}
    assert metrics.accept_faults == {(OBSERVE, "RuntimeError"): 1}
    lines = fault_lines(capsys)
    assert len(lines) == 2 and "its drafter kept the proposal the filler replaced" in lines[0]
    assert "verified without speculation (RuntimeError: draft broke" in lines[1]


class OtherRankFaulted:
    def any_rank(self, flag: bool) -> bool:
        return True


@pytest.mark.parametrize("broken, ran, faults", [
    # the snapshot raised: this rank learnt nothing, so it has nothing to restore
    ("learnt", ["learnt"], 1),
    # the peer faulted and this rank's restore raised: both counted, nothing raises
    ("restore", ["learnt", "observe_outcome", "restore"], 2),
])
def test_under_tensor_parallelism_a_fault_around_the_drafters_learning_is_counted(metrics, capsys, broken, ran,
                                                                                  faults):
    drafter = Drafter(broken)
    hooks._observe_accepted(drafter, SimpleNamespace(peers=OtherRankFaulted(), faults=None), 4)
    assert drafter.ran == ran
    assert sum(metrics.accept_faults.values()) == faults and {stage for stage, _ in metrics.accept_faults} == {OBSERVE}
    assert len(fault_lines(capsys)) == faults


@pytest.mark.parametrize("extend", ["prefill", "decode"])
def test_a_fault_stubbing_a_skipped_head_pass_runs_sglangs_draft_extend(monkeypatch, metrics, capsys,
                                                                        sglang_with_plugin, extend):
    """A ``lookup`` server never runs the head's draft extend; where its stub raises, SGLang's draft extend runs
    (the head's pass: more work, the same output)."""
    worker = SimpleNamespace(topk=4, device="cpu", speculative_num_draft_tokens=1)  # a plain window: every row
    drafter = Drafter()
    drafter.uses_head = False
    attach(worker, plugin_worker_state(drafter=drafter))
    monkeypatch.setattr(hooks, "_stub_draft_input", lambda worker, size: {}[size])
    batch = SimpleNamespace(reqs=[object()], seq_lens=torch.tensor([9]))
    sglangs = []
    if extend == "prefill":
        result = hooks.draft_extend_for_prefill_around(lambda *args: sglangs.append(args) or "extended", worker,
                                                       batch, None, torch.tensor([3]))
    else:
        result = hooks.draft_extend_for_decode_around(lambda *args: sglangs.append(args) or "extended", worker,
                                                      batch, SimpleNamespace(next_draft_input=SimpleNamespace()))
    assert result == "extended" and len(sglangs) == 1
    assert metrics.accept_faults == {(HEAD_SKIP, "KeyError"): 1}
    lines = fault_lines(capsys)
    assert len(lines) == 1 and "fault in head_skip, batch of 1: the head's pass over it ran" in lines[0]


def test_a_fault_choosing_a_draft_extends_logit_rows_runs_it_over_every_row(metrics, capsys, sglang_with_plugin):
    """Where choosing the rows of a decode extend's logits raises, SGLang's extend runs as it is (every row's
    logits: more work, the same candidates), counted and said in one line."""
    worker = SimpleNamespace(topk=4, device="cpu")  # no window size: the choice raises
    attach(worker, plugin_worker_state(drafter=Drafter()))
    batch = SimpleNamespace(reqs=[object()], seq_lens=torch.tensor([9]))
    sglangs = []
    result = hooks.draft_extend_for_decode_around(lambda *args: sglangs.append(args) or "extended", worker, batch,
                                                  SimpleNamespace(accept_lens=torch.tensor([2])))
    assert result == "extended" and len(sglangs) == 1
    assert metrics.accept_faults == {(EXTEND_ROWS, "AttributeError"): 1}
    lines = fault_lines(capsys)
    assert len(lines) == 1 and "fault in extend_rows, batch of 1: its LM head ran over every row" in lines[0]


def test_the_verify_inputs_accept_bound_is_the_trees_depth_past_sglangs_draft_steps():
    """A hybrid 11-node tree with 3 head levels drafts in 4 SGLang steps, but its copies run 11 deep: the verify
    input SGLang built with spec_steps 4 (an accepted path of 5 tokens) leaves the hook holding 11 (the whole tree);
    with a planned smaller tree, its budget; a head tree's bound (eagle 8/4/4: its depth is its steps) is left as
    SGLang made it. Without the hook's bound the served hybrid accept lengths fall below the reference decoder's
    (tests/sglang_server/test_context_trees.py)."""
    from sglang_spec.sglang_plugin.options import TreeServerOptions

    hybrid = TreeServerOptions("hybrid", 11, 11, 4, 6, mtp_levels=3)
    assert hybrid.draft_steps == 4
    batch = SimpleNamespace(reqs=[object()])

    def accept_bound(options, **fields):
        worker = SimpleNamespace()
        attach(worker, plugin_worker_state(options=options, drafter=Drafter(guard=None), steps=options.draft_steps,
                                           **fields))
        built = SimpleNamespace(spec_steps=options.draft_steps)  # as SGLang's build_eagle_verify_input sets it
        return hooks.draft_around(lambda worker, batch: built, worker, batch).spec_steps

    assert accept_bound(hybrid) == 11
    assert accept_bound(hybrid, step_budget=6) == 6
    assert accept_bound(TreeServerOptions("eagle", 8, 4, 4, 4)) == 4


def resting_worker(pool, skip_head: bool):
    """A draft worker whose tree-auto planner rests (or runs) the head this step, with ``pool`` as its draft KV."""
    from sglang_spec.sglang_plugin.step_planner import StepPlanner

    worker = SimpleNamespace(topk=4, device="cpu", draft_runner=SimpleNamespace(token_to_kv_pool=pool))
    state = attach(worker, plugin_worker_state(drafter=Drafter()))
    state.auto = StepPlanner(None, (1, 9), 9, head_rest=1)
    state.auto.skip_head = skip_head
    return worker


def slot_major_pool() -> SimpleNamespace:
    """Two layers of an MHA pool, one token slot a row, every slot written (ones)."""
    return SimpleNamespace(k_buffer=[torch.ones(32, 2, 4) for _ in range(2)],
                           v_buffer=[torch.ones(32, 2, 4) for _ in range(2)])


def decode_batch() -> SimpleNamespace:
    """Two requests at 5 and 7 tokens; request pool rows 1 and 0, their tokens in slots 10.. and 20.."""
    req_to_token = torch.zeros(2, 16, dtype=torch.int32)
    req_to_token[1] = torch.arange(10, 26)
    req_to_token[0] = torch.arange(16, 32)
    return SimpleNamespace(reqs=[object(), object()], seq_lens=torch.tensor([5, 7]),
                           req_pool_indices=torch.tensor([1, 0]),
                           req_to_token_pool=SimpleNamespace(req_to_token=req_to_token))


def test_a_plain_step_with_the_head_at_rest_zeroes_its_tokens_head_kv_and_stubs_its_outputs(monkeypatch,
                                                                                            sglang_with_plugin):
    """The head at rest (``step_planner``): the draft extend does not run; the head KV of the step's verify token
    (position ``seq_lens`` of each request: slots 15 and 23) is zeroed in every layer and nothing else; the next
    draft input's head fields are stubs. With the head not resting (negative control) SGLang's draft extend runs
    and the pool is untouched."""
    monkeypatch.setattr(hooks, "_stub_draft_input", lambda worker, size: {"topk_p": torch.zeros(size, 4)})
    pool = slot_major_pool()
    output = SimpleNamespace(next_draft_input=SimpleNamespace())
    sglangs = []
    result = hooks.draft_extend_for_decode_around(lambda *args: sglangs.append(args), resting_worker(pool, True),
                                                  decode_batch(), output)
    assert result is None and not sglangs
    assert output.next_draft_input.topk_p.shape == (2, 4)
    for buffer in pool.k_buffer + pool.v_buffer:
        zeroed = (buffer == 0).all(dim=(1, 2)).nonzero().flatten().tolist()
        assert zeroed == [15, 23]
    running = slot_major_pool()
    hooks.draft_extend_for_decode_around(lambda *args: sglangs.append(args), resting_worker(running, False),
                                         decode_batch(), SimpleNamespace(next_draft_input=SimpleNamespace()))
    assert len(sglangs) == 1 and all(bool((buffer == 1).all()) for buffer in running.k_buffer + running.v_buffer)


def test_a_fault_zeroing_a_rested_heads_kv_still_rests_it(monkeypatch, metrics, capsys, sglang_with_plugin):
    """A rest is the group's decision: where zeroing raises, the step still stubs the head (a rank that ran the
    head's pass alone would leave its peers' collectives unpaired); one line, counted."""
    monkeypatch.setattr(hooks, "_stub_draft_input", lambda worker, size: {})
    broken = SimpleNamespace(k_buffer=[torch.ones(4, 2, 4)])  # slots past its rows: the zeroing raises
    sglangs = []
    result = hooks.draft_extend_for_decode_around(lambda *args: sglangs.append(args), resting_worker(broken, True),
                                                  decode_batch(), SimpleNamespace(next_draft_input=SimpleNamespace()))
    assert result is None and not sglangs
    assert metrics.accept_faults == {(HEAD_SKIP, "IndexError"): 1}
    lines = fault_lines(capsys)
    assert len(lines) == 1 and "its head KV left as it was (the head at rest)" in lines[0]
