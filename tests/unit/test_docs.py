"""The user docs stay short, linked and followable: the README fits on a few screens, its tables hold a verdict of a
line per cell and no commit hashes (figures live in docs/benchmarks.md, history in benchmarks/results/*_notes.md),
every relative link in the README and docs/ leads to a file (and heading) that exists, and no page sends a reader to
notes they cannot read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 220
README_MAX_CELL = 200  # characters in one table cell: a verdict, not a lab note
README_MAX_TABLE_ROWS = 20  # body rows of one README table: the capability table fits one screen

FENCED_CODE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
# A commit hash as people paste it: 7 to 40 lower-case hex digits holding at least one digit and one letter a-f.
# An English word has no digit and a number has no letter, so neither can match; `deadbeef` or `1234567` would not.
COMMIT_LIKE = re.compile(r"(?<![\w-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w-])")


def prose(text: str) -> str:
    """The text without code blocks and code spans, where brackets are code, not links."""
    return INLINE_CODE.sub("", FENCED_CODE.sub("", text))


def relative_links(text: str) -> list[str]:
    """Link targets that point into the repository (not URLs, not mail)."""
    return [target for target in LINK.findall(prose(text)) if not re.match(r"[a-z][a-z0-9+.-]*:", target)]


def table_rows(text: str) -> list[list[list[str]]]:
    """Each Markdown table of `text` as its body rows, a row as its cells, split at every `|` (as the stop hook does:
    a pipe inside a code span splits too, which only makes cells shorter)."""
    tables: list[list[list[str]]] = []
    previous = ""
    for line in FENCED_CODE.sub("", text).splitlines():
        if line.startswith("|"):
            if not previous.startswith("|"):
                tables.append([])
            if not re.fullmatch(r"[|\s:-]+", line):
                tables[-1].append([cell.strip() for cell in line.split("|")[1:-1]])
        previous = line
    return [rows[1:] for rows in tables]  # the first row is the header


def commit_like_words(text: str) -> list[str]:
    """Words of `text` that read as commit hashes."""
    return COMMIT_LIKE.findall(text)


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading id of a markdown page, with GitHub's -1, -2 suffixes for repeated headings."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCED_CODE.sub("", page.read_text())):
        slug = github_anchor(heading)
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


def test_the_readme_is_short() -> None:
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/ (limit {README_MAX_LINES})"


def test_readme_table_cells_are_a_verdict_of_a_line() -> None:
    long = [cell[:60] + "..." for table in table_rows(README.read_text()) for row in table for cell in row
            if len(cell) > README_MAX_CELL]
    assert not long, (f"README.md has table cells over {README_MAX_CELL} characters: {long}; give a verdict of a line "
                      "and move the figures to docs/benchmarks.md, the history to benchmarks/results/*_notes.md")


def test_readme_tables_fit_one_screen() -> None:
    sizes = [len(table) for table in table_rows(README.read_text())]
    assert sizes and max(sizes) <= README_MAX_TABLE_ROWS, f"README.md tables have {sizes} rows (at most " \
        f"{README_MAX_TABLE_ROWS}: one screen); merge rows or move detail into docs/"


def test_the_readme_names_no_commit() -> None:
    found = commit_like_words(README.read_text())
    assert not found, f"README.md names commits {found}: a reader cannot use them; results and notes carry them"


def test_the_readme_checks_see_long_cells_and_hashes() -> None:
    page = ("| A | B |\n|---|---|\n| x | " + "y" * 201 + " |\n\n```\n| not | a table |\n```\n| C |\n|:-:|\n| z |\n")
    assert [[len(cell) for cell in row] for table in table_rows(page) for row in table] == [[1, 201], [1]]
    assert commit_like_words("at 27fc597, (b355ea7) and 0123456789abcdef0123456789abcdef01234567.") == [
        "27fc597", "b355ea7", "0123456789abcdef0123456789abcdef01234567"]
    assert commit_like_words("deadbeef faced 1234567 1,872 fp16 bf16 dtrain-27fc597x ab12cd3-x 10.5e3") == []


def test_the_readme_names_the_two_make_targets() -> None:
    text = README.read_text()
    assert "make demo" in text and "make test" in text


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_relative_link_leads_somewhere(page: Path) -> None:
    broken = []
    for target in relative_links(page.read_text()):
        path_part, _, anchor = target.partition("#")
        destination = (page.parent / path_part).resolve() if path_part else page
        if not destination.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{target} (no heading #{anchor})")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_no_page_cites_notes_a_reader_cannot_follow(page: Path) -> None:
    text = page.read_text()
    seeds = re.findall(r"\bseeds? 0\d*", text, flags=re.IGNORECASE)
    dates = re.findall(r"\b20\d\d-\d\d-\d\d\b", text)
    assert not seeds, f"{page.relative_to(ROOT)} cites the project's seed documents: {seeds}"
    assert not dates, f"{page.relative_to(ROOT)} has dated lab notes {dates}; results go to benchmarks/results/"


def test_the_link_checker_sees_broken_links_and_anchors(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# Top\n\n## The `dtrain plan` tool (v1.0)\n\n## Top\n")
    page = "[ok](a.md#the-dtrain-plan-tool-v10) [dup](a.md#top-1) `[code](nowhere.md)` [web](https://x.org/y)\n"
    assert relative_links(page) == ["a.md#the-dtrain-plan-tool-v10", "a.md#top-1"]
    assert anchors(tmp_path / "a.md") == {"top", "the-dtrain-plan-tool-v10", "top-1"}
    assert github_anchor("Calibration: this machine") == "calibration-this-machine"
