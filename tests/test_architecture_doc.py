"""docs/architecture.md names every module of the package, of the CPU test bed and of the benchmarks exactly once, as
the first cell of a table row (its path relative to ``sglang_spec/``, or from the repository root for the test bed
and the benchmarks), so the map cannot drift from the code: a module added, renamed or removed without its row
fails here."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
# the packages the page maps, and how a row spells a module's path (relative to this folder)
MAPPED = {REPO / "sglang_spec": "", REPO / "sglang_spec_testbed": "sglang_spec_testbed/", REPO / "bench": "bench/"}


def modules() -> list[str]:
    """Every Python module of the mapped packages, as the page spells it; an ``__init__.py`` that defines nothing
    (a package marker or re-exports) is the package's own row, not required."""
    names = []
    for root, prefix in MAPPED.items():
        for path in sorted(root.rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            if path.name == "__init__.py" and not re.search(r"^(def|class) ", path.read_text(), re.MULTILINE):
                continue
            names.append(prefix + relative)
    return names


def named_in_rows(text: str) -> Counter[str]:
    """The module paths named in the first cell of every table row (backticked, ``a.py`` or ``a.py``, ``b.py``)."""
    counts: Counter[str] = Counter()
    for line in text.splitlines():
        if not line.startswith("| ") or line.startswith("| ---") or line.startswith("|---"):
            continue
        first = line.split("|")[1]
        counts.update(re.findall(r"`([\w/]+\.py)`", first))
    return counts


def test_every_module_is_named_once():
    counts = named_in_rows(DOC.read_text())
    expected = modules()
    missing = [name for name in expected if counts[name] == 0]
    twice = [name for name in expected if counts[name] > 1]
    stale = sorted(set(counts) - set(expected))
    assert not missing, f"docs/architecture.md has no row for {missing}"
    assert not twice, f"docs/architecture.md names these in more than one row: {twice}"
    assert not stale, f"docs/architecture.md names modules that do not exist: {stale}"


def test_the_check_fails_on_a_missing_row():
    """Negative control: the page without one module's row is caught."""
    text = DOC.read_text()
    victim = modules()[0]
    pruned = "\n".join(line for line in text.splitlines()
                       if not (line.startswith("| ") and f"`{victim}`" in line.split("|")[1]))
    assert named_in_rows(pruned)[victim] == 0 and named_in_rows(text)[victim] == 1
