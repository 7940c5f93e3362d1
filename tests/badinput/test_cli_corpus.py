"""Every command against the bad-input corpus: each case exits with status 2, prints exactly one line
(``error: ...``) and no traceback, writes nothing to stdout, and changes no file.

Commands run in-process through ``sglang_spec.cli.main`` (one model load per case on the tiny model)."""

from __future__ import annotations

import copy
import hashlib
import os
import stat
from pathlib import Path

import pytest
import torch

from corpus import GOOD_PROFILE, make_corpus
from sglang_spec.cli import main
from sglang_spec.mtp.checkpoint import save_mtp_head
from sglang_spec.train.traffic import TrafficRecord, write_traffic

TINY = ["--model", "tiny-deepseek"]
GEN = ["generate", *TINY, "--no-chat", "--prompt", "abc", "--max-new-tokens", "4"]
CONTEXT = 512  # tiny-deepseek's max_position_embeddings


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny):
    """The corpus, plus good inputs for the cases that need one bad thing at a time."""
    root = tmp_path_factory.mktemp("badinput")
    paths = make_corpus(root / "corpus")
    work = root / "work"
    work.mkdir()
    (work / "existing.json").write_text('{"rank_acceptance": [0.5]}\n')
    (work / "folder").mkdir()
    records = [TrafficRecord(f"toy/{i}/greedy", "toy", "ab" * (i + 3), prompt="abc" * (i + 1),
                             source="generate tiny-deepseek temperature=0.0") for i in range(12)]
    write_traffic(records, work / "tiny.jsonl")
    write_traffic([TrafficRecord(r.id, r.domain, r.completion, prompt=r.prompt,
                                 source="generate smollm2 temperature=0.0") for r in records], work / "other.jsonl")
    loaded, head = tiny
    save_mtp_head(head, work / "smollm2-head.safetensors", metadata={"model": "smollm2"})
    (work / "run.safetensors").write_bytes(b"an earlier head")
    (work / "run.state.pt").write_bytes(b"\x80\x02 not a torch file")
    save_mtp_head(head, work / "good.safetensors", metadata={"model": "tiny-deepseek"})
    small = copy.deepcopy(head)
    small.draft_vocab = torch.arange(8)
    small.refresh_draft_head()
    save_mtp_head(small, work / "small-vocab.safetensors", metadata={"model": "tiny-deepseek"})
    (work / "good.state.pt").write_bytes(b"\x80\x02 not a torch file")
    return root, {**{name: str(path) for name, path in paths.items()}, **{
        "work": str(work), "tiny.jsonl": str(work / "tiny.jsonl"), "other.jsonl": str(work / "other.jsonl")}}


def _fill(text: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        text = text.replace(key, value)
    return text


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under ``root``: its kind, and for regular files their bytes' hash and mtime."""
    result = {}
    for folder, names, files in os.walk(root):
        for name in names + files:
            path = Path(folder) / name
            info = path.lstat()
            entry: tuple = (stat.S_IFMT(info.st_mode),)
            if stat.S_ISREG(info.st_mode):
                entry += (hashlib.sha256(path.read_bytes()).hexdigest(), info.st_mtime_ns)
            result[str(path.relative_to(root))] = entry
    return result


C = "{corpus}/"
W = "{work}/"
CASES = [
    # ---- generate: numbers
    ("temperature 1e999", [*GEN, "--temperature", "1e999"], "temperature must be >= 0"),
    ("temperature nan", [*GEN, "--temperature", "nan"], "temperature must be >= 0"),
    ("temperature -1", [*GEN, "--temperature", "-1"], "temperature must be >= 0"),
    ("temperature word", [*GEN, "--temperature", "warm"], "temperature must be >= 0"),
    ("seed 1e23", [*GEN, "--seed", "1e23"], "--seed"),
    ("seed 10^23", [*GEN, "--seed", "1" + "0" * 23], "out of range"),
    ("seed negative", [*GEN, "--seed", "-1"], "out of range"),
    ("max-new-tokens 0", [*GEN, "--max-new-tokens", "0"], "--max-new-tokens: 0 is out of range"),
    ("max-new-tokens past the context", [*GEN, "--max-new-tokens", "100000"], "use at most 509"),
    ("prompt longer than the context", ["generate", *TINY, "--no-chat", "--prompt", "x" * 600], "context holds 512"),
    ("topk 10^6", [*GEN, "--policy", "specexec", "--topk", "1000000"], "exceeds the maximum 64"),
    ("topk 0", [*GEN, "--policy", "specexec", "--topk", "0"], "topk must be >= 1"),
    ("top-p nan", [*GEN, "--top-p", "nan"], "--top-p"),
    ("top-p 0", [*GEN, "--top-p", "0"], "--top-p"),
    ("top-k negative", [*GEN, "--top-k", "-1"], "--top-k: -1 is out of range"),
    ("top-k 10^30", [*GEN, "--top-k", "1" + "0" * 30], "--top-k"),
    ("budget 0", [*GEN, "--budget", "0"], "budget must be >= 1"),
    ("non-UTF-8 prompt", ["generate", *TINY, "--prompt", "ab\udcffc"], "is not valid UTF-8"),
    # ---- generate: files
    *[(f"profile {name}", [*GEN, "--acceptance", C + name], name) for name in (
        "profile-truncated.json", "profile-huge-integer.json", "profile-too-many-digits.json", "profile-deep.json",
        "profile-invalid-utf8.json", "profile-nan.json", "profile-rows-not-lists.json", "profile-empty.json",
        "a-fifo", "a-file")],
    ("profile a folder", [*GEN, "--acceptance", "{corpus}"], "is a folder"),
    *[(f"costs {name}", [*GEN, "--auto", "--costs", C + name], name) for name in (
        "costs-not-json.json", "costs-list.json", "costs-missing-key.json", "costs-unknown-key.json",
        "costs-bad-size.json", "costs-negative.json", "costs-nan.json", "costs-string-times.json",
        "costs-empty-verify.json", "costs-deep.json")],
    ("costs under a file", [*GEN, "--auto", "--costs", C + "a-file/costs.json"], "is not a folder"),
    *[(f"head {name}", [*GEN, "--mtp", C + name], name) for name in (
        "head-empty.safetensors", "head-random.safetensors", "head-truncated.safetensors",
        "head-header-not-json.safetensors", "head-header-a-list.safetensors",
        "head-header-missing-size.safetensors", "head-header-string-size.safetensors",
        "head-header-bad-feedback.safetensors", "head-header-bad-metadata.safetensors",
        "head-no-header.safetensors", "a-fifo")],
    ("head a folder of nothing", [*GEN, "--mtp", W + "folder"], "expected one .safetensors"),
    ("head of another model", [*GEN, "--mtp", W + "smollm2-head.safetensors"], "trained for 'smollm2'"),
    # ---- generate: lookup / hybrid trees, --trace
    ("hybrid budget 0", [*GEN, "--policy", "hybrid", "--budget", "0"], "budget must be >= 1"),
    ("lookup budget 10^6", [*GEN, "--policy", "lookup", "--budget", "1000000"], "exceeds the maximum 1023"),
    ("hybrid depth 0", [*GEN, "--policy", "hybrid", "--depth", "0"], "depth must be >= 1"),
    ("hybrid topk 10^6", [*GEN, "--policy", "hybrid", "--topk", "1000000"], "exceeds the maximum 64"),
    ("hybrid topk past the draft vocabulary", [*GEN, "--policy", "hybrid", "--topk", "64", "--mtp",
                                               W + "small-vocab.safetensors"], "exceeds the head's draft vocabulary"),
    ("mtp-levels -1", [*GEN, "--policy", "hybrid", "--mtp-levels", "-1"], "--mtp-levels: -1 is out of range"),
    ("mtp-levels 10^6", [*GEN, "--policy", "hybrid", "--mtp-levels", "1000000"], "--mtp-levels"),
    ("mtp-levels word", [*GEN, "--policy", "hybrid", "--mtp-levels", "two"], "is not an integer"),
    ("policy unknown", [*GEN, "--policy", "suffix"], "invalid choice"),
    ("mtp-levels without hybrid", [*GEN, "--policy", "lookup", "--mtp-levels", "1"], "the lookup policy has none"),
    *[(f"acceptance sources {name}", [*GEN, "--policy", "hybrid", "--acceptance", C + name], name) for name in (
        "sources-truncated.json", "sources-a-list.json", "sources-missing-key.json", "sources-wrong-shape.json",
        "sources-accepted-past-offered.json", "sources-nan.json", "sources-huge-integer.json",
        "sources-invalid-utf8.json", "profile-deep.json", "a-fifo", "a-file")],
    ("acceptance a folder", [*GEN, "--policy", "lookup", "--acceptance", "{corpus}"], "is a folder"),
    ("acceptance absent", [*GEN, "--policy", "lookup", "--acceptance", W + "absent.json"], "absent.json"),
    ("trace under a file", [*GEN, "--policy", "lookup", "--trace", C + "a-file/t.html"], "is not a folder"),
    ("trace /dev/full", [*GEN, "--policy", "lookup", "--trace", "/dev/full"], "is a device"),
    ("trace a folder", [*GEN, "--policy", "lookup", "--trace", W + "folder"], "is a directory"),
    ("trace a fifo", [*GEN, "--policy", "hybrid", "--trace", C + "a-fifo"], "is a fifo"),
    ("trace names no file", [*GEN, "--policy", "hybrid", "--trace", ""], "names no file"),
    ("trace non-UTF-8", [*GEN, "--policy", "hybrid", "--trace", "t\udcff.html"], "not valid UTF-8"),
    ("auto lookup costs under a file", [*GEN, "--policy", "lookup", "--auto", "--costs", C + "a-file/c.json"],
     "is not a folder"),
    ("auto hybrid costs damaged", [*GEN, "--policy", "hybrid", "--auto", "--costs", C + "costs-nan.json"],
     "costs-nan.json"),
    ("hybrid head of another model", [*GEN, "--policy", "hybrid", "--mtp", W + "smollm2-head.safetensors"],
     "trained for 'smollm2'"),
    ("lookup head corrupt", [*GEN, "--policy", "lookup", "--mtp", C + "head-random.safetensors"],
     "head-random.safetensors"),
    ("hybrid past the context", [*GEN, "--policy", "hybrid", "--max-new-tokens", "100000"], "use at most 509"),
    # ---- tree
    ("tree topk 10^6", ["tree", "--policy", "specexec", "--budget", "8", "--depth", "3", "--topk", "1000000"],
     "exceeds the maximum 64"),
    ("tree profile huge integer", ["tree", "--policy", "sequoia", "--budget", "8", "--depth", "3", "--acceptance",
                                   C + "profile-huge-integer.json"], "is not a finite number"),
    ("tree profile deep", ["tree", "--policy", "sequoia", "--budget", "8", "--depth", "3", "--acceptance",
                           C + "profile-deep.json"], "nested too deeply"),
    ("tree profile invalid UTF-8", ["tree", "--policy", "sequoia", "--budget", "8", "--depth", "3",
                                    "--acceptance", C + "profile-invalid-utf8.json"], "is not UTF-8"),
    # ---- traffic generate
    *[(f"traffic generate {label}", ["traffic", "generate", *TINY, "--prompts", C + "prompts-empty.txt", *extra],
       message) for label, extra, message in (
        ("out under a file", ["--out", C + "a-file/t.jsonl"], "is not a folder"),
        ("out /dev/full", ["--out", "/dev/full", "--force"], "is a device"),
        ("out a fifo", ["--out", C + "a-fifo", "--force"], "is a fifo"),
        ("out a folder", ["--out", W + "folder", "--force"], "is a directory"),
        ("out exists", ["--out", W + "existing.json"], "exists; pass --force"),
        ("sampling at -1", ["--out", W + "t.jsonl", "--no-greedy", "--temperature", "-1"], "need --temperature"),
        ("sampling at nan", ["--out", W + "t.jsonl", "--no-greedy", "--temperature", "nan"], "need --temperature"),
        ("sampling at 1e-40", ["--out", W + "t.jsonl", "--temperature", "1e-40"], "need --temperature"),
        ("batch-size 0", ["--out", W + "t.jsonl", "--batch-size", "0"], "--batch-size: 0 is out of range"),
        ("max-new-tokens 0", ["--out", W + "t.jsonl", "--max-new-tokens", "0"], "--max-new-tokens: 0"),
        ("samples 10^6", ["--out", W + "t.jsonl", "--samples", "1000000"], "--samples"),
        ("seed 1e23", ["--out", W + "t.jsonl", "--seed", "1e23"], "--seed"),
        ("nothing to do", ["--out", W + "t.jsonl", "--no-greedy", "--samples", "0"], "nothing to generate"),
    )],
    *[(f"prompts {name}", ["traffic", "generate", *TINY, "--prompts", C + name, "--out", W + "t.jsonl"], name)
      for name in ("prompts-invalid-utf8.txt", "prompts-empty.txt", "prompts-a-list.jsonl",
                   "prompts-messages-a-string.jsonl", "prompts-messages-no-role.jsonl",
                   "prompts-domain-a-number.jsonl", "prompts-surrogate.jsonl", "prompts-deep.jsonl", "a-fifo")],
    ("prompts a folder", ["traffic", "generate", *TINY, "--prompts", "{corpus}", "--out", W + "t.jsonl"],
     "is a folder"),
    ("prompt past the context", ["traffic", "generate", *TINY, "--prompts", "{work}/long.txt", "--out",
                                 W + "t.jsonl", "--max-new-tokens", "500"], "use at most"),
    # ---- traffic import / stats
    ("import out under a file", ["traffic", "import", "{tiny.jsonl}", "--format", "openai", "--out",
                                 C + "a-file/x.jsonl"], "is not a folder"),
    ("import a folder", ["traffic", "import", "{corpus}", "--format", "openai", "--out", W + "i.jsonl"],
     "is a folder"),
    ("import a fifo", ["traffic", "import", C + "a-fifo", "--format", "sglang", "--out", W + "i.jsonl"], "a fifo"),
    ("import a non-UTF-8 domain", ["traffic", "import", "{tiny.jsonl}", "--format", "openai", "--domain", "\udcff",
                                   "--out", W + "i.jsonl"], "not valid UTF-8"),
    ("stats of a folder", ["traffic", "stats", "{corpus}"], "is a folder"),
    ("stats of invalid UTF-8", ["traffic", "stats", C + "traffic-invalid-utf8.jsonl"], "is not UTF-8"),
    # ---- train
    *[(f"train {label}", ["train", *TINY, "--traffic", "{tiny.jsonl}", "--out", W + "h.safetensors", *extra],
       message) for label, extra, message in (
        ("lr 1e30", ["--lr", "1e30"], "--lr: 1e+30 is out of range"),
        ("lr nan", ["--lr", "nan"], "--lr: 'nan' is not a finite number"),
        ("lr 0", ["--lr", "0"], "--lr: 0 is out of range"),
        ("steps 0", ["--steps", "0"], "--steps"),
        ("batch-size 0", ["--batch-size", "0"], "--batch-size"),
        ("seq-len 1", ["--seq-len", "1"], "--seq-len"),
        ("seq-len past the context", ["--seq-len", "100000"], "exceeds tiny-deepseek's context of 512"),
        ("unroll 0", ["--unroll", "0"], "--unroll"),
        ("eval-fraction 1", ["--eval-fraction", "1"], "--eval-fraction"),
        ("eval-fraction nan", ["--eval-fraction", "nan"], "--eval-fraction"),
        ("top-k-targets past the draft vocabulary", ["--top-k-targets", "100000"], "exceeds the draft vocabulary"),
        ("draft-vocab negative", ["--draft-vocab", "-1"], "--draft-vocab"),
        ("checkpoint-every 0", ["--checkpoint-every", "0"], "--checkpoint-every"),
        ("seed 1e23", ["--seed", "1e23"], "--seed"),
        ("init corrupt", ["--init", C + "head-truncated.safetensors"], "head-truncated.safetensors"),
        ("init of another model", ["--init", W + "smollm2-head.safetensors"], "trained for 'smollm2'"),
        ("resume nothing", ["--resume"], "nothing to resume"),
        ("teacher-store without a capture", ["--teacher-store", W + "store"], "use it with --capture"),
    )],
    *[(f"train traffic {name}", ["train", *TINY, "--traffic", C + name, "--out", W + "h.safetensors"], name)
      for name in ("traffic-a-list.jsonl", "traffic-a-string.jsonl", "traffic-no-completion.jsonl",
                   "traffic-both-prompts.jsonl", "traffic-deep.jsonl", "traffic-invalid-utf8.jsonl",
                   "traffic-surrogate.jsonl", "a-fifo")],
    ("train empty traffic", ["train", *TINY, "--traffic", C + "traffic-empty.jsonl", "--out", W + "h.safetensors"],
     "no traffic records"),
    ("train on another model's traffic", ["train", *TINY, "--traffic", "{other.jsonl}", "--out",
                                          W + "h.safetensors"], "generated by 'smollm2'"),
    ("train out under a file", ["train", *TINY, "--traffic", "{tiny.jsonl}", "--out", C + "a-file/h.safetensors"],
     "is not a folder"),
    ("train out /dev/full", ["train", *TINY, "--traffic", "{tiny.jsonl}", "--out", "/dev/full", "--force"],
     "is a device"),
    ("train out exists", ["train", *TINY, "--traffic", "{tiny.jsonl}", "--out", W + "run.safetensors"],
     "pass --force to overwrite or --resume"),
    ("train resume a damaged state", ["train", *TINY, "--traffic", "{tiny.jsonl}", "--out", W + "run.safetensors",
                                      "--resume"], "is damaged"),
    # ---- calibrate
    *[(f"calibrate {label}", ["calibrate", *TINY, "--traffic", "{tiny.jsonl}", "--out", W + "p.json", *extra],
       message) for label, extra, message in (
        ("temperature nan", ["--temperature", "nan"], "temperature must be >= 0"),
        ("temperature inf", ["--temperature", "inf"], "temperature must be >= 0"),
        ("depth 0", ["--depth", "0"], "--depth"),
        ("depth 999", ["--depth", "999"], "--depth"),
        ("max-rank 0", ["--max-rank", "0"], "--max-rank"),
        ("max-rank 10^4", ["--max-rank", "10000"], "--max-rank"),
        ("held-out nan", ["--held-out", "nan"], "--held-out"),
        ("head corrupt", ["--mtp", C + "head-random.safetensors"], "head-random.safetensors"),
        ("head of another model", ["--mtp", W + "smollm2-head.safetensors"], "trained for 'smollm2'"),
    )],
    ("calibrate another model's traffic", ["calibrate", *TINY, "--traffic", "{other.jsonl}", "--out", W + "p.json"],
     "generated by 'smollm2'"),
    ("calibrate out exists", ["calibrate", *TINY, "--traffic", "{tiny.jsonl}", "--out", W + "existing.json"],
     "exists; pass --force"),
    ("calibrate out a folder", ["calibrate", *TINY, "--traffic", "{tiny.jsonl}", "--out", W + "folder", "--force"],
     "is a directory"),
    ("calibrate out under a file", ["calibrate", *TINY, "--traffic", "{tiny.jsonl}", "--out",
                                    C + "a-file/p.json"], "is not a folder"),
    # ---- calibrate --prompts (the per-source counts)
    ("calibrate neither traffic nor prompts", ["calibrate", *TINY, "--out", W + "s.json"], "give --traffic"),
    ("calibrate prompts without a positional table", ["calibrate", *TINY, "--prompts", "{work}/toy.txt", "--out",
                                                      W + "s.json"], "--update PROFILE.json"),
    *[(f"calibrate prompts {label}", ["calibrate", *TINY, "--traffic", "{tiny.jsonl}", "--prompts", "{work}/toy.txt",
                                      *extra], message)
      for label, extra, message in (
        ("out exists", ["--out", W + "existing.json"], "exists; pass --force"),
        ("out under a file", ["--out", C + "a-file/s.json"], "is not a folder"),
        ("out /dev/full", ["--out", "/dev/full", "--force"], "is a device"),
        ("out a folder", ["--out", W + "folder", "--force"], "is a directory"),
        ("out a fifo", ["--out", C + "a-fifo", "--force"], "is a fifo"),
        ("max-new-tokens 0", ["--out", W + "s.json", "--max-new-tokens", "0"], "--max-new-tokens: 0"),
        ("max-new-tokens 10^30", ["--out", W + "s.json", "--max-new-tokens", "1" + "0" * 30], "--max-new-tokens"),
        ("max-new-tokens past the context", ["--out", W + "s.json", "--max-new-tokens", "100000"], "use at most"),
        ("temperature nan", ["--out", W + "s.json", "--temperature", "nan"], "temperature must be >= 0"),
        ("temperature -1", ["--out", W + "s.json", "--temperature", "-1"], "temperature must be >= 0"),
        ("every 0", ["--out", W + "s.json", "--prompts", "{work}/toy.txt@0"], "after @ give a whole number"),
        ("every 10^30", ["--out", W + "s.json", "--prompts", "{work}/toy.txt@1" + "0" * 30],
         "after @ give a whole number"),
        ("every a word", ["--out", W + "s.json", "--prompts", "{work}/toy.txt@two"], "after @ give a whole number"),
        ("unknown prompt set", ["--out", W + "s.json", "--prompts", "humaneval:x"], "unknown prompt set"),
        ("head corrupt", ["--out", W + "s.json", "--mtp", C + "head-truncated.safetensors"],
         "head-truncated.safetensors"),
        ("head of another model", ["--out", W + "s.json", "--mtp", W + "smollm2-head.safetensors"],
         "trained for 'smollm2'"),
    )],
    *[(f"calibrate prompts file {name}", ["calibrate", *TINY, "--traffic", "{tiny.jsonl}", "--prompts", C + name,
                                          "--out", W + "s.json"], name)
      for name in ("prompts-invalid-utf8.txt", "prompts-empty.txt", "prompts-a-list.jsonl", "prompts-deep.jsonl",
                   "a-fifo")],
]


@pytest.mark.parametrize("argv, message", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_input_is_one_line_exit_2_and_changes_nothing(world, capsys, argv, message):
    root, names = world
    work = Path(names["work"])
    (work / "long.txt").write_text("y" * 100 + "\n")  # 100 tokens + 500 new ones > 512
    (work / "toy.txt").write_text("abc\nabcabc\n")
    values = {"{corpus}": names["a-fifo"].rsplit("/", 1)[0], "{work}": names["work"],
              "{tiny.jsonl}": names["tiny.jsonl"], "{other.jsonl}": names["other.jsonl"]}
    argv = [_fill(part, values) for part in argv]
    before = snapshot(root)
    code = main(argv)
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert code == 2, captured.err
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    assert message in lines[0], lines[0]
    assert snapshot(root) == before


def test_the_corpus_covers_every_file_it_makes(world):
    """Each corpus file is read by at least one case, so a new entry cannot go untested."""
    _, names = world
    used = " ".join(" ".join(argv) for _, argv, _ in CASES)
    unused = [name for name in names if name.endswith((".json", ".jsonl", ".txt", ".safetensors"))
              and "/" not in name and name not in used and name not in ("tiny.jsonl", "other.jsonl")]
    assert not unused, unused
    assert GOOD_PROFILE  # the good profile is used by the positive tests
