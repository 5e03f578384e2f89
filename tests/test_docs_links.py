"""The README and docs/ stay navigable: every relative link (and #anchor) lands on a file and
heading inside the repository, nothing points outside it, and the README stays a front door."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
README_MAX_LINES = 220

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,}).*?^ {0,3}\1[`~]*[ \t]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)", re.DOTALL)
INLINE_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^()\s]*(?:\([^()\s]*\))*[^()\s]*)"
)
REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)", re.MULTILINE)
HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.*?)[ \t]*#*[ \t]*$", re.MULTILINE)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
FORBIDDEN = ("../shared", "/work/")


def _without_fences(text: str) -> str:
    """The text with fenced code blocks blanked out (a `#` there is no heading)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def _prose(text: str) -> str:
    """The text with code blocks and code spans blanked out (links there are not links)."""
    return CODE_SPAN.sub("", _without_fences(text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lowercased, punctuation other than '-'
    and '_' removed, spaces turned into '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    """Every anchor the page's headings give, with GitHub's -1, -2 suffixes for repeats."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for match in HEADING.finditer(_without_fences(page.read_text(encoding="utf-8"))):
        base = slug(match.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def links_in(text: str) -> list[str]:
    """Every link and image target outside code, as written (titles and <> dropped)."""
    prose = _prose(text)
    targets = [m.group(1) for m in INLINE_LINK.finditer(prose)]
    targets += [m.group(1) for m in REFERENCE_DEF.finditer(prose)]
    return [t[1:-1] if t.startswith("<") and t.endswith(">") else t for t in targets]


def links(page: Path) -> list[str]:
    return links_in(page.read_text(encoding="utf-8"))


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_there_are_docs() -> None:
    assert (ROOT / "docs" / "README.md").is_file()
    assert len(PAGES) > 2


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_relative_links_resolve(page: Path) -> None:
    broken: list[str] = []
    for target in links(page):
        if not target or SCHEME.match(target):
            continue  # http(s):, mailto: and the like
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / unquote(path_part)).resolve() if path_part else page
        if not dest.is_relative_to(ROOT):
            broken.append(f"{target}: outside the repository")
        elif not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and unquote(anchor) not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {_name(dest)}")
        elif anchor and dest.suffix != ".md":
            broken.append(f"{target}: an anchor into a file that is not markdown")
    assert not broken, f"{_name(page)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_nothing_points_outside_the_repository(page: Path) -> None:
    lines = page.read_text(encoding="utf-8").splitlines()
    bad = [
        f"line {n}: {line.strip()}"
        for n, line in enumerate(lines, 1)
        if any(f in line for f in FORBIDDEN)
    ]
    assert not bad, f"{_name(page)}: " + "; ".join(bad)


def test_readme_is_a_front_door() -> None:
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines, at most {README_MAX_LINES}"


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("One request through the cluster (PD mode)", "one-request-through-the-cluster-pd-mode"),
        ("`bench/serve.py`", "benchservepy"),
        ("What has run on a GPU: nothing yet", "what-has-run-on-a-gpu-nothing-yet"),
        ("API keys (frontend)", "api-keys-frontend"),
        ("Migrations and request IDs", "migrations-and-request-ids"),
        ("snake_case and dash-ed", "snake_case-and-dash-ed"),
    ],
)
def test_slug_is_githubs(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor


def test_anchors_of_a_page(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# `bench/serve.py`\n\n```sh\n# not a heading\n```\n\n## Twice\n## Twice\n")
    assert anchors(page) == {"benchservepy", "twice", "twice-1"}


def test_links_are_found_outside_code_only() -> None:
    text = (
        'See [a](a.md#x), ![img](img/p.png "title") and [b](<b c.md>).\n'
        "`[not](code.md)`\n\n```md\n[not](fenced.md)\n```\n\n[ref]: r.md\n"
        "[nested [brackets]](n.md) [ext](https://example.com)\n"
    )
    assert links_in(text) == [
        "a.md#x",
        "img/p.png",
        "b c.md",
        "n.md",
        "https://example.com",
        "r.md",
    ]
