"""Hypothesis strategies for request bodies to SGLang's generate routes (``/generate``, ``/v1/completions``,
``/v1/chat/completions``): each field drawn from what its schema takes (``GenerateReqInput`` / ``SamplingParams``,
the OpenAI protocol's requests) most of the time and from hostile values otherwise: empty, huge, wrong types,
NaN / infinite / negative numbers, unicode (lone surrogates included), nested lists, token ids outside the
vocabulary, lists that do not fit the prompts, broken grammars; a few raw bodies that are not JSON objects. Each
draw is a ``Send``: the route, the body and how the client delivers it (whole, a stream closed early, a client that
hangs up before the answer).

Generation stays short (at most ``MAX_NEW_TOKENS`` new tokens a prompt, at most ``MAX_PROMPTS`` prompts of at
most ``MAX_SAMPLES`` samples) so a body costs a second or so a server on the 2-core CPU; lengths past the
context (512 on the fuzz servers) come as whole numbers SGLang refuses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

VOCAB = 49152  # SmolLM2's
MAX_NEW_TOKENS = 8
MAX_PROMPTS = 3
MAX_SAMPLES = 3
ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")
DELIVERIES = ("whole", "close_stream", "hang_up")


@dataclass(frozen=True)
class Send:
    """One request: ``route``, its ``body`` (a JSON value, or raw bytes sent as they are) and ``delivery``: ``whole``
    (the answer read to its end), ``close_stream`` (streamed, the connection closed after ``chunks`` data chunks),
    ``hang_up`` (the connection closed ``seconds`` after the request went out)."""

    route: str
    body: Any
    delivery: str = "whole"
    chunks: int = 1
    seconds: float = 0.0

    def encoded(self) -> bytes:
        return self.body if isinstance(self.body, bytes) else json.dumps(self.body).encode()

    def greedy(self) -> bool:
        """Whether every prompt of the body decodes greedily (temperature 0 or top_k 1), so a tree server's answer
        must equal plain decoding's."""
        body = self.body
        if not isinstance(body, dict):
            return True  # refused before any decoding: the refusals must be equal too
        if self.route == "/generate":
            params = body.get("sampling_params")
            return all(_greedy(p) for p in (params if isinstance(params, list) else [params]))
        return _greedy(body)


def _greedy(params: Any) -> bool:
    if not isinstance(params, dict):
        return True  # refused
    temperature, top_k = params.get("temperature"), params.get("top_k")
    return temperature == 0 or top_k == 1


# ---------------------------------------------------------------------------------------------- hostile values
SCALARS = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8))
JSON_VALUES = st.recursive(SCALARS, lambda children: st.lists(children, max_size=3)
                           | st.dictionaries(st.text(max_size=6), children, max_size=3), max_leaves=6)
HUGE_INTS = st.sampled_from([-1, -2**63, 2**31, 2**63 - 1, 2**63, 10**30, 512, 4096])
# lengths and sample counts: values refused at once (none that would decode for minutes, nor SGLang's default
# lengths a null gives: 128 new tokens, the whole context)
BAD_LENGTHS = st.sampled_from([-1, -2**63, 2**31, 2**63, 10**30, 512, 4096, "4", 1.5, [], {}])
BAD_SAMPLES = st.sampled_from([0, -1, 1025, 2**31, 2**63, 10**30, "2", 1.5, [], {}])
BAD_NUMBERS = st.sampled_from([float("nan"), float("inf"), float("-inf"), -1.0, -1e308, 1e308, 1e-300, 0.0])


def sometimes(good: st.SearchStrategy, bad: st.SearchStrategy = JSON_VALUES) -> st.SearchStrategy:
    """``good`` about four draws in five, ``bad`` otherwise."""
    return st.one_of(good, good, good, good, bad)


UNICODE = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=24)
SURROGATES = st.text(st.characters(categories=("Cs",)), min_size=1, max_size=2)
WORDS = st.sampled_from(["Hello", "The capital of France is", "def add(a, b):\n    return", "1, 2, 3, 4,",
                         "Write a haiku about rain.", "日本語で答えて: 空は", "🙂🙃 emoji", " ", "\n\n", "<|im_end|>"])
TEXTS = st.one_of(WORDS, WORDS, UNICODE, st.just(""), SURROGATES, st.just("lorem ipsum " * 400))
TOKEN_IDS = st.one_of(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
                      st.lists(st.integers(0, VOCAB - 1), max_size=0),
                      st.lists(st.one_of(st.integers(0, VOCAB - 1), HUGE_INTS), min_size=1, max_size=4),
                      st.just([1] * 600))


# ---------------------------------------------------------------------------------------------- sampling
def grammars() -> st.SearchStrategy:
    return st.sampled_from([
        {"regex": r"(Yes|No)\."}, {"regex": "(("}, {"json_schema": json.dumps({"type": "object"})},
        {"json_schema": "{not json"}, {"ebnf": 'root ::= "a" | "b"'}, {"ebnf": "root ::= "},
        {"stop_regex": r"\d"}, {"stop_regex": "[z"}, {"regex": ".*", "json_schema": "{}"},
    ])


def sampling_params() -> st.SearchStrategy:
    """One ``sampling_params`` object of /generate."""
    optional = {
        "top_p": sometimes(st.sampled_from([0.9, 1.0]), BAD_NUMBERS), "top_k": sometimes(st.sampled_from([1, 5, -1]),
                                                                                         HUGE_INTS),
        "min_p": sometimes(st.sampled_from([0.0, 0.05]), BAD_NUMBERS),
        "frequency_penalty": sometimes(st.sampled_from([0.0, 0.8, -2.0, 2.0]), BAD_NUMBERS),
        "presence_penalty": sometimes(st.sampled_from([0.0, 0.5]), BAD_NUMBERS),
        "repetition_penalty": sometimes(st.sampled_from([1.0, 1.3, 0.01, 2.0]), BAD_NUMBERS),
        "min_new_tokens": sometimes(st.integers(0, MAX_NEW_TOKENS), BAD_LENGTHS),
        "stop": sometimes(st.one_of(WORDS, st.lists(WORDS, max_size=3), st.just([""]))),
        "stop_token_ids": sometimes(st.lists(st.integers(0, VOCAB - 1), max_size=3), st.lists(HUGE_INTS, max_size=2)),
        "ignore_eos": sometimes(st.booleans()), "skip_special_tokens": sometimes(st.booleans()),
        "no_stop_trim": sometimes(st.booleans()), "n": sometimes(st.integers(1, MAX_SAMPLES), BAD_SAMPLES),
        "logit_bias": sometimes(st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=2),
                                st.dictionaries(st.sampled_from(["-1", "49152", "x", "1e3"]), st.floats(), max_size=2)),
        "sampling_seed": sometimes(st.integers(0, 2**31), HUGE_INTS),
        "stream_interval": sometimes(st.integers(1, 4), HUGE_INTS),
    }
    required = {"max_new_tokens": sometimes(st.integers(0, MAX_NEW_TOKENS), BAD_LENGTHS),
                "temperature": sometimes(st.sampled_from([0, 0, 0, 0.7, 1.0]), BAD_NUMBERS)}
    params = st.fixed_dictionaries(required, optional=optional)
    return st.one_of(params, params, params, params.flatmap(
        lambda drawn: grammars().map(lambda grammar: {**drawn, **grammar})))


# ---------------------------------------------------------------------------------------------- the routes
def generate_body() -> st.SearchStrategy:
    """A /generate body: one prompt or a batch (text, token ids, both, neither, embeddings), its sampling params (one
    object or a list), and the logprob, stream and id fields."""
    prompt = st.one_of(
        st.fixed_dictionaries({"text": TEXTS}), st.fixed_dictionaries({"input_ids": TOKEN_IDS}),
        st.fixed_dictionaries({"text": st.lists(TEXTS, min_size=1, max_size=MAX_PROMPTS)}),
        st.fixed_dictionaries({"input_ids": st.lists(TOKEN_IDS, min_size=1, max_size=MAX_PROMPTS)}),
        st.fixed_dictionaries({"text": TEXTS, "input_ids": TOKEN_IDS}), st.just({}),
        st.fixed_dictionaries({"input_embeds": st.sampled_from([[], [[]], [[0.5] * 576]])}),
        st.fixed_dictionaries({"text": st.lists(st.lists(TEXTS, max_size=2), max_size=2)}),  # nested lists
    )
    optional = {
        "stream": sometimes(st.booleans()), "return_logprob": sometimes(st.booleans()),
        "top_logprobs_num": sometimes(st.integers(0, 5), HUGE_INTS),
        "logprob_start_len": sometimes(st.integers(-1, 3), HUGE_INTS),
        "return_text_in_logprobs": sometimes(st.booleans()),
        "token_ids_logprob": sometimes(st.lists(st.integers(0, VOCAB - 1), max_size=3), st.lists(HUGE_INTS, max_size=2)),
        "rid": sometimes(st.text(st.characters(codec="ascii", categories=("Ll",)), min_size=1, max_size=4)),
        "return_hidden_states": sometimes(st.booleans()),
    }

    def with_params(prompt_fields: dict) -> st.SearchStrategy:
        count = len(next(iter(prompt_fields.values()), [])) if _is_batch(prompt_fields) else 1
        params = st.one_of(sampling_params(), sampling_params(),
                           st.lists(sampling_params(), min_size=count, max_size=count),  # one a prompt
                           st.lists(sampling_params(), max_size=MAX_PROMPTS + 1))  # whatever the count
        return st.fixed_dictionaries({**{k: st.just(v) for k, v in prompt_fields.items()}, "sampling_params": params},
                                     optional=optional)

    return prompt.flatmap(with_params)


def _is_batch(prompt_fields: dict) -> bool:
    value = prompt_fields.get("text", prompt_fields.get("input_ids"))
    return isinstance(value, list) and bool(value) and isinstance(value[0], (str, list))


def _openai_sampling() -> dict:
    return {
        "temperature": sometimes(st.sampled_from([0, 0, 0, 0.7]), BAD_NUMBERS),
        "top_p": sometimes(st.sampled_from([0.9, 1.0]), BAD_NUMBERS), "top_k": sometimes(st.sampled_from([1, -1]),
                                                                                         HUGE_INTS),
        "n": sometimes(st.integers(1, MAX_SAMPLES), BAD_SAMPLES),
        "stop": sometimes(st.one_of(WORDS, st.lists(WORDS, max_size=3))),
        "frequency_penalty": sometimes(st.sampled_from([0.0, 0.8]), BAD_NUMBERS),
        "presence_penalty": sometimes(st.sampled_from([0.0, 0.5]), BAD_NUMBERS),
        "seed": sometimes(st.integers(0, 2**31), HUGE_INTS),
        "stream": sometimes(st.booleans()),
        "stream_options": sometimes(st.fixed_dictionaries({"include_usage": st.booleans()})),
        "logit_bias": sometimes(st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=2)),
        "min_tokens": sometimes(st.integers(0, 4), BAD_LENGTHS),
        "response_format": sometimes(st.sampled_from([
            {"type": "text"}, {"type": "json_object"},
            {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}}},
            {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "nonsense"}}}, {"type": "?"}])),
    }


def completions_body() -> st.SearchStrategy:
    prompt = st.one_of(TEXTS, st.lists(TEXTS, min_size=1, max_size=MAX_PROMPTS), TOKEN_IDS,
                       st.lists(TOKEN_IDS, min_size=1, max_size=MAX_PROMPTS), st.just([]), JSON_VALUES)
    return st.fixed_dictionaries(
        {"model": sometimes(st.just("default")), "prompt": prompt,
         "max_tokens": sometimes(st.integers(1, MAX_NEW_TOKENS), BAD_LENGTHS | st.just(0))},
        optional={**_openai_sampling(), "echo": sometimes(st.booleans()),
                  "logprobs": sometimes(st.integers(0, 5), HUGE_INTS), "suffix": sometimes(WORDS)})


def chat_body() -> st.SearchStrategy:
    part = st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": TEXTS}),
                     st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries(
                         {"url": st.sampled_from(["data:x", "http://127.0.0.1:1/a.png"])})}), JSON_VALUES)
    content = st.one_of(TEXTS, TEXTS, st.lists(part, max_size=3), st.none(), JSON_VALUES)
    role = sometimes(st.sampled_from(["user", "user", "system", "assistant", "tool"]), st.text(max_size=5))
    message = st.fixed_dictionaries({"role": role, "content": content})
    messages = st.one_of(st.lists(message, min_size=1, max_size=3), st.just([]), JSON_VALUES)
    limit = sometimes(st.integers(1, MAX_NEW_TOKENS), BAD_LENGTHS | st.just(0))
    return st.fixed_dictionaries(
        {"model": sometimes(st.just("default")), "messages": messages},
        optional={**_openai_sampling(), "max_tokens": limit, "max_completion_tokens": limit,
                  "logprobs": sometimes(st.booleans()), "top_logprobs": sometimes(st.integers(0, 5), HUGE_INTS),
                  "continue_final_message": sometimes(st.booleans())},
    ).filter(lambda body: "max_tokens" in body or "max_completion_tokens" in body)  # SGLang's default: the context


RAW_BODIES = st.sampled_from([b"", b"{", b"[]", b"null", b"42", b'"text"', b"\xff\xfe\x00", b'{"text": "a"' * 3,
                              b'{"text": "Hello", "sampling_params": {"max_new_tokens": 2, "temperature": NaN}}'])


def sends() -> st.SearchStrategy:
    """One request to one of the routes, delivered whole most of the time."""
    body = st.one_of(
        st.tuples(st.just("/generate"), generate_body()), st.tuples(st.just("/generate"), generate_body()),
        st.tuples(st.just("/v1/completions"), completions_body()),
        st.tuples(st.just("/v1/chat/completions"), chat_body()),
        st.tuples(st.sampled_from(ROUTES), RAW_BODIES),
    )
    delivery = st.one_of(st.just(("whole", 1, 0.0)), st.just(("whole", 1, 0.0)), st.just(("whole", 1, 0.0)),
                         st.tuples(st.just("close_stream"), st.integers(0, 3), st.just(0.0)),
                         st.tuples(st.just("hang_up"), st.just(1), st.sampled_from([0.0, 0.05, 0.3])))
    return st.builds(lambda routed, how: Send(routed[0], routed[1], *how), body, delivery)
