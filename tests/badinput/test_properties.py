"""Property-based bad input (Hypothesis): every reader and every number option answers arbitrary input with a
value it accepts or one ``SpecError`` / ``ValueError`` line, never another exception."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from corpus import GOOD_COSTS, GOOD_HEADER, head_with_header
from sglang_spec.cli.parser import MAX_TEMPERATURE, integer, number, temperature
from sglang_spec.errors import SpecError
from sglang_spec.mtp.checkpoint import read_mtp_header
from sglang_spec.sampling import TEMPERATURE_FLOOR, SamplingParams
from sglang_spec.train.prompts import _jsonl_prompt
from sglang_spec.train.traffic import _openai_record, import_sglang_log, parse_record
from sglang_spec.costs import CostCurve
from sglang_spec.tree.profile import AcceptanceProfile

FAST = settings(max_examples=150, deadline=None)

scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=10**300, max_value=10**400)
           | st.floats() | st.text(max_size=6))
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=16,
)


def one_line(error: Exception) -> bool:
    return "\n" not in str(error) and len(str(error)) < 500


@FAST
@given(json_values | st.fixed_dictionaries({"rank_acceptance": json_values}))
def test_profiles(obj):
    try:
        profile = AcceptanceProfile.from_obj(obj)
    except SpecError as error:
        assert one_line(error)
        return
    assert all(0 <= value <= 1 and math.isfinite(value) for row in profile.rank_acceptance for value in row)


@FAST
@given(st.dictionaries(st.sampled_from([*GOOD_COSTS, "other"]), json_values, max_size=7)
       .map(lambda changes: {**GOOD_COSTS, **changes}) | json_values)
def test_cost_curves(data):
    try:
        costs = CostCurve.from_json(json.loads(json.dumps(data)))  # keys as JSON has them: strings
    except SpecError as error:
        assert one_line(error)
        return
    assert all(seconds > 0 and math.isfinite(seconds) for seconds in costs.verify.values())


traffic_like = st.fixed_dictionaries({}, optional={
    "id": json_values, "domain": json_values, "completion": json_values, "prompt": json_values,
    "messages": json_values | st.lists(st.dictionaries(st.sampled_from(["role", "content"]), json_values)),
    "meta": json_values, "source": json_values, "request": json_values, "response": json_values,
})


@FAST
@given(traffic_like | json_values)
def test_traffic_lines(data):
    for parse in (lambda d: parse_record(d, "x"), lambda d: _openai_record(d, "x", "general", "log")):
        try:
            record = parse(data)
        except ValueError as error:
            assert one_line(error)
            continue
        record.to_json().encode("utf-8")


@FAST
@given(st.fixed_dictionaries({"event": st.sampled_from(["request.finished", "request.received"])},
                              optional={"obj": json_values, "out": json_values, "rid": json_values}) | json_values)
def test_sglang_log_lines(tmp_path_factory, event):
    path = tmp_path_factory.mktemp("log") / "server.log"
    path.write_text("prefix " + json.dumps(event) + "\n")
    records, problems, _ = import_sglang_log(path)
    assert all(one_line(ValueError(str(problem))) for problem in problems)
    for record in records:
        record.to_json().encode("utf-8")


@FAST
@given(traffic_like | json_values)
def test_prompt_file_lines(data):
    try:
        _jsonl_prompt(data, "p/1")
    except ValueError as error:
        assert one_line(error)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.sampled_from([*GOOD_HEADER, "other"]), json_values, max_size=8)
       .map(lambda changes: {**GOOD_HEADER, **changes}) | json_values)
def test_head_headers(tmp_path_factory, header):
    path = tmp_path_factory.mktemp("head") / "head.safetensors"
    path.write_bytes(head_with_header(header))
    try:
        read_mtp_header(path)
    except SpecError as error:
        assert one_line(error)


@FAST
@given(st.text(max_size=12) | st.floats().map(str) | st.integers().map(str))
def test_number_options(text):
    for parse, check in (
        (temperature, lambda v: v == 0 or TEMPERATURE_FLOOR <= v <= MAX_TEMPERATURE),
        (number(0, 1, low_open=True), lambda v: 0 < v <= 1),
        (integer(1, 4096), lambda v: 1 <= v <= 4096),
    ):
        try:
            value = parse(text)
        except argparse.ArgumentTypeError as error:
            assert one_line(error)
            continue
        assert math.isfinite(value) and check(value)


@FAST
@given(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5), st.floats())
def test_sampling_params(temperature_value, top_k, top_p):
    try:
        params = SamplingParams(temperature=temperature_value, top_k=top_k, top_p=top_p)
    except SpecError as error:
        assert one_line(error)
        return
    assert params.temperature == 0 or params.temperature >= TEMPERATURE_FLOOR


numbers_as_text = (st.integers().map(str) | st.floats().map(repr) | st.text(max_size=8)
                   | st.sampled_from(["1e23", "1e-40", "-0", "nan", "inf", "0x10", "1_000", " 7 ", "１"]))


@settings(max_examples=120, deadline=None)
@given(st.dictionaries(st.sampled_from(["--temperature", "--top-k", "--top-p", "--budget", "--depth", "--topk",
                                        "--seed", "--max-new-tokens"]), numbers_as_text, max_size=4))
def test_generate_options_parse_or_fail_in_one_line(options):
    """What `generate` checks before loading a model: a usage error (one line, exit 2), a SpecError (one line),
    or settings every later step accepts (the sampling tensors included)."""
    import torch

    from sglang_spec.cli import build_parser
    from sglang_spec.tree.policies import TreePolicy
    from sglang_spec.tree.profile import AcceptanceProfile

    argv = ["generate", "--model", "tiny-deepseek", "--prompt", "x"]
    for flag, value in options.items():
        argv += [f"{flag}={value}"]
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = build_parser().parse_args(argv)
    except SystemExit as exit:
        err = stderr.getvalue()
        assert exit.code == 2 and err.count("\n") == 1 and err.startswith("error: ")
        return
    try:
        sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
        TreePolicy(args.policy, budget=args.budget, depth=args.depth, topk=args.topk,
                   profile=AcceptanceProfile.load(None))
    except SpecError as error:
        assert one_line(error)
        return
    torch.full((1,), sampling.top_k, dtype=torch.int64)
    torch.Generator().manual_seed(args.seed)
    assert args.max_new_tokens >= 1
