"""``--speculative-tree-mla-verify``: parsed with the other tree options, and refused in one line (SpecError, which
the start-up hook turns into one ``error:`` line) where the cascade cannot serve: a model without MLA, a target
back-end it does not sit on, a draft back-end that takes no tree. Through launch_server:
``tests/sglang_server/test_mla_tree_verify_server.py``."""

from __future__ import annotations

import argparse

import pytest

from sglang_spec.errors import SpecError
from sglang_spec.sglang_plugin.options import (
    TreeServerOptions,
    add_arguments,
    from_namespace,
    validate_backends,
    validate_mla_verify_cache,
)

CASCADE = TreeServerOptions("eagle", 10, 4, 4, 4, mla_verify="flashinfer")


def test_the_option_parses_and_needs_a_tree_policy():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    options = from_namespace(parser.parse_args(["--speculative-tree-policy", "eagle",
                                                "--speculative-tree-mla-verify", "flashinfer"]))
    assert options is not None and options.mla_verify == "flashinfer"
    assert from_namespace(parser.parse_args(["--speculative-tree-policy", "eagle"])).mla_verify is None
    with pytest.raises(SpecError, match="--speculative-tree-mla-verify needs --speculative-tree-policy"):
        from_namespace(parser.parse_args(["--speculative-tree-mla-verify", "flashinfer"]))
    with pytest.raises(SystemExit):  # argparse's own one line for an unknown choice
        parser.parse_args(["--speculative-tree-policy", "eagle", "--speculative-tree-mla-verify", "trtllm"])


@pytest.mark.parametrize(
    "backends, is_mla, device, message",
    [
        (dict(attention_backend="intel_amx"), False, "cpu", "serves MLA models"),
        (dict(attention_backend="fa3", speculative_draft_attention_backend="triton"), True, "cuda",
         "attention-backend is fa3; use --attention-backend flashinfer"),
        (dict(attention_backend="flashinfer"), True, "cuda", "add --speculative-draft-attention-backend fa3 or triton"),
        (dict(attention_backend="flashinfer", decode_attention_backend="trtllm_mla",
              speculative_draft_attention_backend="fa3"), True, "cuda", "decode-attention-backend is trtllm_mla"),
        (dict(attention_backend="torch_native"), True, "cpu", "use --attention-backend intel_amx"),
    ],
    ids=["not-mla", "target-not-flashinfer", "draft-on-flashinfer", "decode-elsewhere", "cpu-not-intel-amx"],
)
def test_refused_where_the_cascade_cannot_serve(backends, is_mla, device, message):
    with pytest.raises(SpecError, match=message):
        validate_backends(CASCADE, backends, is_mla, device)


def test_accepted_where_it_serves():
    validate_backends(CASCADE, dict(attention_backend="intel_amx"), True, "cpu")
    validate_backends(CASCADE, dict(attention_backend="flashinfer", speculative_draft_attention_backend="fa3"),
                      True, "cuda")
    # without the option, FlashInfer is still no tree back-end for an MLA model
    with pytest.raises(SpecError, match="cannot run tree speculation for an MLA model"):
        validate_backends(TreeServerOptions("eagle", 10, 4, 4, 4),
                          dict(attention_backend="flashinfer", speculative_draft_attention_backend="fa3"), True, "cuda")


def test_a_quantized_kv_cache_is_refused():
    with pytest.raises(SpecError, match="--kv-cache-dtype is fp8_e4m3; drop --kv-cache-dtype or the option"):
        validate_mla_verify_cache(CASCADE, "fp8_e4m3")
    for unquantized in (None, "auto", "bfloat16"):
        validate_mla_verify_cache(CASCADE, unquantized)
    validate_mla_verify_cache(TreeServerOptions("eagle", 10, 4, 4, 4), "fp8_e4m3")  # not ours to refuse
