"""Self-distillation of an MTP head: match the target's own distribution for the token after next, with the
recursive drafting unrolled so deeper tree levels are trained on what they will actually see.

For a token sequence t_0..t_{T-1} the frozen target gives final hidden states h_i and next-token distributions
p_i = p(. | t_<=i). Step 1 runs the head on the exact pairs (h_i, t_{i+1}) at positions i and matches p_{i+1}.
Step s > 1 runs it on (g_{s-1}(i), t_{i+s}) at position i+s-1, where g_{s-1}(i) is the head's own feedback state
from step s-1 for the same base i, and matches p_{i+s}. Each step-s pair attends to the exact pairs of positions
<= i and to its own base's recursive pairs of steps 2..s: the same view a depth-(s-1) tree node has at inference.

Loss: sum over steps of weight_s * cross-entropy between p (restricted to the head's draft vocabulary) and the
head's distribution; weights decay by ``step_decay`` (EAGLE-3 uses 0.8). Teacher targets may be sparse: the top-K
of p over the draft vocabulary (K = the whole draft vocabulary is the dense case).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, TYPE_CHECKING

import torch

from sglang_spec.attention.kv_cache import new_dynamic_cache
from sglang_spec.attention.masks import attention_mask_for
from sglang_spec.mtp.head import MTPHead

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True, eq=False)
class TeacherBatch:
    """Fields (B sequences, right-padded to T):
      input_ids:    [B, T] int64.
      lengths:      [B] int64 real tokens per sequence.
      hidden:       [B, T, d] the target's final (post-norm) hidden states.
      target_ids:   [B, T, K] int64 draft-vocabulary indices of the teacher's top-K next tokens, most likely first.
      target_probs: [B, T, K] float32 their probabilities under the target (the rest of the mass is dropped).
      loss_mask:    [B, T] bool, positions whose next-token prediction is supervised (None = all real ones).
    """

    input_ids: torch.Tensor
    lengths: torch.Tensor
    hidden: torch.Tensor
    target_ids: torch.Tensor
    target_probs: torch.Tensor
    loss_mask: torch.Tensor | None = None


@torch.no_grad()
def teacher_batch(target: PreTrainedModel, head: MTPHead, sequences: list[list[int]],
                  temperature: float = 1.0) -> TeacherBatch:
    """Runs the frozen target over right-padded sequences (causal, so padding never leaks backwards)."""
    device = next(target.parameters()).device
    width = max(len(sequence) for sequence in sequences)
    input_ids = torch.zeros(len(sequences), width, dtype=torch.int64)
    for row, sequence in enumerate(sequences):
        input_ids[row, : len(sequence)] = torch.tensor(sequence)
    input_ids = input_ids.to(device)
    output = target.model(input_ids=input_ids, use_cache=False)
    hidden = output.last_hidden_state
    probs = torch.softmax(target.lm_head(hidden).float() / temperature, dim=-1)
    if head.draft_vocab is not None:
        probs = probs.index_select(-1, head.draft_vocab.to(device))
    target_probs, target_ids = torch.sort(probs, dim=-1, descending=True)
    lengths = torch.tensor([len(sequence) for sequence in sequences], device=device)
    return TeacherBatch(input_ids, lengths, hidden, target_ids, target_probs)


@dataclass(frozen=True)
class StepMetrics:
    """Per unrolled step: loss, top-1 agreement with the target, and the number of supervised positions."""

    loss: list[float]
    top1: list[float]
    count: list[int]


@dataclass(frozen=True, eq=False)
class UnrolledStep:
    """One unrolled drafting step over all bases i = 0..T-2 of a batch.

    Fields:
      step:        s (1 = the exact pairs; s > 1 drafts at tree depth s - 1).
      logits:      [B, T - 1, V_draft] the head's logits for the token at position i + s + 1.
      valid:       [B, T - 1] bool, supervised positions (inside the sequence and the loss mask).
      token_index: [T - 1] int64, i + s: the position whose next-token distribution the step predicts.
    """

    step: int
    logits: torch.Tensor
    valid: torch.Tensor
    token_index: torch.Tensor


def step_valid(batch: TeacherBatch, step: int) -> torch.Tensor:
    """[B, T - 1] bool: the bases i whose step-``step`` prediction is supervised (t_{i+step} inside the sequence
    and, with a loss mask, in it)."""
    size, length = batch.input_ids.shape
    base = torch.arange(length - 1, device=batch.input_ids.device)
    valid = base[None, :] + step <= batch.lengths[:, None] - 1
    if batch.loss_mask is not None:
        valid = valid & batch.loss_mask[:, (base + step).clamp(max=length - 1)]
    return valid


def unrolled_steps(head: MTPHead, batch: TeacherBatch, unroll: int, stop_when_empty: bool = True
                   ) -> Iterator[UnrolledStep]:
    """Runs the head ``unroll`` times, feeding back its own hidden states, with inference's attention view.
    ``stop_when_empty``: stop at the first step with no supervised position in this batch (False: always run
    ``unroll`` steps, as every rank of a distributed run must, since each forward is a collective there)."""
    input_ids, hidden = batch.input_ids, batch.hidden
    size, length = input_ids.shape
    pairs = length - 1  # bases i = 0..T-2
    device = input_ids.device
    dtype = head.eh_proj.weight.dtype
    base = torch.arange(pairs, device=device)
    cache = new_dynamic_cache()
    feedback = hidden[:, :pairs].to(dtype)
    for step in range(1, unroll + 1):
        # step s: token t_{i+s} at position i+s-1, supervised by p_{i+s}
        valid = step_valid(batch, step)  # [B, pairs]
        token_index = (base + step).clamp(max=length - 1)
        if stop_when_empty and not bool(valid.any()):
            return
        tokens = input_ids[:, token_index]
        positions = (base + step - 1).expand(size, pairs)
        keys = cache.get_seq_length() + pairs
        allowed = torch.zeros(pairs, keys, dtype=torch.bool, device=device)
        allowed[:, :pairs] = base[None, :] <= base[:, None]  # exact pairs of positions <= i (causal)
        for earlier in range(1, step):  # this base's own recursive pairs of steps 2..s
            allowed[base, earlier * pairs + base] = True
        mask = attention_mask_for(head.config, allowed[None, None].expand(size, 1, pairs, keys), dtype)
        output = head(tokens, feedback, positions, mask, cache)
        yield UnrolledStep(step, output.logits, valid, token_index)
        feedback = output.hidden


def unrolled_loss(head: MTPHead, batch: TeacherBatch, unroll: int, step_decay: float = 0.8,
                  reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[torch.Tensor, StepMetrics]:
    """The training objective on one teacher batch (differentiable in the head's parameters).

    ``reduce`` sums a tensor over the ranks of a distributed run (None: one process). Each step's loss is
    normalised by the supervised positions of the whole (global) batch, so the ranks' losses add up to the loss
    of the batch in one process, and their gradients summed are its gradient. The metrics are global."""
    reduce = reduce if reduce is not None else (lambda tensor: tensor)
    device = batch.input_ids.device
    local_counts = torch.stack([step_valid(batch, step).sum() for step in range(1, unroll + 1)])
    global_counts = reduce(local_counts.to(torch.float64)).round().long().tolist()
    # the leading steps with a supervised position anywhere (a single process stops at its first empty step)
    steps = next((index for index, count in enumerate(global_counts) if count == 0), unroll)
    total = torch.zeros((), device=device)
    sums = torch.zeros(2, steps, device=device)  # [loss sum, top-1 agreements] per step, float32 as the loss
    for drafted in unrolled_steps(head, batch, steps, stop_when_empty=False):
        index = drafted.step - 1
        log_q = torch.log_softmax(drafted.logits.float(), dim=-1)
        teacher_ids = batch.target_ids[:, drafted.token_index]
        per_position = -(batch.target_probs[:, drafted.token_index] * log_q.gather(-1, teacher_ids)).sum(-1)
        step_sum = (per_position * drafted.valid).sum()
        total = total + (step_decay ** index) * (step_sum / global_counts[index])
        agree = (log_q.argmax(-1) == teacher_ids[..., 0]) & drafted.valid
        sums[0, index] = step_sum.detach()
        sums[1, index] = agree.sum()
    sums = reduce(sums)
    counts = global_counts[:steps]
    return total, StepMetrics([float(sums[0, s] / counts[s]) for s in range(steps)],
                              [float(sums[1, s]) / counts[s] for s in range(steps)], counts)
