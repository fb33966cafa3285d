"""The documentation stays true: every relative link resolves (file and heading), every chapter is
reachable from the README, the generated configuration table matches the parser, the reliability
chapter lists every row the contract test checks, and the README's two commands are what the
Makefile and CI run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.reliability.test_reliability_contract import ROWS
from tests.support import config_table

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "bench" / "README.md", ROOT / "bench" / "RESULTS.md",
                *(ROOT / "docs").glob("*.md")])
# Chapters other branches of this wave add (the README links them already). Empty this set once they
# are merged: from then on their links are checked like any other.
PENDING: set[str] = set()

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^ *```.*?^ *```", re.S | re.M)


def prose(page: Path) -> str:
    """The page without its fenced code blocks (a `[x](y)` in code is not a link)."""
    return FENCE.sub("", page.read_text())


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens, -1, -2 ... on repeats."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", prose(page), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        if seen[slug]:
            seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def links(page: Path) -> list[str]:
    return [t for t in LINK.findall(prose(page)) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves_to_a_file_and_heading(page: Path):
    assert links(page) or page.name == "RESULTS.md", f"{page} links nowhere"
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        rel = file.relative_to(ROOT).as_posix() if file.is_relative_to(ROOT) else str(file)
        if not file.exists():
            if rel not in PENDING:
                broken.append(f"{target}: no file {rel}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {rel}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_every_chapter_is_linked_from_the_readme():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(ROOT / "README.md")}
    chapters = {p.resolve() for p in (ROOT / "docs").glob("*.md")} | {(ROOT / p).resolve() for p in PENDING}
    assert not chapters - linked, sorted(str(p.relative_to(ROOT)) for p in chapters - linked)
    assert (ROOT / "bench" / "README.md").resolve() in linked and (ROOT / "bench" / "RESULTS.md").resolve() in linked


def test_the_readme_stays_a_front_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_the_configuration_table_is_generated_from_the_parser():
    text = config_table.DOC.read_text()
    assert config_table.current(text) == config_table.block(), "stale: run python -m tests.support.config_table"


def test_the_reliability_chapter_lists_every_row_of_the_contract_test():
    chapter = (ROOT / "docs" / "reliability.md").read_text()
    missing = [f"{r.row} {r.situation} {r.code.name}" for r in ROWS
               if f"| {r.row} | {r.situation} | {r.code.name} |" not in chapter]
    assert not missing, missing


def test_the_two_commands_are_what_the_makefile_and_ci_run():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^test: lint typecheck proto-check pytest(\s|$)", makefile, re.M)
    assert re.search(r"^pytest:.*\n\t\$\(PYTEST\)\n", makefile, re.M)
    assert re.search(r"^PYTEST := \$\(BIN\)/python -m pytest -q -n 2 --dist loadfile\n", makefile, re.M)
    assert re.search(r"^run:.*\n\t\$\(BIN\)/python -m service\n", makefile, re.M)
    assert (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1] == "make test"
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "`make run` is `python -m service` with every default" in readme
    assert "`make test` is `make lint typecheck proto-check pytest`" in readme
    assert "then `python -m pytest -q -n 2 --dist loadfile`" in readme  # what the Makefile's PYTEST is
    assert "CI runs exactly it (`.ci/run`)" in readme
