"""Penalties in a tree's verify (``sglang_plugin/penalties.py``) against plain decoding's, node by node.

The reference is SGLang's own penalizers (``sampling/penaltylib``: frequency, presence, repetition,
min_new_tokens) run as plain decoding runs them: one request, its output tokens followed by the node's path fed one
token per step, then applied to the node's logits row. Trees are random (a small vocabulary, so tokens repeat
along paths and between output and path) in SGLang's verify layout; the negative control is SGLang's own relaxed
verify rule (the root's penalties on every node), which must differ.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers import random_tree
from sglang_spec.sglang_plugin.penalties import RequestPenalties, node_paths, tree_penalties
from sglang_spec.tree import encode_sglang_verify

pytestmark = pytest.mark.sglang

VOCAB = 12
EOS = 3


def sglang_request(settings: RequestPenalties):
    params = SimpleNamespace(frequency_penalty=settings.frequency, presence_penalty=settings.presence,
                             repetition_penalty=settings.repetition, min_new_tokens=settings.min_new_tokens,
                             stop_token_ids=set())
    return SimpleNamespace(sampling_params=params, eos_token_ids={EOS},
                           tokenizer=SimpleNamespace(additional_stop_token_ids=None, eos_token_id=EOS))


class OneRequestBatch:
    """What SGLang's orchestrator reads of a ScheduleBatch (held by weak reference: a class, not a namespace)."""

    def __init__(self, request) -> None:
        self.reqs = [request]
        self.device = "cpu"


def plain_decoding_penalised(settings: RequestPenalties, emitted: list[int], logits: torch.Tensor) -> torch.Tensor:
    """``logits`` [V] penalised as plain decoding penalises the token after ``emitted``: SGLang's orchestrator for
    one request, fed one output token per decode step, applied as its sampler applies it (additive, then scaling)."""
    from sglang.srt.sampling import penaltylib

    batch = OneRequestBatch(sglang_request(settings))
    orchestrator = penaltylib.BatchedPenalizerOrchestrator(
        vocab_size=VOCAB, batch=batch,
        penalizers={penaltylib.BatchedFrequencyPenalizer, penaltylib.BatchedMinNewTokensPenalizer,
                    penaltylib.BatchedPresencePenalizer, penaltylib.BatchedRepetitionPenalizer})
    for token in emitted:
        orchestrator.cumulate_output_tokens(torch.tensor([token]))
    row = logits.clone()[None]
    orchestrator.apply(row, repeat=1)
    return row[0]


def batch_of_trees(seed: int, batch: int, nodes: int, depth: int):
    rng = np.random.default_rng(seed)
    trees = [random_tree(rng, nodes, 3, depth, vocab_size=VOCAB) for _ in range(batch)]
    meta = encode_sglang_verify(trees, [20] * batch)
    tokens = meta.draft_tokens.view(batch, nodes)
    requests = []
    for b in range(batch):
        output = [int(token) for token in rng.integers(VOCAB, size=int(rng.integers(0, 6)))] + [int(tokens[b, 0])]
        requests.append(RequestPenalties(frequency=float(rng.choice([0.0, 0.7])),
                                         presence=float(rng.choice([0.0, 0.4])),
                                         repetition=float(rng.choice([1.0, 1.3])),
                                         min_new_tokens=len(output) + int(rng.integers(0, depth + 1)),
                                         output_ids=output))
    logits = torch.from_numpy(rng.normal(size=(batch * nodes, VOCAB)).astype(np.float32))
    return trees, meta, tokens, requests, logits


def stop_set(batch: int) -> torch.Tensor:
    """The tokens min_new_tokens bans (the hook reads them off SGLang's accumulated penalty, whose -inf entries
    they are while SGLang bans; SGLang bans at least as long as plain decoding, counting a step where it should
    count tokens)."""
    stops = torch.zeros(batch, VOCAB, dtype=torch.bool)
    stops[:, EOS] = True
    return stops


@pytest.mark.parametrize("seed", range(6))
def test_every_node_is_penalised_as_plain_decoding_would(seed):
    batch, nodes, depth = 3, 10, 4
    trees, meta, tokens, requests, logits = batch_of_trees(seed, batch, nodes, depth)
    penalties = tree_penalties(requests, tokens, meta.retrieve_next_token, meta.retrieve_next_sibling,
                               stop_set(batch), VOCAB)
    assert penalties is not None
    got = logits.clone()
    penalties.apply(got)
    for b, request in enumerate(requests):
        paths = node_paths(meta.retrieve_next_token[b].tolist(), meta.retrieve_next_sibling[b].tolist(),
                           tokens[b].tolist())
        for i, path in enumerate(paths):
            row = b * nodes + i
            expected = plain_decoding_penalised(request, list(request.output_ids) + path, logits[row])
            torch.testing.assert_close(got[row], expected, rtol=0, atol=1e-6, msg=f"request {b} node {i}")


def test_sglangs_relaxed_rule_is_not_plain_decoding():
    """Negative control: the root's penalties on every node (SGLang's verify) miss what the path adds."""
    batch, nodes, depth = 3, 10, 4
    trees, meta, tokens, requests, logits = batch_of_trees(1, batch, nodes, depth)
    requests = [RequestPenalties(0.7, 0.4, 1.3, 0, request.output_ids) for request in requests]
    exact = tree_penalties(requests, tokens, meta.retrieve_next_token, meta.retrieve_next_sibling,
                           stop_set(batch), VOCAB)
    assert exact is not None
    got = logits.clone()
    exact.apply(got)
    relaxed = torch.stack([plain_decoding_penalised(requests[row // nodes], list(requests[row // nodes].output_ids),
                                                    logits[row]) for row in range(batch * nodes)])
    roots = torch.arange(batch) * nodes
    torch.testing.assert_close(got[roots], relaxed[roots])  # the roots agree
    assert not torch.allclose(got, relaxed)


def test_node_paths_follow_the_links():
    # root 0 -> 1 -> 3, root 0 -> 2; node 4 unreachable (padding)
    first_child = [1, 3, -1, -1, -1]
    next_sibling = [-1, 2, -1, -1, -1]
    assert node_paths(first_child, next_sibling, [9, 5, 6, 7, 8]) == [[], [5], [6], [5, 7], []]


def test_output_ids_behind_the_tree_give_none():
    """With the overlap scheduler the output ids lag the tree's root: no exact penalty can be had."""
    batch, nodes, depth = 2, 6, 3
    trees, meta, tokens, requests, logits = batch_of_trees(2, batch, nodes, depth)
    lagging = [RequestPenalties(0.7, 0.0, 1.0, 0,
                                list(requests[0].output_ids[:-1]) + [(int(tokens[0, 0]) + 1) % VOCAB]),
               requests[1]]
    assert tree_penalties(lagging, tokens, meta.retrieve_next_token, meta.retrieve_next_sibling, stop_set(batch),
                          VOCAB) is None
