import numpy as np
import torch

from helpers import random_tree
from sglang_spec.tree import TokenTree, TreeBatch
from reference_rules import verify_typical
from sglang_spec.verify import RelaxedAcceptance, verify_greedy, verify_relaxed_top_n_delta

BEGIN, END = 8, 9


def logits_from_probs(rows):
    return torch.log(torch.tensor(rows, dtype=torch.float32).clamp(min=1e-9))


def chain_batch(tokens, copies):
    return TreeBatch.from_trees([TokenTree.from_parents(list(range(-1, len(tokens) - 1)), tokens=tokens)] * copies)


def test_topn_delta_relaxes_only_inside_thinking():
    # root: argmax token 1 (0.5); the draft is token 2 (0.4), within delta 0.2 of the top
    probs = [[0.05, 0.5, 0.4, 0.05, 0, 0, 0, 0, 0, 0.0]] + [[0.0, 0, 0, 0.9, 0.1, 0, 0, 0, 0, 0]] * 2
    batch = chain_batch([0, 2, 3], copies=2)
    logits = logits_from_probs(probs).expand(2, 3, 10)
    relaxed = verify_relaxed_top_n_delta(batch, logits, RelaxedAcceptance(3, 0.2, BEGIN, END),
                                       thinking=torch.tensor([True, False]))
    assert relaxed.result.tokens(0) == [2, 3, 3]  # accepted the non-argmax 2, then 3, bonus argmax 3
    assert relaxed.result.tokens(1) == [1]  # strict outside thinking: greedy correction
    narrow = verify_relaxed_top_n_delta(batch, logits, RelaxedAcceptance(1, 0.2, BEGIN, END),
                                       thinking=torch.tensor([True, True]))
    assert narrow.result.tokens(0) == [1]  # not in the top-1
    tight = verify_relaxed_top_n_delta(batch, logits, RelaxedAcceptance(3, 0.05, BEGIN, END),
                                       thinking=torch.tensor([True, True]))
    assert tight.result.tokens(0) == [1]  # 0.4 < 0.5 - 0.05


def test_end_of_thinking_makes_the_rest_strict():
    # root accepts </think> (argmax); after it, the next draft 4 (0.3 vs top 0.6) is judged strictly
    probs = [[0.0] * 9 + [1.0], [0, 0, 0, 0.6, 0.3, 0.1, 0, 0, 0, 0], [0.0, 1, 0, 0, 0, 0, 0, 0, 0, 0]]
    batch = chain_batch([0, END, 4], copies=1)
    result = verify_relaxed_top_n_delta(batch, logits_from_probs(probs)[None], RelaxedAcceptance(5, 0.5, BEGIN, END),
                                       thinking=torch.tensor([True]))
    assert result.result.tokens(0) == [END, 3]
    assert result.thinking_after.tolist() == [False]


def test_topn_delta_with_zero_delta_is_greedy_and_prefers_the_greedy_child():
    rng = np.random.default_rng(0)
    trees = [random_tree(rng, 12, 3, 4, vocab_size=6) for _ in range(5)]
    batch = TreeBatch.from_trees(trees)
    logits = torch.randn(5, 12, 6, generator=torch.Generator().manual_seed(0)) * 3
    strict = verify_relaxed_top_n_delta(batch, logits, RelaxedAcceptance(4, 0.0, BEGIN, END),
                                       thinking=torch.zeros(5, dtype=torch.bool))
    greedy = verify_greedy(batch, logits.argmax(-1))
    assert torch.equal(strict.result.output_tokens, greedy.output_tokens)
    loose = verify_relaxed_top_n_delta(batch, logits, RelaxedAcceptance(6, 1.0, BEGIN, END),
                                       thinking=torch.ones(5, dtype=torch.bool))
    assert bool((loose.result.accept_length >= greedy.accept_length).all())


def test_typical_acceptance_at_zero_temperature_is_greedy():
    rng = np.random.default_rng(1)
    trees = [random_tree(rng, 10, 3, 5, vocab_size=5) for _ in range(6)] + [None]
    batch = TreeBatch.from_trees(trees)
    logits = torch.randn(7, 10, 5, generator=torch.Generator().manual_seed(1)) * 2
    typical = verify_typical(batch, logits, temperature=0.0, epsilon=0.09, alpha=0.3)
    greedy = verify_greedy(batch, logits.argmax(-1))
    assert torch.equal(typical.output_tokens, greedy.output_tokens)
    assert typical.accept_length.tolist()[-1] == 0


def test_typical_acceptance_takes_the_deepest_acceptable_path():
    #      0
    #    /   \
    #   1     2
    #         |
    #         3
    tree = TokenTree.from_parents([-1, 0, 0, 2], tokens=[0, 1, 2, 3])
    probs = [[0.0, 0.6, 0.35, 0.05], [0.25] * 4, [0.1, 0.1, 0.1, 0.7], [0.25] * 4]
    result = verify_typical(TreeBatch.from_trees([tree]), logits_from_probs(probs)[None], temperature=1.0,
                            epsilon=0.3, alpha=0.3)
    # node 1 (0.6) and node 2 (0.35) both pass; only node 2 continues (3 has 0.7), so the deeper path wins
    assert result.accepted_nodes.tolist() == [[0, 2, 3]]
    assert result.tokens(0) == [2, 3, 0]
