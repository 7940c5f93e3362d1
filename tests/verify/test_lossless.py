"""Losslessness of the sampling rules: exact enumeration at one node, then chi-square on a toy LM end to end.
Each test carries a negative control: a known biased combination that the same check rejects."""

import itertools

import numpy as np
import pytest
import torch
from scipy import stats

from sglang_spec.sampling import sample_from_probs
from sglang_spec.tree import TokenTree, TreeBatch
from reference_rules import rejection_step, verify_rejection
from sglang_spec.verify import (
    CandidateFirstRule,
    verify_candidate_first,
    verify_sample_match,
    walk,
)
from sglang_spec.verify.target_only import first_above


class ResidualKeepsCandidates(CandidateFirstRule):
    """Negative control: SGLang's walk, but the bonus is drawn from the whole target (the rejected candidates not
    removed), which over-weights them."""

    def bonus(self, rows, node, real):
        return first_above(self.target_probs[rows, node], self.final_coins)


def node_output_law(target, draft, outcome, rule):
    """Exact law of the token a rejection rule emits at one node, for one draft outcome (children in order)."""
    reach, law = 1.0, np.zeros(len(target))
    current_target = torch.tensor(target, dtype=torch.float64)[None]
    current_draft = torch.tensor(draft, dtype=torch.float64)[None]
    for token in outcome:
        step = rejection_step(current_target, current_draft, torch.tensor([token]), rule)
        accept = float(step.accept_probability[0])
        law[token] += reach * accept
        reach *= 1 - accept
        current_target, current_draft = step.target_after_reject, step.draft_after_reject
    return law + reach * current_target[0].numpy(), 1 - reach


def swor_outcomes(draft, count):
    """Ordered draws without replacement and their probabilities."""
    for outcome in itertools.permutations(range(len(draft)), count):
        prob, remaining = 1.0, np.array(draft, dtype=np.float64)
        for token in outcome:
            prob *= remaining[token] / remaining.sum()
            remaining[token] = 0
        yield outcome, prob


def iid_outcomes(draft, count):
    for outcome in itertools.product(range(len(draft)), repeat=count):
        yield outcome, float(np.prod([draft[t] for t in outcome]))


def law_over(outcomes, target, draft, rule):
    total_law, total_accept = np.zeros(len(target)), 0.0
    for outcome, weight in outcomes:
        law, accept = node_output_law(target, draft, outcome, rule)
        total_law += weight * law
        total_accept += weight * accept
    return total_law, total_accept


def random_pairs(count, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        vocab = int(rng.integers(4, 7))
        yield rng.dirichlet(np.full(vocab, 0.5)), rng.dirichlet(np.full(vocab, 0.5)), int(rng.integers(1, 4))


def test_exact_enumeration_single_node_rejection_rules():
    worst = {"swor": 0.0, "iid": 0.0, "iid_on_swor": 0.0, "swor_on_topk": 0.0}
    for target, draft, count in random_pairs(300):
        law, accept = law_over(swor_outcomes(draft, count), target, draft, "swor")
        worst["swor"] = max(worst["swor"], np.abs(law - target).max())
        if count == 1:
            assert accept == pytest.approx(np.minimum(target, draft).sum(), abs=1e-12)
        law, _ = law_over(iid_outcomes(draft, count), target, draft, "iid")
        worst["iid"] = max(worst["iid"], np.abs(law - target).max())
        # negative controls: SpecInfer's rule (q unchanged) on drafts drawn without replacement, and a p/q
        # ratio rule on deterministic top-k candidates
        law, _ = law_over(swor_outcomes(draft, count), target, draft, "iid")
        worst["iid_on_swor"] = max(worst["iid_on_swor"], np.abs(law - target).max())
        top = tuple(np.argsort(-draft, kind="stable")[:count].tolist())
        law, _ = law_over([(top, 1.0)], target, draft, "swor")
        worst["swor_on_topk"] = max(worst["swor_on_topk"], np.abs(law - target).max())
    assert worst["swor"] < 1e-9 and worst["iid"] < 1e-9
    assert worst["iid_on_swor"] > 0.1 and worst["swor_on_topk"] > 0.1


def test_exact_enumeration_sample_and_match_over_its_coin():
    """verify_sample_match on a one-level tree is piecewise constant in the root's coin: evaluating it at the
    midpoint of every CDF interval and weighting by the interval length gives its exact output law."""
    for target, draft, count in random_pairs(100, seed=1):
        vocab = len(target)
        target = target * (np.random.default_rng(vocab).random(vocab) > 0.2)  # some zero-probability tokens
        if target.sum() == 0:
            continue
        target = target / target.sum()
        children = np.argsort(-draft, kind="stable")[:count]
        tree = TokenTree.from_parents([-1] + [0] * count, tokens=[vocab] + children.tolist())
        edges = np.concatenate([[0.0], np.cumsum(target)])
        edges[-1] = 1.0
        width = np.diff(edges)
        keep = width > 0
        midpoints = ((edges[:-1] + edges[1:]) / 2)[keep]
        batch = TreeBatch.from_trees([tree] * len(midpoints))
        probs = torch.tensor(target, dtype=torch.float32).expand(len(midpoints), count + 1, vocab)
        coins = torch.zeros(len(midpoints), count + 1, dtype=torch.float64)
        coins[:, 0] = torch.tensor(midpoints)
        result = verify_sample_match(batch, probs, coins)
        law = np.zeros(vocab)
        np.add.at(law, result.output_tokens[:, 0].numpy(), width[keep])
        assert np.abs(law - target).max() < 1e-6
        accepted = (result.accept_length == 2).double().numpy() @ width[keep]
        assert accepted == pytest.approx(target[children].sum(), abs=1e-6)


@pytest.mark.parametrize("rule", [CandidateFirstRule, ResidualKeepsCandidates])
def test_exact_enumeration_candidate_first_over_its_coins(rule):
    """SGLang's candidate-first rule on a one-level tree is piecewise constant in (root coin, final coin):
    evaluating it at the midpoints of both coins' intervals, weighted by the intervals' areas, gives its exact
    law: the target for the real rule; off the target for the control."""
    worst = 0.0
    for target, draft, count in random_pairs(60, seed=2):
        vocab = len(target)
        children = np.argsort(-draft, kind="stable")[:count]
        tree = TokenTree.from_parents([-1] + [0] * count, tokens=[vocab] + children.tolist())
        child_edges = np.concatenate([[0.0], np.cumsum(target[children]), [1.0]])
        residual = target.copy()
        residual[children] = 0.0 if rule is CandidateFirstRule else residual[children]
        final_edges = np.concatenate([[0.0], np.cumsum(residual) / residual.sum()])
        coin_mid, coin_width = (child_edges[:-1] + child_edges[1:]) / 2, np.diff(child_edges)
        final_mid, final_width = (final_edges[:-1] + final_edges[1:]) / 2, np.diff(final_edges)
        grid = [(c, f, cw * fw) for c, cw in zip(coin_mid, coin_width) for f, fw in zip(final_mid, final_width)
                if cw > 0 and fw > 0]
        batch = TreeBatch.from_trees([tree] * len(grid))
        probs = torch.tensor(target, dtype=torch.float32).expand(len(grid), count + 1, vocab)
        coins = torch.zeros(len(grid), count + 1)
        coins[:, 0] = torch.tensor([c for c, _, _ in grid])
        finals = torch.tensor([f for _, f, _ in grid])
        result = walk(batch, rule(batch, probs, coins, finals))
        law = np.zeros(vocab)
        np.add.at(law, result.output_tokens[:, 0].numpy(), [w for _, _, w in grid])
        worst = max(worst, np.abs(law - target).max())
    if rule is CandidateFirstRule:
        assert worst < 1e-5
    else:
        assert worst > 0.05


class ToyLM:
    """Seeded random next-token tables keyed by the whole context (vocabulary 3), for target p and draft q."""

    def __init__(self, seed: int, vocab: int = 3, max_len: int = 8):
        rng = np.random.default_rng(seed)
        self.vocab = vocab
        size = (vocab + 1) ** max_len
        self.target = torch.from_numpy(rng.dirichlet(np.full(vocab, 0.8), size=size))
        self.draft = torch.from_numpy(rng.dirichlet(np.full(vocab, 0.8), size=size))

    def extend(self, code, token):
        return code * (self.vocab + 1) + token + 1


def draw_children(draft, count, mode, generator):
    """[B, count] children of each row of draft [B, V]: deterministic top-k, SWOR (Gumbel top-k) or i.i.d."""
    if mode == "topk":
        return torch.topk(draft, count, dim=-1).indices
    if mode == "swor":
        gumbel = -torch.log(-torch.log(torch.rand(draft.shape, generator=generator, dtype=torch.float64)))
        return torch.topk(torch.log(draft) + gumbel, count, dim=-1).indices
    return torch.multinomial(draft, count, replacement=True, generator=generator)


def generate_three_tokens(lm, drafting, rule, trials, seed):
    """Speculative generation of 3 tokens per trial with a fixed tree (root -> 2 children -> 1 child each)."""
    generator = torch.Generator().manual_seed(seed)
    parents = torch.tensor([-1, 0, 0, 1, 2]).expand(trials, 5)
    code = torch.full((trials,), 1, dtype=torch.int64)  # prompt = token 0
    outputs = torch.full((trials, 3), -1, dtype=torch.int64)
    produced = torch.zeros(trials, dtype=torch.int64)
    rows = torch.arange(trials)
    while bool((produced < 3).any()):
        node_code = torch.zeros(trials, 5, dtype=torch.int64)
        tokens = torch.zeros(trials, 5, dtype=torch.int64)
        node_code[:, 0] = code
        tokens[:, 0] = 0
        tokens[:, 1:3] = draw_children(lm.draft[code], 2, drafting, generator)
        for child, grandchild in [(1, 3), (2, 4)]:
            node_code[:, child] = lm.extend(code, tokens[:, child])
            tokens[:, grandchild] = draw_children(lm.draft[node_code[:, child]], 1, drafting, generator)[:, 0]
            node_code[:, grandchild] = lm.extend(node_code[:, child], tokens[:, grandchild])
        batch = TreeBatch(
            tokens=tokens,
            parents=parents,
            depths=torch.tensor([0, 1, 1, 2, 2]).expand(trials, 5),
            first_child=torch.tensor([1, 3, 4, -1, -1]).expand(trials, 5),
            next_sibling=torch.tensor([-1, 2, -1, -1, -1]).expand(trials, 5),
            num_nodes=torch.full((trials,), 5),
        )
        target_probs = lm.target[node_code]
        if rule == "sample_match":
            result = verify_sample_match(batch, target_probs, torch.rand(trials, 5, generator=generator))
        elif rule == "candidate_first":
            result = verify_candidate_first(batch, target_probs, torch.rand(trials, 5, generator=generator),
                                            torch.rand(trials, generator=generator))
        else:
            result = verify_rejection(
                batch,
                target_probs,
                lm.draft[node_code],
                torch.rand(trials, 5, generator=generator, dtype=torch.float64),
                torch.rand(trials, 5, generator=generator, dtype=torch.float64),
                rule=rule,
            )
        for j in range(3):
            emit = (j < result.accept_length) & (produced < 3)
            slot = produced.clamp(max=2)
            token = result.output_tokens[:, j]
            outputs[rows[emit], slot[emit]] = token[emit]
            code = torch.where(emit, lm.extend(code, token.clamp(min=0)), code)
            produced = produced + emit.long()
    return outputs


def chi_square_p_value(lm, outputs):
    vocab = lm.vocab
    index = outputs[:, 0] * vocab * vocab + outputs[:, 1] * vocab + outputs[:, 2]
    observed = np.bincount(index.numpy(), minlength=vocab**3)
    expected = np.zeros(vocab**3)
    for a, b, c in itertools.product(range(vocab), repeat=3):
        code_a = lm.extend(1, a)
        code_b = lm.extend(code_a, b)
        expected[a * vocab * vocab + b * vocab + c] = (
            lm.target[1, a] * lm.target[code_a, b] * lm.target[code_b, c]
        )
    return stats.chisquare(observed, expected * len(outputs) / expected.sum()).pvalue


@pytest.mark.slow
@pytest.mark.parametrize(
    "drafting, rule, lossless",
    [
        ("topk", "sample_match", True),
        ("topk", "candidate_first", True),
        ("swor", "swor", True),
        ("iid", "iid", True),
        ("swor", "iid", False),  # SpecInfer's rule on drafts sampled without replacement
        ("topk", "swor", False),  # a p/q ratio rule on deterministic top-k candidates
    ],
)
def test_chi_square_first_three_tokens_on_a_toy_lm(drafting, rule, lossless):
    lm = ToyLM(seed=3)
    outputs = generate_three_tokens(lm, drafting, rule, trials=60_000, seed=11)
    assert bool((outputs >= 0).all())
    p_value = chi_square_p_value(lm, outputs)
    if lossless:
        assert p_value > 1e-3, p_value
    else:
        assert p_value < 1e-10, p_value


def test_sample_from_probs_never_returns_zero_probability_tokens():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
    coins = torch.tensor([0.0, 0.49, 0.5, 0.9999999999])
    assert sample_from_probs(probs, coins).tolist() == [1, 1, 3, 3]
