"""Training, resuming and calibrating a head end to end on the tiny model (small step counts)."""

import json

import pytest

from sglang_spec.cli import main
from sglang_spec.decode.decoder import GenerationConfig, SpeculativeDecoder
from sglang_spec.models.toy_language import ToyLanguage
from sglang_spec.mtp.checkpoint import read_mtp_header
from sglang_spec.train.traffic import TrafficRecord, write_traffic
from sglang_spec.tree import AcceptanceProfile, TreePolicy


@pytest.fixture(scope="module")
def tiny_traffic(tiny, tmp_path_factory):
    """Greedy completions of the tiny model on toy-language prompts, as traffic text (byte tokenizer)."""
    loaded, head = tiny
    language = ToyLanguage(512, seed=123)  # the language tiny-deepseek was trained on
    prompts = [language.sample(1, 6)[0].tolist() for _ in range(40)]
    decoder = SpeculativeDecoder(loaded.model, head, TreePolicy("chain", 4, 4))
    output = decoder.generate(prompts, GenerationConfig(max_new_tokens=40))
    # the byte tokenizer round-trips any token ids through text, so the traffic holds exactly these tokens
    records = [
        TrafficRecord(f"toy/{i}/greedy", "toy", loaded.decode(r.tokens[:-1] if r.tokens[-1] == 1 else r.tokens),
                      prompt=loaded.decode(p))
        for i, (p, r) in enumerate(zip(prompts, output.requests))
    ]
    path = tmp_path_factory.mktemp("traffic") / "toy.jsonl"
    write_traffic(records, path)
    return path, prompts


def test_train_checkpoints_resumes_and_refuses_to_overwrite(tiny, tiny_traffic, tmp_path, capsys):
    tiny_traffic = tiny_traffic[0]
    out = tmp_path / "head.safetensors"
    args = ["train", "--model", "tiny-deepseek", "--traffic", str(tiny_traffic), "--out", str(out), "--steps", "6",
            "--batch-size", "4", "--checkpoint-every", "3", "--draft-vocab", "64", "--unroll", "2", "--json"]
    # stop after the first checkpoint by asking for 3 steps, then resume to 6
    assert main(args[:-1] + ["--steps", "3", "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["steps"] == 3 and out.exists()
    code = main(args)
    assert code == 2 and "pass --force to overwrite or --resume" in capsys.readouterr().err
    # an interrupted run leaves a state file; simulate by training with a checkpoint cadence, then resuming
    assert main(args + ["--force"]) == 0
    done = json.loads(capsys.readouterr().out)
    assert done["steps"] == 6 and done["draft_vocab_size"] == 64 and 0 < done["draft_vocab_coverage"] <= 1
    header = read_mtp_header(out)
    assert header["draft_vocab_size"] == 64 and header["metadata"]["steps"] == 6
    code = main(args + ["--resume"])
    assert code == 2 and "nothing to resume" in capsys.readouterr().err


def test_resume_continues_from_the_saved_step(tiny, tiny_traffic, tmp_path, capsys, monkeypatch):
    tiny_traffic = tiny_traffic[0]
    from sglang_spec.train import trainer

    out = tmp_path / "head.safetensors"
    args = ["train", "--model", "tiny-deepseek", "--traffic", str(tiny_traffic), "--out", str(out), "--steps", "6",
            "--batch-size", "4", "--checkpoint-every", "2", "--draft-vocab", "0", "--unroll", "2", "--json"]
    calls = {"n": 0}
    original = trainer.unrolled_loss

    def interrupt_after_three(*a, **k):
        calls["n"] += 1
        if calls["n"] == 4 + 1:  # 4 training steps (+ one evaluation batch at step 2) then Ctrl-C
            raise KeyboardInterrupt
        return original(*a, **k)

    monkeypatch.setattr(trainer, "unrolled_loss", interrupt_after_three)
    code = main(args)
    captured = capsys.readouterr()
    assert code == 2 and "continue with --resume" in captured.err
    assert out.with_suffix(".state.pt").exists()
    monkeypatch.setattr(trainer, "unrolled_loss", original)
    assert main(args + ["--resume"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 6
    assert not out.with_suffix(".state.pt").exists()


def test_calibrated_profile_matches_the_decoders_acceptance(tiny, tiny_traffic, tmp_path, capsys):
    """Depth-1 rank-1 acceptance measured by calibration equals what the decoder sees on the same prompts."""
    loaded, head = tiny
    tiny_traffic, prompts = tiny_traffic
    profile_path = tmp_path / "profile.json"
    code = main(["calibrate", "--model", "tiny-deepseek", "--traffic", str(tiny_traffic), "--depth", "3",
                 "--max-rank", "4", "--out", str(profile_path)])
    assert code == 0
    profile = json.loads(profile_path.read_text())
    rows = profile["rank_acceptance"]
    assert len(rows) == 3 and all(len(row) == 4 for row in rows)
    assert all(sum(row) <= 1 + 1e-6 for row in rows) and rows[0][0] > 0.8  # toy language: highly predictable
    assert profile["positions_per_depth"][0] > 500
    # a depth-1 chain accepts its one draft with probability rows[0][0]
    decoder = SpeculativeDecoder(loaded.model, head, TreePolicy("chain", 1, 1))
    measured = decoder.generate(prompts, GenerationConfig(max_new_tokens=40)).accept_length_mean - 1
    assert abs(measured - rows[0][0]) < 0.05, (measured, rows[0][0])
    # and the sequoia policy reads it
    assert main(["tree", "--policy", "sequoia", "--budget", "6", "--depth", "3", "--acceptance", str(profile_path),
                 "--json"]) == 0


def test_calibrate_max_records_takes_an_even_subset_and_rejects_negatives(tiny, tiny_traffic, tmp_path, capsys):
    tiny_traffic, _ = tiny_traffic
    profile_path = tmp_path / "subset.json"
    assert main(["calibrate", "--model", "tiny-deepseek", "--traffic", str(tiny_traffic), "--depth", "2",
                 "--max-rank", "2", "--max-records", "7", "--out", str(profile_path)]) == 0
    assert json.loads(profile_path.read_text())["records"] == 7
    capsys.readouterr()
    assert main(["calibrate", "--model", "tiny-deepseek", "--traffic", str(tiny_traffic), "--max-records", "-1",
                 "--out", str(tmp_path / "bad.json")]) != 0
    assert "--max-records must be >= 0" in capsys.readouterr().err
    assert not (tmp_path / "bad.json").exists()


def test_calibrate_held_out_keeps_exactly_the_training_eval_split(tiny, tiny_traffic, tmp_path, capsys):
    from sglang_spec.train.records import is_eval_record
    from sglang_spec.train.traffic import read_traffic_strict

    tiny_traffic, _ = tiny_traffic
    expected = sum(is_eval_record(record.id, 0.3) for record in read_traffic_strict([tiny_traffic]))
    assert 0 < expected < 40
    profile_path = tmp_path / "held_out.json"
    assert main(["calibrate", "--model", "tiny-deepseek", "--traffic", str(tiny_traffic), "--depth", "2",
                 "--max-rank", "2", "--held-out", "0.3", "--out", str(profile_path)]) == 0
    stored = json.loads(profile_path.read_text())
    assert stored["records"] == expected and stored["held_out"] == 0.3
    capsys.readouterr()
    assert main(["calibrate", "--model", "tiny-deepseek", "--traffic", str(tiny_traffic), "--held-out", "5",
                 "--out", str(tmp_path / "bad.json")]) != 0
    assert "--held-out takes the training run's eval fraction" in capsys.readouterr().err


def test_one_calibrate_command_measures_both_sections_of_one_profile(tiny, tiny_traffic, tmp_path, capsys):
    """--traffic gives the positional table, --prompts the per-source counts, in one file that generate reads;
    --update adds counts to a profile without re-measuring its table."""
    loaded, _ = tiny
    tiny_traffic, prompts = tiny_traffic
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt": loaded.decode(p)}) + "\n" for p in prompts[:3]))
    both = tmp_path / "both.json"
    assert main(["calibrate", "--model", "tiny-deepseek", "--traffic", str(tiny_traffic), "--depth", "2",
                 "--max-rank", "2", "--prompts", str(prompt_file), "--max-new-tokens", "12", "--out", str(both)]) == 0
    profile = AcceptanceProfile.from_json(both)
    assert profile.num_rows == 2 and profile.sources is not None
    offered = sum(cell[1] for row in profile.sources.lookup for cell in row) + sum(c[1] for c in profile.sources.both)
    assert offered > 1  # the negligible prior (1e-3 a cell) outweighed by counted candidates
    assert json.loads(both.read_text())["sources"]["max_new_tokens"] == 12  # where the counts came from
    # --update: a table measured earlier, counts measured now
    table_only = tmp_path / "table.json"
    profile.with_sources(None).to_json(table_only)
    updated = tmp_path / "updated.json"
    assert main(["calibrate", "--model", "tiny-deepseek", "--prompts", str(prompt_file), "--max-new-tokens", "12",
                 "--update", str(table_only), "--out", str(updated)]) == 0
    again = AcceptanceProfile.from_json(updated)
    assert again.rank_acceptance == profile.rank_acceptance and again.sources is not None
    assert again.sources.to_obj() == profile.sources.to_obj()  # same prompts, same greedy decoding, same counts
    capsys.readouterr()
    assert main(["generate", "--model", "tiny-deepseek", "--policy", "hybrid", "--acceptance", str(both),
                 "--prompt", "abc", "--max-new-tokens", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["policy"] == "hybrid"


@pytest.mark.parametrize("steps", [4, 48, 1000])
def test_the_schedule_warms_up_within_a_tenth_of_the_run_and_ends_decayed(steps):
    from sglang_spec.train.trainer import TrainConfig, learning_rate_factor

    config = TrainConfig(steps=steps)  # warmup 50: longer than an adapt round of 48 steps
    factors = [learning_rate_factor(step, config) for step in range(steps)]
    peak = max(range(steps), key=factors.__getitem__)
    assert factors[peak] == pytest.approx(1.0)
    assert peak <= max(1, steps // 10)
    assert factors[-1] < 0.2 if steps > 4 else factors[-1] < 1.0  # the last steps run at a decayed rate
