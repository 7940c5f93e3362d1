"""The plugin's check of a request in SGLang's tokenizer manager (``hooks.requests``): an empty prompt is refused
with one ``ValueError`` line (SGLang's routes answer it with 400) before SGLang schedules a 0-token prefill; a fault
in the check leaves the request to SGLang's own validation, counted and logged in one line.

Through the real server (every route, plain and tree servers): ``tests/sglang_server/test_request_fuzz.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_spec.sglang_plugin import faults as faults_module
from sglang_spec.sglang_plugin.faults import REQUEST
from sglang_spec.sglang_plugin.hooks import requests as hooks
from sglang_spec.sglang_plugin.metrics import AcceptanceMetrics

pytestmark = pytest.mark.sglang


@pytest.fixture
def metrics(monkeypatch):
    counted = AcceptanceMetrics()
    monkeypatch.setattr(faults_module, "METRICS", counted)
    return counted


def request(session_params=None):
    """A GenerateReqInput of one prompt, as far as the check reads it."""
    return SimpleNamespace(session_params=session_params)


def sglangs_validation(calls):
    def validate(manager, obj, input_ids):
        calls.append(list(input_ids))
    return validate


@pytest.mark.parametrize("input_ids", [[], ()])
def test_an_empty_prompt_is_refused_in_one_line_before_sglangs_validation(input_ids):
    calls = []
    with pytest.raises(ValueError) as refused:
        hooks.validate_one_request_around(sglangs_validation(calls), None, request(), input_ids)
    assert str(refused.value) == hooks.EMPTY_PROMPT and "\n" not in hooks.EMPTY_PROMPT
    assert calls == []


def test_a_prompt_of_one_token_and_an_embeddings_prompt_go_to_sglangs_validation():
    calls = []
    hooks.validate_one_request_around(sglangs_validation(calls), None, request(), [7])
    hooks.validate_one_request_around(lambda manager, obj, ids: calls.append(ids), None, request(), None)
    assert calls == [[7], None]


def test_a_session_continuation_is_left_to_sglang():
    """Its session's history supplies the prompt (SGLang's scheduler rejects one still empty after that)."""
    assert hooks.refusal(request(session_params={"id": "chat-1"}), []) is None
    assert hooks.refusal(request(session_params=SimpleNamespace(id="chat-1")), []) is None
    assert hooks.refusal(request(session_params={"id": None}), []) == hooks.EMPTY_PROMPT


def test_a_fault_in_the_check_leaves_the_request_to_sglang(monkeypatch, metrics, capsys):
    calls = []
    monkeypatch.setattr(hooks, "refusal", lambda obj, input_ids: 1 / 0)
    hooks.validate_one_request_around(sglangs_validation(calls), None, request(), [])
    assert calls == [[]]  # SGLang's own validation ran, as without the plugin
    assert metrics.accept_faults == {(REQUEST, "ZeroDivisionError"): 1}
    lines = [line for line in capsys.readouterr().err.splitlines() if "fault in" in line]
    assert lines == ["[sglang_spec] fault in request_check, one request: checked by SGLang's validation alone "
                     "(ZeroDivisionError: division by zero; sglang_spec_accept_faults_total)"]


def test_the_hook_reaches_sglangs_tokenizer_manager(sglang_with_plugin):
    import inspect

    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    hook = inspect.getclosurevars(TokenizerManager._validate_one_request).nonlocals.get("hook")
    assert hook is hooks.validate_one_request_around
