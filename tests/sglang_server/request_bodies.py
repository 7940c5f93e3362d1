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

    def exact(self) -> bool:
        """Whether a tree server's answer must equal plain decoding's: every prompt decodes greedily (temperature 0
        or top_k 1), and none asks for ``ignore_eos`` under a grammar. (There SGLang's speculative decoding, its own
        EAGLE too, ends the output where the grammar ends, while plain decoding goes on past the EOS.)"""
        body = self.body
        if not isinstance(body, dict):
            return True  # refused before any decoding: the refusals must be equal too
        if self.route == "/generate":
            params = body.get("sampling_params")
            return all(_exact(p) for p in (params if isinstance(params, list) else [params]))
        response_format = body.get("response_format")
        structured = isinstance(response_format, dict) and response_format.get("type") in ("json_object", "json_schema")
        return _exact({**body, "json_schema": True} if structured else body)


GRAMMARS = ("regex", "json_schema", "ebnf", "structural_tag")


def _exact(params: Any) -> bool:
    if not isinstance(params, dict):
        return True  # refused
    temperature, top_k = params.get("temperature"), params.get("top_k")
    grammar_past_eos = params.get("ignore_eos") is True and any(params.get(name) for name in GRAMMARS)
    return (temperature == 0 or top_k == 1) and not grammar_past_eos


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


UNICODE = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=24)
SURROGATES = st.text(st.characters(categories=("Cs",)), min_size=1, max_size=2)
WORDS = st.sampled_from(["Hello", "The capital of France is", "def add(a, b):\n    return", "1, 2, 3, 4,",
                         "Write a haiku about rain.", "日本語で答えて: 空は", "🙂🙃 emoji",
                         " x", "\n\nQ:", "<|im_end|>"])


class Fields:
    """The strategies of one kind of body: ``hostile`` False, every field as its schema takes it (the body is
    served, so a greedy one is compared with plain decoding); True, each field hostile about one draw in five and
    the prompts empty, huge or unencodable at times."""

    def __init__(self, hostile: bool) -> None:
        self.hostile = hostile
        good_texts = st.one_of(WORDS, WORDS, UNICODE.filter(str.strip))
        self.texts = st.one_of(good_texts, st.just(""), SURROGATES, st.just("lorem ipsum " * 400)) if hostile \
            else good_texts
        good_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
        self.ids = st.one_of(good_ids, st.just([]), st.lists(st.one_of(st.integers(0, VOCAB - 1), HUGE_INTS),
                                                             min_size=1, max_size=4), st.just([1] * 600)) if hostile \
            else good_ids

    def field(self, good: st.SearchStrategy, bad: st.SearchStrategy = JSON_VALUES) -> st.SearchStrategy:
        """``good``; in a hostile body ``bad`` about one draw in five."""
        return st.one_of(good, good, good, good, bad) if self.hostile else good

    # ------------------------------------------------------------------------------------------ /generate
    def grammar(self) -> st.SearchStrategy:
        good = [{"regex": r"(Yes|No)\."}, {"json_schema": json.dumps({"type": "object"})},
                {"ebnf": 'root ::= "a" | "b"'}, {"stop_regex": r"\d"}]
        bad = [{"regex": "(("}, {"json_schema": "{not json"}, {"ebnf": "root ::= "}, {"stop_regex": "[z"},
               {"regex": ".*", "json_schema": "{}"}]
        return st.sampled_from(good + bad if self.hostile else good)

    def sampling_params(self) -> st.SearchStrategy:
        """One ``sampling_params`` object of /generate."""
        field = self.field
        optional = {
            "top_p": field(st.sampled_from([0.9, 1.0]), BAD_NUMBERS),
            "top_k": field(st.sampled_from([1, 5, -1]), HUGE_INTS),
            "min_p": field(st.sampled_from([0.0, 0.05]), BAD_NUMBERS),
            "frequency_penalty": field(st.sampled_from([0.0, 0.8, -2.0, 2.0]), BAD_NUMBERS),
            "presence_penalty": field(st.sampled_from([0.0, 0.5]), BAD_NUMBERS),
            "repetition_penalty": field(st.sampled_from([1.0, 1.3, 0.5, 2.0]), BAD_NUMBERS),
            "min_new_tokens": field(st.integers(0, MAX_NEW_TOKENS // 2), BAD_LENGTHS),
            "stop": field(st.one_of(WORDS, st.lists(WORDS, max_size=3), st.just([""]))),
            "stop_token_ids": field(st.lists(st.integers(0, VOCAB - 1), max_size=3), st.lists(HUGE_INTS, max_size=2)),
            "ignore_eos": field(st.booleans()), "skip_special_tokens": field(st.booleans()),
            "no_stop_trim": field(st.booleans()), "n": field(st.integers(1, MAX_SAMPLES), BAD_SAMPLES),
            "logit_bias": field(st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=2),
                                st.dictionaries(st.sampled_from(["-1", "49152", "x", "1e3"]), st.floats(), max_size=2)),
            "sampling_seed": field(st.integers(0, 2**31), HUGE_INTS),
            "stream_interval": field(st.integers(1, 4), HUGE_INTS),
        }
        required = {"max_new_tokens": field(st.integers(0, MAX_NEW_TOKENS), BAD_LENGTHS),
                    "temperature": field(st.sampled_from([0, 0, 0, 0.7, 1.0]), BAD_NUMBERS)}
        params = st.fixed_dictionaries(required, optional=optional)
        return st.one_of(params, params, params, params.flatmap(
            lambda drawn: self.grammar().map(lambda grammar: {**drawn, **grammar})))

    def generate_body(self) -> st.SearchStrategy:
        """A /generate body: one prompt or a batch (text, token ids; hostile: both, neither, embeddings, nested
        lists), its sampling params (one object, a list of one a prompt; hostile: a list of any length), and the
        logprob, stream and id fields."""
        field, texts, ids = self.field, self.texts, self.ids
        prompts = [st.fixed_dictionaries({"text": texts}), st.fixed_dictionaries({"input_ids": ids}),
                   st.fixed_dictionaries({"text": st.lists(texts, min_size=1, max_size=MAX_PROMPTS)}),
                   st.fixed_dictionaries({"input_ids": st.lists(ids, min_size=1, max_size=MAX_PROMPTS)})]
        if self.hostile:
            prompts += [st.fixed_dictionaries({"text": texts, "input_ids": ids}), st.just({}),
                        st.fixed_dictionaries({"input_embeds": st.sampled_from([[], [[]], [[0.5] * 576]])}),
                        st.fixed_dictionaries({"text": st.lists(st.lists(texts, max_size=2), max_size=2)})]
        optional = {
            "stream": field(st.booleans()), "return_logprob": field(st.booleans()),
            "top_logprobs_num": field(st.integers(0, 5), HUGE_INTS),
            "logprob_start_len": field(st.integers(-1, 0), HUGE_INTS),
            "return_text_in_logprobs": field(st.booleans()),
            "token_ids_logprob": field(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3),
                                       st.lists(HUGE_INTS, max_size=2)),
            "rid": field(st.text(st.characters(codec="ascii", categories=("Ll",)), min_size=1, max_size=4)),
        }
        if self.hostile:
            optional["return_hidden_states"] = field(st.booleans())

        def with_params(prompt_fields: dict) -> st.SearchStrategy:
            count = len(next(iter(prompt_fields.values()), [])) if _is_batch(prompt_fields) else 1
            params = [self.sampling_params(), self.sampling_params()]
            if count > 1:
                params.append(st.lists(self.sampling_params(), min_size=count, max_size=count))  # one a prompt
            if self.hostile:
                params.append(st.lists(self.sampling_params(), max_size=MAX_PROMPTS + 1))  # whatever the count
            return st.fixed_dictionaries({**{k: st.just(v) for k, v in prompt_fields.items()},
                                          "sampling_params": st.one_of(*params)}, optional=optional)

        return st.one_of(*prompts).flatmap(with_params)

    # ------------------------------------------------------------------------------------------ OpenAI
    def openai_sampling(self) -> dict:
        field = self.field
        formats = [{"type": "text"}, {"type": "json_object"},
                   {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}}}]
        if self.hostile:
            formats += [{"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "nonsense"}}},
                        {"type": "?"}]
        return {
            "temperature": field(st.sampled_from([0, 0, 0, 0.7]), BAD_NUMBERS),
            "top_p": field(st.sampled_from([0.9, 1.0]), BAD_NUMBERS), "top_k": field(st.sampled_from([1, -1]),
                                                                                     HUGE_INTS),
            "n": field(st.integers(1, MAX_SAMPLES), BAD_SAMPLES),
            "stop": field(st.one_of(WORDS, st.lists(WORDS, max_size=3))),
            "frequency_penalty": field(st.sampled_from([0.0, 0.8]), BAD_NUMBERS),
            "presence_penalty": field(st.sampled_from([0.0, 0.5]), BAD_NUMBERS),
            "seed": field(st.integers(0, 2**31), HUGE_INTS),
            "stream": field(st.booleans()),
            "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
            "logit_bias": field(st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=2)),
            "min_tokens": field(st.integers(0, 4), BAD_LENGTHS),
            "response_format": field(st.sampled_from(formats)),
        }

    def completions_body(self) -> st.SearchStrategy:
        field, texts, ids = self.field, self.texts, self.ids
        prompts = [texts, st.lists(texts, min_size=1, max_size=MAX_PROMPTS), ids,
                   st.lists(ids, min_size=1, max_size=MAX_PROMPTS)]
        prompts += [st.just([]), JSON_VALUES] if self.hostile else []
        return st.fixed_dictionaries(
            {"model": field(st.just("default")), "prompt": st.one_of(*prompts),
             "max_tokens": field(st.integers(1, MAX_NEW_TOKENS), BAD_LENGTHS | st.just(0))},
            optional={**self.openai_sampling(), "echo": field(st.booleans()),
                      "logprobs": field(st.integers(0, 5), HUGE_INTS), "suffix": field(WORDS)})

    def chat_body(self) -> st.SearchStrategy:
        field, texts = self.field, self.texts
        parts = [st.fixed_dictionaries({"type": st.just("text"), "text": texts})]
        if self.hostile:
            parts += [st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries(
                {"url": st.sampled_from(["data:x", "http://127.0.0.1:1/a.png"])})}), JSON_VALUES]
        contents = [texts, texts, st.lists(st.one_of(*parts), min_size=1, max_size=3)]
        contents += [st.none(), JSON_VALUES] if self.hostile else []
        role = field(st.sampled_from(["user", "user", "system", "assistant"]), st.text(max_size=5) | st.just("tool"))
        message = st.fixed_dictionaries({"role": role, "content": st.one_of(*contents)})
        messages = st.lists(message, min_size=1, max_size=3).filter(lambda m: m[-1]["role"] != "system")
        if self.hostile:
            messages = st.one_of(messages, st.just([]), JSON_VALUES)
        limit = field(st.integers(1, MAX_NEW_TOKENS), BAD_LENGTHS | st.just(0))
        return st.fixed_dictionaries(
            {"model": field(st.just("default")), "messages": messages},
            optional={**self.openai_sampling(), "max_tokens": limit, "max_completion_tokens": limit,
                      "logprobs": field(st.booleans()), "top_logprobs": field(st.integers(0, 5), HUGE_INTS),
                      "continue_final_message": field(st.booleans())},
        ).filter(lambda body: "max_tokens" in body or "max_completion_tokens" in body)  # SGLang's default: the context


def _is_batch(prompt_fields: dict) -> bool:
    value = prompt_fields.get("text", prompt_fields.get("input_ids"))
    return isinstance(value, list) and bool(value) and isinstance(value[0], (str, list))


RAW_BODIES = st.sampled_from([b"", b"{", b"[]", b"null", b"42", b'"text"', b"\xff\xfe\x00", b'{"text": "a"' * 3,
                              b'{"text": "Hello", "sampling_params": {"max_new_tokens": 2, "temperature": NaN}}'])


def bodies(fields: Fields) -> st.SearchStrategy:
    """(route, body) of one kind (``fields``), /generate twice as often as each OpenAI route."""
    routed = [st.tuples(st.just("/generate"), fields.generate_body()),
              st.tuples(st.just("/generate"), fields.generate_body()),
              st.tuples(st.just("/v1/completions"), fields.completions_body()),
              st.tuples(st.just("/v1/chat/completions"), fields.chat_body())]
    return st.one_of(*routed, st.tuples(st.sampled_from(ROUTES), RAW_BODIES)) if fields.hostile else st.one_of(*routed)


def sends() -> st.SearchStrategy:
    """One request to one of the routes, a served body or a hostile one about as often, delivered whole most of the
    time."""
    body = st.one_of(bodies(Fields(hostile=False)), bodies(Fields(hostile=True)))
    delivery = st.one_of(st.just(("whole", 1, 0.0)), st.just(("whole", 1, 0.0)), st.just(("whole", 1, 0.0)),
                         st.tuples(st.just("close_stream"), st.integers(0, 3), st.just(0.0)),
                         st.tuples(st.just("hang_up"), st.just(1), st.sampled_from([0.0, 0.05, 0.3])))
    return st.builds(lambda routed, how: Send(routed[0], routed[1], *how), body, delivery)
