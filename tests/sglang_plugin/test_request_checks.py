"""The plugin's checks of a request before SGLang schedules it (``hooks.requests``): each request that killed the
scheduler or got a 500 is refused with one ``ValueError`` line (SGLang's routes answer it with 400) and SGLang's own
code is not reached; a fault in a check leaves the request to SGLang, counted and logged in one line. SGLang's real
``GenerateReqInput`` is split through the hook.

Through the real server (every route, plain and tree servers): ``tests/sglang_server/test_request_fuzz.py``."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest

from sglang_spec.sglang_plugin import faults as faults_module
from sglang_spec.sglang_plugin.faults import REQUEST
from sglang_spec.sglang_plugin.hooks import requests as hooks
from sglang_spec.sglang_plugin.metrics import AcceptanceMetrics

pytestmark = pytest.mark.sglang

VOCAB = 100
MANAGER = SimpleNamespace(model_config=SimpleNamespace(vocab_size=VOCAB))


@pytest.fixture
def metrics(monkeypatch):
    counted = AcceptanceMetrics()
    monkeypatch.setattr(faults_module, "METRICS", counted)
    return counted


def request(session_params=None, sampling_params=None, return_logprob=False, top_logprobs_num=0, images=False):
    """A GenerateReqInput of one prompt, as far as the checks read it."""
    return SimpleNamespace(session_params=session_params, sampling_params=sampling_params or {},
                           return_logprob=return_logprob, top_logprobs_num=top_logprobs_num,
                           contains_mm_input=lambda: images)


def validate(obj, input_ids):
    """The hook around SGLang's validation; returns what reached SGLang's (None: nothing did)."""
    reached = []
    hooks.validate_one_request_around(lambda manager, obj, ids: reached.append(ids), MANAGER, obj, input_ids)
    return reached[0] if reached else None


@pytest.mark.parametrize("obj, input_ids, message", [
    (request(), [], hooks.EMPTY_PROMPT),
    (request(), (), hooks.EMPTY_PROMPT),
    (request(), [5, VOCAB], f"input_ids holds token id {VOCAB}, outside this model's vocabulary [0, {VOCAB})"),
    (request(), [-1, 5], f"input_ids holds token id -1, outside this model's vocabulary [0, {VOCAB})"),
    (request(sampling_params={"top_k": 2**31}), [5], "top_k 2147483648 is past the largest SGLang's sampler holds"),
    (request(return_logprob=True, top_logprobs_num=VOCAB + 1), [5], f"top_logprobs_num {VOCAB + 1} is more than"),
    (request(sampling_params={"stop_regex": "(("}), [5], "stop_regex '((' is not a regular expression"),
    (request(sampling_params={"stop_regex": ["a+", "[z"]}), [5], "stop_regex '[z' is not a regular expression"),
])
def test_what_sglang_cannot_serve_is_refused_in_one_line_before_its_validation(obj, input_ids, message):
    with pytest.raises(ValueError) as refused:
        validate(obj, input_ids)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


@pytest.mark.parametrize("obj, input_ids", [
    (request(), [0, VOCAB - 1]),
    (request(), None),  # input_embeds
    (request(images=True), [VOCAB + 7]),  # multimodal placeholder ids
    (request(sampling_params={"top_k": 2**31 - 1, "stop_regex": ["a+", r"\d{2}"]}), [5]),
    (request(return_logprob=True, top_logprobs_num=VOCAB), [5]),
    (request(return_logprob=False, top_logprobs_num=VOCAB + 1), [5]),  # not asked for: never computed
    (request(session_params={"id": "chat-1"}), []),  # the session's history supplies the prompt
    (request(session_params=SimpleNamespace(id="chat-1")), []),
])
def test_what_sglang_can_serve_goes_to_its_validation(obj, input_ids):
    assert validate(obj, input_ids) == input_ids


def test_a_fault_in_a_check_leaves_the_request_to_sglang(monkeypatch, metrics, capsys):
    monkeypatch.setattr(hooks, "refusal", lambda obj, input_ids, vocab_size: 1 / 0)
    assert validate(request(), []) == []  # SGLang's own validation ran, as without the plugin
    assert metrics.accept_faults == {(REQUEST, "ZeroDivisionError"): 1}
    lines = [line for line in capsys.readouterr().err.splitlines() if "fault in" in line]
    assert lines == ["[sglang_spec] fault in request_check, one request: checked by SGLang's validation alone "
                     "(ZeroDivisionError: division by zero; sglang_spec_accept_faults_total)"]


# ---------------------------------------------------------------------------------------------- the split
def split(body: dict):
    """SGLang's GenerateReqInput of ``body``, split through the hook around its real normalization."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    obj = GenerateReqInput(**body)
    hooks.normalize_around(GenerateReqInput.normalize_batch_and_arguments.__wrapped__, obj)
    return obj


GREEDY = {"max_new_tokens": 4, "temperature": 0}


@pytest.mark.parametrize("body, message", [
    ({"text": ["a", "b"], "sampling_params": [GREEDY]}, "sampling_params holds 1 entries for 2 prompts"),
    ({"input_ids": [[1], [2]], "sampling_params": [GREEDY] * 3}, "sampling_params holds 3 entries for 2 prompts"),
    ({"text": "a", "sampling_params": [GREEDY]}, "sampling_params is a list for a single prompt"),
    ({"text": "a", "sampling_params": []}, "the request's fields do not fit its prompts (IndexError"),
    ({"input_embeds": [], "sampling_params": GREEDY}, "input_embeds is empty"),
    ({"text": "a", "sampling_params": {**GREEDY, "n": 2**63}}, "n = 9223372036854775808 samples a prompt is more"),
    ({"text": ["a", "b"], "sampling_params": [GREEDY, {**GREEDY, "n": 1025}]}, "n = 1025 samples a prompt"),
    ({"input_embeds": [[]], "sampling_params": GREEDY}, "input_embeds is empty"),
    ({"text": ["a", "b"], "return_logprob": [True], "sampling_params": GREEDY},
     "the request's fields do not fit its prompts (IndexError"),
])
def test_a_body_whose_fields_do_not_fit_its_prompts_is_refused_in_one_line(sglang_with_plugin, body, message):
    with pytest.raises(ValueError) as refused:
        split(body)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


def test_a_billion_samples_are_refused_before_sglang_expands_the_request():
    """n copies of the request's state are made by SGLang's split itself (10**9: tens of GB), so the refusal comes
    before it (checked on the body alone here: a broken check must not take the test's memory)."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    obj = GenerateReqInput(text="a", sampling_params={**GREEDY, "n": 10**9})
    assert hooks.shape_refusal(obj).startswith(f"n = {10**9} samples a prompt is more than this server takes (1024)")
    assert hooks.shape_refusal(GenerateReqInput(text="a", sampling_params={**GREEDY, "n": 1024})) is None


@pytest.mark.parametrize("body", [
    {"text": ["a", "b"], "sampling_params": [GREEDY, GREEDY]},
    {"text": "a", "sampling_params": [{**GREEDY, "n": 2}]},  # n > 1 makes a single prompt a batch of its samples
    {"text": "a", "sampling_params": GREEDY},
    {"input_ids": [[1], [2]], "return_logprob": [True, False]},
])
def test_a_body_that_fits_is_split_by_sglang(sglang_with_plugin, body):
    obj = split(body)
    assert obj.is_single or len(obj.rid) >= 2


# ---------------------------------------------------------------------------------------------- the HTTP body
def parsed(path: str, body):
    """The hook around SGLang's parse of an HTTP body at ``path``: the body, or the HTTPException raised."""
    import asyncio

    async def sglangs_parse(request):
        return body

    request = SimpleNamespace(scope={"path": path})
    try:
        return asyncio.run(hooks.request_json_around(sglangs_parse, request))
    except Exception as error:  # fastapi's HTTPException
        return error


CHAT = "/v1/chat/completions"


@pytest.mark.parametrize("path, body, message", [
    (CHAT, [], "the body is a JSON array, not an object"),
    ("/v1/completions", 42, "the body is a JSON number, not an object"),
    (CHAT, {"messages": [], "response_format": "json"}, "response_format is a JSON string: give an object"),
    (CHAT, {"response_format": {"type": "json_schema", "schema": [1]}}, "response_format.schema is a JSON array"),
    (CHAT, {"response_format": {"type": "json_schema", "schema": {"properties": "strict"}}},
     "response_format.schema.properties is a JSON string"),
    (CHAT, {"response_format": {"type": "json_schema", "schema": {"properties": {"strict": 1}}}},
     "response_format.schema.properties.strict is a JSON number"),
])
def test_an_openai_body_sglangs_request_model_cannot_read_is_refused_with_400(sglang_with_plugin, path, body,
                                                                                message):
    from fastapi import HTTPException

    refused = parsed(path, body)
    assert isinstance(refused, HTTPException) and refused.status_code == 400, refused
    assert refused.detail.startswith(message) and "\n" not in refused.detail


@pytest.mark.parametrize("path, body", [
    (CHAT, {"messages": [], "response_format": {"type": "json_schema", "schema": {"properties": {"strict": {}}}}}),
    (CHAT, {"response_format": None}),
    ("/generate", []),  # SGLang's own contract check answers /generate
    ("/v1/completions", {"prompt": "a"}),
])
def test_a_body_sglang_can_read_is_passed_on(sglang_with_plugin, path, body):
    assert parsed(path, body) is body


def test_the_hooks_reach_sglang(sglang_with_plugin):
    from sglang.srt.entrypoints.http_server import ORJSONRequest
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    def hook_of(function):
        return inspect.getclosurevars(function).nonlocals.get("hook")

    assert hook_of(TokenizerManager._validate_one_request) is hooks.validate_one_request_around
    assert hook_of(GenerateReqInput.normalize_batch_and_arguments) is hooks.normalize_around
    assert hook_of(ORJSONRequest.json) is hooks.request_json_around


# ---------------------------------------------------------------------------------------------- while decoding
def grammar_request(min_new_tokens: int):
    """A request whose grammar takes no further token (it admits only the end, which min_new_tokens forbids)."""
    def accept_token(token):
        raise ValueError(f"Tokens not accepted: {token}")

    return SimpleNamespace(rid="r", to_finish=None, finished=lambda: False,
                           sampling_params=SimpleNamespace(min_new_tokens=min_new_tokens),
                           grammar=SimpleNamespace(accept_token=accept_token, is_terminated=lambda: False))


@pytest.mark.parametrize("min_new_tokens, status", [(3, 400), (0, 500)])
def test_a_grammar_ending_before_min_new_tokens_is_the_clients_abort(sglang_with_plugin, min_new_tokens, status):
    """SGLang's own advance of the grammar (hooked) aborts the request; with min_new_tokens the abort is a 400 that
    says why, any other grammar failure stays SGLang's 500."""
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor

    for advance in ("decode", "prefill"):
        request = grammar_request(min_new_tokens)
        if advance == "decode":
            SchedulerBatchResultProcessor._accept_grammar_tokens(SimpleNamespace(), request, [0])
        else:
            SchedulerBatchResultProcessor._apply_prefill_grammar(SimpleNamespace(), req=request, next_token_id=0)
        assert request.to_finish.status_code == status, advance
        if status == 400:
            assert request.to_finish.message.startswith(
                "the grammar ended the output before min_new_tokens (3) tokens, and min_new_tokens forbids")


def test_a_fault_rewriting_a_grammar_abort_leaves_sglangs(monkeypatch, metrics, capsys):
    monkeypatch.setattr(hooks, "client_grammar_abort", lambda request: 1 / 0)
    assert hooks.grammar_abort_after(["kept"], None, grammar_request(3)) == ["kept"]
    assert metrics.accept_faults == {(REQUEST, "ZeroDivisionError"): 1}
    assert "its grammar abort left as SGLang's (500)" in capsys.readouterr().err
