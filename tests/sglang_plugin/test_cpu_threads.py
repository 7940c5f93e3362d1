"""The CPU bed's prefill threads (``sglang_spec_testbed/threads.py``, ``SGLANG_SPEC_CPU_PREFILL_THREADS``): the
variable's parsing, and which forwards the hook gives more threads. Through launch_server:
``tests/sglang_server/test_serving_sweep.py`` (``--prefill-threads``)."""

from __future__ import annotations

import enum
import types

import pytest
import torch

from sglang_spec.errors import SpecError
from sglang_spec_testbed import threads

ENV = threads.PREFILL_THREADS_ENV


class Mode(enum.Enum):  # SGLang's ForwardMode names the hook reads
    EXTEND = 1
    MIXED = 2
    SPLIT_PREFILL = 3
    DECODE = 4
    TARGET_VERIFY = 5
    DRAFT_EXTEND_V2 = 6


def batch(mode: Mode, tokens: int):
    return types.SimpleNamespace(forward_mode=mode, input_ids=torch.zeros(tokens, dtype=torch.long))


def test_the_variable_names_a_positive_thread_count_or_is_refused_in_one_line():
    assert threads.prefill_threads_from_environment({}) is None
    assert threads.prefill_threads_from_environment({ENV: " "}) is None
    assert threads.prefill_threads_from_environment({ENV: "2"}) == 2
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(SpecError, match=rf"^{ENV}='{bad}' is not a thread count; give a positive integer") as error:
            threads.prefill_threads_from_environment({ENV: bad})
        assert "\n" not in str(error.value)
    assert threads.hooks(None) == ()
    (target, hook, kind), = threads.hooks(2)
    assert target.endswith("ModelRunner.forward") and kind == "AROUND" and hook.__self__.threads == 2


def test_prefills_run_on_the_named_threads_and_everything_else_on_the_processs(capsys):
    before = torch.get_num_threads()
    seen = []

    def forward(runner, forward_batch):
        seen.append(torch.get_num_threads())
        return forward_batch.forward_mode

    prefill = threads.PrefillThreads(before + 1)
    runner = types.SimpleNamespace(is_draft_worker=False)
    minimum = threads.PREFILL_MIN_TOKENS
    cases = [(Mode.EXTEND, minimum, before + 1), (Mode.MIXED, 4 * minimum, before + 1),
             (Mode.SPLIT_PREFILL, minimum, before + 1), (Mode.EXTEND, minimum - 1, before),
             (Mode.DECODE, 4 * minimum, before), (Mode.TARGET_VERIFY, 4 * minimum, before),
             (Mode.DRAFT_EXTEND_V2, 4 * minimum, before)]
    for mode, tokens, expected in cases:
        assert prefill.model_forward_around(forward, runner, batch(mode, tokens)) is mode
        assert seen[-1] == expected, (mode, tokens)
        assert torch.get_num_threads() == before
    # a forward that raises gives the threads back too
    with pytest.raises(RuntimeError):
        prefill.model_forward_around(lambda *_: (_ for _ in ()).throw(RuntimeError("boom")), runner,
                                     batch(Mode.EXTEND, minimum))
    assert torch.get_num_threads() == before
    said = [line for line in capsys.readouterr().err.splitlines() if "prefills of" in line]
    assert said == [f"[sglang_spec] CPU bed: the target model's prefills of {minimum}+ tokens run on {before + 1} "
                    f"threads (decode steps on {before}; first: {minimum} tokens)"]
