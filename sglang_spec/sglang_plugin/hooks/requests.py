"""Hooks of a request's admission, before SGLang's tokenizer manager sends it to the scheduler: a request that no
forward can serve, or that SGLang would fail on with an internal error, is refused in one line through SGLang's own
error path (a ``ValueError``, which its routes answer with HTTP 400 and the message; a refused batch member aborts
the members already sent). Every generate route goes through the split and the check of each prompt below
(``/generate`` one prompt or a batch, ``/v1/completions``, ``/v1/chat/completions``, ``sgl.Engine``), on a plain
server too: the plugin hooks SGLang whether or not the tree options are set.

``ORJSONRequest.json`` (``request_json_around``) parses an HTTP body for SGLang's routes. On the OpenAI completion
routes, SGLang's request models read the body as an object in validators that run before their type checks, so a
body that is not a JSON object (``[]``, ``42``), or a chat ``response_format`` (its ``schema``, the schema's
``properties``) that is not one, raised ``AttributeError`` / ``TypeError`` in the parse: a 500. Refused there
(``body_refusal``) with an ``HTTPException`` of 400, which SGLang answers with the message.

``GenerateReqInput.normalize_batch_and_arguments`` (``normalize_around``) splits a body into its prompts. Refused
there (``shape_refusal``), each an ``IndexError`` / ``AttributeError`` and a 500 in SGLang 0.5.23:

* a batch whose ``sampling_params`` list holds another number of entries than it has prompts;
* a single prompt with a ``sampling_params`` list (one entry a prompt of a batch);
* an empty ``input_embeds``;
* more than ``MAX_SAMPLES`` samples a prompt (``n``): SGLang expands the request into n copies of its state (ids,
  settings, a request id each) before anything is scheduled, so a body of a few bytes with n = 10**9 exhausts the
  host's memory, and one past 2**63 raised ``OverflowError`` (a 500). OpenAI's API takes at most 128.

Any other ``IndexError`` / ``KeyError`` / ``TypeError`` of the split, or of taking a batch's prompts apart right
after it (another per-prompt list too short), is the client's too: answered the same way, naming it.

``TokenizerManager._validate_one_request`` (``validate_one_request_around``) sees each prompt once it is final:
tokenized, chat template applied, multimodal placeholders expanded. Refused there (``refusal``):

* an empty prompt (0 tokens: ``text: ""`` with a tokenizer that adds no BOS, a batch member ``""`` or ``[]``, a
  completion's empty prompt): SGLang schedules a 0-token prefill, which no attention or rotary kernel is written
  for (on the CPU the scheduler died in the rotary embedding's reshape, and the server with it). A request
  continuing a session (``session_params`` with an id) is left to SGLang: its history supplies the prompt.
* a prompt token id outside the model's vocabulary (SGLang checks only ``token_ids_logprob``'s): the prefill's
  embedding lookup indexes past its table (on the CPU an ``IndexError`` killed the scheduler; a GPU's gather
  reads out of bounds or asserts). Not checked for a multimodal request, whose placeholder ids the model's own
  embedding routine replaces.
* a ``top_k`` past 2**31 - 1: SGLang's batch of sampling settings holds top_k as int32, and the conversion raised
  in the scheduler (the server died); any top_k from the vocabulary's size up samples from all of it.
* more top logprobs a token than the vocabulary has (``top_logprobs_num``; the completions route's ``logprobs``)
  with ``return_logprob``: the sampler's top-k over the vocabulary raised (the scheduler died).
* a ``stop_regex`` that is no regular expression: SGLang's parse of it raised ``re.error`` (a 500).

One conflict shows only while decoding, in the scheduler: a grammar (``regex``, ``json_schema``, ``ebnf``) that
ends the output before ``min_new_tokens``, whose penalty forbids the end there, so no token is left; SGLang aborts
the request as its own error (500). ``grammar_abort_after`` makes that abort the client's (400, one line).

A fault in a check itself is counted and logged in one line (``faults.plugin_fault``) and the request goes on to
SGLang as without the plugin.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from sglang_spec.sglang_plugin.faults import REQUEST, plugin_fault

OPENAI_ROUTES = ("/v1/completions", "/v1/chat/completions")
INT32_MAX = 2**31 - 1
MAX_SAMPLES = 1024  # samples a prompt (``n``) a request may ask for
EMPTY_PROMPT = ("the prompt is empty (0 tokens): send at least one token of text or input_ids (in a batch, every "
                "prompt)")


# ---------------------------------------------------------------------------------------------- the HTTP body
async def request_json_around(original, request, *args, **kwargs):
    """An HTTP request's JSON body as SGLang parses it, after the plugin's check of its shape (``body_refusal``)."""
    body = await original(request, *args, **kwargs)
    refused = _refusal_of(lambda: body_refusal(request.scope.get("path", ""), body), "parsed by SGLang alone")
    if refused is not None:
        from fastapi import HTTPException  # sglang's HTTP layer: there only with sglang

        raise HTTPException(status_code=400, detail=refused)
    return body


def body_refusal(path: str, body: Any) -> str | None:
    """Why SGLang's request model of the route at ``path`` cannot read the parsed JSON ``body``, or None."""
    if path not in OPENAI_ROUTES:
        return None
    if not isinstance(body, dict):
        return f"the body is a JSON {_json_type(body)}, not an object: send the request's fields as one JSON object"
    response_format = body.get("response_format")
    if path != "/v1/chat/completions" or not response_format:
        return None
    if not isinstance(response_format, dict):
        return (f"response_format is a JSON {_json_type(response_format)}: give an object, such as "
                f'{{"type": "json_object"}}')
    schema = response_format.get("schema") if response_format.get("type") == "json_schema" else None
    if schema and not isinstance(schema, dict):
        return f"response_format.schema is a JSON {_json_type(schema)}: give a JSON schema object"
    properties = schema.get("properties") if isinstance(schema, dict) else None
    if isinstance(schema, dict) and "properties" in schema and not isinstance(properties, dict):
        return f"response_format.schema.properties is a JSON {_json_type(properties)}: give an object"
    strict = properties.get("strict") if isinstance(properties, dict) else None
    if strict and not isinstance(strict, dict):
        return f"response_format.schema.properties.strict is a JSON {_json_type(strict)}: give a schema object"
    return None


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


# ---------------------------------------------------------------------------------------------- the split
def normalize_around(original, obj, *args, **kwargs):
    """SGLang's split of a generate request into its prompts, between the plugin's checks of the lists it indexes
    (``shape_refusal``); a structural error of the split is the client's, refused in one line."""
    _refuse_if(lambda: shape_refusal(obj), "split by SGLang alone")
    try:
        result = original(obj, *args, **kwargs)
        if not obj.is_single:
            for index in range(len(obj.rid)):  # what SGLang does next with a batch: each prompt taken apart
                obj[index]
    except (IndexError, KeyError, TypeError) as error:
        raise ValueError(f"the request's fields do not fit its prompts ({type(error).__name__}: {error}): give each "
                         f"per-prompt field as one value for all prompts, or a list of one a prompt") from None
    _refuse_if(lambda: split_refusal(obj), "split by SGLang alone")
    return result


def shape_refusal(obj: Any) -> str | None:
    """Why SGLang cannot split the generate request ``obj`` (a ``GenerateReqInput`` as parsed) into its prompts, or
    None."""
    embeds = getattr(obj, "input_embeds", None)
    if obj.text is None and obj.input_ids is None and isinstance(embeds, list) and (not embeds or embeds[0] == []):
        return "input_embeds is empty: give one embedding a prompt token"
    params = obj.sampling_params
    for entry in params if isinstance(params, list) else [params]:
        samples = entry.get("n") if isinstance(entry, dict) else None
        if isinstance(samples, int) and samples > MAX_SAMPLES:
            return (f"n = {samples} samples a prompt is more than this server takes ({MAX_SAMPLES}): ask for fewer, "
                    f"or send the prompt again")
    prompts = obj.text if obj.text is not None else obj.input_ids
    batch = isinstance(prompts, list) and (obj.text is not None or (bool(prompts) and isinstance(prompts[0], list)))
    if batch and isinstance(params, list) and len(params) != len(prompts):
        return (f"sampling_params holds {len(params)} entries for {len(prompts)} prompts: give one a prompt, or one "
                f"object for all")
    return None


def split_refusal(obj: Any) -> str | None:
    """Why SGLang cannot serve the request ``obj`` as split (``normalize_batch_and_arguments`` done), or None."""
    if obj.is_single and isinstance(obj.sampling_params, list):
        return ("sampling_params is a list for a single prompt: send one object (a list holds one entry a prompt of "
                "a batch)")
    return None


# ---------------------------------------------------------------------------------------------- one prompt
def validate_one_request_around(original, manager, obj, input_ids, *args, **kwargs):
    """SGLang's validation of one request (a batch member), after the plugin's own (``refusal``)."""
    _refuse_if(lambda: refusal(obj, input_ids, manager.model_config.vocab_size),
               "checked by SGLang's validation alone")
    return original(manager, obj, input_ids, *args, **kwargs)


def refusal(obj: Any, input_ids: Sequence[int] | None, vocab_size: int) -> str | None:
    """Why SGLang must not schedule the request ``obj`` (a ``GenerateReqInput`` or ``EmbeddingReqInput`` of one
    prompt) whose final prompt is ``input_ids`` (None: given as ``input_embeds``) on a model of ``vocab_size``
    embedding rows, or None to let it through."""
    return (_prompt_refusal(obj, input_ids, vocab_size) or _sampling_refusal(_sampling_params(obj), vocab_size)
            or _logprob_refusal(obj, vocab_size))


def _prompt_refusal(obj: Any, input_ids: Sequence[int] | None, vocab_size: int) -> str | None:
    if input_ids is None:
        return None
    if len(input_ids) == 0:
        return None if _session_id(obj) is not None else EMPTY_PROMPT
    if _multimodal(obj):
        return None
    lowest, highest = min(input_ids), max(input_ids)
    if lowest < 0 or highest >= vocab_size:
        outside = lowest if lowest < 0 else highest
        return (f"input_ids holds token id {outside}, outside this model's vocabulary [0, {vocab_size}): send the "
                f"ids its tokenizer gives, or text")
    return None


def _sampling_refusal(params: dict, vocab_size: int) -> str | None:
    top_k = params.get("top_k")
    if isinstance(top_k, int) and top_k > INT32_MAX:
        return (f"top_k {top_k} is past the largest SGLang's sampler holds ({INT32_MAX}): "
                f"give at most the vocabulary's {vocab_size}, or -1 for all of it")
    patterns = params.get("stop_regex")
    for pattern in [patterns] if isinstance(patterns, str) else patterns if isinstance(patterns, list) else []:
        if not isinstance(pattern, str):
            continue
        try:
            re.compile(pattern)
        except re.error as error:
            return f"stop_regex {pattern[:80]!r} is not a regular expression ({error}): fix it, or send stop strings"
    return None


def _logprob_refusal(obj: Any, vocab_size: int) -> str | None:
    top = getattr(obj, "top_logprobs_num", None)
    if getattr(obj, "return_logprob", False) and isinstance(top, int) and top > vocab_size:
        return (f"top_logprobs_num {top} is more than this model's vocabulary of {vocab_size} tokens: ask for at most "
                f"{vocab_size}")
    return None


# ---------------------------------------------------------------------------------------------- while decoding
GRAMMAR_FAILURE = "Grammar accept_token failed"  # the start of SGLang's abort message


def grammar_abort_after(result, processor, *args, **kwargs):
    """After SGLang advanced a request's grammar over its new tokens (a prefill's or a decode step's, speculative or
    not): an abort because the grammar took no token, on a request whose ``min_new_tokens`` forbade the end the
    grammar reached, is the client's (``client_grammar_abort``)."""
    request = kwargs.get("req", args[0] if args else None)
    try:
        client_grammar_abort(request)
    except Exception as error:  # its abort stays SGLang's
        plugin_fault(REQUEST, error, "one request", "its grammar abort left as SGLang's (500)")
    return result


def client_grammar_abort(request: Any) -> None:
    """``request.to_finish`` (SGLang's ``FINISH_ABORT``), where SGLang aborted ``request`` as a server error because
    its grammar accepted no token and the request asks for ``min_new_tokens``, made a 400 that says so. Any other
    grammar failure is left as SGLang's."""
    finish = getattr(request, "to_finish", None)
    if type(finish).__name__ != "FINISH_ABORT" or finish.status_code != 500:
        return
    if not str(finish.message).startswith(GRAMMAR_FAILURE):
        return
    floor = int(getattr(request.sampling_params, "min_new_tokens", 0) or 0)
    if floor <= 0:
        return
    finish.message = (f"the grammar ended the output before min_new_tokens ({floor}) tokens, and min_new_tokens "
                      f"forbids ending it there: lower min_new_tokens, or give a grammar that takes longer outputs")
    finish.status_code = 400
    finish.err_type = "BadRequestError"


# ---------------------------------------------------------------------------------------------- helpers
def _refuse_if(check, outcome: str) -> None:
    """Raises the refusal ``check()`` gives as a ``ValueError`` (``_refusal_of``)."""
    refused = _refusal_of(check, outcome)
    if refused is not None:
        raise ValueError(refused)


def _refusal_of(check, outcome: str) -> str | None:
    """The refusal ``check()`` gives; a check that itself raises is a plugin fault (counted, one line) and refuses
    nothing (``outcome``: what becomes of the request)."""
    try:
        return check()
    except Exception as error:  # a check must not refuse or fail a request it could not judge
        plugin_fault(REQUEST, error, "one request", outcome)
        return None


def _sampling_params(obj: Any) -> dict:
    params = getattr(obj, "sampling_params", None)
    return params if isinstance(params, dict) else {}


def _multimodal(obj: Any) -> bool:
    contains = getattr(obj, "contains_mm_input", None)
    return bool(contains()) if callable(contains) else False


def _session_id(obj: Any) -> Any:
    params = getattr(obj, "session_params", None)
    return params.get("id") if isinstance(params, dict) else getattr(params, "id", None)
