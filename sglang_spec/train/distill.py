"""Self-distillation of an MTP head: match the target's own distribution for the token after next, with the
recursive drafting unrolled so deeper tree levels are trained on what they will actually see.

For a token sequence t_0..t_{T-1} the frozen target gives final hidden states h_i and next-token distributions
p_i = p(. | t_<=i). Step 1 runs the head on the exact pairs (h_i, t_{i+1}) at positions i and matches p_{i+1}.
Step s > 1 runs it on (g_{s-1}(i), t_{i+s}) at position i+s-1, where g_{s-1}(i) is the head's own feedback state
from step s-1 for the same base i, and matches p_{i+s}. Each step-s pair attends to the exact pairs of positions
<= i and to its own base's recursive pairs of steps 2..s: the same view a depth-(s-1) tree node has at inference.

Loss: sum over steps of weight_s * cross-entropy between p (restricted to the head's draft vocabulary) and the
head's distribution; weights decay by ``step_decay`` (EAGLE-3 uses 0.8).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sglang_spec.decode.masks import attention_mask_for
from sglang_spec.mtp.head import MTPHead


@dataclass(frozen=True, eq=False)
class TeacherBatch:
    """Fields: input_ids [B, T] int64 (right-padded), lengths [B] int64, hidden [B, T, d] post-norm target states,
    probs [B, T, V_draft] float32 target next-token probabilities restricted to the head's draft vocabulary."""

    input_ids: torch.Tensor
    lengths: torch.Tensor
    hidden: torch.Tensor
    probs: torch.Tensor


@torch.no_grad()
def teacher_batch(target: nn.Module, head: MTPHead, sequences: list[list[int]], temperature: float = 1.0) -> TeacherBatch:
    """Runs the frozen target over right-padded sequences (causal, so padding never leaks backwards)."""
    device = next(target.parameters()).device
    width = max(len(sequence) for sequence in sequences)
    input_ids = torch.zeros(len(sequences), width, dtype=torch.int64)
    for row, sequence in enumerate(sequences):
        input_ids[row, : len(sequence)] = torch.tensor(sequence)
    input_ids = input_ids.to(device)
    output = target.model(input_ids=input_ids, use_cache=False)
    hidden = output.last_hidden_state
    logits = target.lm_head(hidden).float()
    if head.draft_vocab is not None:
        logits_probs = torch.softmax(logits / temperature, dim=-1).index_select(-1, head.draft_vocab.to(device))
    else:
        logits_probs = torch.softmax(logits / temperature, dim=-1)
    lengths = torch.tensor([len(sequence) for sequence in sequences], device=device)
    return TeacherBatch(input_ids=input_ids, lengths=lengths, hidden=hidden, probs=logits_probs)


@dataclass(frozen=True)
class StepMetrics:
    """Per unrolled step: loss, top-1 agreement with the target, and the number of supervised positions."""

    loss: list[float]
    top1: list[float]
    count: list[int]


def unrolled_loss(head: MTPHead, batch: TeacherBatch, unroll: int, step_decay: float = 0.8) -> tuple[torch.Tensor, StepMetrics]:
    """The training objective on one teacher batch (differentiable in the head's parameters)."""
    from transformers import DynamicCache

    input_ids, hidden, probs = batch.input_ids, batch.hidden, batch.probs
    size, length = input_ids.shape
    pairs = length - 1  # bases i = 0..T-2
    device = input_ids.device
    dtype = head.eh_proj.weight.dtype
    base = torch.arange(pairs, device=device)
    cache = DynamicCache()
    total = torch.zeros((), device=device)
    losses, top1s, counts = [], [], []
    feedback = hidden[:, :pairs].to(dtype)
    for step in range(1, unroll + 1):
        # step s: token t_{i+s} at position i+s-1, supervised by p_{i+s}
        valid = base[None, :] + step <= batch.lengths[:, None] - 1  # [B, pairs]
        if not bool(valid.any()):
            break
        token_index = (base + step).clamp(max=length - 1)
        tokens = input_ids[:, token_index]
        positions = (base + step - 1).expand(size, pairs)
        keys = cache.get_seq_length() + pairs
        allowed = torch.zeros(pairs, keys, dtype=torch.bool, device=device)
        allowed[:, :pairs] = base[None, :] <= base[:, None]  # exact pairs of positions <= i (causal)
        for earlier in range(1, step):  # this base's own recursive pairs of steps 2..s
            allowed[base, earlier * pairs + base] = True
        mask = attention_mask_for(head.config, allowed[None, None].expand(size, 1, pairs, keys), dtype)
        output = head(tokens, feedback, positions, mask, cache)
        log_q = torch.log_softmax(output.logits.float(), dim=-1)
        teacher = probs[:, token_index]
        per_position = -(teacher * log_q).sum(-1)
        count = valid.sum()
        step_loss = (per_position * valid).sum() / count.clamp(min=1)
        total = total + (step_decay ** (step - 1)) * step_loss
        agree = (log_q.argmax(-1) == teacher.argmax(-1)) & valid
        losses.append(float(step_loss.detach()))
        top1s.append(float(agree.sum()) / max(int(count), 1))
        counts.append(int(count))
        feedback = output.hidden
    return total, StepMetrics(losses, top1s, counts)
