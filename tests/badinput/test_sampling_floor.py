"""Temperatures below the documented floor (``TEMPERATURE_FLOOR``, 1e-5) are greedy everywhere sampling happens:
never a NaN distribution, never all-zero tokens."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_spec.cli import main
from sglang_spec.kernels.verify_accept import target_tokens, target_tokens_reference
from sglang_spec.sampling import TEMPERATURE_FLOOR, SamplingParams, target_probs_from_logits
from reference_rules import verify_typical
from sglang_spec.tree.batch import TreeBatch
from sglang_spec.tree.token_tree import TokenTree


@pytest.mark.parametrize("temperature", [1e-40, 3e-39, 1e-30, 1e-6, 0.0])
def test_tiny_temperatures_are_greedy_in_sampling_params(temperature):
    assert SamplingParams(temperature=temperature).greedy


@settings(max_examples=60, deadline=None)
@given(st.floats(min_value=0, max_value=2 * TEMPERATURE_FLOOR, allow_subnormal=True), st.integers(0, 2**31 - 1))
def test_target_probs_never_nan(temperature, seed):
    logits = torch.randn(2, 3, 50, generator=torch.Generator().manual_seed(seed)) * 30
    probs = target_probs_from_logits(logits, torch.full((2,), temperature), torch.zeros(2, dtype=torch.int64),
                                     torch.ones(2))
    assert torch.isfinite(probs).all()
    assert torch.allclose(probs.sum(-1), torch.ones(2, 3))
    if temperature < TEMPERATURE_FLOOR:
        assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and torch.equal(probs.max(-1).values, torch.ones(2, 3))


@pytest.mark.parametrize("launcher", [target_tokens, target_tokens_reference])
def test_kernel_and_reference_take_the_argmax_below_the_floor(launcher):
    batch, nodes, vocab = 3, 4, 97
    logits = torch.randn(batch * nodes, vocab, generator=torch.Generator().manual_seed(0)) * 10
    temperature = torch.tensor([1e-40, 3e-39, 5e-6], dtype=torch.float32)
    coins = torch.rand(batch * nodes, generator=torch.Generator().manual_seed(1))
    tokens = launcher(logits, nodes, temperature, torch.zeros(batch, dtype=torch.int64), torch.ones(batch), coins,
                      sample=True)
    assert torch.equal(tokens, logits.argmax(-1))


def test_typical_acceptance_below_the_floor_is_greedy():
    tree = TokenTree.from_parents([-1, 0, 1], tokens=torch.tensor([5, 1, 2]))
    batch = TreeBatch.from_trees([tree])
    logits = torch.full((1, 3, 8), -5.0)
    logits[0, 0, 1] = logits[0, 1, 2] = logits[0, 2, 3] = 5.0  # the target agrees with the chain, then says 3
    result = verify_typical(batch, logits, temperature=1e-40, epsilon=0.09, alpha=0.3)
    assert int(result.accept_length[0]) == 3 and result.tokens(0) == [1, 2, 3]


def cli_env() -> dict[str, str]:
    """The test session's environment with the torchvision stand-in on the path, as conftest.py has it."""
    boot = str(Path(__file__).resolve().parents[2] / "sglang_spec" / "sglang_plugin" / "cpu" / "boot")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([boot, os.environ.get("PYTHONPATH", "")])}


def _generate(capsys, temperature: str) -> dict:
    code = main(["generate", "--model", "tiny-deepseek", "--no-chat", "--prompt", "abc", "--temperature",
                 temperature, "--max-new-tokens", "24", "--json"])
    assert code == 0
    return json.loads(capsys.readouterr().out)


def test_generate_at_1e40_equals_greedy(tiny, capsys):
    """The issue's reproduction: the output was all token 0; now it is greedy decoding's."""
    greedy = _generate(capsys, "0")
    for temperature in ("1e-40", "3e-39", "1e-6"):
        report = _generate(capsys, temperature)
        assert report["tokens"] == greedy["tokens"] and report["temperature"] == 0.0
    assert len(set(greedy["tokens"])) > 1


def test_generate_at_1e40_through_the_console_script(tiny):
    """End to end, as a user types it (a new process, the installed entry point)."""
    command = [sys.executable, "-m", "sglang_spec.cli", "generate", "--model", "tiny-deepseek", "--no-chat",
               "--prompt", "abc", "--max-new-tokens", "12", "--json", "--check"]
    greedy = subprocess.run(command + ["--temperature", "0"], capture_output=True, text=True, env=cli_env())
    tiny_t = subprocess.run(command + ["--temperature", "1e-40"], capture_output=True, text=True, env=cli_env())
    assert greedy.returncode == 0 and tiny_t.returncode == 0, tiny_t.stderr
    ours, theirs = json.loads(tiny_t.stdout), json.loads(greedy.stdout)
    assert ours["tokens"] == theirs["tokens"] and ours["identical_to_baseline"] is True
    assert not all(token == 0 for token in ours["tokens"])
    assert all(math.isfinite(ours[key]) for key in ("accept_length_mean", "tokens_per_second"))
