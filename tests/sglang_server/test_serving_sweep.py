"""bench/serving_sweep.py through SGLang's benchmark client against the CPU server: plain decoding and a Sequoia
tree at concurrency 1 and 4 on held-out prompts (prefills on two threads), written as CSV, JSON and a plot with p50
/ p99 inter-token latency per policy."""

from __future__ import annotations

import csv
import json
import importlib.util
import subprocess
from pathlib import Path

import pytest

import sglang_spec_testbed.server as cpu_server
from sglang_spec_testbed.server import free_port, option_value

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

REPO = Path(__file__).resolve().parents[2]


def test_sweep_against_the_cpu_server(smollm2_cpu, tmp_path):
    spec = importlib.util.spec_from_file_location("serving_sweep", REPO / "bench" / "serving_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    out = tmp_path / "sweep.csv"
    assert sweep.main(["--cpu-model", "smollm2", "--policies", "plain,sequoia", "--budgets", "15", "--concurrency",
                       "1,4", "--num-prompts", "4", "--random-output-len", "16", "--port", str(free_port()),
                       "--prefill-threads", "2", "--out", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert [(row["policy"], row["concurrency"]) for row in rows] == [
        ("plain", "1"), ("plain", "4"), ("sequoia", "1"), ("sequoia", "4")]
    for row in rows:
        assert float(row["output_throughput"]) > 0
        assert float(row["p99_itl_ms"]) >= float(row["median_itl_ms"]) > 0
    assert all(float(row["accept_length"]) > 1.0 for row in rows if row["policy"] == "sequoia")
    assert out.with_suffix(".png").stat().st_size > 10_000 and out.with_suffix(".json").exists()
    # --prefill-threads reached each server: its prompts' prefills ran on two threads, its decode steps on one
    for name in ("plain", "sequoia-15"):
        log = (REPO / "runs" / "serving_sweep" / f"{name}.log").read_text(errors="replace")
        assert "CPU bed: the target model's prefills of 128+ tokens run on 2 threads (decode steps on 1;" in log, name



def test_a_workload_with_fewer_prompts_than_asked_is_cycled_to_fill_the_concurrency(tmp_path, capsys):
    """bench_serving sends each dataset entry once: a workload's 32 distinct requests are cycled when more are asked
    (with a warning: a cross-request corpus would see the repeats), and never repeat below that."""
    spec = importlib.util.spec_from_file_location("serving_sweep", REPO / "bench" / "serving_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    args = sweep.parse_args(["--cpu-model", "smollm2", "--workloads", "extraction,code", "--num-prompts", "40"])
    datasets = sweep.workload_datasets(args, tmp_path)
    extraction = [entry["conversations"][0]["value"] for entry in json.loads(datasets["extraction"].read_text())]
    assert len(extraction) == 40 and len(set(extraction)) == 32 and extraction[32] == extraction[0]
    assert "32 distinct prompts repeated to 40 requests" in capsys.readouterr().err
    # the first six are the earlier extraction set: passage i with question i mod 3
    assert [text.rsplit("\n\n", 1)[1] for text in extraction[:6]] == [*sweep.EXTRACTION_QUESTIONS] * 2
    assert sweep.repeated(["a", "b", "c"], 2) == ["a", "b", "c"]
    assert "repeated" not in capsys.readouterr().err


def test_speedups_are_over_the_faster_plain_decoding_and_plain_sync_turns_overlap_off():
    """On this CPU SGLang's overlap loop slows plain decoding on long prompts; the context policies run without it,
    so their ratio is over the faster of the two plain servers, never over the slower one alone."""
    spec = importlib.util.spec_from_file_location("serving_sweep", REPO / "bench" / "serving_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    args = sweep.parse_args(["--cpu-model", "smollm2", "--policies", "plain,plain-sync,hybrid"])
    assert sweep.tree_arguments(args, "plain-sync", 15, None) == ["--disable-overlap-schedule"]
    # context trees run as deep as their budget unless --hybrid-depth says otherwise; head trees take --depth
    def depth(arguments: list[str]) -> str:
        return arguments[arguments.index("--speculative-tree-depth") + 1]

    assert depth(sweep.tree_arguments(args, "hybrid", 15, None)) == "15"
    assert depth(sweep.tree_arguments(args, "auto", 7, None)) == "7"
    assert depth(sweep.tree_arguments(args, "specexec", 15, None)) == "4"
    shallow = sweep.parse_args(["--cpu-model", "smollm2", "--hybrid-depth", "8"])
    assert depth(sweep.tree_arguments(shallow, "lookup", 15, None)) == "8"
    # lookup-device: the lookup server's options, its trees grown on the device
    assert sweep.tree_arguments(args, "lookup-device", 15, None) == \
        sweep.tree_arguments(args, "lookup", 15, None) + ["--speculative-tree-context-on", "device"]
    assert sweep.tree_arguments(args, "hybrid-device", 7, None) == \
        sweep.tree_arguments(args, "hybrid", 7, None) + ["--speculative-tree-context-on", "device"]
    # the planner's servers with the overlap loop off: their own options and plain-sync's one
    for policy in ("auto", "auto-batch"):
        assert sweep.tree_arguments(args, f"{policy}-sync", 11, None) == \
            sweep.tree_arguments(args, policy, 11, None) + ["--disable-overlap-schedule"]

    def row(policy, workload, throughput):
        return {**sweep.row_from_result(policy, 15, 1, {"output_throughput": throughput}, workload)}

    rows = [row("plain", "extraction", 6.0), row("plain-sync", "extraction", 8.0), row("hybrid", "extraction", 10.0),
            row("plain", "code", 12.0), row("plain-sync", "code", 11.0), row("hybrid", "code", 15.0)]
    sweep.add_speedups(rows)
    assert [round(r["speedup_over_plain"], 3) for r in rows] == [0.75, 1.0, 1.25, 1.0, 0.917, 1.25]
    assert rows[1]["budget"] == 0
    assert not any("speedup_over_plain_rounds" in r for r in rows)  # one round: no per-round ratios


def test_rounds_rotate_the_servers_so_each_takes_every_place():
    spec = importlib.util.spec_from_file_location("serving_sweep", REPO / "bench" / "serving_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    shapes = [("plain", 7), ("plain-sync", 7), ("auto", 7)]
    orders = [sweep.round_order(shapes, index) for index in range(4)]
    assert orders[0] == shapes and orders[3] == shapes
    assert [order[0][0] for order in orders[:3]] == ["plain", "plain-sync", "auto"]
    for shape in shapes:  # over three rounds each server ran first, second and third once
        assert sorted(order.index(shape) for order in orders[:3]) == [0, 1, 2]
    assert sweep.round_order([], 2) == []


def test_rounds_report_each_figure_as_its_median_and_keep_every_round(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("serving_sweep", REPO / "bench" / "serving_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)

    def row(policy, throughput, p99):
        return sweep.row_from_result(policy, 15, 16, {"output_throughput": throughput, "p99_itl_ms": p99}, "chat")

    rounds = [row("plain", 60.0, 250.0), row("auto", 58.0, 260.0), row("auto", 64.0, 255.0),
              row("plain", 66.0, 240.0), row("plain", 63.0, 245.0), row("auto", 65.0, 300.0)]
    for index, member in enumerate(rounds):
        member["position"] = index % 2
    merged = sweep.median_over_rounds(rounds)
    sweep.add_speedups(merged)
    assert [(r["policy"], r["output_throughput"], r["p99_itl_ms"]) for r in merged] == \
        [("plain", 63.0, 245.0), ("auto", 64.0, 260.0)]
    assert merged[1]["output_throughput_rounds"] == [58.0, 64.0, 65.0]
    assert merged[0]["position_rounds"] == [0, 1, 0] and merged[1]["position_rounds"] == [1, 0, 1]
    assert merged[1]["speedup_over_plain"] == pytest.approx(64.0 / 63.0) and merged[1]["accept_length"] is None
    # each round's ratio over that round's plain (the servers of a round share the machine's phase)
    assert merged[1]["speedup_over_plain_rounds"] == pytest.approx([58.0 / 60.0, 64.0 / 66.0, 65.0 / 63.0])
    assert merged[0]["speedup_over_plain_rounds"] == pytest.approx([1.0, 1.0, 1.0])
    sweep.print_table(merged)
    table = capsys.readouterr().out.splitlines()
    assert "rounds x" in table[0] and "0.97-1.03" in table[2]
    with pytest.raises(SystemExit):
        sweep.parse_args(["--cpu-model", "smollm2", "--rounds", "0"])
    sweep.write_csv_and_plot(merged, tmp_path / "one.csv")  # one concurrency: bars by workload
    assert (tmp_path / "one.png").stat().st_size > 0
    assert "output_throughput_rounds" not in (tmp_path / "one.csv").read_text()


def test_num_prompts_per_concurrency_reaches_the_benchmark_client_and_a_bad_list_is_refused(tmp_path, capsys):
    """``--num-prompts 6,16,32`` with ``--concurrency 1,4,16``: each run sends its own count (the dataset holds
    the largest), so a concurrency-1 run does not decode a concurrency-16 run's requests one by one."""
    spec = importlib.util.spec_from_file_location("serving_sweep", REPO / "bench" / "serving_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    args = sweep.parse_args(["--cpu-model", "smollm2", "--workloads", "code", "--concurrency", "1,4,16",
                             "--num-prompts", "6,16,32"])
    assert args.prompts_at == {1: 6, 4: 16, 16: 32}
    sent = {concurrency: sweep.bench_command(args, concurrency, tmp_path / "out.jsonl", tmp_path / "code.json")
            for concurrency in (1, 4, 16)}
    assert {c: int(command[command.index("--num-prompts") + 1]) for c, command in sent.items()} == args.prompts_at
    dataset = sweep.workload_datasets(args, tmp_path)["code"]
    assert len(json.loads(dataset.read_text())) == 32
    assert sweep.parse_args(["--concurrency", "1,4", "--num-prompts", "8"]).prompts_at == {1: 8, 4: 8}
    for bad in ("6,16", "0", "six"):
        with pytest.raises(SystemExit):
            sweep.parse_args(["--concurrency", "1,4,16", "--num-prompts", bad])
        assert "--num-prompts" in capsys.readouterr().err


def test_output_len_spread_gives_each_request_its_own_length_as_bench_serving_counts_it(smollm2_cpu, tmp_path,
                                                                                           capsys):
    """``--output-len-spread 0.5``: bench_serving's own sampler reads each request's length from its placeholder
    reply, spread over 24-72 tokens around 48 (the same request the same length on every server); without the
    spread every request asks for 48, and a tokenizer that does not count one token a word is refused."""
    from sglang.benchmark.datasets.sharegpt import sample_sharegpt_requests
    from transformers import AutoTokenizer

    from sglang_spec.errors import SpecError

    spec = importlib.util.spec_from_file_location("serving_sweep", REPO / "bench" / "serving_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_cpu.target_dir))
    spread = sweep.parse_args(["--cpu-model", "smollm2", "--workloads", "code", "--concurrency", "4",
                               "--num-prompts", "32", "--random-output-len", "48", "--output-len-spread", "0.5"])
    dataset = sweep.workload_datasets(spread, tmp_path, tokenizer)["code"]
    command = sweep.bench_command(spread, 4, tmp_path / "out.jsonl", dataset)
    assert "--sharegpt-output-len" not in command
    lengths = [row.output_len for row in sample_sharegpt_requests(str(dataset), 32, tokenizer)]
    assert min(lengths) >= 24 and max(lengths) <= 72 and len(set(lengths)) > 16
    assert abs(sum(lengths) / len(lengths) - 48) < 3
    # the control: one length for all, from the command line
    alike = sweep.parse_args(["--cpu-model", "smollm2", "--workloads", "code", "--concurrency", "4",
                              "--random-output-len", "48"])
    command = sweep.bench_command(alike, 4, tmp_path / "out.jsonl", dataset)
    assert command[command.index("--sharegpt-output-len") + 1] == "48"

    class TwoTokensAWord:
        def encode(self, text):
            return text.split() * 2

    with pytest.raises(SpecError, match="counts 48 tokens in a reply of 24 words"):
        sweep.placeholder_replies(TwoTokensAWord(), [24])
    for bad in (["--output-len-spread", "1"], ["--output-len-spread", "0.5", "--dataset", "random"]):
        with pytest.raises(SystemExit):
            sweep.parse_args(["--cpu-model", "smollm2", *bad])
        assert "--output-len-spread" in capsys.readouterr().err


def test_each_bench_run_flushes_so_its_accept_length_is_its_own():
    """SGLang reports the accept length its counters hold since their last reset (a cache flush): a server that
    serves code, then extraction, then chat would otherwise report chat's as the mean over all three."""
    spec = importlib.util.spec_from_file_location("serving_sweep", REPO / "bench" / "serving_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    args = sweep.parse_args(["--cpu-model", "smollm2", "--workloads", "code,chat", "--concurrency", "1"])
    command = sweep.bench_command(args, 1, Path("out.jsonl"), Path("code.json"))
    assert "--flush-cache" in command


def test_every_server_logs_each_decode_step_so_its_accept_length_counts_every_step():
    """SGLang's reported accept length only takes in a window of steps when it logs it (every 40 by default)."""
    spec = importlib.util.spec_from_file_location("serving_sweep", REPO / "bench" / "serving_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    args = sweep.parse_args(["--cpu-model", "smollm2", "--server-args", "--max-running-requests 16"])
    assert sweep.extra_server_args(args) == ["--max-running-requests", "16", "--decode-log-interval", "1"]
    args = sweep.parse_args(["--cpu-model", "smollm2", "--server-args=--decode-log-interval=40"])
    assert sweep.extra_server_args(args) == ["--decode-log-interval=40"]


def test_prefill_threads_and_draft_weights_reach_each_cpu_server_and_bad_values_are_refused(capsys):
    spec = importlib.util.spec_from_file_location("serving_sweep", REPO / "bench" / "serving_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    args = sweep.parse_args(["--cpu-model", "smollm2", "--prefill-threads", "2"])
    assert sweep.bed_environment(args) == {"SGLANG_SPEC_CPU_PREFILL_THREADS": "2"}
    args = sweep.parse_args(["--cpu-model", "smollm2", "--draft-weights", "bfloat16"])
    assert sweep.bed_environment(args) == {"SGLANG_SPEC_CPU_DRAFT_WEIGHTS": "bfloat16"}
    for bad in (["--cpu-model", "smollm2", "--draft-weights", "fp8"], ["--draft-weights", "bfloat16"]):
        with pytest.raises(SystemExit):
            sweep.parse_args(bad)
        assert "--draft-weights" in capsys.readouterr().err
    assert sweep.bed_environment(sweep.parse_args(["--cpu-model", "smollm2"])) == {}
    for bad in (["--cpu-model", "smollm2", "--prefill-threads", "0"], ["--prefill-threads", "2"]):
        with pytest.raises(SystemExit):
            sweep.parse_args(bad)
        assert "error: --prefill-threads" in capsys.readouterr().err


class _ServerStandIn:
    """Records what the sweep does with a server; bench runs against it answer with one JSON line."""

    events: list[tuple[str, int]] = []
    started: list[_ServerStandIn] = []

    def __init__(self, args, port, log_path, env=None, cpu=True):
        self.args, self.port, self.env = list(args), port, dict(env or {})

    def start(self, timeout=300.0):
        self.events.append(("start", self.port))
        self.started.append(self)
        return self

    def stop(self, timeout=8.0, wait=True):
        self.events.append(("stop", self.port))


def _bench_stand_in(command, env=None, stdout=None, stderr=None):
    """bench_serving's stand-in: the run's port and workload make its tokens/s, written where the sweep reads."""
    port = int(command[command.index("--port") + 1])
    workload = Path(command[command.index("--dataset-path") + 1]).stem.removeprefix("serving-")
    _ServerStandIn.events.append((f"bench {workload}", port))
    Path(command[command.index("--output-file") + 1]).write_text(json.dumps({"output_throughput": float(port)}))
    return subprocess.CompletedProcess(command, 0)


def _sweep_on_stand_ins(model_name: str, tmp_path: Path, monkeypatch):
    """bench/serving_sweep.py with its servers and bench_serving stood in (``_ServerStandIn``, ``_bench_stand_in``),
    its scratch files under ``tmp_path``."""
    spec = importlib.util.spec_from_file_location("serving_sweep", REPO / "bench" / "serving_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    model = cpu_server.CpuModel(model_name, tmp_path, ("--draft",), None)
    monkeypatch.setattr(cpu_server, "prepare_model", lambda name: model)
    monkeypatch.setattr(cpu_server, "SGLangServer", _ServerStandIn)
    monkeypatch.setattr(sweep.subprocess, "run", _bench_stand_in)
    monkeypatch.setattr(sweep, "REPO", tmp_path)
    _ServerStandIn.events, _ServerStandIn.started = [], []
    return sweep


@pytest.mark.parametrize("together", [False, True])
def test_servers_together_start_once_on_their_own_ports_and_take_each_workload_back_to_back(
        together, tmp_path, monkeypatch):
    """``--servers-together``: every server starts once on its own port, sleeps when idle (an idle SGLang scheduler
    spins a core, which would slow the server being measured), may take the memory its peers hold (the CPU bed's
    start-up check would refuse the last ones), and each round runs one workload on every server in
    the round's rotated order before the next workload. Without it, one server at a time on ``--port``, all its
    workloads, restarted every round."""
    sweep = _sweep_on_stand_ins("smollm2", tmp_path, monkeypatch)
    argv = ["--cpu-model", "smollm2", "--policies", "plain,plain-sync", "--concurrency", "4", "--num-prompts", "4",
            "--workloads", "code,chat", "--rounds", "2", "--port", "31000", "--out", str(tmp_path / "s.csv")]
    assert sweep.main(argv + (["--servers-together"] if together else [])) == 0
    events, started = _ServerStandIn.events, _ServerStandIn.started
    if together:
        assert events == [("start", 31000), ("start", 31001),
                          ("bench code", 31000), ("bench code", 31001), ("bench chat", 31000), ("bench chat", 31001),
                          ("bench code", 31001), ("bench code", 31000), ("bench chat", 31001), ("bench chat", 31000),
                          ("stop", 31000), ("stop", 31001)]
        assert all("--sleep-on-idle" in server.args for server in started)
        # the bed's start-up memory check counts the peers' memory against each: the fraction lets them start
        assert all(option_value(server.args, "--mem-fraction-static") == sweep.TOGETHER_MEMORY_FRACTION
                   for server in started)
    else:
        assert events == [("start", 31000), ("bench code", 31000), ("bench chat", 31000), ("stop", 31000)] * 4
        assert not any("--sleep-on-idle" in server.args for server in started)
        assert all(option_value(server.args, "--mem-fraction-static") == option_value(cpu_server.CPU_FLAGS,
                                                                                     "--mem-fraction-static")
                   for server in started)
    record = json.loads((tmp_path / "s.json").read_text())
    assert record["command"].startswith("python bench/serving_sweep.py ") and "commit" not in record["environment"]
    rows = record["rows"]
    assert {(row["policy"], row["workload"]) for row in rows} == {
        (policy, workload) for policy in ("plain", "plain-sync") for workload in ("code", "chat")}
    assert all(len(row["output_throughput_rounds"]) == 2 for row in rows)


def test_tp_sizes_start_every_method_at_each_size_and_compare_each_with_plain_at_its_size(tmp_path, monkeypatch,
                                                                                         capsys):
    """``--tp-sizes 1,2``: each policy's server at both sizes (the second with ``--tp-size 2``, its name and rows
    marked), each ratio over plain decoding at the same size, and the report's TP table gives the TP 2 ratio over
    the TP 1 ratio; SmolLM2 itself (heads that do not split) and a --tp-size in --server-args are refused."""
    sweep = _sweep_on_stand_ins("smollm2-split", tmp_path, monkeypatch)
    argv = ["--cpu-model", "smollm2-split", "--policies", "plain-sync,lookup", "--budgets", "6", "--tp-sizes", "1,2",
            "--concurrency", "1", "--num-prompts", "2", "--workloads", "code", "--port", "31000", "--servers-together",
            "--out", str(tmp_path / "s.csv")]
    assert sweep.main(argv) == 0
    assert "-tp2" in capsys.readouterr().out
    started = _ServerStandIn.started
    assert [option_value(server.args, "--tp-size") for server in started] == [None, None, "2", "2"]
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    by_server = {(row["policy"], row["tp_size"]): row for row in rows}
    # the stand-in's tokens/s is the server's port: 31000 + its place in the list
    assert by_server["lookup", 1]["speedup_over_plain"] == pytest.approx(31001 / 31000)
    assert by_server["lookup", 2]["speedup_over_plain"] == pytest.approx(31003 / 31002)
    assert by_server["plain-sync", 2]["speedup_over_plain"] == 1.0
    report_spec = importlib.util.spec_from_file_location("report", REPO / "bench" / "report.py")
    report = importlib.util.module_from_spec(report_spec)
    report_spec.loader.exec_module(report)
    [found] = report.tp_ratios(rows)
    assert found["policy"] == "lookup" and found["held"] == pytest.approx((31003 / 31002) / (31001 / 31000))
    for bad, message in ((["--cpu-model", "smollm2", "--tp-sizes", "1,2"], "smollm2-split"),
                         (["--cpu-model", "smollm2-split", "--tp-sizes", "2", "--server-args", "--tp-size 2"],
                          "give one of the two"),
                         (["--cpu-model", "smollm2-split", "--tp-sizes", "0"], "distinct positive")):
        with pytest.raises(SystemExit):
            sweep.parse_args(bad)
        assert message in capsys.readouterr().err
