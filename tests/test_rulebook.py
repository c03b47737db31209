"""The rule book resolves: every rule citation in the code names a file in ``specs/`` and a heading
in it (specs/README.md explains the citation form).

A citation is ``<name>.md §N.M`` (also ``specs/<name>.md §N.M``), a range ``<name>.md §A–B`` (en
dash or hyphen; every section of the range must exist), a list ``<name>.md §A, §B`` or a bare
``§N.M``. Chapter numbers are unique across the rule book, so a bare section belongs to the file of
its chapter, and a section cited with a file must belong to that file's chapter. A bare mention of
a ``<name>.md`` file must name a file of ``specs/`` too.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPECS = ROOT / "specs"
SCANNED = ("core", "effects", "runtime", "kernels", "tests")

# .md names that appear in the code but are not references to the rule book, with the reason.
# Empty today: every .md name in the code is meant as a rule-book file.
NOT_RULE_BOOK: dict[str, str] = {}

_NUMBER = r"\d+(?:\.\d+)*"
_SECTION = re.compile(r"\u00a7\s?(?P<a>" + _NUMBER + r")(?:\s?[\u2013-]\s?(?P<b>" + _NUMBER + r"))?")
_FILE = re.compile(r"(?<![A-Za-z0-9_.-])(?P<name>[A-Za-z0-9_-]+\.md)\b")
_FILE_BEFORE = re.compile(r"(?P<name>[A-Za-z0-9_-]+\.md)\s?$")
_HEADING = re.compile(r"^#+\s")
_HEADING_SECTION = re.compile(r"\u00a7(" + _NUMBER + r")(?=\s|$)")


def headings(text: str) -> set[str]:
    """Section numbers that open a heading line of a rule-book file."""
    found: set[str] = set()
    for line in text.splitlines():
        if _HEADING.match(line):
            found.update(_HEADING_SECTION.findall(line))
    return found


def rule_book(specs: Path = SPECS) -> dict[str, set[str]]:
    """Every Markdown file directly in ``specs/`` and the section numbers of its headings."""
    return {p.name: headings(p.read_text(encoding="utf-8")) for p in sorted(specs.glob("*.md"))}


def chapters(book: dict[str, set[str]]) -> dict[int, str]:
    """Chapter number -> the file whose headings carry it."""
    owner: dict[int, str] = {}
    for name, sections in book.items():
        for section in sections:
            owner.setdefault(int(section.split(".")[0]), name)
    return owner


def expand(a: str, b: str | None) -> list[str]:
    """The sections of a citation: ``a`` alone, or every section of the range ``a``–``b``.

    ``5.10–5.14`` is 5.10, 5.11, ... 5.14; a short end (``6.5–8``) replaces the last part of ``a``.
    Ends that differ in more than the last part are checked as ends only.
    """
    if b is None:
        return [a]
    head_a, last_a = a.rsplit(".", 1) if "." in a else ("", a)
    if "." not in b and head_a:
        b = f"{head_a}.{b}"
    head_b, last_b = b.rsplit(".", 1) if "." in b else ("", b)
    if head_a == head_b and int(last_a) <= int(last_b):
        prefix = f"{head_a}." if head_a else ""
        return [f"{prefix}{n}" for n in range(int(last_a), int(last_b) + 1)]
    return [a, b]


def unresolved(text: str, book: dict[str, set[str]], where: str = "<text>") -> list[str]:
    """Every citation or ``.md`` mention in ``text`` that the rule book ``book`` cannot resolve."""
    owner = chapters(book)
    problems: list[str] = []

    def line_of(pos: int) -> int:
        return text.count("\n", 0, pos) + 1

    for m in _FILE.finditer(text):
        name = m.group("name")
        if name not in book and name not in NOT_RULE_BOOK:
            problems.append(f"{where}:{line_of(m.start())}: {name} is not a file of specs/")
    for m in _SECTION.finditer(text):
        cited = m.group(0).strip()
        before = _FILE_BEFORE.search(text, 0, m.start())
        named = before.group("name") if before else None
        for section in expand(m.group("a"), m.group("b")):
            chapter = int(section.split(".")[0])
            target = named if named is not None else owner.get(chapter)
            at = f"{where}:{line_of(m.start())}: {named + ' ' if named else ''}{cited}"
            if named is not None and named in NOT_RULE_BOOK:
                continue
            if target is None:
                problems.append(f"{at}: no file of specs/ holds chapter {chapter}")
            elif target not in book:
                continue  # the missing file is already reported above
            elif owner.get(chapter) not in (None, target):
                problems.append(f"{at}: chapter {chapter} is {owner[chapter]}, not {target}")
            elif section not in book[target]:
                problems.append(f"{at}: {target} has no heading \u00a7{section}")
    return problems


def scanned_files() -> list[Path]:
    return sorted(p for folder in SCANNED for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


# --- the rule book as it is --------------------------------------------------------------------


def test_every_citation_in_the_code_resolves():
    book = rule_book()
    problems = []
    for path in scanned_files():
        problems += unresolved(path.read_text(encoding="utf-8"), book, str(path.relative_to(ROOT)))
    assert not problems, "unresolved rule-book citations:\n" + "\n".join(problems)


def test_the_scan_finds_the_citations_it_checks():
    texts = [p.read_text(encoding="utf-8") for p in scanned_files()]
    assert sum(len(_SECTION.findall(t)) for t in texts) >= 30


def test_each_file_is_one_chapter_and_its_headings_are_unique():
    for path in sorted(SPECS.glob("*.md")):
        if path.name == "README.md":
            continue
        numbers = [n for line in path.read_text(encoding="utf-8").splitlines() if _HEADING.match(line)
                   for n in _HEADING_SECTION.findall(line)]
        assert numbers, f"{path.name} has no \u00a7 headings"
        assert len(set(numbers)) == len(numbers), f"{path.name} repeats a heading number"
        assert len({n.split(".")[0] for n in numbers}) == 1, f"{path.name} mixes chapters"
    owner: dict[str, str] = {}
    for name, sections in rule_book().items():
        for chapter in {s.split(".")[0] for s in sections}:
            assert owner.setdefault(chapter, name) == name, f"chapter {chapter} is in {owner[chapter]} and {name}"


def test_the_readme_indexes_every_file():
    readme = (SPECS / "README.md").read_text(encoding="utf-8")
    for path in sorted(SPECS.glob("*.md")):
        if path.name != "README.md":
            assert f"({path.name})" in readme, f"specs/README.md does not list {path.name}"


# --- the checker itself ------------------------------------------------------------------------

# Made-up citations are assembled from pieces so that this file's own text holds no citation.
SIGN = "\u00a7"
MD = ".md"
BOOK = {f"alpha{MD}": {"1.1", "1.2", "1.3", "1.4", "1.4.1"}, f"beta{MD}": {"2.1"}}


def cite(name: str, section: str) -> str:
    return f"{name}{MD} {SIGN}{section}"


def test_good_citations_pass():
    text = "\n".join([cite("alpha", "1.2"), cite("specs/alpha", "1.4.1") + ".", cite("alpha", "1.1\u20131.4"),
                      cite("alpha", "1.2-1.3"), "(" + cite("alpha", "1.1") + f", {SIGN}1.3)", f"bare {SIGN}2.1",
                      cite("beta", "2.1") + " step 4\u20135", f"see beta{MD}"])
    assert unresolved(text, BOOK) == []


@pytest.mark.parametrize("text, words", [
    (cite("gamma", "1.1"), f"gamma{MD} is not a file of specs/"),
    (cite("alpha", "1.9"), "has no heading"),
    (cite("alpha", "1.1\u20131.6"), "has no heading \u00a71.5"),
    (cite("alpha", "1.3-1.5"), "has no heading \u00a71.5"),
    (cite("alpha", "2.1"), f"chapter 2 is beta{MD}, not alpha{MD}"),
    (f"bare {SIGN}7.1", "no file of specs/ holds chapter 7"),
    (cite("alpha", "1.1") + f", {SIGN}2.9", f"beta{MD} has no heading \u00a72.9"),
    (f"mentions nowhere{MD} only", f"nowhere{MD} is not a file of specs/"),
])
def test_a_broken_citation_is_reported(text, words):
    problems = unresolved(text, BOOK, "made-up.py")
    assert problems and any(words in p for p in problems), problems
    assert all(p.startswith("made-up.py:1: ") for p in problems)


def test_headings_need_the_section_sign_and_a_space_after_the_number():
    text = "# 1. Title\n## " + SIGN + "1.1 Start\n### " + SIGN + "1.1.2\nnot a heading " + SIGN + "1.9\n## 1.3 plain"
    assert headings(text) == {"1.1", "1.1.2"}


def test_ranges_expand_to_every_section():
    assert expand("5.10", "5.14") == ["5.10", "5.11", "5.12", "5.13", "5.14"]
    assert expand("6.5", "8") == ["6.5", "6.6", "6.7", "6.8"]
    assert expand("5.19", "6.2") == ["5.19", "6.2"]
    assert expand("3.8.8", None) == ["3.8.8"]
