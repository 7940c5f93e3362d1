"""The teacher store (``train/teacher_store.py``, ``train --teacher-store``): a sequence's soft targets are computed
once and read by a later run over the same captured states, never by a run whose head, draft vocabulary or top-K
differ; a damaged entry is computed again; a folder that cannot be written keeps nothing and the run goes on;
``prune_untouched`` drops what a run neither read nor wrote."""

from __future__ import annotations

import os
import time

import pytest
import torch

from captured import toy_sequences, write_capture
from sglang_spec.cli import main
from sglang_spec.train.capture import iter_captured
from sglang_spec.train.teacher_store import SUFFIX, TeacherStore, prune_untouched
from sglang_spec.train.trainer import TrainConfig, captured_data, teacher_from_capture


@pytest.fixture(scope="module")
def captured(tiny, tmp_path_factory):
    loaded = tiny[0]
    capture = write_capture(tmp_path_factory.mktemp("capture") / "toy", toy_sequences(loaded, 6, length=20))
    data, hidden = captured_data(loaded, list(iter_captured(capture)), TrainConfig(draft_vocab=64, top_k_targets=8))
    return loaded, capture, data, hidden


def test_a_second_run_reads_each_sequences_targets_and_gets_the_same(captured, tmp_path):
    loaded, _, data, hidden = captured
    weight = loaded.model.lm_head.weight
    fresh = teacher_from_capture(data, hidden, weight, 8, progress=False)
    store = tmp_path / "store"
    first = teacher_from_capture(data, hidden, weight, 8, progress=False, store=store)
    assert len(list(store.glob(f"*{SUFFIX}"))) == len(hidden)
    # the second run reads the store: a doctored entry comes back as written (it is not recomputed)
    kept = TeacherStore(store, weight, data.draft_vocab, 8)
    ids, probs = kept.get(hidden[0])
    torch.save({"ids": ids, "probs": torch.zeros_like(probs)}, kept.path_for(hidden[0]))
    second = teacher_from_capture(data, hidden, weight, 8, progress=False, store=store)
    assert torch.count_nonzero(second.target_probs[0]) == 0
    for row in range(1, len(hidden)):
        assert torch.equal(second.target_ids[row], fresh.target_ids[row]) and torch.equal(first.target_ids[row],
                                                                                        fresh.target_ids[row])
        assert torch.equal(second.target_probs[row], fresh.target_probs[row])


def test_another_head_vocabulary_or_top_k_never_reads_an_entry_and_damage_is_recomputed(captured, tmp_path):
    loaded, _, data, hidden = captured
    weight = loaded.model.lm_head.weight
    kept = TeacherStore(tmp_path, weight, data.draft_vocab, 8)
    others = [TeacherStore(tmp_path, weight * 1.001, data.draft_vocab, 8),
              TeacherStore(tmp_path, weight, data.draft_vocab.flip(0), 8),
              TeacherStore(tmp_path, weight, None, 8), TeacherStore(tmp_path, weight, data.draft_vocab, 4)]
    assert len({store.path_for(hidden[0]) for store in [kept, *others]}) == 5
    assert kept.path_for(hidden[0]) != kept.path_for(hidden[1])
    kept.put(hidden[0], torch.zeros(len(hidden[0]), 8, dtype=torch.int32), torch.zeros(len(hidden[0]), 8))
    assert kept.get(hidden[0]) is not None and all(store.get(hidden[0]) is None for store in others)
    kept.path_for(hidden[0]).write_bytes(b"damaged")
    assert kept.get(hidden[0]) is None  # computed again by the caller, and written over
    kept.put(hidden[0], torch.zeros(3, 8, dtype=torch.int32), torch.zeros(3, 8))
    assert kept.get(hidden[0]) is None  # another sequence's length: not these states' targets


def test_a_store_that_cannot_be_written_keeps_nothing_and_the_run_goes_on(captured, tmp_path):
    loaded, _, data, hidden = captured
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    cache = teacher_from_capture(data, hidden, loaded.model.lm_head.weight, 8, progress=False, store=blocked)
    assert len(cache.target_ids) == len(hidden) and blocked.read_text() == "not a folder"


def test_prune_drops_what_a_run_did_not_touch(captured, tmp_path):
    loaded, _, data, hidden = captured
    kept = TeacherStore(tmp_path, loaded.model.lm_head.weight, data.draft_vocab, 8)
    for states in hidden[:3]:
        kept.put(states, torch.zeros(len(states), 8, dtype=torch.int32), torch.zeros(len(states), 8))
    old = time.time() - 600
    for path in tmp_path.glob(f"*{SUFFIX}"):
        os.utime(path, (old, old))
    since = time.time() - 1
    assert kept.get(hidden[1]) is not None  # read this run: touched
    assert prune_untouched(tmp_path, since) == 2
    assert [path.name for path in tmp_path.glob(f"*{SUFFIX}")] == [kept.path_for(hidden[1]).name]


def test_train_from_a_capture_fills_the_store(captured, tmp_path):
    _, capture, _, _ = captured
    store = tmp_path / "store"
    assert main(["train", "--steps", "2", "--batch-size", "2", "--draft-vocab", "64", "--json", "--teacher-store",
                 str(store), "--capture", str(capture), "--out", str(tmp_path / "head.safetensors")]) == 0
    assert len(list(store.glob(f"*{SUFFIX}"))) == 6
