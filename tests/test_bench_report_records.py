"""The records folder: every Markdown record and every script is linked from its index, every link of the index
resolves."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "benchmarks"


def index_links() -> set[str]:
    return set(re.findall(r"\]\(([^)#]+)\)", (RECORDS / "README.md").read_text()))


def test_every_record_is_indexed() -> None:
    records = {p.name for p in RECORDS.glob("*.md")} - {"README.md"}
    assert records, "no records found"
    assert sorted(records - index_links()) == []


def test_every_script_is_listed() -> None:
    scripts = {f"scripts/{p.name}" for p in (RECORDS / "scripts").glob("*.py")}
    assert scripts, "no scripts found"
    assert sorted(scripts - index_links()) == []


def test_index_links_resolve() -> None:
    missing = [link for link in index_links() if not (RECORDS / link).exists()]
    assert missing == []


def test_no_patches_among_the_records() -> None:
    assert [p.name for p in RECORDS.rglob("*") if p.suffix in (".patch", ".diff")] == []
