"""The docs hold together: every relative link in README.md and docs/**/*.md points at a
file (and a heading, when it names one) that exists; every `docs/...` path the pages
mention exists; docs/README.md indexes every page under docs/ in the section of its
kind (guides, reference, results); and every file under docs/ is linked from a page."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
INDEX = DOCS / "README.md"
KINDS = {"guides": "Guides", "reference": "Reference", "results": "Results"}

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.DOTALL)
# [text](target) and ![alt](target); the target may carry a "title"
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
DOCS_PATH = re.compile(r"(?<![\w/.-])docs/[\w./-]*[\w/]")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced code blocks."""
    out, fenced = [], False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, line))
    return out


def paragraphs(path: Path) -> list[tuple[int, str]]:
    """(first line number, text) of each run of non-blank prose lines, so that a link whose
    text wraps onto the next line is still one link."""
    out: list[tuple[int, str]] = []
    start, buf, last = 0, [], -1
    for n, line in prose_lines(path):
        if not line.strip() or n != last + 1:
            if buf:
                out.append((start, "\n".join(buf)))
            buf = []
        if line.strip():
            if not buf:
                start = n
            buf.append(line)
        last = n
    if buf:
        out.append((start, "\n".join(buf)))
    return out


def links(path: Path) -> list[tuple[int, str]]:
    found = []
    for start, text in paragraphs(path):
        for k, line in enumerate(text.split("\n")):
            ref = REF_DEF.match(line)
            if ref:
                found.append((start + k, ref.group(1)))
        plain = INLINE_CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
        for m in LINK.finditer(plain):
            found.append((start + plain.count("\n", 0, m.start()), m.group(1)))
    return found


def slug(text: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link counts by its text
    text = unicodedata.normalize("NFC", text).lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        k = seen.get(base, 0)
        seen[base] = k + 1
        out.add(base if k == 0 else f"{base}-{k}")
    return out


def is_external(target: str) -> bool:
    return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target))


def resolve(page: Path, target: str) -> tuple[Path, str]:
    file_part, _, anchor = target.partition("#")
    dest = page if not file_part else (page.parent / unquote(file_part)).resolve()
    return dest, anchor


def link_problems(page: Path) -> list[str]:
    problems = []
    where = page.relative_to(ROOT)
    for n, target in links(page):
        if is_external(target):
            continue
        dest, anchor = resolve(page, target)
        if not dest.is_relative_to(ROOT):
            problems.append(f"{where}:{n}: {target} leaves the repository")
        elif not dest.exists():
            problems.append(f"{where}:{n}: {target} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}:{n}: {target}: no heading '#{anchor}' in {dest.relative_to(ROOT)}")
    return problems


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    problems = link_problems(page)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_mentioned_docs_paths_exist(page: Path):
    """A page that names a docs file in prose (`docs/guides/tasks.md`) names one that exists."""
    missing = []
    for n, line in prose_lines(page):
        for m in DOCS_PATH.finditer(line):
            if not (ROOT / m.group(0)).exists():
                missing.append(f"{page.relative_to(ROOT)}:{n}: {m.group(0)} does not exist")
    assert not missing, "\n".join(missing)


def index_sections() -> dict[str, set[Path]]:
    """The pages docs/README.md links to, by the `## ` section the link stands in."""
    sections: dict[str, set[Path]] = {}
    current = ""
    for n, line in prose_lines(INDEX):
        m = HEADING.match(line)
        if m and len(m.group(1)) == 2:
            current = m.group(2).strip()
            continue
        for target in (t for k, t in links(INDEX) if k == n):
            if not is_external(target):
                sections.setdefault(current, set()).add(resolve(INDEX, target)[0])
    return sections


def test_index_lists_every_page_under_its_kind():
    sections = index_sections()
    for folder, title in KINDS.items():
        assert title in sections, f"docs/README.md has no '## {title}' section"
        want = set((DOCS / folder).rglob("*.md"))
        missing = sorted(str(p.relative_to(ROOT)) for p in want - sections[title])
        assert missing == [], f"docs/README.md '## {title}' does not list {missing}"
    listed = set().union(*sections.values())
    strays = sorted(
        str(p.relative_to(ROOT))
        for p in DOCS.rglob("*.md")
        if p != INDEX and p.parent == DOCS and p not in listed
    )
    assert strays == [], f"pages outside guides/, reference/, results/ and not indexed: {strays}"


def test_every_file_under_docs_is_linked():
    """No orphans: each file under docs/ is the target of some link (a link to a folder
    covers what is inside it)."""
    targets = set()
    for page in pages():
        for _, target in links(page):
            if not is_external(target):
                targets.add(resolve(page, target)[0])
    orphans = sorted(
        str(f.relative_to(ROOT))
        for f in DOCS.rglob("*")
        if f.is_file() and f != INDEX and not any(t == f or t in f.parents for t in targets)
    )
    assert not orphans, "linked from no page: " + ", ".join(orphans)


def test_the_checker_catches_what_it_should(tmp_path: Path):
    """The parsing above on a page with a good link, a broken one, a bad anchor, a link
    inside code (ignored) and an external one (ignored)."""
    (tmp_path / "a.md").write_text("# Title\n\n## Second part (`x.py`)\n", encoding="utf-8")
    page = tmp_path / "b.md"
    page.write_text(
        "[ok](a.md#second-part-xpy) [gone](nope.md) [bad](a.md#nothing)\n"
        "`[code](skip.md)` [web](https://example.com/x.md) [wrapped\ntext](a.md#title)\n"
        "```\n[fenced](skip2.md)\n```\n",
        encoding="utf-8",
    )
    assert [t for _, t in links(page)] == [
        "a.md#second-part-xpy", "nope.md", "a.md#nothing", "https://example.com/x.md", "a.md#title"
    ]
    assert anchors(tmp_path / "a.md") == {"title", "second-part-xpy"}
    dest, anchor = resolve(page, "a.md#nothing")
    assert dest == tmp_path / "a.md" and anchor not in anchors(dest)


def code_files() -> list[Path]:
    """Source, tests, configs and scripts of the repository (not the virtual environment)."""
    skip = {".venv", ".git", "node_modules", "build", "dist", ".hypothesis", ".pytest_cache"}
    out = []
    for path in ROOT.rglob("*"):
        if any(part in skip for part in path.relative_to(ROOT).parts):
            continue
        if path.is_file() and path.suffix in {".py", ".toml", ".sh", ".cfg", ".yaml", ".yml"}:
            out.append(path)
    return sorted(out)


def test_docs_paths_named_in_code_exist():
    """Code, tests and configs that name a docs file (in a comment, an error message, or a
    path a test reads) name one that exists; a page moved under guides/ or reference/
    must take its readers along."""
    missing = []
    for path in code_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for n, line in enumerate(text.splitlines(), 1):
            for m in DOCS_PATH.finditer(line):
                if not (ROOT / m.group(0)).exists():
                    missing.append(f"{path.relative_to(ROOT)}:{n}: {m.group(0)} does not exist")
            for m in re.finditer(r'"docs"((?:\s*/\s*"[^"]+")+)', line):
                parts = re.findall(r'"([^"]+)"', m.group(1))
                if not (DOCS.joinpath(*parts)).exists():
                    missing.append(f"{path.relative_to(ROOT)}:{n}: docs/{'/'.join(parts)} does not exist")
    assert not missing, "\n".join(missing)


OUTSIDE = re.compile(r"(?<![\w/.-])(refs/[\w./-]*[\w]|DESIGN\.md)")


def test_no_brief_beside_the_repository_is_cited():
    """Code and docs cite files of the repository only, never the briefs kept beside it
    (refs/..., DESIGN.md), which a reader of the repository does not have."""
    cited = []
    for path in [*code_files(), *pages()]:
        if path == Path(__file__).resolve():  # names the briefs to refuse them
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            for m in OUTSIDE.finditer(line):
                if not (ROOT / m.group(0)).exists():
                    cited.append(f"{path.relative_to(ROOT)}:{n}: cites {m.group(0)}, which is not in the repository")
    assert not cited, "\n".join(cited)
