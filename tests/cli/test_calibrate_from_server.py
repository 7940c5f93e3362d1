"""``sglang-spec calibrate --from-server``: the Prometheus text parsed into the positional table, the profile
written (``--update`` keeps the per-source counts), and one error line per failure, against a local HTTP server."""

from __future__ import annotations

import http.server
import json
import threading

import pytest

from sglang_spec.cli import main
from sglang_spec.cli.calibrate import parse_rank_counts, rank_rows
from sglang_spec.errors import SpecError
from sglang_spec.tree.profile import AcceptanceProfile, SourceCounts

METRICS = """# HELP sglang_spec_tree_rank_steps_total verify steps
# TYPE sglang_spec_tree_rank_steps_total counter
sglang_spec_tree_rank_steps_total 10.0
sglang_spec_tree_rank_offered_total{depth="1",rank="0"} 10.0
sglang_spec_tree_rank_offered_total{rank="1",depth="1"} 10.0
sglang_spec_tree_rank_accepted_total{depth="1",rank="0"} 6.0
sglang_spec_tree_rank_accepted_total{depth="1",rank="1"} 2.0
sglang_spec_tree_rank_offered_total{depth="2",rank="0"} 8.0
sglang_spec_tree_rank_accepted_total{depth="2",rank="0"} 4.0
sglang_spec_tree_rank_offered_total{depth="4",rank="0"} 3.0
sglang:num_requests_total 5.0
"""


def test_parse_and_rows():
    steps, offered, accepted = parse_rank_counts(METRICS)
    assert steps == 10 and offered[(1, 1)] == 10 and accepted[(2, 0)] == 4
    rows, counted = rank_rows(offered, accepted, 64, 64)
    assert rows == [(0.6, 0.2), (0.5,)] and counted == [20, 8]  # depth 3 has no offers: the table ends there
    assert rank_rows(offered, accepted, 1, 1)[0] == [(0.6,)]


def test_counts_from_two_processes_add_and_rows_past_one_are_scaled():
    text = METRICS + 'sglang_spec_tree_rank_offered_total{depth="1",rank="0"} 10.0\n'
    _, offered, accepted = parse_rank_counts(text)
    assert offered[(1, 0)] == 20
    rows, _ = rank_rows({(1, 0): 10, (1, 1): 2}, {(1, 0): 9, (1, 1): 2}, 64, 64)  # 0.9 + 1.0: noise, scaled
    assert sum(rows[0]) == pytest.approx(1.0) and rows[0][0] == pytest.approx(0.9 / 1.9)


@pytest.mark.parametrize("text, message", [
    ("sglang:num_requests_total 5.0\n", "does not run the sglang_spec plugin"),
    ("sglang_spec_tree_verify_steps_total 0.0\n", "no per-rank counts yet"),
])
def test_parse_errors(text, message):
    with pytest.raises(SpecError, match=message):
        parse_rank_counts(text)


class _Server:
    def __init__(self, body: str | None):
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path != "/metrics" or outer.body is None:
                    self.send_error(404)
                    return
                data = outer.body.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.body = body
        self.httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_writes_the_profile_and_update_keeps_the_sources(tmp_path, capsys):
    base = tmp_path / "base.json"
    sources = SourceCounts.generic().to_obj()
    base.write_text(json.dumps({"rank_acceptance": [0.5], "model": "old", "sources": sources}))
    out = tmp_path / "p.json"
    with _Server(METRICS) as server:
        assert main(["calibrate", "--from-server", server.url + "/", "--out", str(out)]) == 0
        written = json.loads(out.read_text())
        assert written["rank_acceptance"] == [[0.6, 0.2], [0.5, 0.0]]
        assert written["from_server"] == server.url and written["steps"] == 10 and "sources" not in written
        assert main(["calibrate", "--from-server", server.url, "--update", str(base), "--out", str(out),
                     "--force"]) == 0
    written = json.loads(out.read_text())
    assert written["rank_acceptance"] == [[0.6, 0.2], [0.5, 0.0]] and "model" not in written
    assert AcceptanceProfile.from_json(out).sources.to_obj() == AcceptanceProfile.from_json(base).sources.to_obj()


def test_one_line_errors(tmp_path, capsys):
    out = str(tmp_path / "p.json")
    with _Server(None) as server:
        assert main(["calibrate", "--from-server", server.url, "--out", out]) == 2
        assert "launch the server with --enable-metrics" in capsys.readouterr().err
        url = server.url
    assert main(["calibrate", "--from-server", url, "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot reach") and err.count("\n") == 1
    with _Server("sglang:num_requests_total 1.0\n") as server:
        assert main(["calibrate", "--from-server", server.url, "--out", out]) == 2
        assert "does not run the sglang_spec plugin" in capsys.readouterr().err
    assert main(["calibrate", "--from-server", url, "--traffic", out, "--out", out]) == 2
    assert "run --traffic or --prompts (with --model) separately" in capsys.readouterr().err


def test_per_source_counts_are_read_by_cell_and_added_to_the_prior():
    from sglang_spec.cli.calibrate import parse_source_counts

    text = METRICS + (
        'sglang_spec_source_offered_total{cell="lookup/3/0"} 10.0\n'
        'sglang_spec_source_accepted_total{cell="lookup/3/0"} 7.0\n'
        'sglang_spec_source_offered_total{cell="mtp/1/9"} 4.0\n'
        'sglang_spec_source_offered_total{cell="lookup/3/0"} 2.0\n')  # a second process's
    observed = parse_source_counts(text)
    assert observed == {"lookup/3/0": (7.0, 12.0), "mtp/1/9": (0.0, 4.0)}
    assert parse_source_counts(METRICS) == {}
    prior = SourceCounts.generic()
    learnt = prior.with_observed(observed, "server")
    assert learnt.lookup[2][0] == [prior.lookup[2][0][0] + 7, prior.lookup[2][0][1] + 12]
    assert learnt.mtp[0][9][1] == prior.mtp[0][9][1] + 4 and prior.lookup[2][0][1] == 4.0  # the prior is untouched
    with pytest.raises(SpecError, match="a count for 'lookup/9/0', which a table with max_ngram 8"):
        prior.with_observed({"lookup/9/0": (1.0, 2.0)}, "server")
