"""The README and the documentation site (docs/): their Python examples run as written, their
links and #anchors resolve, every page is in the site's navigation, and they cover the CLI.

A ```python block runs unless the line right before it is `<!-- not run: REASON -->`; the
reason says why (a call signature rather than a program, or an example too slow for the
suite), and the marker is the only way to leave a block out."""

import fnmatch
import importlib.util
import re
from pathlib import Path

import pytest

from moeify.cli.main import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.*?)\s*-->")
FENCE = re.compile(r"^(```+|~~~+)")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def fenced(text: str) -> list[tuple[int, str, str, str]]:
    """(line number, language, code, the line before the block) for every fenced block."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m:
            start, lang, body = i, lines[i][len(m.group(1)):].strip(), []
            i += 1
            while i < len(lines) and not lines[i].startswith(m.group(1)):
                body.append(lines[i])
                i += 1
            before = lines[start - 1] if start else ""
            out.append((start + 1, lang, "\n".join(body) + "\n", before))
        i += 1
    return out


def python_blocks(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, code, reason it is not run or None) for every ```python block of a page."""
    blocks = []
    for line, lang, code, before in fenced(path.read_text()):
        if lang == "python":
            m = NOT_RUN.search(before)
            blocks.append((line, code, m.group(1) if m else None))
    return blocks


def prose(text: str) -> str:
    """The page without its fenced blocks and inline code (links there are not links)."""
    lines, keep, inside = text.splitlines(), [], None
    for line in lines:
        m = FENCE.match(line)
        if inside is None and m:
            inside = m.group(1)
        elif inside is not None and line.startswith(inside):
            inside = None
        elif inside is None:
            keep.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(keep)


def anchors(path: Path) -> set[str]:
    """The #anchors of a Markdown page's headings, as GitHub (and MkDocs, for ASCII headings)
    make them: lower case, punctuation dropped, spaces to hyphens, -1, -2 for repeats."""
    seen: dict[str, int] = {}
    for line in prose(path.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1)).replace("*", "")
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        if n:
            seen[f"{slug}-{n}"] = 1
    return set(seen)


def links(path: Path) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", prose(path.read_text()))


RUNNABLE = [p for p in PAGES if any(reason is None for _, _, reason in python_blocks(p))]


@pytest.mark.parametrize("page", RUNNABLE, ids=rel)
def test_python_examples_run(page, tmp_path, monkeypatch):
    """Every block, in a fresh namespace, with a private cache; a block that imports
    transformers is skipped (and said) where the hf extra is not installed."""
    import torch

    monkeypatch.setenv("MOEIFY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    skipped = []
    try:
        for line, code, reason in python_blocks(page):
            if reason is not None:
                continue
            if "import transformers" in code and importlib.util.find_spec("transformers") is None:
                skipped.append(line)
                continue
            # Line numbers in a traceback are the page's own.
            exec(compile("\n" * line + code, str(page), "exec"), {})
    finally:
        torch.set_num_threads(threads)
    if skipped:
        pytest.skip(f"transformers is not installed (pip install -e '.[hf]'): skipped the "
                    f"blocks of {rel(page)} at lines {skipped}")


def test_the_api_examples_are_kept_and_not_run_markers_say_why():
    every = [(p, *b) for p in PAGES for b in python_blocks(p)]
    run = [code for _, _, code, reason in every if reason is None]
    assert any("load_trained" in b and "train_from" in b and "upcycle" in b for b in run)
    assert any("import_hf" in b and "export_hf" in b for b in run)
    for page in PAGES:
        text = page.read_text()
        for m in NOT_RUN.finditer(text):
            assert len(m.group(1)) > 5, f"{rel(page)}: say why a block is not run: {m.group(0)}"
        markers = len(NOT_RUN.findall(text))
        marked = sum(1 for _, _, r in python_blocks(page) if r is not None)
        assert markers == marked, f"{rel(page)}: a not-run marker that is not right before a " \
                                  f"```python block"


def test_readme_opens_with_the_two_setup_commands_then_activation():
    text = README.read_text()
    first_block = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1)
    assert "make train" in first_block and "make test" in first_block
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    # No `moeify ...` command before the README has said how to get it on the PATH.
    activate = text.index("source .venv/bin/activate")
    first_use = min(m.start() for m in re.finditer(r"^moeify \w", text, flags=re.M))
    assert activate < first_use
    assert len(text.splitlines()) < 400, "the README is a short page: details go under docs/"


def test_every_subcommand_is_documented():
    text = "\n".join(p.read_text() for p in PAGES)
    missing = [c for c in COMMANDS if f"moeify {c}" not in text]
    assert not missing, f"neither README.md nor docs/ mention: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_links_and_anchors_resolve(page):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading with that anchor)")
    assert not broken, f"{rel(page)}: broken links: {broken}"


def test_every_docs_page_is_in_the_site_navigation():
    """A page that is neither in mkdocs.yml's nav nor matched by its not_in_nav patterns is
    built but unreachable from the site's menus."""
    config = (ROOT / "mkdocs.yml").read_text()
    nav = set(re.findall(r"^\s*- (?:[^:\n]+: )?(\S+\.md)\s*$", config, flags=re.M))
    block = re.search(r"^not_in_nav: \|\n((?:  .*\n)+)", config, flags=re.M)
    patterns = block.group(1).split() if block else []
    for path in nav:
        assert (DOCS / path).is_file(), f"mkdocs.yml's nav names a missing page: {path}"
    lost = [p for p in (str(q.relative_to(DOCS)) for q in DOCS.rglob("*.md"))
            if p not in nav and not any(fnmatch.fnmatch(p, pat) for pat in patterns)]
    assert not lost, f"docs pages missing from mkdocs.yml's nav: {lost}"
