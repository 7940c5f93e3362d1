"""Exact ancestry: a node's draft distribution in a tree equals drafting its root-to-node path alone."""

import pytest
import torch

from sglang_spec.decode.target import TransformersRunner
from sglang_spec.mtp.expansion import MTPDrafter
from sglang_spec.tree import GrowingTree, TreePolicy
from sglang_spec.tree.candidates import CandidateSource
from sglang_spec.tree.proposal import DraftSources


class Recorder(CandidateSource):
    """Wraps a drafter source and records the child logits of every expanded node."""

    def __init__(self, inner):
        self.inner = inner
        self.logits = {}

    def expand(self, tree, node_ids, k):
        candidates = self.inner.expand(tree, node_ids, k)
        for node in node_ids:
            self.logits[tuple(tree.path_tokens(node))] = self.inner.drafter.expand(self.inner.state, tree, [node])[0]
        return candidates


def fresh_state(model, drafter, prompt, first):
    prefill = TransformersRunner(model).prefill(torch.tensor(prompt))
    return drafter.prefill(prefill.hidden, torch.tensor(prompt[1:] + [first]))


def chain_logits(model, drafter, prompt, path):
    """Drafts ``path`` (root first) as a chain with a fresh state, one node per forward."""
    state = fresh_state(model, drafter, prompt, path[0])
    tree = GrowingTree(path[0])
    node = 0
    for token in path[1:]:
        drafter.expand(state, tree, [node])
        node = tree.add(node, token, 0, 1.0)
    return drafter.expand(state, tree, [node])[0]


@pytest.mark.parametrize("policy", ["specexec", "eagle", "sequoia"])
@pytest.mark.parametrize("which", ["random_tiny", "tiny"])
def test_every_node_sees_only_its_own_ancestors(policy, which, request):
    fixture = request.getfixturevalue(which)
    model, head = fixture if which == "random_tiny" else (fixture[0].model, fixture[1])
    from sglang_spec.tree import AcceptanceProfile

    drafter = MTPDrafter(head)
    prompt = [3, 17, 99, 4, 250]
    first = 77
    profile = AcceptanceProfile.uniform([0.5, 0.25, 0.1])
    tree_policy = TreePolicy(policy, budget=14, depth=4, topk=3, profile=profile)
    recorder = Recorder(drafter.source(fresh_state(model, drafter, prompt, first)))
    tree = tree_policy.build(first, DraftSources(mtp=recorder)).tree
    assert tree.depth >= 2 and max(len(kids) for kids in tree.children()) >= 2  # a real tree, siblings present
    for path, logits in recorder.logits.items():
        alone = chain_logits(model, drafter, prompt, list(path))
        assert torch.allclose(torch.softmax(logits, -1), torch.softmax(alone, -1), atol=2e-5), path


def test_without_the_tree_mask_siblings_would_leak(random_tiny):
    """Negative control: attending to every cached slot (no ancestry mask) changes a node's distribution."""
    model, head = random_tiny
    drafter = MTPDrafter(head)
    prompt, first = [3, 17, 99, 4, 250], 77
    state = fresh_state(model, drafter, prompt, first)
    tree = GrowingTree(first)
    first_child, second_child = tree.add(0, 10, 0, 0.5), tree.add(0, 11, 1, 0.3)
    drafter.expand(state, tree, [first_child])
    exact = drafter.expand(state, tree, [second_child])[0]
    leaky_state = fresh_state(model, drafter, prompt, first)
    leaky_tree = GrowingTree(first)
    a = leaky_tree.add(0, 10, 0, 0.5)
    leaky_tree.add(0, 11, 1, 0.3)  # the sibling the unmasked head would see
    drafter.expand(leaky_state, leaky_tree, [a])
    width = leaky_state.cache.get_seq_length()
    output = head(torch.tensor([[11]]), leaky_state.root_hidden[None, None], torch.tensor([[len(prompt)]]), None,
                  leaky_state.cache)  # no mask: also sees the sibling's slot
    assert leaky_state.cache.get_seq_length() == width + 1
    assert not torch.allclose(torch.softmax(exact, -1), torch.softmax(output.logits[0, 0], -1), atol=1e-4)
