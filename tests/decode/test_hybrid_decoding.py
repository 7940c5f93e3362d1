"""Hybrid and lookup-only trees through the reference decoder: greedy output equals plain decoding token for
token (tiny DeepSeek-V3 on transformers' forward, SmolLM2 on the static-cache runner), the lookup policy never runs
the head, every step records who drafted each token, and the decoder's calibration learns online."""

import copy

import numpy as np
import pytest

from sglang_spec.decode.decoder import GenerationConfig, SpeculativeDecoder, generate_plain
from sglang_spec.errors import SpecError
from sglang_spec.models.toy_language import ToyLanguage
from sglang_spec.costs import CostCurve
from sglang_spec.tree.policies import TreePolicy
from sglang_spec.tree.profile import SOURCE_BOTH, SOURCE_LOOKUP, SOURCE_MTP
from test_greedy_identity import check_identity, tiny_prompts


def repetitive_prompts(count=12, seed=0):
    """Toy-language text with repeats, so the context has something to copy (and random prompts, where it
    mostly has not)."""
    language = ToyLanguage(512, seed=123 + seed)
    rng = np.random.default_rng(seed)
    prompts = []
    for index in range(count):
        piece = language.sample(1, int(rng.integers(4, 12)))[0].tolist()
        prompts.append(piece * int(rng.integers(2, 4)) + piece[: int(rng.integers(0, len(piece)))])
    return prompts + tiny_prompts(count // 2, seed=seed)


def synthetic_costs(verify_step):
    return CostCurve({n: 0.01 + verify_step * (n - 1) for n in (1, 2, 4, 8, 16, 32)}, draft_level=0.001,
                     step_overhead=0.0005, prefix=64, device="synthetic", plain_token=0.0105)


POLICIES = [
    TreePolicy("lookup", budget=8, depth=8),
    TreePolicy("hybrid", budget=10, depth=6, mtp_levels=2, topk=3),
    TreePolicy("hybrid", budget=16, depth=8, mtp_levels=3, topk=3, lookup_width=3, costs=synthetic_costs(2e-4)),
]


@pytest.mark.parametrize("policy", POLICIES, ids=["lookup", "hybrid", "adaptive"])
@pytest.mark.parametrize("batch_size", [1, 5])
def test_tiny_deepseek_greedy_identity(tiny, policy, batch_size, near_tie_report):
    loaded, head = tiny
    outputs = check_identity(loaded.model, head, repetitive_prompts(), policy, GenerationConfig(max_new_tokens=24),
                             batch_size, near_tie_report)
    sources = [s for request in outputs for step in request.steps[1:] for s in step.sources[:-1]]
    assert any(s & SOURCE_LOOKUP for s in sources)  # the context's candidates really get accepted
    if policy.uses_head:
        assert any(s == SOURCE_MTP for s in sources) and any(s == SOURCE_BOTH for s in sources)
    else:
        assert set(sources) == {SOURCE_LOOKUP}
    lengths = [length for request in outputs for length in request.accept_lengths]
    assert np.mean(lengths) > (2 if policy.uses_head else 1.2)


def test_step_records_and_online_calibration(tiny):
    loaded, head = tiny
    decoder = SpeculativeDecoder(loaded.model, head, TreePolicy("hybrid", budget=8, depth=6))
    before = copy.deepcopy(decoder.tree_drafter.counts.to_obj())
    output = decoder.generate(repetitive_prompts(4), GenerationConfig(max_new_tokens=20))
    for request in output.requests:
        steps = request.steps
        assert [t for step in steps for t in step.tokens][: len(request.tokens)] == request.tokens
        assert steps[0].tree_nodes == 0 and all(step.sources[-1] == 0 for step in steps)
        assert [len(step.tokens) for step in steps[1:]] == request.accept_lengths
        times = request.token_times()
        assert len(times) == len(request.tokens) and times == sorted(times)
    after = decoder.tree_drafter.counts.to_obj()
    offered = lambda obj: sum(cell[1] for row in obj["lookup"] for cell in row) + sum(c[1] for c in obj["both"])
    assert offered(after) > offered(before)  # every offered lookup candidate was counted


def test_the_lookup_policy_needs_no_head(tiny):
    loaded, _ = tiny
    decoder = SpeculativeDecoder(loaded.model, None, TreePolicy("lookup", budget=6, depth=6))
    assert decoder.head_drafter is None
    prompts = repetitive_prompts(3)
    ours = decoder.generate(prompts, GenerationConfig(max_new_tokens=16))
    plain = generate_plain(loaded.model, prompts, GenerationConfig(max_new_tokens=16))
    assert [r.tokens for r in ours.requests] == [r.tokens for r in plain.requests]
    assert ours.stats.draft_forwards == 0
    with pytest.raises(SpecError, match="drafts with an MTP head"):
        SpeculativeDecoder(loaded.model, None, TreePolicy("hybrid", budget=6, depth=6))


@pytest.fixture(scope="module")
def smollm2_case(smollm2):
    """HumanEval 120-125 and five chat prompts, their greedy config, and plain decoding's answers (decoded once for
    every policy and batch size below)."""
    from test_smollm2_identity import CHAT
    from sglang_spec.train.generate_traffic import prompt_tokens
    from sglang_spec.train.prompts import humaneval_prompts

    loaded, _ = smollm2
    prompts = [prompt_tokens(loaded, spec) for spec in humaneval_prompts(120, 125)]
    prompts += [loaded.encode_prompt(text) for text in CHAT[:5]]
    config = GenerationConfig(max_new_tokens=24, eos_token_ids=loaded.eos_token_ids)
    return prompts, config, generate_plain(loaded.model, prompts, config)


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.parametrize("name", ["lookup", "hybrid"])
def test_smollm2_greedy_identity(smollm2, smollm2_case, name, near_tie_report):
    loaded, head = smollm2
    prompts, config, plain = smollm2_case
    policy = TreePolicy(name, budget=12, depth=8, mtp_levels=2)
    outputs = check_identity(loaded.model, head, prompts, policy, config, batch_size=1, report=near_tie_report,
                             plain=plain)
    check_identity(loaded.model, head, prompts, policy, config, batch_size=4, report=near_tie_report, plain=plain)
    lengths = [length for request in outputs for length in request.accept_lengths]
    assert sum(lengths) / len(lengths) > 1.3


@pytest.mark.parametrize("batch_size", [1, 3])
def test_lean_plain_stretches_keep_greedy_identity_and_the_head_in_step(tiny, batch_size, near_tie_report,
                                                                        monkeypatch):
    """--auto's switch (decode/switch.py) told that plain decoding is always faster: stretches of lean plain steps
    (no tree, no head forward) between probes; output still equals plain decoding, and after every stretch the
    head, caught up in one forward, drafts tokens that are accepted again."""
    from sglang_spec.decode.switch import SpeculationSwitch

    monkeypatch.setattr(SpeculationSwitch, "plain_rate", lambda self: 1e-9)
    loaded, head = tiny
    policy = TreePolicy("hybrid", budget=10, depth=6, mtp_levels=2, topk=3, costs=synthetic_costs(2e-4))
    outputs = check_identity(loaded.model, head, tiny_prompts(6, seed=2), policy, GenerationConfig(max_new_tokens=160),
                             batch_size, near_tie_report)
    after_stretch = []
    for request in outputs:
        nodes = [step.tree_nodes for step in request.steps[1:]]
        # after a window of 8 speculative steps (one may itself be budget 0) 2 lean steps measure plain decoding;
        # a probe of 4 then loses too and a stretch of 8 follows
        assert nodes[8:10] == [1, 1] and any(n > 1 for n in nodes[:8])
        assert nodes[14:22] == [1] * 8 and any(n > 1 for n in nodes[10:14])
        after_stretch += [s for step, previous in zip(request.steps[2:], nodes) if previous == 1 and step.tree_nodes > 1
                          for s in step.sources]
    assert any(s & SOURCE_MTP for s in after_stretch)


def test_the_head_caught_up_in_one_forward_drafts_as_if_it_had_followed_every_step(tiny):
    """Pairs appended to the head's cache one commit at a time or all in one (what a lean stretch defers) give
    the same next-root draft distribution."""
    import torch

    from sglang_spec.mtp.expansion import MTPDrafter

    loaded, head = tiny
    drafter = MTPDrafter(head)
    generator = torch.Generator().manual_seed(0)
    hidden_size = loaded.model.config.hidden_size
    prompt_hidden = torch.randn(12, hidden_size, generator=generator)
    prompt_tokens = torch.randint(loaded.model.config.vocab_size, (12,), generator=generator)
    later_hidden = torch.randn(6, hidden_size, generator=generator)
    later_tokens = torch.randint(loaded.model.config.vocab_size, (6,), generator=generator)
    stepwise = drafter.prefill(prompt_hidden, prompt_tokens)
    for index in range(6):
        drafter.commit(stepwise, later_hidden[index : index + 1], later_tokens[index : index + 1])
    at_once = drafter.prefill(prompt_hidden, prompt_tokens)
    drafter.commit(at_once, later_hidden, later_tokens)
    assert at_once.committed == stepwise.committed == 18
    torch.testing.assert_close(at_once.root_logits, stepwise.root_logits, rtol=1e-4, atol=1e-4)
    # and a wrong catch-up (a pair missing) is told apart
    short = drafter.prefill(prompt_hidden, prompt_tokens)
    drafter.commit(short, later_hidden[1:], later_tokens[1:])
    assert not torch.allclose(short.root_logits, stepwise.root_logits, rtol=1e-4, atol=1e-4)
