"""The user documentation: README length, links, the CI command, and no history narration.

Reference docs state what the code does; the history lives in ``CHANGELOG.md`` and ``git log``.
These checks read files only (no model is built except by the quick-start snippet test).
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 200
CODE_DIRS = ("tengrad_fx", "zoo", "tools", "testing")

# Narration: history, issue numbers, work sessions, figures flagged as out of date.
NARRATION = [re.compile(p, re.IGNORECASE) for p in (
    r"\bissue\s*#?\d+",
    r"\bbefore issue\b",
    r"\bthis session\b",
    r"\bsession start\b",
    r"stale",
    r"predate",
    r"not re-measured",
)]

MAIN_COMMAND = ('python3 -m venv .venv && .venv/bin/pip install -q torch==2.14.1 torchvision==0.29.1 '
                '-e ".[plot]" && .venv/bin/tengrad-reproduce fmnist --methods tengrad,sgd')


def markdown_files() -> list[Path]:
    return [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_files() -> list[Path]:
    return sorted(p for d in CODE_DIRS for p in (ROOT / d).rglob("*.py"))


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """``(line number, text)`` of a Python file's comments and docstrings (bare string
    statements: module, class, function and attribute docstrings); code is left out."""
    src = path.read_text(encoding="utf-8")
    lines = src.splitlines()
    out: list[tuple[int, str]] = []
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    for node in ast.walk(ast.parse(src, filename=str(path))):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            end = node.end_lineno or node.lineno
            out.extend((n, lines[n - 1]) for n in range(node.lineno, end + 1))
    return out


def narration_hits(numbered: list[tuple[int, str]], path: Path) -> list[str]:
    rel = path.relative_to(ROOT)
    return [f"{rel}:{n}: {text.strip()[:120]}" for n, text in numbered
            if any(p.search(text) for p in NARRATION)]


def test_readme_is_short():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES}); move detail to docs/"


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_markdown_has_no_narration(path: Path):
    assert path.exists(), f"{path.relative_to(ROOT)} is missing"
    text = path.read_text(encoding="utf-8").splitlines()
    hits = narration_hits(list(enumerate(text, start=1)), path)
    assert not hits, "history narration in the docs (say what the code does):\n" + "\n".join(hits)


def test_code_comments_and_docstrings_have_no_narration():
    hits = [h for p in python_files() for h in narration_hits(prose_lines(p), p)]
    assert not hits, "history narration in comments/docstrings:\n" + "\n".join(hits)


def test_narration_patterns_catch_examples():
    caught = ["fixed in issue 10", "see Issue #3", "the coverage before issue 10", "This session added",
              "session start", "these figures are Stale", "they predate the fix", "not re-measured on a GPU"]
    clean = ["the records of the last curvature step", "a tissue of 10 layers", "sessions of torchrun"]
    assert all(any(p.search(s) for p in NARRATION) for s in caught)
    assert not any(p.search(s) for s in clean for p in NARRATION)


def ci_test_command() -> str:
    lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    marks = [i for i, line in enumerate(lines) if line.strip().startswith("# README test command")]
    assert len(marks) == 1, "'.ci/run' must have one '# README test command' comment"
    return lines[marks[0] + 1].strip()


def test_readme_test_command_is_what_ci_runs():
    ci = ci_test_command()
    readme = [line.strip() for line in README.read_text(encoding="utf-8").splitlines()]
    candidates = [line for line in readme if "pytest" in line and line.startswith("python3 -m venv")]
    assert candidates == [ci], f"README's test command {candidates} differs from .ci/run's {ci!r}"


def test_readme_main_command_is_present():
    readme = [line.strip() for line in README.read_text(encoding="utf-8").splitlines()]
    assert MAIN_COMMAND in readme


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_exist(path: Path):
    missing = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # URL, mailto:, in-page anchor
            if not (path.parent / target.split("#", 1)[0]).exists():
                missing.append(f"{path.relative_to(ROOT)}:{n}: {target}")
    assert not missing, "broken relative links:\n" + "\n".join(missing)


def test_every_doc_is_linked_from_the_readme():
    text = README.read_text(encoding="utf-8")
    linked = {(README.parent / t.split("#", 1)[0]).resolve() for t in LINK.findall(text)}
    unlinked = [p.relative_to(ROOT) for p in markdown_files()[1:] if p.resolve() not in linked]
    assert not unlinked, f"not linked from README.md: {unlinked}"


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.DOTALL)


def test_readme_quick_start_runs():
    """The README's first Python block is self-contained: it runs as written."""
    block = python_blocks(README)[0]
    exec(compile(block, "README.md:quick-start", "exec"), {"__name__": "readme_quick_start"})


REPO_PATH = re.compile(r"^(?:tests|tengrad_fx|tools|testing|zoo)/[\w/.]+$")


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_referenced_files_and_tests_exist(path: Path):
    """Paths in backticks (`tests/x.py::test_y`, `tengrad_fx/optim/z.py`) name real files and tests."""
    missing = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        for code in re.findall(r"`([^`]+)`", line):
            for token in code.split():
                file, _, test = token.partition("::")
                if not REPO_PATH.match(file):
                    continue
                if not (ROOT / file).exists():
                    missing.append(f"{path.relative_to(ROOT)}:{n}: {file}")
                elif test and not re.search(rf"def {re.escape(test.split('[')[0])}\b", (ROOT / file).read_text()):
                    missing.append(f"{path.relative_to(ROOT)}:{n}: {token}")
    assert not missing, "references to missing files or tests:\n" + "\n".join(missing)
