import json

import pytest

from sglang_spec.cli import main
from sglang_spec.errors import SpecError
from sglang_spec.train.traffic import (
    TrafficRecord,
    import_openai_chat,
    import_sglang_log,
    read_traffic,
    read_traffic_strict,
    write_traffic,
)


def test_round_trip_and_malformed_lines_are_numbered(tmp_path):
    path = tmp_path / "t.jsonl"
    records = [
        TrafficRecord("a/greedy", "code", "def f(): pass", messages=({"role": "user", "content": "write f"},)),
        TrafficRecord("b/greedy", "chat", "hi!", prompt="hello"),
    ]
    write_traffic(records, path)
    with pytest.raises(SpecError, match="exists; pass --force"):
        write_traffic(records, path)
    with path.open("a") as handle:
        handle.write("not json\n")
        handle.write(json.dumps({"prompt": "x"}) + "\n")
        handle.write(json.dumps({"prompt": "x", "messages": [], "completion": "y"}) + "\n")
        handle.write("\n")
        handle.write(json.dumps({"messages": [{"role": "user", "content": 3}], "completion": "y"}) + "\n")
    good, problems = read_traffic(path)
    assert [r.id for r in good] == ["a/greedy", "b/greedy"] and good[0].messages[0]["content"] == "write f"
    assert [(p.line, p.reason) for p in problems] == [
        (3, "not JSON (Expecting value)"),
        (4, "missing string 'completion'"),
        (5, "give exactly one of 'prompt' or 'messages'"),
        (7, "messages[0] needs string 'content'"),
    ]
    with pytest.raises(SpecError, match="4 malformed line\\(s\\): line 3: not JSON") as error:
        read_traffic_strict([path])
    assert "\n" not in str(error.value)


def test_sglang_json_request_log(tmp_path):
    log = tmp_path / "server.log"
    finished = {"timestamp": "t", "event": "request.finished", "rid": "r1", "obj": {"text": "Q?"},
                "out": {"text": "A.", "meta_info": {"finish_reason": {"type": "stop"}}}}
    batch = {"event": "request.finished", "rid": ["r2", "r3"], "obj": {"text": ["x", "y"]},
             "out": [{"text": "1"}, {"text": "2"}]}
    lines = [
        "[2026-11-21 10:00:00 TM] " + json.dumps(finished),
        json.dumps({"event": "request.received", "rid": "r1", "obj": {"text": "Q?"}}),
        json.dumps(batch),
        "[2026-11-21 10:00:01 TM] Finish: obj=GenerateReqInput(text='Q'), out={'text': 'A'}",
        json.dumps({"event": "request.finished", "rid": "r4", "obj": {"input_ids": [1, 2]}, "out": {"text": "z"}}),
        "{broken",
    ]
    log.write_text("\n".join(lines) + "\n")
    records, problems, ignored = import_sglang_log(log, domain="prod")
    assert [(r.id, r.prompt, r.completion, r.domain) for r in records] == [
        ("r1", "Q?", "A.", "prod"), ("r2", "x", "1", "prod"), ("r3", "y", "2", "prod")]
    assert ignored == 1
    assert [p.line for p in problems] == [4, 5, 6]
    assert "--log-requests-format json" in problems[0].reason and "--log-requests-level 3" in problems[1].reason


def test_openai_chat_logs(tmp_path):
    log = tmp_path / "chat.jsonl"
    lines = [
        {"messages": [{"role": "system", "content": "be nice"}, {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "hello"}]},
        {"request": {"messages": [{"role": "user", "content": [{"type": "text", "text": "2+2?"}]}]},
         "response": {"choices": [{"message": {"role": "assistant", "content": "4"}}]}},
        {"prompt": "p", "completion": "c"},
        {"messages": [{"role": "user", "content": "no answer"}]},
        {"request": {"messages": [{"role": "user", "content": "x"}]}, "response": {"choices": []}},
    ]
    log.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    records, problems, _ = import_openai_chat(log)
    assert [(r.completion, len(r.messages or ())) for r in records] == [("hello", 2), ("4", 1), ("c", 0)]
    assert records[1].messages[0]["content"] == "2+2?"
    assert [(p.line, p.reason) for p in problems] == [
        (4, "the last message must be the assistant's answer"), (5, "response.choices[0] is missing")]


def test_import_command_reports_bad_lines_and_fails(tmp_path, capsys):
    log = tmp_path / "chat.jsonl"
    log.write_text(json.dumps({"prompt": "p", "completion": "c"}) + "\nnope\n")
    out = tmp_path / "traffic.jsonl"
    code = main(["traffic", "import", str(log), "--format", "openai", "--domain", "support", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 1 and "line 2: not JSON" in captured.err and "1 malformed line(s)" in captured.err
    assert read_traffic(out)[0][0].domain == "support"
    code = main(["traffic", "import", str(log), "--format", "openai", "--out", str(out)])
    assert code == 2 and "pass --force" in capsys.readouterr().err
