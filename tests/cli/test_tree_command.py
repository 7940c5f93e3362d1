import json
import subprocess
import sys

import pytest

from sglang_spec.cli import main


def run_cli(capsys, *args):
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_output_has_the_documented_keys(capsys):
    code, out, _ = run_cli(capsys, "tree", "--policy", "sequoia", "--budget", "7", "--depth", "3", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["parents"] == [-1, 0, 0, 0, 1, 1, 2, 4]
    assert data["budget"] == 7 and data["depth"] == 3
    assert data["expected_accept_length"] == pytest.approx(2.5933, abs=1e-4)


def test_table_output_and_a_custom_profile(capsys, tmp_path):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"rank_acceptance": [[0.8, 0.1], [0.6, 0.2]]}))
    code, out, _ = run_cli(capsys, "tree", "--policy", "specexec", "--budget", "5", "--depth", "4",
                           "--acceptance", str(profile))
    assert code == 0
    assert "node 0 (root)" in out and "expected accept length" in out
    code, out, _ = run_cli(capsys, "tree", "--policy", "chain", "--budget", "3", "--depth", "3",
                           "--acceptance", str(profile), "--json")
    assert json.loads(out)["expected_accept_length"] == pytest.approx(1 + 0.8 + 0.8 * 0.6 + 0.8 * 0.6 * 0.6)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--policy", "chain", "--budget", "0", "--depth", "2"], "budget must be >= 1"),
        (["--policy", "chain", "--budget", "2", "--depth", "70"], "exceeds the maximum depth 64"),
        (["--policy", "sequoia", "--budget", "2", "--depth", "2", "--acceptance", "/nonexistent.json"],
         "cannot read acceptance profile"),
    ],
)
def test_bad_input_is_one_error_line(capsys, args, message):
    code, out, err = run_cli(capsys, "tree", *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err and err.startswith("error: ")


def test_bad_profile_file_is_one_error_line(capsys, tmp_path):
    for content, message in [
        ({"rank_acceptance": [0.5, -0.2]}, "is negative"),
        ({"rank_acceptance": [0.9, 0.3]}, "sums to 1.200000 > 1"),
    ]:
        path = tmp_path / "p.json"
        path.write_text(json.dumps(content))
        code, _, err = run_cli(capsys, "tree", "--policy", "sequoia", "--budget", "4", "--depth", "2",
                               "--acceptance", str(path))
        assert code == 2 and err.count("\n") == 1 and message in err


def test_unknown_policy_through_the_console_script():
    completed = subprocess.run(
        [sys.executable, "-m", "sglang_spec.cli", "tree", "--policy", "beam", "--budget", "4", "--depth", "2"],
        capture_output=True,
        text=True,
    )
    assert completed.returncode == 2 and completed.stdout == ""
    assert completed.stderr.count("\n") == 1 and "invalid choice: 'beam'" in completed.stderr
