"""The results page (docs/results/README.md) and the README's results table are what ``python bench/report.py``
writes from the benchmarks' JSON, byte for byte; every file the page names exists, and docs/results holds nothing
the page does not name (one file set per benchmark). No server, no model: the report reads JSON only."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "docs" / "results"


def load_report():
    spec = importlib.util.spec_from_file_location("bench_report", REPO / "bench" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


report = load_report()


def test_the_page_is_what_the_json_gives():
    assert report.PAGE.read_text() == report.render_page(), \
        "docs/results/README.md is stale: run python bench/report.py"


def test_the_readme_results_table_is_what_the_json_gives():
    text = report.README.read_text()
    assert text == report.update_readme(text, report.render_headline()), \
        "README.md's results table is stale: run python bench/report.py"


def test_every_file_the_page_names_exists():
    missing = sorted(name for name in report.named_files(report.PAGE.read_text()) if not (RESULTS / name).is_file())
    assert not missing, f"docs/results/README.md names files that are not there: {missing}"


def test_every_link_of_the_readme_table_exists():
    block = report.render_headline()
    for target in report.named_files(block):
        assert (REPO / target).is_file(), target


def test_docs_results_holds_only_what_the_page_names():
    named = report.named_files(report.PAGE.read_text()) | {"README.md"}
    present = {str(path.relative_to(RESULTS)) for path in RESULTS.rglob("*") if path.is_file()}
    extra = sorted(present - named)
    assert not extra, (f"docs/results holds files the results page does not name: {extra}; keep one file set per "
                       "benchmark (stable names), then run python bench/report.py")


@pytest.fixture
def copy_of_results(tmp_path):
    folder = tmp_path / "results"
    shutil.copytree(RESULTS, folder)
    return folder


def test_a_changed_figure_makes_the_page_stale(copy_of_results):
    """Negative control: the comparison sees one figure move in one JSON."""
    path = copy_of_results / "serving_sweep_c1.json"
    data = json.loads(path.read_text())
    auto = next(row for row in data["rows"] if row["policy"] == "auto")
    auto["accept_length"] = round(auto["accept_length"] + 0.01, 2)  # moves the two decimals the page shows
    path.write_text(json.dumps(data))
    assert path.read_text() != (RESULTS / "serving_sweep_c1.json").read_text()
    assert report.render_page(copy_of_results) != report.PAGE.read_text()


def test_a_deleted_file_is_caught(copy_of_results):
    """Negative control: a plot the page links to, removed, is missing; a removed JSON changes the page."""
    (copy_of_results / "hybrid.png").unlink()
    named = report.named_files(report.render_page(copy_of_results))
    assert "hybrid.png" not in named  # the page links only what is there ...
    assert "hybrid.png" in report.named_files(report.PAGE.read_text())  # ... so the committed page is stale
    (copy_of_results / "sglang_trees.json").unlink()
    assert "Tree shapes through SGLang" not in report.render_page(copy_of_results)


def test_the_page_names_no_commit_and_no_date_of_a_run():
    """The machine lines come from the JSON's environment without its commit or date."""
    page = report.PAGE.read_text()
    for name in ("acceptance.json", "hybrid.json", "copy_ceiling.json", "gpu/h200-rerun.json"):
        environment = report.load(RESULTS, name).get("environment", {})
        for key in ("commit", "date"):
            if environment.get(key):
                assert str(environment[key]) not in page, (name, key)


def test_the_gpu_tally_counts_skipped_checks_apart_from_those_that_ran():
    def result(status):
        return ({"status": status}, "gpu/x.json")

    latest = {("H200", "a"): result("passed"), ("H200", "b"): result("failed"), ("H200", "c"): result("skipped"),
              ("H100", "a"): result("passed")}
    assert report.gpu_tally(latest) == "H200: 1 of 2 passed, 1 skipped; H100: 1 of 1 passed"
