"""docs/MATH.md is the math-to-code map, and minillama/core/ops.py the reference it points at: both
are checked here so that neither drifts.

* every ``path.py:name`` that MATH.md cites (and each bare ``name`` chained after it, as in
  "`minillama/core/ops.py:rope_forward`, `rope_backward`") exists in that file;
* every public ``*_forward`` / ``*_backward`` of the reference has its equation (LaTeX) and its
  shapes in the docstring, and MATH.md cites it;
* the reference stays plain: short bodies, no threading or tuning machinery.

The ops are discovered from the module, so ops appended later are covered without editing this.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from minillama.cli.mathmap import citations
from minillama.core import ops

ROOT = Path(__file__).resolve().parents[1]
MATH = ROOT / "docs" / "MATH.md"
OPS = ROOT / "minillama" / "core" / "ops.py"
#: the reference: ops.py and the RoPE table builders it re-exports (held to the same plainness)
REFERENCE_FILES = (OPS, ROOT / "minillama" / "core" / "rope_scaling.py")

#: LaTeX: a command (\sqrt, \odot, \, ...), a superscript, a braced subscript or a one-letter
#: symbol with a subscript (z_b, x_i)
LATEX = re.compile(r"\\[A-Za-z,;!]|\^|_\{|\b[A-Za-z]_[A-Za-z0-9]\b")
#: a shape such as (B, T, D), (..., in), (N,) or (B, S, KVH, hd)
SHAPE = re.compile(r"\((?:\.\.\.|[A-Za-z][\w/* ]*)(?:,\s*(?:\.\.\.|[\w/* ]+))*,?\s*\)")
#: what the reference must not contain (speed belongs in backends/)
FORBIDDEN = ("parallel_rows", "single_threaded_blas", "/proc/self/maps", "mallopt", "ThreadPool",
             "import threading", "openblas")
MAX_BODY_LINES = 25


def math_citations() -> list[tuple[str, str]]:
    """Every (path, dotted name) that MATH.md cites (read as `minillama explain` reads them)."""
    return citations(MATH.read_text(encoding="utf-8"))


def defined_names(path: Path) -> set[str]:
    """Top-level functions/classes/assignments of a Python file, and ``Class.member`` for the
    methods and class attributes of its classes (parsed, not imported: CuPy files work too)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(f"{node.name}.{sub.name}")
                elif isinstance(sub, ast.Assign):
                    names.update(f"{node.name}.{t.id}" for t in sub.targets
                                 if isinstance(t, ast.Name))
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def reference_ops() -> list[str]:
    """The public forward/backward functions of minillama.core.ops, in source order."""
    return [name for name, fn in inspect.getmembers(ops, inspect.isfunction)
            if fn.__module__ == ops.__name__ and not name.startswith("_")
            and name.endswith(("_forward", "_backward"))]


def test_math_md_cites_something():
    cites = math_citations()
    assert len(cites) >= 20, cites  # the parser still understands the file's citation style
    assert ("minillama/core/ops.py", "attention_forward") in cites


def test_every_citation_exists():
    missing = []
    cache: dict[str, set[str]] = {}
    for path, name in math_citations():
        file = ROOT / path
        if not file.is_file():
            missing.append(f"{path} (no such file)")
            continue
        if path not in cache:
            cache[path] = defined_names(file)
        if name not in cache[path]:
            missing.append(f"{path}:{name}")
    assert not missing, f"docs/MATH.md cites what does not exist: {missing}"


def test_reference_ops_found():
    names = reference_ops()
    for op in ("embedding", "linear", "rmsnorm", "rope", "attention", "swiglu", "cross_entropy"):
        assert f"{op}_forward" in names and f"{op}_backward" in names


@pytest.mark.parametrize("name", reference_ops())
def test_reference_docstring_has_equation_and_shapes(name):
    doc = inspect.getdoc(getattr(ops, name)) or ""
    assert "=" in doc and LATEX.search(doc), f"ops.{name}: no equation (LaTeX) in the docstring"
    assert SHAPE.search(doc), f"ops.{name}: no shapes such as (B, T, D) in the docstring"


def test_math_md_lists_every_reference_op():
    cited = {name for path, name in math_citations() if path == "minillama/core/ops.py"}
    missing = [name for name in reference_ops() if name not in cited]
    assert not missing, f"docs/MATH.md does not cite minillama/core/ops.py:{missing}"


def _code_lines(fn: ast.FunctionDef, path: Path = OPS) -> int:
    """Lines of a function body that hold code (no docstring, blank or comment-only lines)."""
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    if not body:
        return 0
    lines = path.read_text(encoding="utf-8").splitlines()[body[0].lineno - 1:fn.end_lineno]
    return sum(1 for ln in lines if ln.strip() and not ln.strip().startswith("#"))


@pytest.mark.parametrize("path", REFERENCE_FILES, ids=lambda p: p.name)
def test_reference_bodies_read_at_a_glance(path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    long = {node.name: _code_lines(node, path) for node in tree.body
            if isinstance(node, ast.FunctionDef) and _code_lines(node, path) > MAX_BODY_LINES}
    assert not long, f"reference functions longer than {MAX_BODY_LINES} code lines: {long}"


@pytest.mark.parametrize("path", REFERENCE_FILES, ids=lambda p: p.name)
def test_reference_has_no_speed_machinery(path):
    text = path.read_text(encoding="utf-8")
    found = [word for word in FORBIDDEN if word in text]
    assert not found, f"{path.name} should be plain math; found {found} (move to backends/)"


def test_math_md_has_no_control_characters():
    """LaTeX written through a Python string without ``r""`` loses ``\\t``, ``\\b``, ``\\f``
    (``\\text``, ``\\bar``, ``\\frac`` become a tab, a backspace, a form feed)."""
    text = MATH.read_text(encoding="utf-8")
    bad = [(n, line[:40]) for n, line in enumerate(text.splitlines(), 1)
           if re.search(r"[\x00-\x08\x0b-\x1f]|\t", line)]
    assert not bad, bad
