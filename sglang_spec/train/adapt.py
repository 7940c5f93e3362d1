"""``sglang-spec adapt``: a head that keeps learning beside the server that drafts with it.

One loop, in its own process beside a running tree server (HTTP only; the server launched with
``--speculative-tree-traffic-log LOG --enable-return-hidden-states --disable-radix-cache --enable-metrics``):

1. **Capture.** The requests the server finished since the last look (``live_traffic.TrafficTail`` on LOG), each
   replayed as one prefill for the target's hidden states (``capture_served``), appended to a rolling capture:
   the newest ``window`` sequences, older shards deleted (bounded disk; capture pauses below ``min_free_mb``).
2. **Train.** Every ``train_every`` new sequences, the window (hard-linked into a snapshot the capture cannot
   change) trains a candidate from the served head: ``sglang-spec train --capture --keep-draft-vocab`` in a child
   process (under ``torchrun`` with ``train_processes`` > 1; ``train_threads`` threads, ``train_nice`` niceness:
   off the serving cores' critical path where the machine has room). The rounds share a teacher store
   (``teacher_store``): a sequence's soft targets are computed in the first round that trains on it, read in the
   later ones, and dropped once a round no longer does.
3. **Screen.** A round trains on the window less a ``holdout`` share of its requests, and scores both the
   candidate and the head it was trained from on those (top-1 agreement with the target per drafting depth on
   their answers, as a chain's expected accept length): a candidate not above the served head is not swapped in.
   Both heads are judged on the same tokens; the served probation below compares different requests, which vary
   more than one round moves a head.
4. **Swap.** A candidate that is a head for the served model (type, sizes, feedback, the served draft vocabulary,
   finite weights) waits until the served head has served ``probation_steps`` verify steps of its own (the
   baseline it is judged against), then goes into the running server through SGLang's weight update of the draft
   runner alone (``swap_head``: generation paused in place, ``update_weights_from_tensor`` with selector
   ``draft``, resumed); requests in flight finish across it.
5. **Probation.** The swapped-in head serves ``probation_steps`` verify steps; its accept length (the server's
   per-head counters, ``sglang_spec_head_*``) below ``(1 - margin)`` times the previous head's over its own
   serving rolls it back: the previous head's weights go back in the same way. Either way one line says so,
   ``events.jsonl`` records it, and the kept head's acceptance profile (its per-depth, per-rank table from the
   server's counters over its probation) is written beside it, for the next launch's ``sequoia``.

Faults (the trainer dying, a damaged or foreign candidate, a refused update, a full disk) are one line each: the
server keeps the last good head (a failed update puts it back), nothing is half-written (heads, snapshots and
state are written atomically), and the loop goes on. The state (``adapt.json``: the log position, the heads)
lets the same command resume: the last good head is swapped in again and the log read on from where it stopped.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from sglang_spec.errors import SpecError, brief
from sglang_spec.files import read_json, write_json_atomic
from sglang_spec.mtp.checkpoint import llama_draft_state_dict, read_mtp_header
from sglang_spec.train.capture import MANIFEST, CaptureManifest, CaptureWriter, read_manifest
from sglang_spec.train.live_traffic import (TailPosition, TrafficTail, capture_served, disk_free_bytes,
                                            position_from_json, position_to_json)
from sglang_spec.train.server_capture import post_json
from sglang_spec.train.server_counts import (LAUNCH_HEAD, parse_head_counts, parse_rank_counts, rank_rows,
                                             subtract_counts)
from sglang_spec.train.teacher_store import prune_untouched
from sglang_spec.tree.policies import MAX_TOPK
from sglang_spec.tree.profile import AcceptanceProfile
from sglang_spec.tree.token_tree import MAX_DEPTH, TokenTree

STATE_FILE = "adapt.json"
EVENTS_FILE = "events.jsonl"
TEACHER_STORE = "teacher"  # each window sequence's soft targets, kept across rounds (``train --teacher-store``)


@dataclass(frozen=True)
class AdaptSettings:
    """window: captured sequences trained on (the newest); train_every: new sequences between training rounds;
    steps, batch_size, seq_len, unroll, lr: each round's training (``sglang-spec train``); holdout: the share of
    the window (by request) a round does not train on, where the candidate must score above the head it was
    trained from before it is swapped in (0: no screen); probation_steps: verify
    steps a swapped-in head serves before its verdict; margin: the share of the previous head's accept length a
    head may lose on probation; capture_batch: served requests replayed per capture request; min_free_mb: free
    disk below which capture pauses; train_processes / train_threads / train_nice: the trainer's processes,
    threads each and niceness; poll_seconds: the loop's period when there is nothing to do; bf16: the rounds train
    with bfloat16 autocast (``train --bf16``)."""

    window: int = 64
    train_every: int = 16
    steps: int = 60
    batch_size: int = 8
    seq_len: int = 512
    unroll: int = 3
    lr: float = 5e-4
    holdout: float = 0.25
    probation_steps: int = 150
    margin: float = 0.05
    capture_batch: int = 4
    min_free_mb: int = 256
    train_processes: int = 1
    train_threads: int = 1
    train_nice: int = 10
    poll_seconds: float = 1.0
    bf16: bool = False

    def __post_init__(self) -> None:
        for name in ("window", "train_every", "steps", "batch_size", "unroll", "probation_steps", "capture_batch",
                     "train_processes", "train_threads"):
            if getattr(self, name) < 1:
                raise SpecError(f"--{name.replace('_', '-')} must be >= 1")
        if self.seq_len < 3:
            raise SpecError("--seq-len must be >= 3")
        if not 0 <= self.holdout < 1:
            raise SpecError(f"--holdout must be in [0, 1), got {self.holdout}")
        if not 0 <= self.margin < 1:
            raise SpecError(f"--margin must be in [0, 1), got {self.margin}")
        if self.train_every > self.window:
            raise SpecError(f"--train-every {self.train_every} exceeds --window {self.window}: a round would train on "
                            f"less than it waited for")


# --------------------------------------------------------------------------------------------------- the guard
@dataclass(frozen=True)
class HeadStats:
    """What one head's verify steps accepted while it was served: ``steps`` verify steps, ``accepted`` drafts."""

    label: str
    steps: int
    accepted: int

    @property
    def accept_length(self) -> float:
        return 1.0 + self.accepted / self.steps if self.steps else 1.0


def probation_verdict(previous: HeadStats, candidate: HeadStats, probation_steps: int, margin: float) -> str | None:
    """``keep`` or ``rollback`` for a head on probation, None while it has served fewer than ``probation_steps``
    verify steps: rolled back when its accept length is below ``(1 - margin)`` times the previous head's."""
    if candidate.steps < probation_steps:
        return None
    return "rollback" if candidate.accept_length < previous.accept_length * (1 - margin) else "keep"


def held_out_accept_length(top1: list[float]) -> float:
    """The accept length a chain as deep as ``top1`` would reach if depth d's draft were accepted with the
    held-out top-1 agreement ``top1[d - 1]`` (Sequoia's F(T) of a chain): the score both heads of a screen get."""
    if not top1:
        return 1.0
    chain = TokenTree.from_parents([-1, *range(len(top1))])
    return AcceptanceProfile.from_obj({"rank_acceptance": [[value] for value in top1]}).expected_accept_length(chain)


def screen_verdict(summary: dict[str, Any]) -> tuple[float, float] | None:
    """(the --init head's, the candidate's) held-out accept length from a training round's summary
    (``sglang-spec train --json``), or None when the round held nothing out to score on."""
    before, after = summary.get("init_eval_top1") or [], summary.get("eval_top1") or []
    if not before or not after or not summary.get("eval_sequences"):
        return None
    return held_out_accept_length(before), held_out_accept_length(after)


def fetch_text(url: str, path: str, timeout: float = 30.0) -> str:
    """GET ``url + path`` as text, or one line saying why not."""
    try:
        with urllib.request.urlopen(url + path, timeout=timeout) as response:
            return response.read().decode()
    except (urllib.error.URLError, OSError) as error:
        raise SpecError(f"cannot read {url}{path} ({getattr(error, 'reason', error)}); is the server running "
                        f"with --enable-metrics?") from None


# ---------------------------------------------------------------------------------------------------- the swap
@dataclass(frozen=True)
class ServedHead:
    """What every head swapped into this server must match: the launch head's header fields and draft
    vocabulary (the server's token map)."""

    model_type: str
    hidden_size: int
    vocab_size: int
    feedback: str
    draft_vocab: torch.Tensor | None

    @classmethod
    def of(cls, path: Path) -> ServedHead:
        header = read_mtp_header(path)
        _, draft_vocab = llama_draft_state_dict(path)
        return cls(header["target_model_type"], header["hidden_size"], header["vocab_size"], header["feedback"],
                   draft_vocab)

    def draft_tensors(self, path: Path) -> dict[str, torch.Tensor]:
        """The head file's tensors as the served draft loads them, or one line saying why it cannot be served."""
        header = read_mtp_header(path)
        for name, served in (("target_model_type", self.model_type), ("hidden_size", self.hidden_size),
                             ("vocab_size", self.vocab_size), ("feedback", self.feedback)):
            if header[name] != served:
                raise SpecError(f"{path.name} is a head for another model or drafting mode ({name} "
                                f"{brief(header[name])}, the served head's is {brief(served)})")
        tensors, draft_vocab = llama_draft_state_dict(path)
        same = (draft_vocab is None and self.draft_vocab is None) or (
            draft_vocab is not None and self.draft_vocab is not None and torch.equal(draft_vocab, self.draft_vocab))
        if not same:
            raise SpecError(f"{path.name} drafts over another vocabulary than the server's token map; train it with "
                            f"--keep-draft-vocab")
        return tensors


def swap_head(url: str, tensors: dict[str, torch.Tensor], label: str, ranks: int) -> float:
    """Puts ``tensors`` into the server's draft runner in place, labelled ``label``; returns the seconds generation
    was paused. Generation is paused in place (requests in flight keep their state) and always resumed."""
    data = base64.b64encode(pickle.dumps(list(tensors.items()))).decode()
    payload = {"serialized_named_tensors": [data] * ranks, "selector": "draft", "flush_cache": False,
               "weight_version": label}
    start = time.perf_counter()
    post_json(url, "/pause_generation", {"mode": "in_place"}, timeout=120)
    try:
        post_json(url, "/begin_weight_update", {"selector": "draft"}, timeout=120)
        try:
            post_json(url, "/update_weights_from_tensor", payload, timeout=600)
        finally:
            post_json(url, "/end_weight_update", {}, timeout=120)
    finally:
        post_json(url, "/continue_generation", {}, timeout=120)
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------------------- rolling capture
class RollingCapture:
    """The newest ``window`` captured sequences in ``folder`` (a captured dataset), older shards dropped from the
    manifest and then deleted."""

    def __init__(self, folder: Path, manifest: CaptureManifest, window: int, shard_size: int) -> None:
        self.writer = CaptureWriter(folder, manifest, shard_size)
        self.folder = folder
        self.window = window

    @property
    def sequences(self) -> int:
        return self.writer.manifest.num_sequences + len(self.writer.buffer)

    def add(self, sequences: list) -> None:
        for sequence in sequences:
            if sequence.id not in self.writer.done:
                self.writer.add(sequence)
        self.trim()

    def trim(self) -> None:
        manifest = self.writer.manifest
        shards = list(manifest.shards)
        while shards and manifest.num_sequences - shards[0].sequences >= self.window:
            dropped = shards.pop(0)
            manifest = CaptureManifest(**{**asdict(manifest), "shards": tuple(shards)})
            write_json_atomic(self.folder / MANIFEST, manifest.to_json())
            self.writer.manifest = manifest
            (self.folder / dropped.file).unlink(missing_ok=True)

    def snapshot(self, out: Path) -> int:
        """The window as it is now, into ``out`` (hard links, a manifest of its own): what a training round reads
        while capture goes on. Returns its sequences."""
        self.writer.flush()
        self.trim()
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        manifest = read_manifest(self.folder)
        for entry in manifest.shards:
            try:
                os.link(self.folder / entry.file, out / entry.file)
            except OSError:  # another file system: a copy
                shutil.copy(self.folder / entry.file, out / entry.file)
        write_json_atomic(out / MANIFEST, manifest.to_json())
        return manifest.num_sequences


# ---------------------------------------------------------------------------------------------------- the loop
@dataclass
class AdaptState:
    """What ``adapt.json`` holds: the log position, the heads by label (files under ``heads/``), the served and
    last good labels, the head on probation (None: none) and the one it would roll back to, the counts."""

    position: TailPosition = TailPosition()
    heads: dict[str, str] = field(default_factory=dict)
    served: str = LAUNCH_HEAD
    last_good: str = LAUNCH_HEAD
    probation: str | None = None
    next_label: int = 1
    requests_seen: int = 0
    captured: int = 0
    since_train: int = 0
    rounds: int = 0
    verdicts: int = 0
    # per head label: the counters at its last swap-in (what it served since is its own)
    swapped_at: dict[str, list[int]] = field(default_factory=dict)
    offered: bool = False

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["position"] = position_to_json(self.position)
        return data

    @classmethod
    def from_json(cls, data: Any) -> AdaptState:
        if not isinstance(data, dict):
            raise SpecError(f"{STATE_FILE} is not an adapt state; start over with --force")
        try:
            state = cls(**{**data, "position": position_from_json(data.get("position"))})
        except TypeError:
            raise SpecError(f"{STATE_FILE} is from another version of adapt; start over with --force") from None
        return state


@dataclass(frozen=True)
class AdaptJob:
    """One adapt run: the server ``url`` and its traffic ``log``, the served model (``model``: its --model name;
    ``hidden_size``; ``encode``: its tokenizer for logged prompt texts), the launch head file, the work folder,
    the settings, a head to offer first (``offer``), when to stop (``max_verdicts``, ``max_seconds``: None runs
    until interrupted) and ``ranks`` (the server's tensor-parallel size)."""

    url: str
    log: Path
    model: str
    model_type: str
    hidden_size: int
    vocab_size: int
    encode: Callable[[str], list[int]]
    head: Path
    work: Path
    settings: AdaptSettings
    offer: Path | None = None
    max_verdicts: int | None = None
    max_seconds: float | None = None
    ranks: int = 1


class Adapter:
    """The loop (``run``); ``say`` prints its one-line events."""

    def __init__(self, job: AdaptJob, say: Callable[[str], None] = print) -> None:
        self.job = job
        self.say = say
        self.settings = job.settings
        job.work.mkdir(parents=True, exist_ok=True)
        (job.work / "heads").mkdir(exist_ok=True)
        path = job.work / STATE_FILE
        self.state = AdaptState.from_json(read_json(path, "adapt state")) if path.exists() else AdaptState()
        self.served_head = ServedHead.of(job.head)
        if (self.served_head.model_type, self.served_head.hidden_size, self.served_head.vocab_size) != (
                job.model_type, job.hidden_size, job.vocab_size):
            raise SpecError(f"--head {job.head} is a head for another model than {job.model}")
        self.state.heads.setdefault(LAUNCH_HEAD, str(job.head))
        manifest = CaptureManifest(job.model, job.model_type, job.hidden_size, job.vocab_size, "float16",
                                   source={"server": job.url, "traffic_log": str(job.log)})
        self.capture = RollingCapture(job.work / "capture", manifest, self.settings.window,
                                      max(1, min(8, self.settings.train_every)))
        self.tail = TrafficTail(job.log, job.encode, self.state.position)
        self.trainer: subprocess.Popen | None = None
        self.trainer_log: Path | None = None
        self.round_started = 0.0  # time.time() at the running round's start (what the teacher store keeps)
        self.candidate: Path | None = None
        self.ready: tuple[Path, str] | None = None  # a head to swap in once the served head's baseline is measured
        self.capture_paused = False
        self.started = time.monotonic()
        # per head label: the server's rank counters (offered, accepted) at its swap-in (its profile's zero)
        self.rank_at: dict[str, tuple[dict, dict]] = {}

    # ------------------------------------------------------------------------------------------------ run
    def run(self) -> AdaptState:
        try:
            self._resume()
            while not self._done():
                busy = self._capture()
                busy |= self._probation()
                busy |= self._training()
                self._save()
                if not busy:
                    time.sleep(self.settings.poll_seconds)
        finally:
            if self.trainer is not None and self.trainer.poll() is None:
                self.trainer.terminate()
                self.trainer.wait()
            self._save()
        return self.state

    def _done(self) -> bool:
        job = self.job
        if job.max_verdicts is not None and self.state.verdicts >= job.max_verdicts:
            return True
        return job.max_seconds is not None and time.monotonic() - self.started >= job.max_seconds

    def _resume(self) -> None:
        """A resumed run: the last good head back in the server (it may have restarted with the launch head, or
        a candidate on probation may be in it)."""
        state = self.state
        if state.probation is not None or state.served != state.last_good:
            self._event("resume", f"resuming: head {state.last_good} (the last good) is swapped in again")
            state.probation = None
            self._swap(state.last_good)
        elif state.last_good != LAUNCH_HEAD:
            self._swap(state.last_good)
        self._mark_swapped(state.served)

    # -------------------------------------------------------------------------------------------- capture
    def _capture(self) -> bool:
        requests = self.tail.read(limit=self.settings.capture_batch)
        self.state.position = self.tail.position
        if not requests:
            return False
        self.state.requests_seen += len(requests)
        free_mb = disk_free_bytes(self.job.work) // 2**20
        if free_mb < self.settings.min_free_mb:
            if not self.capture_paused:
                self._event("capture_paused", f"capture paused: {free_mb} MiB free under {self.job.work} (below "
                            f"--min-free-mb {self.settings.min_free_mb}); the server keeps serving head "
                            f"{self.state.served}")
            self.capture_paused = True
            return True
        try:
            sequences = capture_served(self.job.url, requests, "served", self.settings.seq_len + 1,
                                       self.job.hidden_size)
            self.capture.add(sequences)
        except SpecError as error:
            self._event("capture_fault", f"capture: {error}")
            return True
        except OSError as error:
            self.capture.writer.buffer = []  # the shard was not written; those sequences are lost, not half-kept
            self._event("capture_fault", f"capture: cannot write under {self.job.work} ({error.strerror or error}); "
                        f"the server keeps serving head {self.state.served}")
            return True
        self.capture_paused = False
        self.state.captured += len(sequences)
        self.state.since_train += len(sequences)
        return True

    # ------------------------------------------------------------------------------------------- training
    def _training(self) -> bool:
        state = self.state
        if self.trainer is not None:
            if self.trainer.poll() is None:
                return False
            return self._trained()
        if state.probation is not None:
            return False
        if self.ready is not None:
            if not self._baseline_ready():
                return False
            path, what = self.ready
            self.ready = None
            return self._offer(path, what)
        if self.job.offer is not None and not state.offered:
            state.offered = True
            self.ready = (self.job.offer, f"offered head {self.job.offer}")
            return True
        if state.since_train < self.settings.train_every or self.capture.sequences < self.settings.train_every:
            return False
        self._start_training()
        return True

    def _start_training(self) -> None:
        state, settings, work = self.state, self.settings, self.job.work
        state.rounds += 1
        state.since_train = 0
        snapshot = work / "window"
        sequences = self.capture.snapshot(snapshot)
        self.candidate = work / "heads" / "candidate.safetensors"
        self.trainer_log = work / f"train-{state.rounds}.log"
        train = ["-m", "sglang_spec.cli", "train", "--capture", str(snapshot), "--model", self.job.model,
                 "--init", state.heads[state.served], "--out", str(self.candidate), "--keep-draft-vocab",
                 "--feedback", self.served_head.feedback, "--steps", str(settings.steps),
                 "--batch-size", str(settings.batch_size), "--seq-len", str(settings.seq_len),
                 "--unroll", str(settings.unroll), "--lr", str(settings.lr), "--eval-fraction", str(settings.holdout),
                 "--checkpoint-every", str(settings.steps), "--teacher-store", str(work / TEACHER_STORE), "--force",
                 "--json"]
        if settings.bf16:
            train.append("--bf16")
        if settings.train_processes > 1:
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                       str(settings.train_processes), *train]
        else:
            command = [sys.executable, *train]
        environment = {**os.environ, "OMP_NUM_THREADS": str(settings.train_threads), "HF_HUB_OFFLINE": "1"}
        self.round_started = time.time()
        niceness = settings.train_nice
        with open(self.trainer_log, "w") as log:
            self.trainer = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment,
                                            preexec_fn=(lambda: os.nice(niceness)) if niceness else None)
        self._event("train", f"round {state.rounds}: training from head {state.served} on the newest {sequences} "
                    f"served sequences ({settings.steps} steps)", sequences=sequences)

    def _trained(self) -> bool:
        assert self.trainer is not None and self.candidate is not None and self.trainer_log is not None
        code = self.trainer.returncode
        self.trainer = None
        if code != 0:
            lines = [line for line in self.trainer_log.read_text(errors="replace").splitlines() if line.strip()]
            self._event("train_fault", f"round {self.state.rounds}: the trainer failed (exit {code}: "
                        f"{brief(lines[-1] if lines else 'no output', 200)}); the server keeps serving head "
                        f"{self.state.served}")
            return True
        # the store holds the window's sequences: what this round neither read nor wrote has left the window (a
        # round that failed may have stopped before reading them all: its store stays)
        prune_untouched(self.job.work / TEACHER_STORE, self.round_started)
        summary = self._summary(self.trainer_log)
        scores = screen_verdict(summary)
        if scores is not None:
            before, after = scores
            figures = (f"held-out accept length {after:.3f} against head {self.state.served}'s {before:.3f} on the "
                       f"same {summary['eval_sequences']} requests")
            if after <= before:
                self._event("screened", f"round {self.state.rounds}'s head not swapped in: {figures}; the server "
                            f"keeps serving head {self.state.served}", accept_length=after,
                            previous_accept_length=before)
                return True
            self._event("screen", f"round {self.state.rounds}'s head passed the screen: {figures}",
                        accept_length=after, previous_accept_length=before)
        self.ready = (self.candidate, f"round {self.state.rounds}'s head")
        return True

    @staticmethod
    def _summary(log: Path) -> dict[str, Any]:
        """The round's summary (the last JSON object ``train --json`` printed), or {}."""
        for line in reversed(log.read_text(errors="replace").splitlines()):
            if line.startswith("{"):
                try:
                    value = json.loads(line)
                except ValueError:
                    continue
                if isinstance(value, dict):
                    return value
        return {}

    def _baseline_ready(self) -> bool:
        """Whether the served head has served ``probation_steps`` verify steps since it went in: the evidence a
        candidate's probation is measured against (a swap waits for it)."""
        served = self._stats(self.state.served, parse_head_counts(fetch_text(self.job.url, "/metrics")))
        return served.steps >= self.settings.probation_steps

    def _offer(self, path: Path, what: str) -> bool:
        """Checks a head, keeps it under heads/ with the next label, swaps it in and starts its probation."""
        state = self.state
        try:
            self.served_head.draft_tensors(path)
        except SpecError as error:
            self._event("refused", f"{what} refused: {error}; the server keeps serving head {state.served}")
            return True
        label = str(state.next_label)
        state.next_label += 1
        kept = self.job.work / "heads" / f"head-{label}.safetensors"
        shutil.copyfile(path, kept.with_suffix(".partial"))
        os.replace(kept.with_suffix(".partial"), kept)
        state.heads[label] = str(kept)
        previous = state.served
        if self._swap(label):
            state.probation = label
            self._event("swap", f"{what} swapped in as head {label} (on probation for "
                        f"{self.settings.probation_steps} verify steps against head {previous})", head=label,
                        previous=previous)
        return True

    # -------------------------------------------------------------------------------------------- probation
    def _probation(self) -> bool:
        state = self.state
        if state.probation is None:
            return False
        counts = parse_head_counts(fetch_text(self.job.url, "/metrics"))
        candidate = self._stats(state.probation, counts)
        previous = self._stats(state.last_good, counts, until_swap=True)
        verdict = probation_verdict(previous, candidate, self.settings.probation_steps, self.settings.margin)
        if verdict is None:
            return False
        label = state.probation
        state.probation = None
        state.verdicts += 1
        figures = (f"accept length {candidate.accept_length:.3f} over {candidate.steps} verify steps against head "
                   f"{previous.label}'s {previous.accept_length:.3f} over {previous.steps}")
        if verdict == "keep":
            dropped = state.last_good
            state.last_good = label
            self._write_profile(label)
            self._event("keep", f"head {label} kept: {figures}", head=label, accept_length=candidate.accept_length,
                        previous_accept_length=previous.accept_length)
            self._forget(dropped)
        else:
            self._event("rollback", f"head {label} rolled back to head {state.last_good}: {figures}", head=label,
                        accept_length=candidate.accept_length, previous_accept_length=previous.accept_length)
            self._swap(state.last_good)
            self._forget(label)
        return True

    def _stats(self, label: str, counts: dict[str, tuple[int, int]], until_swap: bool = False) -> HeadStats:
        """What head ``label`` served since its last swap-in (``until_swap``: up to the swap that ended it)."""
        now = counts.get(label, (0, 0))
        start = self.state.swapped_at.get(label, [0, 0])
        end = self.state.swapped_at.get(f"{label}:end", list(now)) if until_swap else list(now)
        return HeadStats(label, end[0] - start[0], end[1] - start[1])

    def _forget(self, label: str) -> None:
        """A head no longer needed on disk (neither the launch head nor the last good)."""
        if label in (LAUNCH_HEAD, self.state.last_good, self.state.served):
            return
        path = self.state.heads.pop(label, None)
        if path is not None:
            Path(path).unlink(missing_ok=True)

    def _swap(self, label: str) -> bool:
        """Head ``label`` into the server; on a failed update the last good head is put back. True on success."""
        state = self.state
        try:
            tensors = self.served_head.draft_tensors(Path(state.heads[label]))
        except (SpecError, KeyError) as error:
            self._event("swap_fault", f"head {label} cannot be swapped in ({error}); the server keeps serving head "
                        f"{state.served}")
            return False
        self._mark_swapped(state.served, end=True)
        try:
            seconds = swap_head(self.job.url, tensors, label, self.job.ranks)
        except SpecError as error:
            self._event("swap_fault", f"head {label} was not swapped in ({error}); putting head {state.last_good} "
                        f"back")
            if label != state.last_good:
                try:
                    swap_head(self.job.url, self.served_head.draft_tensors(Path(state.heads[state.last_good])),
                              state.last_good, self.job.ranks)
                    state.served = state.last_good
                    self._mark_swapped(state.served)
                except SpecError as again:
                    self._event("swap_fault", f"head {state.last_good} could not be put back either ({again})")
            return False
        state.served = label
        self._mark_swapped(label)
        self._event("swapped", f"head {label} in the server (generation paused {seconds:.2f} s)", head=label,
                    paused_seconds=seconds)
        return True

    def _mark_swapped(self, label: str, end: bool = False) -> None:
        """The server's counters for ``label`` now: where its serving starts (or, ``end``, stops)."""
        try:
            text = fetch_text(self.job.url, "/metrics")
        except SpecError:
            return
        counts = parse_head_counts(text)
        self.state.swapped_at[f"{label}:end" if end else label] = list(counts.get(label, (0, 0)))
        if not end:
            self.state.swapped_at.pop(f"{label}:end", None)
            try:
                _, offered, accepted = parse_rank_counts(text, self.job.url)
                self.rank_at[label] = (offered, accepted)
            except SpecError:  # no ranks counted yet
                self.rank_at[label] = ({}, {})

    def _write_profile(self, label: str) -> None:
        """The kept head's per-depth, per-rank acceptance table, from the server's rank counters (what
        ``sglang-spec calibrate --from-server`` reads) counted since the head went in, beside its file: the
        profile to launch ``sequoia`` with this head. Nothing where the server counted no ranks (no metrics)."""
        before = self.rank_at.get(label)
        try:
            _, offered, accepted = parse_rank_counts(fetch_text(self.job.url, "/metrics"), self.job.url)
        except SpecError:
            return
        if before is not None:
            offered, accepted = subtract_counts(offered, before[0]), subtract_counts(accepted, before[1])
        rows, _ = rank_rows(offered, accepted, MAX_DEPTH, MAX_TOPK)
        if rows:
            profile = AcceptanceProfile.from_obj({"rank_acceptance": [list(row) for row in rows],
                                                  "from_server": self.job.url, "head": label}, "served head counts")
            write_json_atomic(Path(self.state.heads[label]).with_suffix(".profile.json"), profile.to_obj())

    # ------------------------------------------------------------------------------------------------ state
    def _event(self, kind: str, line: str, **fields: Any) -> None:
        self.say(line)
        record = {"event": kind, "time": round(time.monotonic() - self.started, 3),
                  "requests_seen": self.state.requests_seen, "captured": self.state.captured,
                  "served": self.state.served, "message": line, **fields}
        with open(self.job.work / EVENTS_FILE, "a") as handle:
            handle.write(json.dumps(record) + "\n")

    def _save(self) -> None:
        self.state.position = self.tail.position
        write_json_atomic(self.job.work / STATE_FILE, self.state.to_json())
