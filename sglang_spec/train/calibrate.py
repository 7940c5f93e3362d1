"""Measuring an acceptance profile (``sglang-spec calibrate``): both of its sections.

* ``calibrate``, the positional table (``rank_acceptance``), from traffic as token ids (``records.EncodedRecord``:
  prompt and completion, where the completion starts). For every completion position b of the traffic, the head drafts a
  chain along the target's own continuation,
exactly as a tree node at depth d sees it (exact pairs up to b, its own recursive pairs after). At depth d the
head ranks its candidates x_1, x_2, ...; with deterministic top-k children and the lossless sample-and-match
rule, the rank-k child of an accepted node is the accepted one with probability p_T(x_k), the target's tempered
probability of that token (at temperature 0: 1 when x_k is the target's argmax). The profile entry for depth d,
rank k is the average of p_T(x_k^(d)) over positions, which is what Sequoia's DP needs.

Positions come from the completions (where drafting happens) and follow the completion's own tokens; calibrate
on greedy traffic for temperature 0 (the continuation then is the target's argmax path).

* ``calibrate_sources``, the per-source counts (``sources``), by decoding prompts: the decoder's own online
  calibration run from a negligible prior with a wide hybrid tree (many candidates of every kind offered at every
  accepted node) counts, for every offered candidate, whether it was the accepted child. Those counts are exactly
  the conditional acceptance P(accepted | parent accepted) best-first trees multiply along a path. Calibrate on
  prompts the benchmarks never see (``scripts/calibrate_sources.sh`` uses the heads' training prompts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from tqdm import tqdm

from sglang_spec.decode.decoder import GenerationConfig, SpeculativeDecoder
from sglang_spec.errors import SpecError
from sglang_spec.models.loading import LoadedModel
from sglang_spec.mtp.head import MTPHead
from sglang_spec.sampling import SamplingParams
from sglang_spec.train.distill import TeacherBatch, unrolled_steps
from sglang_spec.train.records import EncodedRecord
from sglang_spec.tree.ngram import DEFAULT_MAX_NGRAM
from sglang_spec.tree.policies import TreePolicy
from sglang_spec.tree.profile import AcceptanceProfile, SourceCounts

# a prior this light is outweighed by the first observation of a cell; unobserved cells keep its guess
_NEGLIGIBLE = 1e-3


@dataclass(frozen=True)
class Calibration:
    profile: AcceptanceProfile
    positions: list[int]  # supervised positions per depth
    top1: list[float]  # rank-1 acceptance per depth (the headline number)


@torch.no_grad()
def calibrate(
    loaded: LoadedModel,
    head: MTPHead,
    records: Sequence[EncodedRecord],
    depth: int = 6,
    max_rank: int = 8,
    temperature: float = 0.0,
    seq_len: int = 512,
    batch_size: int = 8,
    progress: bool = True,
) -> Calibration:
    if depth < 1 or max_rank < 1:
        raise SpecError("depth and max-rank must be >= 1")
    if max_rank > head.draft_vocab_size:
        raise SpecError(f"max-rank {max_rank} exceeds the head's draft vocabulary of {head.draft_vocab_size} "
                        f"tokens")
    temperature = SamplingParams(temperature=temperature).temperature  # refuses NaN; below the floor is greedy
    model = loaded.model
    device = next(model.parameters()).device
    encoded = [EncodedRecord(record.id, list(record.tokens[:seq_len]), min(record.completion_start, seq_len))
               for record in records]
    encoded = [record for record in encoded if len(record.tokens) - record.completion_start >= 2]
    if not encoded:
        raise SpecError("no completions long enough to calibrate on")
    sums = torch.zeros(depth, max_rank, dtype=torch.float64)
    counts = torch.zeros(depth, dtype=torch.float64)
    bar = tqdm(total=len(encoded), desc="calibrating", disable=not progress)
    head.eval()
    for start in range(0, len(encoded), batch_size):
        chunk = encoded[start : start + batch_size]
        width = max(len(record.tokens) for record in chunk)
        input_ids = torch.zeros(len(chunk), width, dtype=torch.int64)
        loss_mask = torch.zeros(len(chunk), width, dtype=torch.bool)
        for row, record in enumerate(chunk):
            input_ids[row, : len(record.tokens)] = torch.tensor(record.tokens)
            loss_mask[row, record.first_drafted : len(record.tokens)] = True
        input_ids = input_ids.to(device)
        hidden = model.model(input_ids=input_ids, use_cache=False).last_hidden_state
        logits = model.lm_head(hidden).float()
        flat_logits = logits.reshape(-1, logits.shape[-1])
        argmax = logits.argmax(-1)
        log_norm = torch.logsumexp(logits / temperature, dim=-1).reshape(-1) if temperature > 0 else None
        row_offset = (torch.arange(len(chunk), device=device) * width)[:, None]
        batch = TeacherBatch(
            input_ids=input_ids,
            lengths=torch.tensor([len(r.tokens) for r in chunk], device=device),
            hidden=hidden,
            target_ids=torch.zeros(len(chunk), width, 1, dtype=torch.int64, device=device),
            target_probs=torch.zeros(len(chunk), width, 1, device=device),
            loss_mask=loss_mask.to(device),
        )
        for drafted in unrolled_steps(head, batch, unroll=depth):
            # p_T of the head's rank-k candidate, at the position whose next token this step predicts
            ranked = head.to_full_vocab(torch.topk(drafted.logits, max_rank, dim=-1).indices)  # [B, pairs, R]
            if temperature == 0:
                accepted = (ranked == argmax[:, drafted.token_index, None]).double()
            else:
                assert log_norm is not None
                flat_rows = row_offset + drafted.token_index[None, :]  # [B, pairs] rows of flat_logits
                values = flat_logits[flat_rows[..., None], ranked]  # [B, pairs, R], no [B, pairs, V] copy
                accepted = torch.exp(values / temperature - log_norm[flat_rows][..., None]).double()
            sums[drafted.step - 1] += (accepted * drafted.valid[..., None]).sum((0, 1)).double().cpu()
            counts[drafted.step - 1] += drafted.valid.sum().double().cpu()
        bar.update(len(chunk))
    bar.close()
    usable = int((counts > 0).sum())
    if usable == 0:
        raise SpecError("no calibration positions: completions are too short for the requested depth")
    rows = (sums[:usable] / counts[:usable, None]).tolist()
    profile = AcceptanceProfile.from_obj({
        # rounded down so a row never sums past 1 by rounding
        "rank_acceptance": [[math.floor(value * 1e6) / 1e6 for value in row] for row in rows],
        "temperature": temperature,
        "positions_per_depth": [int(c) for c in counts[:usable]],
    })
    return Calibration(profile, [int(c) for c in counts[:usable]], [row[0] for row in rows])


def calibrate_sources(
    loaded: LoadedModel,
    head: MTPHead,
    prompts: Sequence[list[int]],
    config: GenerationConfig,
    max_ngram: int = DEFAULT_MAX_NGRAM,
    progress: bool = True,
) -> SourceCounts:
    """Counts of accepted / offered candidates per cell, over greedy or sampled decoding (``config``) of
    ``prompts`` with a wide hybrid tree."""
    prior = AcceptanceProfile.load(None).with_sources(SourceCounts.generic(max_ngram, weight=_NEGLIGIBLE))
    policy = TreePolicy("hybrid", budget=32, depth=10, mtp_levels=3, topk=4, lookup_width=4, max_ngram=max_ngram,
                        profile=prior)
    decoder = SpeculativeDecoder(loaded.model, head, policy)
    for prompt in tqdm(prompts, desc="calibrating sources", disable=not progress):
        decoder.generate([prompt], config)
    counts = decoder.tree_drafter.counts
    counts.source = f"{len(prompts)} prompts, temperature {config.sampling.temperature}"
    return counts
