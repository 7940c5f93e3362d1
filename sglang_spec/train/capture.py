"""A captured dataset: what a server computed for each request, in a folder a head trains from.

    DIR/manifest.json                 {"format", "model", "model_type", "hidden_size", "vocab_size", "dtype",
                                       "source", "shards": [{"file", "sequences", "tokens"}, ...]}
    DIR/shard-00000.safetensors       the sequences of one shard (below), written whole or not at all

One sequence is a request and its answer: ``tokens`` (prompt then answer, as the server saw them) and the target's
final hidden states (post-norm, the output head's input) at every position but the last, as SGLang computes
them: the prefill gives one per prompt token and each decode step one per answer token it feeds in; the last
answer token is never fed in. So a sequence of L tokens has L - 1 hidden states, and row i is the state after
token i, from which the target predicted token i + 1.

A shard stores its S sequences concatenated: ``tokens`` [sum L] int32, ``hidden`` [sum (L - 1), d] in the
manifest's dtype, ``token_offsets`` / ``hidden_offsets`` [S + 1] int64 (sequence s is rows offsets[s] ..
offsets[s + 1] - 1), ``completion_starts`` [S] int64 (the index of the first answer token); its metadata holds
the ids and domains as JSON lists. Shards are written atomically, then the manifest (also atomically) names them:
a shard the manifest does not name is an interrupted write and is ignored; a resumed capture skips every id the
manifest's shards hold.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from sglang_spec.errors import SpecError, brief
from sglang_spec.files import atomic_write, read_json, write_json_atomic

FORMAT = "sglang_spec.capture/1"
MANIFEST = "manifest.json"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True, eq=False)
class CapturedSequence:
    """One request and its answer.

    Fields:
      id:               the prompt's id (unique in a dataset).
      domain:           its domain tag (code, chat, ...).
      tokens:           [L] int64, prompt then answer.
      completion_start: index of the first answer token (the prompt's length).
      hidden:           [L - 1, d] the target's final hidden state after each token but the last.
    """

    id: str
    domain: str
    tokens: torch.Tensor
    completion_start: int
    hidden: torch.Tensor

    def __post_init__(self) -> None:
        if self.tokens.dim() != 1 or self.hidden.dim() != 2 or self.hidden.shape[0] != self.tokens.shape[0] - 1:
            raise SpecError(f"captured sequence {brief(self.id)}: {self.tokens.shape[0]} tokens need "
                            f"{self.tokens.shape[0] - 1} hidden states, got {tuple(self.hidden.shape)}")
        if not 0 < self.completion_start < self.tokens.shape[0]:
            raise SpecError(f"captured sequence {brief(self.id)}: the answer must start inside the sequence")


@dataclass(frozen=True)
class ShardEntry:
    file: str
    sequences: int
    tokens: int


@dataclass(frozen=True)
class CaptureManifest:
    """model: the ``--model`` label; model_type / hidden_size / vocab_size: from its config; dtype: of the
    stored hidden states; source: where they came from (the server's URL, its model path, the sampling)."""

    model: str
    model_type: str
    hidden_size: int
    vocab_size: int
    dtype: str
    source: dict[str, Any] = field(default_factory=dict)
    shards: tuple[ShardEntry, ...] = ()
    format: str = FORMAT

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["shards"] = [asdict(entry) for entry in self.shards]
        return data

    @property
    def num_sequences(self) -> int:
        return sum(entry.sequences for entry in self.shards)

    @property
    def num_tokens(self) -> int:
        return sum(entry.tokens for entry in self.shards)


def read_manifest(folder: Path) -> CaptureManifest:
    """The manifest of the captured dataset in ``folder``, or one line saying why it is not one."""
    path = folder / MANIFEST
    if not path.exists():
        raise SpecError(f"{folder} is not a captured dataset (no {MANIFEST}); make one with `sglang-spec capture`")
    data = read_json(path, "capture manifest")
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise SpecError(f"{path}: not a {FORMAT} manifest")
    try:
        shards = tuple(ShardEntry(str(entry["file"]), int(entry["sequences"]), int(entry["tokens"]))
                       for entry in data["shards"])
        manifest = CaptureManifest(str(data["model"]), str(data["model_type"]), int(data["hidden_size"]),
                                   int(data["vocab_size"]), str(data["dtype"]), dict(data.get("source") or {}),
                                   shards)
    except (KeyError, TypeError, ValueError) as error:
        raise SpecError(f"{path}: malformed manifest ({type(error).__name__}: {brief(str(error))})") from None
    if manifest.dtype not in DTYPES:
        raise SpecError(f"{path}: dtype {brief(manifest.dtype)} is not one of {', '.join(DTYPES)}")
    for entry in shards:
        if Path(entry.file).name != entry.file or not (folder / entry.file).is_file():
            raise SpecError(f"{path}: shard {brief(entry.file)} is missing from {folder}")
    return manifest


def _shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def next_shard_index(manifest: CaptureManifest) -> int:
    """The number of the next shard: past every shard the manifest names (a rolling window drops the oldest)."""
    numbers = [int(entry.file[len("shard-"):-len(".safetensors")]) for entry in manifest.shards
               if entry.file.startswith("shard-") and entry.file.endswith(".safetensors")
               and entry.file[len("shard-"):-len(".safetensors")].isdigit()]
    return max(numbers, default=-1) + 1


def write_shard(path: Path, sequences: Sequence[CapturedSequence], dtype: torch.dtype) -> ShardEntry:
    """Writes ``sequences`` as one shard, atomically."""
    token_lengths = [len(sequence.tokens) for sequence in sequences]
    hidden_lengths = [length - 1 for length in token_lengths]
    tensors = {
        "tokens": torch.cat([sequence.tokens for sequence in sequences]).to(torch.int32),
        "hidden": torch.cat([sequence.hidden for sequence in sequences]).to(dtype).contiguous(),
        "token_offsets": torch.tensor([0, *token_lengths], dtype=torch.int64).cumsum(0),
        "hidden_offsets": torch.tensor([0, *hidden_lengths], dtype=torch.int64).cumsum(0),
        "completion_starts": torch.tensor([sequence.completion_start for sequence in sequences], dtype=torch.int64),
    }
    metadata = {"ids": json.dumps([s.id for s in sequences]), "domains": json.dumps([s.domain for s in sequences])}
    with atomic_write(path, "wb") as handle:
        handle.write(save(tensors, metadata=metadata))
    return ShardEntry(path.name, len(sequences), sum(token_lengths))


def read_shard(path: Path) -> list[CapturedSequence]:
    """The sequences of one shard (hidden states in the stored dtype), or one line saying why it is damaged."""
    try:
        with safe_open(str(path), "pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        ids, domains = json.loads(metadata["ids"]), json.loads(metadata["domains"])
        tokens, hidden = tensors["tokens"].long(), tensors["hidden"]
        token_offsets, hidden_offsets = tensors["token_offsets"].tolist(), tensors["hidden_offsets"].tolist()
        starts = tensors["completion_starts"].tolist()
        return [CapturedSequence(ids[s], domains[s], tokens[token_offsets[s] : token_offsets[s + 1]], starts[s],
                                 hidden[hidden_offsets[s] : hidden_offsets[s + 1]]) for s in range(len(ids))]
    except (SafetensorError, OSError, KeyError, IndexError, ValueError, TypeError) as error:
        raise SpecError(f"{path} is a damaged capture shard ({type(error).__name__}: "
                        f"{brief(str(error).splitlines()[0] if str(error) else '')})") from None


def iter_captured(folder: Path) -> Iterator[CapturedSequence]:
    """Every sequence of the dataset in ``folder``, shard by shard (one shard in memory at a time)."""
    manifest = read_manifest(folder)
    for entry in manifest.shards:
        yield from read_shard(folder / entry.file)


class CaptureWriter:
    """Appends sequences to a dataset folder: ``add`` buffers them, every ``shard_size`` sequences (and at
    ``close``) a shard is written and the manifest updated. An interrupted capture loses at most the buffered
    sequences; opening the folder again resumes it (``done`` holds the ids already stored)."""

    def __init__(self, folder: Path, manifest: CaptureManifest, shard_size: int) -> None:
        """``manifest``: the dataset's settings (its shards are ignored); the folder's own manifest, when there is
        one, must agree with them (same model, hidden size, dtype), and its shards are kept."""
        folder.mkdir(parents=True, exist_ok=True)
        if (folder / MANIFEST).exists():
            existing = read_manifest(folder)
            for name in ("model", "model_type", "hidden_size", "vocab_size", "dtype"):
                if getattr(existing, name) != getattr(manifest, name):
                    raise SpecError(f"{folder} holds a capture with {name} {getattr(existing, name)}, not "
                                    f"{getattr(manifest, name)}; use another --out or pass --force to start over")
            # one dataset, one sampling: a resumed capture must answer as the first part did
            stored, asked = existing.source.get("sampling"), manifest.source.get("sampling")
            if stored is not None and asked is not None and stored != asked:
                raise SpecError(f"{folder} was captured with sampling {json.dumps(stored)}, not "
                                f"{json.dumps(asked)}; use the same settings, another --out, or --force to start "
                                f"over")
            manifest = CaptureManifest(**{**asdict(manifest), "shards": existing.shards})
        self.folder = folder
        self.manifest = manifest
        self.shard_size = shard_size
        self.buffer: list[CapturedSequence] = []
        self.done: set[str] = set()
        for entry in manifest.shards:
            try:
                with safe_open(str(folder / entry.file), "pt") as handle:
                    self.done.update(json.loads((handle.metadata() or {})["ids"]))
            except (SafetensorError, OSError, KeyError, ValueError) as error:
                raise SpecError(f"{folder / entry.file} is a damaged capture shard ({type(error).__name__}); "
                                f"pass --force to start over") from None
        write_json_atomic(folder / MANIFEST, self.manifest.to_json())

    def add(self, sequence: CapturedSequence) -> None:
        if sequence.hidden.shape[1] != self.manifest.hidden_size:
            raise SpecError(f"the server returned hidden states of size {sequence.hidden.shape[1]}, but "
                            f"{self.manifest.model} has hidden size {self.manifest.hidden_size}: the server "
                            f"serves another model")
        self.buffer.append(sequence)
        self.done.add(sequence.id)
        if len(self.buffer) >= self.shard_size:
            self.flush()

    def flush(self) -> None:
        """Writes the buffered sequences as a new shard and names it in the manifest."""
        if not self.buffer:
            return
        path = self.folder / _shard_name(next_shard_index(self.manifest))
        entry = write_shard(path, self.buffer, DTYPES[self.manifest.dtype])
        self.manifest = CaptureManifest(**{**asdict(self.manifest), "shards": (*self.manifest.shards, entry)})
        write_json_atomic(self.folder / MANIFEST, self.manifest.to_json())
        self.buffer = []
