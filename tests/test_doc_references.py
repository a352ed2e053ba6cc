"""Every reference a doc makes to this repository resolves.

In every markdown file, and in the docstrings and comments of every Python
file: a markdown link to a local file exists, and its ``#anchor`` is one of
that file's headings (GitHub's slugs); a repository path (``lmkv/storage/manager.py``,
``docs/<page>.md``, ``benchmarks/<name>.py``, backticked, or bare with a file's
suffix) exists; a section named after a page (``docs/vllm.md, "KV events"``) is
one of that page's headings, or a paragraph's bold title. Paths are read from
the repository's root, from the project the file belongs to (a plugin's own
``tests/``) or from the file's own directory; a path with ``*`` must match
something, and one with ``<...>``, ``{...}`` or ``...`` is a pattern, not a path.

CHANGELOG.md is history: the paths it names were true when it was written.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".venv", "build", "dist", "node_modules", "__pycache__", ".mypy_cache",
             ".ruff_cache", ".pytest_cache"}
SKIP_FILES = {"CHANGELOG.md"}
#: Top-level folders a repository path starts with.
ROOTS = ("lmkv", "lmkv_backends", "lmkv_policies", "kernels", "plugins", "docs", "tests",
         "benchmarks", "scripts", ".ci")

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(?P<text>.+?)\s*#*\s*$")
# A paragraph's title in bold, ending in a full stop or colon: "**Huge pages.** ...".
_RUN_IN = re.compile(r"\*\*(?P<text>[^*]+?)[.:]\*\*")
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.I)
_LINK = re.compile(r"!?\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
_REF_DEF = re.compile(r"^\s*\[[^\]]+\]:\s*(?P<target>\S+)", re.M)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_PATH = re.compile(
    r"(?<![\w./:@~-])(?P<path>(?:" + "|".join(re.escape(r) for r in ROOTS) +
    r")/[\w.*<>{}/-]*)")
_SECTION = re.compile(r"(?P<path>[\w./-]+\.md)\)?(?:,\s*|\s*\(\s*)\"(?P<section>[^\"\n]+)\"")
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)


@dataclass(frozen=True)
class Problem:
    where: str  # file:line
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lower-cased, links as their text,
    punctuation dropped, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _outside_fences(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


@cache
def _headings(path: Path) -> tuple[frozenset[str], frozenset[str]]:
    """The anchors of ``path``'s headings (duplicates numbered as GitHub does)
    and their texts, lower-cased with the markup removed."""
    anchors: set[str] = set()
    titles: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in _outside_fences(path.read_text(encoding="utf-8")):
        anchors.update(_HTML_ANCHOR.findall(line))
        titles.update(_title(m["text"]) for m in _RUN_IN.finditer(line))
        match = _HEADING.match(line)
        if not match:
            continue
        text = match["text"]
        base = slug(text)
        count = seen.get(base, 0)
        seen[base] = count + 1
        anchors.add(base if count == 0 else f"{base}-{count}")
        titles.add(_title(text))
    return frozenset(anchors), frozenset(titles)


def _title(text: str) -> str:
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return " ".join(text.replace("`", "").replace("*", "").split()).lower()


def _project_of(path: Path, repo: Path) -> Path:
    """The nearest folder above ``path`` with a pyproject.toml (a plugin's own)."""
    for parent in path.parents:
        if (parent / "pyproject.toml").exists() or parent == repo:
            return parent
    return repo


def _exists(ref: str, source: Path, repo: Path) -> bool:
    bases = dict.fromkeys([repo, _project_of(source, repo), source.parent])
    for base in bases:
        if "*" in ref:
            if next(iter(base.glob(ref.rstrip("/"))), None) is not None:
                return True
        elif (base / ref).exists():
            return True
    return False


def check_link(target: str, source: Path, repo: Path, where: str) -> Problem | None:
    """A markdown link's target: a local file (from ``source``'s folder) and anchor."""
    if _EXTERNAL.match(target) or target.startswith("//"):
        return None
    file_part, _, anchor = target.partition("#")
    path = (source.parent / file_part).resolve() if file_part else source
    if not path.exists():
        return Problem(where, f"link to {target}: {file_part} does not exist")
    if anchor and path.suffix == ".md" and anchor.lower() not in _headings(path)[0]:
        return Problem(where, f"link to {target}: {path.name} has no heading #{anchor}")
    return None


def check_path(ref: str, source: Path, repo: Path, where: str,
               backticked: bool = True) -> Problem | None:
    """A repository path named in prose. Bare in a sentence, only one that ends in
    a file's suffix or a ``/`` is taken for a path ("lmkv/vLLM" is not one)."""
    if any(mark in ref for mark in ("<", "{", "...")):
        return None
    ref = ref.rstrip(".,:;")
    if not backticked and not (ref.endswith("/") or re.search(r"\.\w+$", ref)):
        return None
    if ref.count("/") == 1 and ref.endswith("/"):
        ref = ref[:-1]
    if _exists(ref, source, repo):
        return None
    return Problem(where, f"{ref} does not exist")


def check_section(page: str, section: str, source: Path, repo: Path,
                  where: str) -> Problem | None:
    """``<page>.md, "Section"``: the page has a heading (or bold title) ``Section``."""
    candidates = [base / page for base in dict.fromkeys(
        [source.parent, _project_of(source, repo), repo])]
    path = next((p for p in candidates if p.exists()), None)
    if path is None:
        return Problem(where, f'{page}, "{section}": {page} does not exist')
    wanted = _title(section)
    # "GPU" names the heading "GPU (`benchmarks/bench_gpu.py`)" too.
    if not any(t == wanted or t.startswith(f"{wanted} (") for t in _headings(path)[1]):
        return Problem(where, f'{page}, "{section}": {page} has no heading "{section}"')
    return None


def check_sections(text: str, source: Path, repo: Path, where: str) -> list[Problem]:
    """The page sections named in a piece of prose (``docs/<page>.md, "Section"``)."""
    found = (check_section(m["path"], m["section"], source, repo, where)
             for m in _SECTION.finditer(text))
    return [p for p in found if p is not None]


def check_paths(text: str, source: Path, repo: Path, where: str) -> list[Problem]:
    """The repository paths named in a piece of prose."""
    found = (check_path(m["path"], source, repo, where,
                        backticked=text[m.start() - 1:m.start()] == "`")
             for m in _PATH.finditer(text))
    return [p for p in found if p is not None]


def check_markdown(path: Path, repo: Path) -> list[Problem]:
    problems: list[Problem | None] = []
    text = path.read_text(encoding="utf-8")
    name = path.relative_to(repo).as_posix()
    for number, line in _outside_fences(text):
        where = f"{name}:{number}"
        for match in _LINK.finditer(_INLINE_CODE.sub("", line)):
            problems.append(check_link(match["target"], path, repo, where))
        for match in _REF_DEF.finditer(line):
            problems.append(check_link(match["target"], path, repo, where))
        problems.extend(check_sections(line, path, repo, where))
        # A path inside a link's target was checked as a link (from this file's folder).
        problems.extend(check_paths(_LINK.sub(r"\g<text>", line), path, repo, where))
    return [p for p in problems if p is not None]


def _python_prose(source: str) -> Iterator[tuple[int, str]]:
    """(line, text) of each docstring and comment of a Python module."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc and node.body:
                yield node.body[0].lineno, doc
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def check_python(path: Path, repo: Path) -> list[Problem]:
    name = path.relative_to(repo).as_posix()
    problems = []
    for line, text in _python_prose(path.read_text(encoding="utf-8")):
        where = f"{name}:{line}"
        problems += check_sections(text, path, repo, where) + check_paths(text, path, repo, where)
    return problems


def _candidates(repo: Path) -> list[Path]:
    """The repository's own files: git's tracked and not-ignored ones (never a venv,
    a build or a bundle beside them); every file where there is no git."""
    import subprocess

    listed = subprocess.run(["git", "-C", str(repo), "ls-files", "-co", "--exclude-standard"],
                            capture_output=True, text=True)
    if listed.returncode != 0:
        return sorted(repo.rglob("*"))
    return sorted(repo / line for line in listed.stdout.splitlines() if line)


def doc_files(repo: Path) -> Iterator[Path]:
    for path in _candidates(repo):
        parts = set(path.relative_to(repo).parts)
        if parts & SKIP_DIRS or path.name in SKIP_FILES or not path.is_file():
            continue
        if any(part.endswith(".egg-info") for part in parts):
            continue
        if path.suffix in (".md", ".py"):
            yield path


def check_repo(repo: Path) -> list[Problem]:
    problems: list[Problem] = []
    for path in doc_files(repo):
        check = check_markdown if path.suffix == ".md" else check_python
        problems += check(path, repo)
    return problems


def test_every_reference_in_the_docs_resolves() -> None:
    problems = check_repo(REPO)
    assert not problems, "references that do not resolve:\n" + "\n".join(map(str, problems))


# -- the checker itself, on a repository of its own ---------------------------

@pytest.fixture
def repo(tmp_path: Path) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "lmkv").mkdir()
    (tmp_path / "lmkv" / "store.py").write_text('"""See docs/guide.md, "Set up"."""\n')
    (tmp_path / "docs" / "guide.md").write_text(
        "# Guide\n\n## Set up\n\n## Set up\n\n### `KV` events (new)\n\n```\n# not a heading\n```\n"
        "- **Huge pages.** A bullet's title. **Rescue:** a paragraph's.\n")
    return tmp_path


def test_github_slugs() -> None:
    assert slug("What the checks cost (`benchmarks/before_after.py`)") == \
        "what-the-checks-cost-benchmarksbefore_afterpy"
    assert slug("Hits at the engine's block") == "hits-at-the-engines-block"
    assert slug("See [fs](tiers/fs.md) now") == "see-fs-now"


def test_what_resolves_passes(repo: Path) -> None:
    (repo / "README.md").write_text(
        "[guide](docs/guide.md#set-up), [again](docs/guide.md#set-up-1), "
        "[events](docs/guide.md#kv-events-new), `lmkv/store.py`, lmkv/*.py,\n"
        '[the guide](docs/guide.md), "Set up"; https://example.com/docs/nothing.md\n'
        "`docs/<page>.md`, docs/tiers/{a,b}.md, tests/..., lmkv/vLLM, "
        '[guide](docs/guide.md) ("Huge pages"), docs/guide.md, "Rescue", docs/guide.md, "KV '
        'events"\n')
    assert check_repo(repo) == []


@pytest.mark.parametrize("text, message", [
    ("[gone](docs/gone.md)", "docs/gone.md does not exist"),
    ("[anchor](docs/guide.md#not-here)", "guide.md has no heading #not-here"),
    ("[code](docs/guide.md#not-a-heading)", "guide.md has no heading #not-a-heading"),
    ("see `lmkv/gone.py`.", "lmkv/gone.py does not exist"),
    ("see lmkv/gone.py, then", "lmkv/gone.py does not exist"),
    ("scripts/*.sh", "scripts/*.sh does not exist"),
    ('docs/guide.md, "Tear down"', 'docs/guide.md has no heading "Tear down"'),
    ('[guide](docs/guide.md) ("Tear down")', 'docs/guide.md has no heading "Tear down"'),
    ('ARCHITECTURE.md, "Storage manager"', "ARCHITECTURE.md does not exist"),
])
def test_a_broken_reference_in_markdown_is_found(repo: Path, text: str, message: str) -> None:
    (repo / "README.md").write_text(f"# Title\n\n{text}\n")
    problems = check_repo(repo)
    assert [p.where for p in problems] == ["README.md:3"]
    assert message in problems[0].message


def test_a_broken_reference_in_a_docstring_or_comment_is_found(repo: Path) -> None:
    (repo / "lmkv" / "store.py").write_text(
        '"""Semantics: docs/guide.md, "Storage manager"."""\n\n'
        "# the rest is in docs/missing.md\n"
        "PATH = 'docs/also-missing.md'  # a string in code is not prose\n")
    problems = check_repo(repo)
    assert [str(p) for p in problems] == [
        'lmkv/store.py:1: docs/guide.md, "Storage manager": docs/guide.md has no heading '
        '"Storage manager"',
        "lmkv/store.py:3: docs/missing.md does not exist",
    ]
