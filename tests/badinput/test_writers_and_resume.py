"""Writers that fail keep the old file; training refuses non-finite losses and heads; --resume says which setting
wins; traffic generation keeps and resumes its finished work; model mismatches need an explicit flag."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch

from sglang_spec import files
from sglang_spec.cli import main
from sglang_spec.errors import SpecError
from sglang_spec.mtp.checkpoint import load_mtp_head, read_mtp_header, save_mtp_head
from sglang_spec.train import trainer
from sglang_spec.train.traffic import TrafficRecord, partial_path, read_traffic, write_traffic
from sglang_spec.costs import CostCurve
from sglang_spec.tree.profile import AcceptanceProfile


def messages(err: str) -> list[str]:
    """stderr without progress bars (tqdm redraws with carriage returns)."""
    lines = [line.rsplit("\r", 1)[-1] for line in err.split("\n")]
    return [line for line in lines if line and "it/s]" not in line and "%|" not in line]


def no_space(*args):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.fixture(scope="module")
def traffic(tiny, tmp_path_factory):
    """Greedy completions of the tiny model (byte tokenizer: the text round-trips its tokens)."""
    from sglang_spec.decode.decoder import GenerationConfig, generate_plain
    from sglang_spec.models.toy_language import ToyLanguage

    loaded, _ = tiny
    language = ToyLanguage(512, seed=123)
    prompts = [language.sample(1, 6)[0].tolist() for _ in range(16)]
    output = generate_plain(loaded.model, prompts, GenerationConfig(max_new_tokens=24))
    records = [TrafficRecord(f"toy/{i}/greedy", "toy", loaded.decode([t for t in r.tokens if t != 1]),
                             prompt=loaded.decode(p), source="generate tiny-deepseek temperature=0.0")
               for i, (p, r) in enumerate(zip(prompts, output.requests))]
    folder = tmp_path_factory.mktemp("traffic")
    write_traffic(records, folder / "tiny.jsonl")
    write_traffic([TrafficRecord(r.id, r.domain, r.completion, prompt=r.prompt, meta={"model": "smollm2"})
                   for r in records], folder / "other.jsonl")
    return folder


@pytest.mark.parametrize("writer", ["head", "profile", "traffic", "costs", "state"])
def test_a_failing_write_keeps_the_old_file(tiny, tmp_path, monkeypatch, writer):
    _, head = tiny
    target = tmp_path / f"old.{writer}"
    target.write_bytes(b"the good old file")
    write = {
        "head": lambda: save_mtp_head(head, target),
        "profile": lambda: AcceptanceProfile.uniform([0.5]).to_json(target),
        "traffic": lambda: write_traffic([TrafficRecord("a", "d", "c", prompt="p")], target, force=True),
        "costs": lambda: files.write_json_atomic(target, CostCurve({1: 0.1}, 0.0, 0.0, 1, "cpu").to_json()),
        "state": lambda: _save_state(target),  # how the trainer writes .state.pt and the teacher cache
    }[writer]
    monkeypatch.setattr(files.os, "fsync", no_space)
    with pytest.raises(SpecError, match="No space left on device"):
        write()
    assert target.read_bytes() == b"the good old file"
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]


def _save_state(target: Path) -> None:
    with files.atomic_write(target, "wb") as handle:
        torch.save({"step": 3, "head": {"w": torch.ones(3)}}, handle)


def test_calibrate_force_keeps_the_old_profile_when_the_write_fails(tiny, traffic, tmp_path, monkeypatch, capsys):
    out = tmp_path / "profile.json"
    out.write_text('{"rank_acceptance": [0.5]}\n')
    monkeypatch.setattr(files.os, "replace", no_space)
    code = main(["calibrate", "--model", "tiny-deepseek", "--traffic", str(traffic / "tiny.jsonl"), "--depth", "2",
                 "--max-rank", "2", "--out", str(out), "--force"])
    err = messages(capsys.readouterr().err)
    assert code == 2 and len(err) == 1 and "No space left on device" in err[0]
    assert out.read_text() == '{"rank_acceptance": [0.5]}\n' and [p.name for p in tmp_path.iterdir()] == [out.name]


def test_no_head_with_non_finite_weights_is_written(tiny, tmp_path):
    _, head = tiny
    broken = type(head).for_target(tiny[0].model)
    broken.load_state_dict(head.state_dict())
    with torch.no_grad():
        broken.eh_proj.weight[0, 0] = float("nan")
    with pytest.raises(SpecError, match="NaN or infinite"):
        save_mtp_head(broken, tmp_path / "h.safetensors")
    with torch.no_grad():
        broken.eh_proj.weight[0, 0] = 1e30  # finite in float32, infinite in float16
    with pytest.raises(SpecError, match="NaN or infinite"):
        save_mtp_head(broken, tmp_path / "h.safetensors", dtype=torch.float16)
    assert list(tmp_path.iterdir()) == []


TRAIN = ["train", "--model", "tiny-deepseek", "--steps", "4", "--batch-size", "4", "--checkpoint-every", "2",
         "--draft-vocab", "64", "--unroll", "2", "--json"]


def test_a_diverging_loss_stops_training_and_writes_no_head(tiny, traffic, tmp_path, monkeypatch, capsys):
    out = tmp_path / "head.safetensors"
    original = trainer.unrolled_loss

    def diverging(*args, **kwargs):
        loss, metrics = original(*args, **kwargs)
        return loss * float("nan"), metrics

    monkeypatch.setattr(trainer, "unrolled_loss", diverging)
    code = main([*TRAIN, "--traffic", str(traffic / "tiny.jsonl"), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "training diverged at step 1: the loss is nan" in err
    assert not out.exists() and not trainer.state_path_for(out).exists()


def test_resume_says_which_setting_wins_and_rebuilds_a_damaged_teacher_cache(tiny, traffic, tmp_path, monkeypatch,
                                                                              capsys):
    out = tmp_path / "head.safetensors"
    args = [*TRAIN, "--traffic", str(traffic / "tiny.jsonl"), "--out", str(out), "--lr", "0.002"]
    original = trainer.unrolled_loss
    calls = {"n": 0}

    def interrupt(*a, **k):
        calls["n"] += 1
        if calls["n"] == 4:  # steps 1, 2, the evaluation at step 2, then Ctrl-C in step 3
            raise KeyboardInterrupt
        return original(*a, **k)

    monkeypatch.setattr(trainer, "unrolled_loss", interrupt)
    assert main(args) == 2 and "continue with --resume" in capsys.readouterr().err
    monkeypatch.setattr(trainer, "unrolled_loss", original)
    state = trainer.state_path_for(out)
    saved_step = torch.load(state, weights_only=True)["step"]
    assert 2 <= saved_step < 4 and read_mtp_header(out)["metadata"]["steps"] == saved_step

    # a setting that fixes the data cannot change
    code = main([*args, "--resume", "--seq-len", "64"])
    assert code == 2 and "--seq-len 64 conflicts with the saved run's 512" in capsys.readouterr().err

    # the teacher cache is only a cache: damaged, it is built again
    cache = out.with_suffix(".teacher.pt")
    cache.write_bytes(cache.read_bytes()[:100])
    seen = {}
    fit = trainer.fit

    def spy(state, *rest):
        seen["lr"] = state.optimizer.param_groups[0]["lr"]
        return fit(state, *rest)

    monkeypatch.setattr(trainer, "fit", spy)
    without_lr = [part for part in args if part not in ("--lr", "0.002")]
    assert main([*without_lr, "--resume", "--lr", "0.01"]) == 0
    captured = capsys.readouterr()
    assert "resume: --lr 0.01 replaces the saved run's 0.002 (the command line wins)" in captured.err
    assert json.loads(captured.out)["steps"] == 4 and not state.exists()
    factor = trainer.learning_rate_factor(saved_step, trainer.TrainConfig(steps=4, lr=0.01))
    assert seen["lr"] == pytest.approx(0.01 * factor)
    assert torch.load(cache, weights_only=True)["fingerprint"]  # rewritten whole


def test_model_mismatch_needs_the_flag(tiny, traffic, tmp_path, capsys):
    loaded, head = tiny
    other = str(traffic / "other.jsonl")
    calibrate = ["calibrate", "--model", "tiny-deepseek", "--traffic", other, "--depth", "2", "--max-rank", "2"]
    assert main([*calibrate, "--out", str(tmp_path / "p.json")]) == 2
    assert "generated by 'smollm2', not 'tiny-deepseek'" in capsys.readouterr().err
    assert main([*calibrate, "--out", str(tmp_path / "p.json"), "--allow-model-mismatch"]) == 0
    err = messages(capsys.readouterr().err)
    assert len(err) == 1 and err[0].startswith("warning: 16 traffic record(s) were generated by 'smollm2'")
    # heads: trained for smollm2 (its metadata says so), structurally a tiny-deepseek head
    head_path = save_mtp_head(head, tmp_path / "h.safetensors", metadata={"model": "smollm2"})
    generate = ["generate", "--model", "tiny-deepseek", "--mtp", str(head_path), "--prompt", "x", "--json",
                "--max-new-tokens", "4"]
    assert main(generate) == 2 and "trained for 'smollm2', not 'tiny-deepseek'" in capsys.readouterr().err
    assert main([*generate, "--allow-model-mismatch"]) == 0
    assert load_mtp_head(head_path, loaded.model) is not None


def test_traffic_generate_keeps_and_resumes_its_work(tiny, tmp_path, monkeypatch, capsys):
    from sglang_spec.cli import traffic as traffic_command

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"prompt number {i}\n" for i in range(5)))
    out = tmp_path / "out.jsonl"
    args = ["traffic", "generate", "--model", "tiny-deepseek", "--prompts", str(prompts), "--samples", "1",
            "--max-new-tokens", "6", "--batch-size", "2", "--out", str(out)]
    original = traffic_command.generate_traffic
    made = []

    def stop_after_three(*a, **k):
        for record in original(*a, **k):
            made.append(record.id)
            if len(made) == 4:
                raise KeyboardInterrupt
            yield record

    monkeypatch.setattr(traffic_command, "generate_traffic", stop_after_three)
    assert main(args) == 130
    assert "3 records kept in" in capsys.readouterr().err
    partial = partial_path(out)
    assert not out.exists() and len(read_traffic(partial)[0]) == 3
    # a torn last line (killed mid-write) is cut off on resume
    with partial.open("a") as handle:
        handle.write('{"id": "torn", "domain"')
    made.clear()
    monkeypatch.setattr(traffic_command, "generate_traffic", original)
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "resuming: 3 records already in" in captured.err and "wrote 10 records" in captured.out
    records, problems = read_traffic(out)
    assert not problems and len(records) == 10 and len({r.id for r in records}) == 10
    assert all(r.meta["model"] == "tiny-deepseek" and r.meta["max_new_tokens"] == 6 for r in records)
    assert not partial.exists()
    # an interrupted run with other settings is not mixed in
    partial.write_text(records[0].to_json() + "\n")
    code = main([*[a if a != "6" else "7" for a in args], "--force"])
    assert code == 2 and "holds an interrupted run with other settings" in capsys.readouterr().err


def test_bad_out_fails_before_the_model_loads(tmp_path, monkeypatch, capsys):
    import sglang_spec.cli.calibrate as calibrate_command
    import sglang_spec.cli.traffic as traffic_command
    import sglang_spec.cli.train as train_command

    def no_loading(*a, **k):
        raise AssertionError("the model was loaded before the output path was checked")

    for module in (traffic_command, train_command, calibrate_command):
        monkeypatch.setattr(module, "load_model", no_loading)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    traffic_file = tmp_path / "t.jsonl"
    write_traffic([TrafficRecord("a/greedy", "d", "completion", prompt="p")], traffic_file)
    for argv in (
        ["traffic", "generate", "--model", "tiny-deepseek", "--prompts", "humaneval:0-1", "--out", f"{blocker}/x"],
        ["train", "--model", "tiny-deepseek", "--traffic", str(traffic_file), "--out", f"{blocker}/h.safetensors"],
        ["calibrate", "--model", "tiny-deepseek", "--traffic", str(traffic_file), "--out", f"{blocker}/p.json"],
    ):
        assert main(argv) == 2 and "is not a folder" in capsys.readouterr().err


def test_a_damaged_default_cost_cache_is_measured_again(tiny, tmp_path, monkeypatch, capsys):
    import sglang_spec.cli.generate as generate_command
    import sglang_spec.decode.autotune as autotune

    monkeypatch.setattr(generate_command, "cache_root", lambda: tmp_path)
    curve = CostCurve({1: 0.01, 2: 0.05, 3: 0.09}, 0.01, 0.0, 200, "cpu", plain_token=0.01)
    monkeypatch.setattr(autotune, "measure_costs", lambda *a, **k: curve)
    args = ["generate", "--model", "tiny-deepseek", "--auto", "--prompt", "abc", "--max-new-tokens", "4", "--json"]
    assert main(args) == 0
    (cache,) = (tmp_path / "costs").iterdir()
    cache.write_text('{"verify": {"1": ')  # what a crash mid-write used to leave
    capsys.readouterr()
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "warning: ignoring the damaged cost cache" in err and err.count("\n") == 1
    assert CostCurve.from_json(json.loads(cache.read_text())) == curve
    assert sorted(p.name for p in cache.parent.iterdir()) == [cache.name]


def test_shipped_heads_name_their_model():
    from sglang_spec.models.loading import shipped_head_path

    for name in ("smollm2", "smollm2-generic"):
        path = shipped_head_path(name)
        assert path is not None and read_mtp_header(Path(path))["metadata"]["model"] == "smollm2"
