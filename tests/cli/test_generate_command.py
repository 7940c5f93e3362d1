import json

import pytest

from sglang_spec.cli import main


def run_cli(capsys, *args):
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_json_report_with_check(tiny, capsys):
    code, out, _ = run_cli(capsys, "generate", "--model", "tiny-deepseek", "--prompt", "hello there", "--policy",
                           "specexec", "--budget", "8", "--depth", "4", "--max-new-tokens", "20", "--check", "--json")
    assert code == 0
    report = json.loads(out)
    for key in ("tokens", "accept_length_mean", "tokens_per_second", "baseline_tokens_per_second",
                "identical_to_baseline", "draft_seconds", "verify_seconds", "accept_length_histogram"):
        assert key in report, key
    assert report["identical_to_baseline"] is True
    assert len(report["tokens"]) == 20 and report["accept_length_mean"] > 2


def test_table_output_and_a_batch_of_prompts(tiny, capsys):
    code, out, _ = run_cli(capsys, "generate", "--model", "tiny-deepseek", "--prompt", "a", "--prompt", "bcd",
                           "--max-new-tokens", "8", "--temperature", "0.8", "--top-p", "0.9")
    assert code == 0 and "--- prompt 1" in out and "accept length mean" in out and "tokens/s" in out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["--model", "tiny-deepseek", "--budget", "0"], "budget must be >= 1"),
        (["--model", "tiny-deepseek", "--depth", "99"], "exceeds the maximum depth 64"),
        (["--model", "tiny-deepseek", "--mtp", "/nonexistent/head.safetensors"], "does not exist"),
        (["--model", "tiny-deepseek", "--temperature", "-1"], "temperature must be >= 0"),
    ],
)
def test_bad_input_is_one_error_line(tiny, capsys, extra, message):
    code, out, err = run_cli(capsys, "generate", "--prompt", "x", *extra)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err, err


def test_missing_mtp_weights_and_a_mismatched_head(tiny, random_tiny, capsys, tmp_path):
    model, _ = random_tiny
    plain = tmp_path / "no-mtp"
    model.save_pretrained(plain)
    capsys.readouterr()  # drop transformers' own progress output
    code, _, err = run_cli(capsys, "generate", "--model", str(plain), "--prompt", "x")
    assert code == 2 and "has no MTP weights" in err and err.count("\n") == 1
    from sglang_spec.mtp.checkpoint import save_mtp_head
    from sglang_spec.mtp.head import MTPHead

    other = type(model)(type(model.config)(**{**model.config.to_dict(), "vocab_size": 300}))
    head_path = save_mtp_head(MTPHead.for_target(other), tmp_path / "other.safetensors")
    capsys.readouterr()
    code, _, err = run_cli(capsys, "generate", "--model", "tiny-deepseek", "--mtp", str(head_path), "--prompt", "x")
    assert code == 2 and "vocabulary (300) does not match the target's (512)" in err and err.count("\n") == 1
