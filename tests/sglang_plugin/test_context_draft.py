"""The host side of lookup / hybrid trees in SGLang (``sglang_plugin/drafters/host_context.py``): the requests'
contexts, the padding to SGLang's fixed verify size, and the live calibration from SGLang's accepted paths."""

import numpy as np
import pytest
import torch

from sglang_spec.sglang_plugin.drafters.base import VerifyOutcome
from sglang_spec.sglang_plugin.drafters.host_context import HostContextDrafter as ContextDrafter
from sglang_spec.sglang_plugin.drafters.host_context import AGREE_TOKENS, History, RequestContexts
from sglang_spec.sglang_plugin.drafters.padding import pad_to_budget
from sglang_spec.tree.proposal import DraftSources
from sglang_spec.tree.drafter import TreeDrafter
from sglang_spec.tree.encode_sglang import decode_sglang_draft, encode_sglang_draft
from sglang_spec.tree.ngram import NgramIndex
from sglang_spec.tree.policies import TreePolicy
from sglang_spec.tree.token_tree import TokenTree


def outcome(accept_index: torch.Tensor, verify_tokens: int) -> VerifyOutcome:
    """SGLang's accept of a verify as the drafter is given it (only the accepted paths matter here)."""
    rows = accept_index.shape[0]
    return VerifyOutcome(torch.arange(rows), torch.zeros(rows * verify_tokens, dtype=torch.int32), accept_index,
                         (accept_index >= 0).sum(1).int(), verify_tokens)


def test_contexts_extend_incrementally_and_rebuild_a_history_that_changed():
    contexts = RequestContexts(max_ngram=4)
    first = contexts.index("a", History.of(([1, 2], [3]), root=3))
    assert first.tokens == [1, 2, 3]
    # the next step's history: the output grew, the verify's tail spliced after it (the overlap scheduler's lag)
    assert contexts.index("a", History.of(([1, 2], [3, 4], [5]), root=5)) is first and first.tokens == [1, 2, 3, 4, 5]
    # a root the output ids do not hold yet (the first step after prefill) is appended
    assert contexts.index("b", History.of(([7, 8], []), root=9)).tokens == [7, 8, 9]
    rebuilt = contexts.index("a", History.of(([1, 2], [6]), root=6))  # shorter: indexed again
    assert rebuilt is not first and rebuilt.tokens == [1, 2, 6]
    changed = contexts.index("a", History.of(([1, 2], [7, 8]), root=8))  # as long, its last token changed
    assert changed is not rebuilt and changed.tokens == [1, 2, 7, 8]


class CountedTokens(list):
    """A prompt or output whose reads are counted: the tokens a step took from it."""

    read = 0

    def __getitem__(self, key):
        taken = super().__getitem__(key)
        CountedTokens.read += len(taken) if isinstance(key, slice) else 1
        return taken


def test_a_step_reads_its_new_tokens_and_a_few_before_whatever_the_context():
    """A long context is read once, when its index is built; each later step reads the tokens it committed and the
    AGREE_TOKENS before them, the same index as the whole history built at once."""
    rng = np.random.default_rng(0)
    prompt = CountedTokens(rng.integers(50, size=20_000).tolist())
    output = CountedTokens(rng.integers(50, size=3).tolist())
    contexts = RequestContexts(max_ngram=4)
    CountedTokens.read = 0
    index = contexts.index("a", History.of((prompt, output), root=output[-1]))
    assert CountedTokens.read <= len(prompt) + len(output) + 2
    for _ in range(5):
        tail = rng.integers(50, size=3).tolist()
        CountedTokens.read = 0
        assert contexts.index("a", History.of((prompt, output, tail), root=tail[-1])) is index
        assert CountedTokens.read <= AGREE_TOKENS + 2  # the tail is a plain list: its reads are not counted
        output.extend(tail)
    whole = NgramIndex(list(prompt) + list(output), max_ngram=4)
    assert index.tokens == whole.tokens
    for tail in ([], [output[-1]], list(output[-3:])):
        assert index.continuations(tail, 4) == whole.continuations(tail, 4)


@pytest.mark.parametrize("width, steps, budget", [(2, 3, 6), (3, 4, 12), (6, 5, 12)])
def test_padding_fills_the_budget_within_the_encodings_bounds(width, steps, budget):
    tree = TokenTree.from_parents([-1, 0, 1], tokens=[5, 0, 9])
    padded = pad_to_budget(tree, budget, width, steps)
    assert padded.budget == budget and padded.depth <= steps
    assert padded.parents.tolist()[:3] == [-1, 0, 1] and padded.tokens.tolist()[:3] == [5, 0, 9]
    for kids in padded.children():
        assert len(kids) <= width
        tokens = [int(padded.tokens[kid]) for kid in kids]
        assert len(set(tokens)) == len(tokens)  # a filler never repeats a sibling's token
    # SGLang's build-tree input reproduces it exactly
    encoding = encode_sglang_draft([padded], width, steps)
    decoded = decode_sglang_draft(encoding.parent_list, encoding.top_scores_index, encoding.draft_tokens,
                                  encoding.bonus_tokens, width)[0]
    assert decoded.parents.tolist() == padded.parents.tolist()
    assert decoded.tokens.tolist() == padded.tokens.tolist()


def test_accepted_paths_teach_the_counts_as_the_reference_decoder_observes_them():
    """SGLang's accept_index (global node indices b * n + j, -1 padded) becomes each tree's accepted node path,
    observed once, exactly as the reference decoder observes the same paths."""
    policy = TreePolicy("lookup", budget=6, depth=3, width=3)
    context = NgramIndex([4, 5, 6, 4, 5, 6, 4, 5], max_ngram=4)
    drafter = ContextDrafter(policy, steps=3, budget=6)
    tree = drafter.drafter.propose(5, DraftSources(context=context))
    assert tree.tree.tokens.tolist()[:3] == [5, 6, 4]  # the copy: 5 -> 6 -> 4
    reference = TreeDrafter(policy)
    reference_tree = reference.propose(5, DraftSources(context=context))
    for path in ([0, 1, 2], [0]):
        reference.observe(reference_tree, path)

    verify_tokens = 7
    drafter.proposed = [tree, tree]
    drafter.record_outcome(outcome(torch.tensor([[0, 1, 2, -1], [verify_tokens, -1, -1, -1]]), verify_tokens))
    assert drafter.proposed == []
    drafter.observe_outcome()
    drafter.observe_outcome()  # an outcome is observed once
    learnt, expected = drafter.drafter.counts, reference.counts
    assert (learnt.lookup, learnt.mtp, learnt.both) == (expected.lookup, expected.mtp, expected.both)
    assert expected.lookup != TreeDrafter(policy).counts.lookup  # the paths taught something


class RecordingMetrics:
    enabled = True

    def __init__(self):
        self.added = []

    def add(self, observed):
        self.added.append(observed)


def test_what_the_counts_learnt_is_exported_once_by_cell_name():
    policy = TreePolicy("lookup", budget=6, depth=3, width=3)
    metrics = RecordingMetrics()
    drafter = ContextDrafter(policy, steps=3, budget=6, metrics=metrics)
    tree = drafter.drafter.propose(5, DraftSources(context=NgramIndex([4, 5, 6, 4, 5, 6, 4, 5], max_ngram=4)))
    drafter.proposed = [tree]
    drafter.record_outcome(outcome(torch.tensor([[0, 1, 2, -1]]), 7))
    drafter.observe_outcome()
    (observed,) = metrics.added
    assert all(name.startswith("lookup/") for name in observed)
    assert sum(hits for hits, _ in observed.values()) == 2  # nodes 1 and 2 accepted
    prior = TreePolicy("lookup", budget=6, depth=3, width=3).source_counts()
    relearnt = prior.with_observed(observed, "test").named_cells()
    learnt = drafter.drafter.counts.named_cells()
    assert all(relearnt[name] == pytest.approx(learnt[name]) for name in learnt)
    drafter.observe_outcome()  # nothing new: nothing exported
    assert len(metrics.added) == 1


def test_tree_auto_runs_at_any_tensor_parallel_shape_and_is_refused_across_pipeline_stages():
    """The ranks of a step agree on its plan (``peers.PlanGroup``): tensor parallelism and DP attention are served,
    decode CUDA graphs too (each verify size has its own: ``verify_shapes``); pipeline stages relay a fixed draft
    shape, so a pipeline is refused in one line."""
    from types import SimpleNamespace

    from sglang_spec.errors import SpecError
    from sglang_spec.sglang_plugin.options import from_values, validate_speculative

    options = from_values({"speculative_tree_policy": "hybrid", "speculative_tree_auto": True})
    resolved = dict(speculative_algorithm="NEXTN", speculative_eagle_topk=options.width, speculative_num_steps=4)
    eager = SimpleNamespace(decode=SimpleNamespace(backend="disabled"))
    for ranks in ({"tp_size": 2}, {"tp_size": 4, "dp_size": 2, "enable_dp_attention": True}, {"dp_size": 2}):
        validate_speculative(options, SimpleNamespace(device="cpu", cuda_graph_config=eager, **ranks, **resolved))
    with pytest.raises(SpecError, match="run it with --pp-size 1"):
        validate_speculative(options, SimpleNamespace(device="cpu", cuda_graph_config=eager, pp_size=2, **resolved))
    graphs = SimpleNamespace(decode=SimpleNamespace(backend="full"))
    validate_speculative(options, SimpleNamespace(device="cuda", cuda_graph_config=graphs, tp_size=8, **resolved))


class PeerFaulted:
    """peers.Peers of a tensor-parallel group whose other rank reports a fault at every agreement."""

    def __init__(self):
        self.calls = []

    def any_rank(self, flag):
        self.calls.append(flag)
        return True


def test_with_tensor_parallelism_a_peers_learning_fault_keeps_every_ranks_counts():
    """A rank whose drafter learnt from the accepted paths while another rank's faulted goes back to the counts it
    had, so both build the same trees next step (the fault-free case learns as alone); one rank alone has no
    agreement and keeps what it learnt."""
    from types import SimpleNamespace

    from sglang_spec.sglang_plugin.hooks.draft import _observe_accepted

    policy = TreePolicy("lookup", budget=6, depth=3, width=3)

    def drafted() -> ContextDrafter:
        drafter = ContextDrafter(policy, steps=3, budget=6)
        tree = drafter.drafter.propose(5, DraftSources(context=NgramIndex([4, 5, 6, 4, 5, 6, 4, 5], max_ngram=4)))
        drafter.proposed = [tree]
        drafter.record_outcome(outcome(torch.tensor([[0, 1, 2, -1]]), 7))
        return drafter

    prior = ContextDrafter(policy, steps=3, budget=6).drafter.counts.named_cells()
    alone, agreed = drafted(), drafted()
    _observe_accepted(alone, SimpleNamespace(peers=None, faults=None), 1)
    assert alone.drafter.counts.named_cells() != prior  # learnt
    peers = PeerFaulted()
    _observe_accepted(agreed, SimpleNamespace(peers=peers, faults=None), 1)
    assert peers.calls == [False]  # this rank learnt without a fault
    assert agreed.drafter.counts.named_cells() == prior  # and went back with the peer


@pytest.mark.parametrize("budget,width,steps", [(7, 2, 4), (15, 4, 5), (5, 3, 2), (12, 6, 3), (3, 1, 3)])
def test_the_device_padding_and_encoding_equal_the_host_ones(budget, width, steps):
    """``pad_to_budget_device`` + ``encode_sglang_draft_device`` give, for a batch of trees as tensors, what
    ``pad_to_budget`` + ``encode_sglang_draft`` give tree by tree: the same fillers, the same SGLang encoding.
    Trees of every size from the root alone to the budget, with small tokens (fillers must skip them)."""
    from helpers import random_tree
    from sglang_spec.sglang_plugin.drafters.padding import pad_to_budget_device
    from sglang_spec.tree.encode_sglang import encode_sglang_draft_device

    rng = np.random.default_rng(budget * 100 + width * 10 + steps)
    trees = [random_tree(rng, int(rng.integers(1, budget + 2)), width, steps, vocab_size=width + 3)
             for _ in range(12)]
    parents = torch.full((len(trees), budget + 3), -1, dtype=torch.int64)  # wider than the budget: cut
    tokens = torch.full_like(parents, -1)
    for row, tree in enumerate(trees):
        parents[row, :tree.num_nodes] = tree.parents
        tokens[row, :tree.num_nodes] = tree.tokens
    counts = torch.tensor([tree.num_nodes for tree in trees])
    padded_parents, padded_tokens = pad_to_budget_device(parents, tokens, counts, budget, width, steps)
    expected = [pad_to_budget(tree, budget, width, steps) for tree in trees]
    for row, tree in enumerate(expected):
        assert padded_parents[row].tolist() == tree.parents.tolist()
        assert padded_tokens[row].tolist() == tree.tokens.tolist()
    host = encode_sglang_draft(expected, width, steps)
    device = encode_sglang_draft_device(padded_parents, padded_tokens, width, steps)
    assert torch.equal(device[0], host.parent_list)
    assert torch.equal(device[1], host.top_scores_index)
    assert torch.equal(device[2], host.draft_tokens)


def test_the_hosts_reads_of_a_draft_come_through_one_copy_exactly():
    """``to_host`` packs a draft's reads (roots, KV lengths, candidate ids, probabilities) into one float64 copy:
    ids as large as DeepSeek's vocabulary and float32 probabilities come back exactly, in their dtypes and shapes.
    On the meta device (a stand-in for a GPU's) the one copy is made and raises, having no data."""
    from sglang_spec.sglang_plugin.drafters.host_context import pack, to_host, unpack

    roots = torch.tensor([129279, 0, 7], dtype=torch.int64)
    lengths = torch.tensor([4096, 12, 163840], dtype=torch.int32)
    probs = torch.rand(3, 4, dtype=torch.float32) / 3
    ids = torch.randint(0, 129280, (3, 4))
    assert all(a is b for a, b in zip(to_host(roots, lengths), [roots, lengths]))  # host tensors: as they are
    tensors = (roots, lengths, ids, probs)
    for back, tensor in zip(unpack(pack(tensors), tensors), tensors):
        assert back.dtype == tensor.dtype and torch.equal(back, tensor)
    with pytest.raises(NotImplementedError):
        to_host(roots.to("meta"), probs.to("meta"))
