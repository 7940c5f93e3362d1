import numpy as np
import pytest
import torch

from host_guard import HostAccessGuard
from paths import bench_module
from sglang_spec.tree import TokenTree
from sglang_spec.verify import RelaxedAcceptance

SpecStep, StepConfig = bench_module("spec_step").SpecStep, bench_module("spec_step").StepConfig

VOCAB, DIM, ROW, SLOTS = 48, 16, 8, 160


class ToyTarget:
    """A stand-in target: each node's hidden state is the mean over its tree-mask row (so the mask matters),
    logits favour a fixed "next token" per token (so drafts built from that rule get accepted), and every tree
    node writes a KV row derived from its hidden state at its tree slot."""

    def __init__(self, kv_buffers, seed=0, device="cpu"):
        generator = torch.Generator().manual_seed(seed)
        self.embed = torch.randn(VOCAB, DIM, generator=generator).to(device)
        self.position = (torch.randn(512, DIM, generator=generator) * 0.1).to(device)
        self.head = (torch.randn(DIM, VOCAB, generator=generator) * 0.5).to(device)
        self.rule = torch.randperm(VOCAB, generator=generator).to(device)
        self.kv_buffers = kv_buffers

    def __call__(self, buffers, inputs):
        meta = buffers.metadata
        batch, nodes = meta.tokens.shape
        hidden = self.embed[meta.input_ids] + self.position[meta.positions]
        mask = meta.tree_mask.float()
        context = (torch.bmm(mask, hidden.view(batch, nodes, DIM)) / mask.sum(-1, keepdim=True)).view(-1, DIM)
        logits = context @ self.head + 6.0 * torch.nn.functional.one_hot(self.rule[meta.input_ids], VOCAB)
        buffers.logits.copy_(logits)
        for layer, buffer in enumerate(self.kv_buffers):
            buffer[inputs.tree_slots.reshape(-1)] = (context[:, None, :ROW] * (layer + 1)).to(buffer.dtype)


def fill_inputs(inputs, rule, config, rng, follow_rule=0.85):
    """Random trees whose rank-0 candidates usually follow the toy target's rule."""
    batch, nodes, k = config.batch_size, config.max_nodes, config.topk
    inputs.parents.fill_(-1)
    inputs.ranks.zero_()
    rule = rule.cpu()
    for b in range(batch):
        count = 0 if b == batch - 1 else int(rng.integers(1, nodes + 1))  # the last request is padding
        parents, depths, fanout = [-1], [0], [0]
        for _ in range(1, count):
            open_nodes = [n for n in range(len(parents)) if fanout[n] < k and depths[n] < config.max_depth]
            parent = int(rng.choice(open_nodes))
            parents.append(parent)
            depths.append(depths[parent] + 1)
            fanout.append(0)
            fanout[parent] += 1
        tree = TokenTree.from_parents(parents) if count else None
        root = int(rng.integers(VOCAB))
        tokens = [root]
        candidates = torch.zeros(nodes, k, dtype=torch.int64)
        for node in range(nodes):
            if node < len(tokens):
                favourite = int(rule[tokens[node]]) if rng.random() < follow_rule else int(rng.integers(VOCAB))
            else:
                favourite = int(rng.integers(VOCAB))
            others = [t for t in rng.permutation(VOCAB).tolist() if t != favourite][: k - 1]
            candidates[node] = torch.tensor([favourite] + others)
            if tree is not None:
                for child in tree.children()[node] if node < count else []:
                    tokens.append(int(candidates[node, int(tree.ranks[child])]))
        inputs.topk_tokens[b] = candidates.to(inputs.topk_tokens.device)
        inputs.topk_probs[b] = torch.sort(torch.rand(nodes, k), -1, descending=True).values.to(inputs.topk_probs.device)
        inputs.root_tokens[b] = root
        inputs.num_nodes[b] = count
        if tree is not None:
            inputs.parents[b, :count] = tree.parents.to(inputs.parents.device)
            inputs.ranks[b, :count] = tree.ranks.clamp(min=0).to(inputs.ranks.device)
    inputs.prefix_lens.copy_(torch.from_numpy(rng.integers(0, 30, size=batch)))
    inputs.tree_slots.copy_(torch.from_numpy(rng.permutation(SLOTS - 1)[: batch * nodes].reshape(batch, nodes) + 1))
    inputs.temperature.copy_(torch.tensor([0.0, 0.7, 1.0, 1.4][:batch] + [1.0] * max(0, batch - 4)))
    inputs.top_k.copy_(torch.tensor([0, 5, 0, 3][:batch] + [0] * max(0, batch - 4)))
    inputs.top_p.copy_(torch.tensor([1.0, 1.0, 0.9, 0.8][:batch] + [1.0] * max(0, batch - 4)))
    inputs.coins.copy_(torch.from_numpy(rng.random(batch * nodes)).float())
    inputs.thinking.copy_(torch.from_numpy(rng.integers(0, 2, size=batch)).to(torch.int8))


def make_step(config, backend, seed=0, device="cpu"):
    kv = [torch.zeros(SLOTS, 1, ROW, dtype=torch.float32, device=device) for _ in range(2)]
    target = ToyTarget(kv, seed=seed, device=device)
    return SpecStep(config, target, kv_buffers=kv, device=device, backend=backend), target


def snapshot(step):
    buffers, inputs = step.buffers, step.inputs
    values = {
        "tokens": buffers.metadata.tokens,
        "positions": buffers.metadata.positions,
        "tree_mask": buffers.metadata.tree_mask,
        # the live bytes only: past the indptr's end a step leaves an earlier step's bytes (StepBuffers)
        # the live bytes only: past the indptr's end a step leaves an earlier step's bytes (StepBuffers)
        "packed_mask": buffers.packed_mask[: int(buffers.indptrs.packed_mask_indptr[-1])],
        "kv_indptr": buffers.indptrs.paged_kv_indptr,
        "accepted": buffers.accept.accepted_nodes,
        "accept_length": buffers.accept.accept_length,
        "bonus": buffers.accept.bonus_token,
        "thinking": buffers.accept.thinking,
        "freed": buffers.freed_slots,
        "output_ids": inputs.output_ids,
        "output_lens": inputs.output_lens,
    }
    values.update({f"kv{i}": buffer for i, buffer in enumerate(step.kv_buffers)})
    return {name: value.detach().cpu().clone() for name, value in values.items()}


MODE_CONFIGS = {
    "greedy": dict(mode="greedy"),
    "sample": dict(mode="sample"),
    "relaxed": dict(mode="relaxed",
                    relaxed=RelaxedAcceptance(top_n=3, delta=0.4, think_begin_token=5, think_end_token=6)),
}


def config_for(mode, batch=4):
    return StepConfig(batch_size=batch, max_nodes=8, topk=3, max_depth=5, vocab_size=VOCAB, max_context_len=40,
                      output_capacity=12, block_v=16, **MODE_CONFIGS[mode])


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODE_CONFIGS))
def test_kernel_step_equals_reference_step_over_consecutive_steps(kernel_device, mode):
    config = config_for(mode)
    # both on the kernel's device: the toy target's float math then gives both steps the very same logits and KV
    kernel_step, target = make_step(config, "kernel", device=kernel_device)
    reference_step, _ = make_step(config, "reference", device=kernel_device)
    rng = np.random.default_rng(1)
    deepest = 0
    for _ in range(2):
        fill_inputs(kernel_step.inputs, target.rule, config, rng)
        reference_step.inputs.copy_(kernel_step.inputs)
        kernel_step.run()
        reference_step.run()
        ours, theirs = snapshot(kernel_step), snapshot(reference_step)
        for name in ours:
            assert torch.equal(ours[name], theirs[name]), name
        deepest = max(deepest, int(ours["accept_length"].max()))
        assert int(ours["accept_length"][-1]) == 0 and int(ours["output_lens"][-1]) == 0  # padded request
    assert deepest >= 3


def replay_against_reference(step, reference, target, config, rng, run, steps, kv_atol=None):
    """``steps`` new batches: each run by ``run`` (the step, or its graph's replay) on the kernel step and by the
    reference step from the same inputs and KV; everything a step defines must be equal (KV within ``kv_atol``
    across devices; snapshots are host copies). Returns the last kernel snapshot."""
    for _ in range(steps):
        fill_inputs(step.inputs, target.rule, config, rng)
        reference.inputs.copy_(step.inputs)
        for ours, theirs in zip(step.kv_buffers, reference.kv_buffers):
            theirs.copy_(ours)
        run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        reference.run()
        ours, theirs = snapshot(step), snapshot(reference)
        for name in ours:
            if kv_atol is not None and name.startswith("kv"):
                assert torch.allclose(ours[name], theirs[name], atol=kv_atol), name
            else:
                assert torch.equal(ours[name], theirs[name]), name
    return ours


@pytest.mark.slow
def test_a_step_after_a_batch_the_reference_never_saw_equals_the_reference(kernel_device):
    """What a graph replay sees (the GPU check caught it first): the kernel step ran a batch before, the reference
    did not, so only what a step defines may be compared (the packed mask's live bytes, not its stale tail)."""
    config = config_for("greedy", batch=8)
    step, target = make_step(config, "kernel", device=kernel_device)
    reference, _ = make_step(config, "reference", device=kernel_device)
    rng = np.random.default_rng(3)
    fill_inputs(step.inputs, target.rule, config, rng)
    step.run()
    longest = int(step.buffers.indptrs.packed_mask_indptr[-1])
    ours = replay_against_reference(step, reference, target, config, rng, step.run, steps=2)
    assert longest > ours["packed_mask"].numel()  # the first batch's mask was longer: its tail is stale here


def test_step_path_reads_nothing_on_the_host_and_allocates_nothing(kernel_device):
    config = config_for("greedy", batch=2)
    step, target = make_step(config, "kernel", device=kernel_device)
    fill_inputs(step.inputs, target.rule, config, np.random.default_rng(0))
    step.run()  # warm-up (a GPU would compile here)
    with HostAccessGuard() as guard:
        step.run()
    assert guard.events == []


def test_the_guard_catches_a_host_read():
    with HostAccessGuard() as guard:
        from sglang_spec.sampling import sample_from_probs

        sample_from_probs(torch.tensor([[0.5, 0.5]]), torch.tensor([0.3]))  # allocates: must be reported
    assert guard.events and all("sampling.py" in event for event in guard.events)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODE_CONFIGS))
def test_cuda_graph_capture_and_replay_matches_the_reference(mode):
    config = config_for(mode, batch=8)
    step, target = make_step(config, "kernel", device="cuda")
    reference, _ = make_step(config, "reference")
    rng = np.random.default_rng(3)
    fill_inputs(step.inputs, target.rule, config, rng)
    step.run()  # compile every kernel before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step.run()
    replay_against_reference(step, reference, target, config, rng, graph.replay, steps=3, kv_atol=1e-5)


@pytest.mark.gpu
def test_no_host_sync_and_no_allocation_on_the_step_path():
    config = config_for("sample", batch=8)
    logits_table = torch.randn(VOCAB, VOCAB, device="cuda")

    def allocation_free_target(buffers, inputs):
        torch.index_select(logits_table, 0, buffers.metadata.input_ids, out=buffers.logits)

    kv = [torch.zeros(SLOTS, 1, ROW, device="cuda")]
    step = SpecStep(config, allocation_free_target, kv_buffers=kv, device="cuda")
    fill_inputs(step.inputs, torch.arange(VOCAB), config, np.random.default_rng(0))
    step.run()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        step.run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
