"""Training an MTP head on traffic (``sglang-spec train``).

1. Tokenise every record as the server saw it: the prompt (chat template for messages) then the completion and
   the end-of-turn token. Positions inside the completion are marked: that is where drafting happens.
2. Pick the draft vocabulary: the ``draft_vocab`` most frequent completion tokens (0 = the full vocabulary).
3. Teacher pass, once: the frozen target's final hidden states (float16) and its top-K next-token probabilities
   over the draft vocabulary at every position, cached on disk next to the output.
4. Train the head with the unrolled self-distillation objective (``distill.unrolled_loss``), AdamW with warmup
   and cosine decay, gradient clipping; periodic checkpoints (the head as a usable .safetensors plus a
   ``.state.pt`` with optimizer and RNG state); ``resume`` continues from the last checkpoint; Ctrl-C saves one.
   A NaN or infinite loss stops training (the last checkpoint stays); no file is written non-atomically and no
   head with a non-finite weight is ever written.

``train_head`` runs these as four steps: ``prepare_data`` (1, 2), ``load_or_build_teacher`` (3), ``start_fit`` +
``fit`` (4) and ``Checkpoints``. ``train_head_from_capture`` replaces 1 and 3 by a captured dataset
(``train/capture.py``): the sequences and the target's hidden states come from the server that captured them and
the top-K targets from those states through the target's output head, so only the target's embedding and output
head are loaded (``models/target_shell.py``), never its layers.

Steps 3-4 run on the distributed engine of ``train/distributed.py``: under ``torchrun`` each rank trains on its
share of every global batch with the head sharded by FSDP2; one plain process is the world-size-1 case of the
same code. The loss of a batch is normalised over the whole batch, so W ranks reach the loss one process does.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm import tqdm

from sglang_spec.errors import SpecError
from sglang_spec.files import atomic_write, check_output_path
from sglang_spec.models.loading import LoadedModel
from sglang_spec.mtp.checkpoint import save_mtp_head
from sglang_spec.mtp.head import MTPHead
from sglang_spec.train.capture import CapturedSequence, iter_captured, read_manifest
from sglang_spec.train.distill import TeacherBatch, unrolled_loss
from sglang_spec.train.distributed import World, full_state, load_full_state, rank_rows, shard_head
from sglang_spec.train.records import EncodedRecord, encode_record, is_eval_record
from sglang_spec.train.teacher_store import TeacherStore
from sglang_spec.train.traffic import TrafficRecord


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 512
    unroll: int = 3
    step_decay: float = 0.8
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.01
    draft_vocab: int = 8192
    top_k_targets: int = 32
    checkpoint_every: int = 100
    eval_fraction: float = 0.05
    seed: int = 0
    feedback: str = "pre_norm"
    save_dtype: str = "float32"
    autocast_bf16: bool = False

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "unroll", "top_k_targets", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise SpecError(f"{name.replace('_', '-')} must be >= 1")
        if self.draft_vocab < 0:
            raise SpecError("draft-vocab must be >= 0 (0 = the full vocabulary)")
        if not 0 <= self.eval_fraction < 1:
            raise SpecError("eval-fraction must be in [0, 1)")
        if not 0 < self.lr <= 1:  # NaN too
            raise SpecError(f"lr must be in (0, 1], got {self.lr}")
        if self.save_dtype not in ("float32", "bfloat16", "float16"):
            raise SpecError("save-dtype must be float32, bfloat16 or float16")


def choose_draft_vocab(records: Sequence[EncodedRecord], size: int,
                       vocab_size: int) -> tuple[torch.Tensor | None, float]:
    """The ``size`` most frequent completion tokens (most frequent first) and the share of completion tokens they
    cover. size 0 or >= vocab: None (the full vocabulary), coverage 1."""
    if size == 0 or size >= vocab_size:
        return None, 1.0
    counts = Counter(token for record in records for token in record.tokens[record.completion_start :])
    chosen = [token for token, _ in counts.most_common(size)]
    for token in range(vocab_size):  # pad with unseen ids so the size is exact
        if len(chosen) >= size:
            break
        if token not in counts:
            chosen.append(token)
    total = sum(counts.values())
    covered = sum(counts[token] for token in chosen[:size])
    return torch.tensor(chosen[:size], dtype=torch.int64), covered / max(total, 1)


@dataclass
class TeacherCache:
    """Per sequence: tokens, completion start, hidden [L, d] float16, top-K draft-vocab ids [L, K] and probs."""

    records: list[EncodedRecord]
    hidden: list[torch.Tensor]
    target_ids: list[torch.Tensor]
    target_probs: list[torch.Tensor]


@torch.no_grad()
def build_teacher_cache(loaded: LoadedModel, records: Sequence[EncodedRecord], draft_vocab: torch.Tensor | None,
                        top_k: int, progress: bool = True, batch_tokens: int = 2048) -> TeacherCache:
    model = loaded.model
    device = next(model.parameters()).device
    order = sorted(range(len(records)), key=lambda i: len(records[i].tokens))
    hidden_list: list = [None] * len(records)
    ids_list: list = [None] * len(records)
    probs_list: list = [None] * len(records)
    bar = tqdm(total=sum(len(r.tokens) for r in records), desc="teacher pass (once)", unit="tok", disable=not progress)
    index = 0
    while index < len(order):
        width = len(records[order[index]].tokens)
        chunk = [order[index]]
        while index + len(chunk) < len(order):
            nxt = order[index + len(chunk)]
            if (len(chunk) + 1) * len(records[nxt].tokens) > batch_tokens:
                break
            chunk.append(nxt)
        width = max(len(records[i].tokens) for i in chunk)
        input_ids = torch.zeros(len(chunk), width, dtype=torch.int64)
        for row, i in enumerate(chunk):
            input_ids[row, : len(records[i].tokens)] = torch.tensor(records[i].tokens)
        hidden = model.model(input_ids=input_ids.to(device), use_cache=False).last_hidden_state
        probs = torch.softmax(model.lm_head(hidden).float(), dim=-1)
        if draft_vocab is not None:
            probs = probs.index_select(-1, draft_vocab.to(device))
        top_probs, top_ids = torch.topk(probs, top_k, dim=-1)
        for row, i in enumerate(chunk):
            length = len(records[i].tokens)
            hidden_list[i] = hidden[row, :length].to(torch.float16).cpu()
            ids_list[i] = top_ids[row, :length].to(torch.int32).cpu()
            probs_list[i] = top_probs[row, :length].to(torch.float16).cpu()
        bar.update(sum(len(records[i].tokens) for i in chunk))
        index += len(chunk)
    bar.close()
    return TeacherCache(list(records), hidden_list, ids_list, probs_list)


@torch.no_grad()
def soft_targets(hidden: torch.Tensor, output_weight: torch.Tensor, draft_vocab: torch.Tensor | None,
                 top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top-K next-token probabilities over the draft vocabulary from its final hidden states.
    hidden: [L, d]; output_weight: [V, d] the output head. Returns ids [L, K] int32 (draft-vocabulary indices,
    most likely first) and probs [L, K] float16."""
    probs = torch.softmax(torch.nn.functional.linear(hidden.to(output_weight.device, output_weight.dtype),
                                                     output_weight).float(), dim=-1)
    if draft_vocab is not None:
        probs = probs.index_select(-1, draft_vocab.to(probs.device))
    top_probs, top_ids = torch.topk(probs, top_k, dim=-1)
    return top_ids.to(torch.int32).cpu(), top_probs.to(torch.float16).cpu()


def teacher_from_capture(data: TrainingData, hidden: Sequence[torch.Tensor], output_weight: torch.Tensor,
                         top_k: int, progress: bool = True, store: Path | None = None) -> TeacherCache:
    """Step 3 from a capture: the captured hidden states (float16, [L, d] per record) and their soft targets;
    ``store``: a folder that keeps each sequence's targets for later runs over the same sequences
    (``teacher_store``)."""
    kept = None if store is None else TeacherStore(store, output_weight, data.draft_vocab, top_k)
    ids_list, probs_list = [], []
    for states in tqdm(hidden, desc="soft targets from captured states", unit="seq", disable=not progress):
        targets = None if kept is None else kept.get(states)
        if targets is None:
            targets = soft_targets(states, output_weight, data.draft_vocab, top_k)
            if kept is not None:
                kept.put(states, *targets)
        ids_list.append(targets[0])
        probs_list.append(targets[1])
    return TeacherCache(list(data.records), [states.to(torch.float16) for states in hidden], ids_list, probs_list)


def make_batch(cache: TeacherCache, rows: Sequence[int], device: torch.device, dtype: torch.dtype,
               supervised: bool = True, drafted_only: bool = False) -> TeacherBatch:
    """The padded batch of ``rows``; ``supervised`` False masks every position out of the loss (a distributed
    rank's stand-in row, ``distributed.rank_rows``); ``drafted_only`` masks the positions a server never drafts
    at (the prompt's, ``EncodedRecord.first_drafted``)."""
    width = max(len(cache.records[row].tokens) for row in rows)
    size, top_k = len(rows), cache.target_ids[rows[0]].shape[1]
    hidden_size = cache.hidden[rows[0]].shape[1]
    input_ids = torch.zeros(size, width, dtype=torch.int64)
    hidden = torch.zeros(size, width, hidden_size, dtype=torch.float32)
    target_ids = torch.zeros(size, width, top_k, dtype=torch.int64)
    target_probs = torch.zeros(size, width, top_k, dtype=torch.float32)
    loss_mask = torch.zeros(size, width, dtype=torch.bool)
    lengths = torch.zeros(size, dtype=torch.int64)
    for slot, row in enumerate(rows):
        record = cache.records[row]
        length = len(record.tokens)
        input_ids[slot, :length] = torch.tensor(record.tokens)
        hidden[slot, :length] = cache.hidden[row].float()
        target_ids[slot, :length] = cache.target_ids[row].long()
        target_probs[slot, :length] = cache.target_probs[row].float()
        first = record.first_drafted if drafted_only else 0
        loss_mask[slot, first:length] = supervised
        lengths[slot] = length
    return TeacherBatch(input_ids.to(device), lengths.to(device), hidden.to(device, dtype), target_ids.to(device),
                        target_probs.to(device), loss_mask.to(device))


@dataclass
class TrainSummary:
    steps: int
    seconds: float
    train_top1: list[float]
    eval_top1: list[float]
    # the --init head's held-out top-1 on the same positions, before training ([] without --init or on --resume)
    init_eval_top1: list[float]
    draft_vocab_size: int
    draft_vocab_coverage: float
    train_sequences: int
    eval_sequences: int
    train_tokens: int


def state_path_for(out: Path) -> Path:
    return out.with_suffix(".state.pt")


def _cache_path(out: Path) -> Path:
    return out.with_suffix(".teacher.pt")


def _fingerprint(model_name: str, records: Sequence[EncodedRecord], config: TrainConfig) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps([model_name, config.draft_vocab, config.top_k_targets, config.seq_len]).encode())
    for record in records:
        digest.update(record.id.encode())
        digest.update(bytes(str(record.tokens), "utf-8"))
    return digest.hexdigest()[:16]


@torch.no_grad()
def evaluate(
    head: MTPHead, cache: TeacherCache, rows: Sequence[int], config: TrainConfig, device: torch.device,
    dtype: torch.dtype, world: World = World(),
) -> list[float]:
    """Top-1 agreement with the target per unrolled step over ``rows``, at the positions a server drafts at (the
    completion's: what acceptance is made of), each batch shared by the ranks."""
    if not rows:
        return []
    agree = [0.0] * config.unroll
    count = [0] * config.unroll
    for start in range(0, len(rows), config.batch_size):
        mine, real = rank_rows(list(rows[start : start + config.batch_size]), world)
        _, metrics = unrolled_loss(head, make_batch(cache, mine, device, dtype, supervised=real, drafted_only=True),
                                   config.unroll, config.step_decay, reduce=world.sum)
        for step, (top1, number) in enumerate(zip(metrics.top1, metrics.count)):
            agree[step] += top1 * number
            count[step] += number
    return [a / max(c, 1) for a, c in zip(agree, count)]


@dataclass(frozen=True, eq=False)
class TrainingData:
    """Step 1, data: the encoded records (three tokens or more), their train / eval split by prompt, and the draft
    vocabulary chosen on the training rows. ``fingerprint`` identifies the data and the teacher settings."""

    records: list[EncodedRecord]
    train_rows: list[int]
    eval_rows: list[int]
    draft_vocab: torch.Tensor | None
    draft_vocab_coverage: float
    fingerprint: str


def check_seq_len(loaded: LoadedModel, config: TrainConfig) -> None:
    context = loaded.context_length
    if context is not None and config.seq_len > context:
        raise SpecError(f"--seq-len {config.seq_len} exceeds {loaded.name}'s context of {context} tokens; use at "
                        f"most {context}")


def prepare_data(loaded: LoadedModel, records: Sequence[TrafficRecord], config: TrainConfig) -> TrainingData:
    check_seq_len(loaded, config)
    encoded = [encode_record(loaded, record, config.seq_len) for record in records]
    return split_data(loaded, [record for record in encoded if len(record.tokens) >= 3], config)


def split_data(loaded: LoadedModel, encoded: list[EncodedRecord], config: TrainConfig) -> TrainingData:
    """Step 1's split and draft vocabulary over encoded records (three tokens or more)."""
    eval_rows = [i for i, r in enumerate(encoded) if is_eval_record(r.id, config.eval_fraction)]
    train_rows = [i for i, r in enumerate(encoded) if not is_eval_record(r.id, config.eval_fraction)]
    if not train_rows:
        raise SpecError("no training sequences (every record is in the evaluation split or too short)")
    vocab_size = loaded.model.config.vocab_size
    draft_vocab, coverage = choose_draft_vocab([encoded[i] for i in train_rows], config.draft_vocab, vocab_size)
    draft_size = vocab_size if draft_vocab is None else len(draft_vocab)
    if config.top_k_targets > draft_size:
        raise SpecError(f"--top-k-targets {config.top_k_targets} exceeds the draft vocabulary of {draft_size} "
                        f"tokens; use at most {draft_size}")
    return TrainingData(encoded, train_rows, eval_rows, draft_vocab, coverage,
                        _fingerprint(loaded.name, encoded, config))


def captured_data(loaded: LoadedModel, sequences: Sequence[CapturedSequence], config: TrainConfig
                  ) -> tuple[TrainingData, list[torch.Tensor]]:
    """Step 1 from a capture: each sequence's tokens with a hidden state (all but the last, whose next token the
    target never predicted; see ``train/capture.py``), cut to the last ``seq_len`` of them, and those states
    [L, d]. The end is kept: a long prompt (a document to extract from) would otherwise leave no answer token to
    learn from, and the server computed each state over the whole sequence, so a window's states are exact."""
    check_seq_len(loaded, config)
    encoded, hidden = [], []
    for sequence in sequences:
        stated = len(sequence.tokens) - 1  # tokens with a hidden state
        length = min(stated, config.seq_len)
        if length < 3:
            continue
        first = stated - length
        # ``{prompt id}/{answer}`` as generated traffic names its records, so the split goes by prompt
        encoded.append(EncodedRecord(f"{sequence.id}/captured", sequence.tokens[first:stated].tolist(),
                                     min(max(sequence.completion_start - first, 0), length)))
        hidden.append(sequence.hidden[first:stated])
    return split_data(loaded, encoded, config), hidden


def with_draft_vocab(data: TrainingData, draft_vocab: torch.Tensor | None, config: TrainConfig) -> TrainingData:
    """``data`` drafting over ``draft_vocab`` (None: the full vocabulary), its coverage of the training rows'
    completion tokens recomputed."""
    if draft_vocab is None:
        return replace(data, draft_vocab=None, draft_vocab_coverage=1.0)
    draft_vocab = draft_vocab.detach().to("cpu", torch.int64)
    if config.top_k_targets > len(draft_vocab):
        raise SpecError(f"--top-k-targets {config.top_k_targets} exceeds the kept draft vocabulary of "
                        f"{len(draft_vocab)} tokens; use at most {len(draft_vocab)}")
    kept = set(draft_vocab.tolist())
    completions = [token for row in data.train_rows
                   for token in data.records[row].tokens[data.records[row].completion_start :]]
    coverage = sum(token in kept for token in completions) / max(len(completions), 1)
    return replace(data, draft_vocab=draft_vocab, draft_vocab_coverage=coverage)


def load_or_build_teacher(
    loaded: LoadedModel, data: TrainingData, config: TrainConfig, cache_path: Path, progress: bool,
    write: bool = True,
) -> TeacherCache:
    """Step 2, teacher: the cached teacher pass when it was made from the same data, else a fresh one (saved
    when ``write``: by one rank of a distributed run). A cache that cannot be read (damaged, or another
    version's) is only a cache: it is built again."""
    if cache_path.exists():
        cache = _read_teacher_cache(cache_path, data)
        if cache is not None:
            return cache
    cache = build_teacher_cache(loaded, data.records, data.draft_vocab, config.top_k_targets, progress=progress)
    if not write:
        return cache
    with atomic_write(cache_path, "wb") as handle:
        torch.save({
            "fingerprint": data.fingerprint, "hidden": cache.hidden, "target_ids": cache.target_ids,
            "target_probs": cache.target_probs,
        }, handle)
    return cache


def _read_teacher_cache(path: Path, data: TrainingData) -> TeacherCache | None:
    """The cached teacher pass for ``data``, or None when the file is damaged, from other data, or malformed.
    Plain tensors and strings only (``weights_only``): loading runs no pickled code."""
    try:
        stored = torch.load(path, weights_only=True, map_location="cpu")
    except Exception:  # torch raises many types for a damaged file (pickle, zip, runtime errors)
        return None
    count = len(data.records)
    if not isinstance(stored, dict) or stored.get("fingerprint") != data.fingerprint:
        return None
    hidden, target_ids, target_probs = (stored.get(name) for name in ("hidden", "target_ids", "target_probs"))
    if not all(isinstance(items, list) and len(items) == count for items in (hidden, target_ids, target_probs)):
        return None
    assert isinstance(hidden, list) and isinstance(target_ids, list) and isinstance(target_probs, list)
    for record, h, ids, probs in zip(data.records, hidden, target_ids, target_probs):
        length = len(record.tokens)
        if not all(isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[0] == length for t in (h, ids, probs)):
            return None
        if ids.shape != probs.shape or not bool(torch.isfinite(h).all()):
            return None
    return TeacherCache(list(data.records), hidden, target_ids, target_probs)


@dataclass
class FitState:
    """Step 3's state, everything a checkpoint saves: the head, its optimizer and schedule, the steps taken,
    the training seconds, the evaluation history, and the batch stream's generator state after the last step
    taken (so a resumed run draws the batches the uninterrupted one would; None: start the stream)."""

    head: MTPHead
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    step: int = 0
    elapsed: float = 0.0
    history: list[dict[str, Any]] = field(default_factory=list)
    batch_stream: torch.Tensor | None = None


def learning_rate_factor(step: int, config: TrainConfig) -> float:
    """Linear warmup over ``config.warmup`` steps (at most a tenth of the run), then cosine decay to 10% at
    ``config.steps``. The cap keeps a short run (an ``adapt`` round of a few dozen steps) from ending at its peak
    rate, still warming up, where its last steps move the weights most."""
    warmup = min(config.warmup, max(1, config.steps // 10))
    if step < warmup:
        return (step + 1) / warmup
    progress_fraction = (step - warmup) / max(1, config.steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress_fraction, 1.0)))


def target_device_dtype(loaded: LoadedModel) -> tuple[torch.device, torch.dtype]:
    """Where the head trains and in which dtype: the target's embedding's (a target shell has no other weight)."""
    weight = loaded.model.get_input_embeddings().weight
    return weight.device, weight.dtype


def start_fit(
    loaded: LoadedModel, data: TrainingData, config: TrainConfig, init: MTPHead | None, resume_from: Path | None,
    world: World = World(),
) -> FitState:
    """A trainable head over the draft vocabulary (sharded over the ranks) with AdamW and the schedule, or the
    state of the checkpoint ``resume_from`` (which must come from the same data and settings)."""
    device, _ = target_device_dtype(loaded)
    head = init if init is not None else MTPHead.for_target(loaded.model, feedback=config.feedback)
    head.draft_vocab = None if data.draft_vocab is None else data.draft_vocab.to(device)
    head.refresh_draft_head()
    head.train()
    for parameter in head.parameters():
        parameter.requires_grad_(True)
    head = shard_head(head, world)
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(learning_rate_factor, config=config))
    state = FitState(head, optimizer, scheduler)
    if resume_from is not None:
        saved = load_training_state(resume_from)
        if saved["fingerprint"] != data.fingerprint:
            raise SpecError(f"{resume_from} was made from other traffic or settings; start over with --force")
        try:
            load_full_state(head, optimizer, saved["head"], saved["optimizer"])
            scheduler.load_state_dict(saved["scheduler"])
            torch.set_rng_state(saved["rng"])
        except (RuntimeError, ValueError, KeyError, TypeError) as error:
            raise SpecError(f"{resume_from} does not fit this head ({str(error).splitlines()[0][:120]}); "
                            f"start over with --force") from None
        # the learning rate is a setting, not state: this run's (see resume_config) replaces the saved one
        scheduler.base_lrs = [config.lr for _ in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = config.lr * learning_rate_factor(saved["step"], config)
        state.step, state.elapsed, state.history = saved["step"], saved["elapsed"], saved["history"]
        stream = saved.get("batch_stream")  # states written before it was saved restart the stream at seed + step
        state.batch_stream = stream if isinstance(stream, torch.Tensor) else None
    return state


_STATE_KEYS = {"step": int, "elapsed": float, "history": list, "fingerprint": str, "head": dict, "optimizer": dict,
               "scheduler": dict, "rng": torch.Tensor}
# settings that fix the data and the teacher pass: a resumed run cannot change them
FIXED_ON_RESUME = ("seq_len", "draft_vocab", "top_k_targets", "feedback", "eval_fraction")


def load_training_state(path: Path) -> dict[str, Any]:
    """A ``.state.pt`` checkpoint (tensors and plain values only, ``weights_only``), or one line saying why not."""
    try:
        saved = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as error:  # torch raises many types for a damaged file
        reason = str(error).splitlines()[0][:100] if str(error) else type(error).__name__
        raise SpecError(f"{path} is damaged ({reason}); start over with --force") from None
    if not isinstance(saved, dict):
        raise SpecError(f"{path} is not a training state; start over with --force")
    for key, kind in _STATE_KEYS.items():
        value = saved.get(key)
        if kind is float and isinstance(value, int):
            continue
        if not isinstance(value, kind):
            raise SpecError(f"{path} is damaged ({key!r} is missing or not a {kind.__name__}); "
                            f"start over with --force")
    return saved


def resume_config(state_path: Path, given: dict[str, Any]) -> tuple[TrainConfig, list[str]]:
    """``--resume``: the saved run's settings, with the ones given on this command line in their place (a note
    for each that differs); settings in ``FIXED_ON_RESUME`` cannot change."""
    saved = load_training_state(state_path).get("config")
    names = {f.name for f in fields(TrainConfig)}
    if not isinstance(saved, dict) or not set(saved) <= names:
        return TrainConfig(**given), [f"{state_path} predates saved settings: this command line's are used"]
    notes = []
    for name, value in given.items():
        if name in saved and saved[name] != value:
            flag = "--" + name.replace("_", "-")
            if name in FIXED_ON_RESUME:
                raise SpecError(f"{flag} {value} conflicts with the saved run's {saved[name]}: it fixes the "
                                f"training data; resume without it, or start over with --force")
            notes.append(f"resume: {flag} {value} replaces the saved run's {saved[name]} (the command line wins)")
    return TrainConfig(**{**saved, **given}), notes


@dataclass(frozen=True)
class Checkpoints:
    """Step 4, checkpoints: the head as a usable .safetensors (with a summary in its metadata) and, while training
    goes on, a ``.state.pt`` next to it with everything ``resume`` needs."""

    out: Path
    config: TrainConfig
    data: TrainingData
    metadata: dict[str, Any]
    world: World = World()

    @property
    def state_path(self) -> Path:
        return state_path_for(self.out)

    def save(self, state: FitState, final: bool = False) -> None:
        """A collective in a distributed run (the head's shards are gathered); rank 0 writes."""
        state.head.eval()
        head_state, optimizer_state = full_state(state.head, state.optimizer)
        if not self.world.is_main:
            self.world.barrier()
            state.head.train()
            return
        summary = {
            "steps": state.step,
            "config": asdict(self.config),
            "draft_vocab_coverage": self.data.draft_vocab_coverage,
            "train_sequences": len(self.data.train_rows),
            "eval_sequences": len(self.data.eval_rows),
            "history": state.history[-5:],
            **self.metadata,
        }
        save_mtp_head(state.head, self.out, metadata=summary, dtype=getattr(torch, self.config.save_dtype),
                      state=head_state)
        if not final:
            with atomic_write(self.state_path, "wb") as handle:
                torch.save({
                    "step": state.step, "elapsed": state.elapsed, "history": state.history,
                    "fingerprint": self.data.fingerprint, "head": head_state, "optimizer": optimizer_state,
                    "scheduler": state.scheduler.state_dict(), "rng": torch.get_rng_state(),
                    "config": asdict(self.config), "world_size": self.world.size,
                    "batch_stream": state.batch_stream,
                }, handle)
        self.world.barrier()
        state.head.train()


def fit(
    state: FitState,
    cache: TeacherCache,
    data: TrainingData,
    config: TrainConfig,
    checkpoints: Checkpoints,
    device: torch.device,
    dtype: torch.dtype,
    progress: bool,
    world: World = World(),
) -> list[float]:
    """Step 3, fit: AdamW steps on random training batches until ``config.steps``, evaluating and checkpointing
    every ``config.checkpoint_every`` steps; Ctrl-C saves a checkpoint (one process; a distributed run keeps its
    last one). Returns the last batch's top-1 per step. Every rank draws the same global batch and trains on its
    rows of it."""
    generator = torch.Generator().manual_seed(config.seed + state.step)
    if state.batch_stream is not None:
        generator.set_state(state.batch_stream)
    state.batch_stream = generator.get_state()
    bar = tqdm(total=config.steps, initial=state.step, desc="training MTP head",
               disable=not (progress and world.is_main))
    train_top1: list[float] = []
    try:
        while state.step < config.steps:
            tick = time.perf_counter()
            picks = torch.randint(len(data.train_rows), (config.batch_size,), generator=generator)
            rows, real = rank_rows([data.train_rows[int(i)] for i in picks], world)
            # bf16 autocast: float32 master weights and loss, bfloat16 matmuls (2x+ on CPUs with AVX-512 BF16)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.autocast_bf16):
                loss, metrics = unrolled_loss(state.head, make_batch(cache, rows, device, dtype, supervised=real),
                                              config.unroll, config.step_decay, reduce=world.sum)
            # this rank's part of the batch loss; the parts add up to it (and every rank sees the same sum)
            batch_loss = float(world.sum(loss.detach()))
            if not math.isfinite(batch_loss):
                raise SpecError(f"training diverged at step {state.step + 1}: the loss is {batch_loss}; lower "
                                f"--lr (now {config.lr:g}); no head was written from the diverged weights")
            state.optimizer.zero_grad()
            # FSDP2 averages the ranks' gradients; the batch's gradient is their sum
            (loss * world.size if world.size > 1 else loss).backward()
            total_norm = torch.nn.utils.clip_grad_norm_(state.head.parameters(), 1.0)
            # under FSDP2 the norm is a replicated DTensor (computed over every rank's shards)
            grad_norm = float(total_norm.full_tensor() if hasattr(total_norm, "full_tensor") else total_norm)
            state.optimizer.step()
            state.scheduler.step()
            state.step += 1
            state.batch_stream = generator.get_state()  # only a finished step moves the saved stream on
            state.elapsed += time.perf_counter() - tick
            train_top1 = metrics.top1
            bar.update()
            bar.set_postfix(loss=f"{batch_loss:.3f}", top1="/".join(f"{t:.2f}" for t in metrics.top1))
            if state.step % config.checkpoint_every == 0 or state.step == config.steps:
                eval_top1 = evaluate(state.head, cache, data.eval_rows, config, device, dtype, world)
                state.history.append({"step": state.step, "loss": batch_loss, "grad_norm": grad_norm,
                                      "train_top1": train_top1,
                                      "eval_top1": eval_top1})
                checkpoints.save(state)
    except KeyboardInterrupt:
        if not world.sharded:  # gathering the shards needs every rank; a distributed run keeps its last checkpoint
            checkpoints.save(state)
        bar.close()
        raise SpecError(f"interrupted at step {state.step}; continue with --resume") from None
    bar.close()
    return train_top1


def check_train_paths(out: Path, resume: bool, force: bool) -> None:
    """Before any work: ``out``, its training state and its teacher cache can be written, and ``resume`` has a
    state to resume from; a finished or started run is not overwritten without ``force``."""
    state_path = state_path_for(out)
    for path in (out, state_path, _cache_path(out)):
        check_output_path(path, force=True)  # a folder that exists, no device or folder in the way
    if resume:
        if not state_path.exists():
            raise SpecError(f"nothing to resume: {state_path} does not exist")
    elif not force and (out.exists() or state_path.exists()):
        raise SpecError(f"{out} (or its training state) exists; pass --force to overwrite or --resume to continue")


def train_head(
    loaded: LoadedModel,
    records: Sequence[TrafficRecord],
    config: TrainConfig,
    out: str | Path,
    init: MTPHead | None = None,
    resume: bool = False,
    force: bool = False,
    progress: bool = True,
    metadata: dict[str, Any] | None = None,
    world: World = World(),
) -> TrainSummary:
    """Data, teacher, fit, checkpoint: trains an MTP head for ``loaded`` on ``records`` and writes it to ``out``."""
    out = Path(out)
    check_train_paths(out, resume, force)
    torch.manual_seed(config.seed)
    data = prepare_data(loaded, records, config)
    cache = load_or_build_teacher(loaded, data, config, _cache_path(out), progress and world.is_main,
                                  write=world.is_main)
    return _fit_and_save(loaded, data, cache, config, out, init, resume, progress, metadata or {}, world)


def train_head_from_capture(
    loaded: LoadedModel,
    capture: str | Path,
    config: TrainConfig,
    out: str | Path,
    init: MTPHead | None = None,
    resume: bool = False,
    force: bool = False,
    progress: bool = True,
    metadata: dict[str, Any] | None = None,
    world: World = World(),
    keep_draft_vocab: bool = False,
    teacher_store: Path | None = None,
) -> TrainSummary:
    """Trains an MTP head on the captured dataset in ``capture`` and writes it to ``out``. ``loaded`` needs only
    the target's config, tokenizer, embedding and output head: a target shell (``models/target_shell.py``).
    ``keep_draft_vocab``: draft over ``init``'s vocabulary instead of the capture's most frequent tokens (a head
    swapped into a running server must keep the token map it launched with). ``teacher_store``: a folder that
    keeps each sequence's soft targets for later runs over the same sequences (``teacher_store``)."""
    out, capture = Path(out), Path(capture)
    check_train_paths(out, resume, force)
    manifest = read_manifest(capture)
    target = loaded.model.config
    for name, theirs in (("model_type", manifest.model_type), ("hidden_size", manifest.hidden_size),
                         ("vocab_size", manifest.vocab_size)):
        if getattr(target, name) != theirs:
            raise SpecError(f"{capture} was captured from a model with {name} {theirs}, but {loaded.name} has "
                            f"{getattr(target, name)}; give the --model that was served")
    torch.manual_seed(config.seed)
    data, hidden = captured_data(loaded, list(iter_captured(capture)), config)
    if keep_draft_vocab:
        if init is None:
            raise SpecError("--keep-draft-vocab keeps the --init head's draft vocabulary; give --init")
        data = with_draft_vocab(data, init.draft_vocab, config)
    output_weight = loaded.model.get_output_embeddings().weight
    cache = teacher_from_capture(data, hidden, output_weight, config.top_k_targets, progress and world.is_main,
                                 teacher_store)
    return _fit_and_save(loaded, data, cache, config, out, init, resume, progress, metadata or {}, world)


def _fit_and_save(loaded: LoadedModel, data: TrainingData, cache: TeacherCache, config: TrainConfig, out: Path,
                  init: MTPHead | None, resume: bool, progress: bool, metadata: dict[str, Any],
                  world: World) -> TrainSummary:
    """Steps 3-4 for either source: fit, the final evaluation, the final head; the training state removed."""
    state_path = state_path_for(out)
    state = start_fit(loaded, data, config, init, state_path if resume else None, world)
    checkpoints = Checkpoints(out, config, data, metadata, world)
    device, dtype = target_device_dtype(loaded)
    init_eval_top1 = (evaluate(state.head, cache, data.eval_rows, config, device, dtype, world)
                      if init is not None and state.step == 0 else [])
    train_top1 = fit(state, cache, data, config, checkpoints, device, dtype, progress, world)
    eval_top1 = evaluate(state.head, cache, data.eval_rows, config, device, dtype, world)
    checkpoints.save(state, final=True)
    if world.is_main:
        state_path.unlink(missing_ok=True)
    head = state.head
    head.eval()
    for parameter in head.parameters():
        parameter.requires_grad_(False)
    return TrainSummary(
        steps=state.step, seconds=state.elapsed, train_top1=train_top1, eval_top1=eval_top1,
        init_eval_top1=init_eval_top1,
        draft_vocab_size=head.draft_vocab_size, draft_vocab_coverage=data.draft_vocab_coverage,
        train_sequences=len(data.train_rows), eval_sequences=len(data.eval_rows),
        train_tokens=sum(len(data.records[i].tokens) for i in data.train_rows),
    )
