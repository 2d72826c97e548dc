"""Every relative link and #anchor in the README, CONTRIBUTING, docs/ and the results' pages resolves: a moved section
or renamed file fails here, not in a reader's browser."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import REPO

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target), and ![alt](image)
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE = re.compile(r"`[^`\n]*`")  # `kernel[grid](...)` is code, not a link


def pages() -> list[Path]:
    results = sorted((REPO / "bench" / "results").glob("**/*.md"))
    candidates = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md")), *results]
    return [p for p in candidates if p.is_file()]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link markup dropped, lower case, punctuation but - and _ removed,
    spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        if m := re.match(r"#{1,6} (.+)", line):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    text = CODE.sub("", FENCE.sub("", page.read_text()))
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    return broken


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(page):
    assert not (broken := broken_links(page)), f"{page.name}: " + "; ".join(broken)


def test_the_check_finds_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## Its `--flag` part\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Top\n[ok](other.md#its---flag-part) [ok](#top) [web](https://example.com/x)\n"
        "`[code](nowhere.md)`\n```\n[fenced](nowhere.md)\n```\n"
        "[gone](missing.md) [bad](other.md#no-such) [self](#nope)\n"
    )
    assert broken_links(page) == [
        "missing.md: no such file",
        "other.md#no-such: no heading with anchor #no-such in other.md",
        "#nope: no heading with anchor #nope in page.md",
    ]


def test_slug_follows_github():
    assert slug("Mixtures: `--data DIR:WEIGHT,DIR:WEIGHT`") == "mixtures---data-dirweightdirweight"
    assert slug("Hugging Face: export and import") == "hugging-face-export-and-import"
    assert slug("Compiled for an H200 without a GPU") == "compiled-for-an-h200-without-a-gpu"


def test_the_docs_card_list_is_the_planners():
    """docs/performance.md's table of cards is the docs' one list of `--plan-gpu` names: it holds
    exactly the cards fastpt.plan.gpus knows."""
    from fastpt.plan import gpus

    text = (REPO / "docs" / "performance.md").read_text()
    table = next(b for b in text[text.index("## The cards") :].split("\n\n") if b.startswith("|"))
    names = [cell for row in table.splitlines()[2:] for cell in re.findall(r"`([^`]+)`", row.split("|")[1])]
    assert sorted(names) == sorted(gpus.GPUS)


def test_pages_stay_short():
    """The README is a front page (160 lines at most, its two commands on the first screen); each docs
    page serves one task (350 lines at most)."""
    readme = (REPO / "README.md").read_text().splitlines()
    assert len(readme) <= 160
    first_screen = "\n".join(readme[:30])
    assert "python -m fastpt.train --compile" in first_screen and "pytest -q" in first_screen
    long = {p.name: n for p in (REPO / "docs").glob("*.md") if (n := len(p.read_text().splitlines())) > 350}
    assert not long, long
