"""The layout stays easy to find one's way in (CONTRIBUTING.md, "Layout"): every module of
``minillama/`` and ``backends/`` under :data:`MAX_MODULE_LINES` lines, every class under
:data:`MAX_CLASS_LINES`, every function under :data:`MAX_FUNCTION_LINES` but for the compiled
numeric kernels named in :data:`LONG_FUNCTIONS`, and no circle among the modules' top-level imports.

Everything is read with ``ast`` (nothing is imported, so the CuPy and Numba files are checked on
any machine). A limit that cannot be met somewhere is an entry with its reason in the tables
below, never a looser limit for all.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_MODULE_LINES = 700
MAX_CLASS_LINES = 200
MAX_FUNCTION_LINES = 60

#: "path:function" -> why it may be longer than MAX_FUNCTION_LINES. Only numeric kernels compiled
#: by Numba, where a call out of the loop nest costs speed (the project guide's exception).
LONG_FUNCTIONS = {
    "backends/numba/decode/float_step.py:decode_step":
        "the fused decode step of several sequences, one compiled loop nest over layers and rows",
    "backends/numba/decode/float_step.py:decode_step_one": "the fused decode step of one sequence",
    "backends/numba/decode/quant_step.py:decode_step_one_q_kernel":
        "the fused decode step on GGML blocks",
    "backends/numba/decode/quant_step.py:decode_step_rows_q_kernel":
        "the fused decode step of several sequences on GGML blocks",
    "backends/numba/quant/matmul.py:_dequant_row_loops": "one loop per GGML block type, unrolled",
    "backends/numba/floats/attention_backward.py:_attn_bwd_item":
        "the attention backward of one (sequence, KV head) work item",
}
#: "path" -> why that module may be longer than MAX_MODULE_LINES
LONG_MODULES: dict[str, str] = {
    "minillama/model/transformer.py": "the whole model in one module, read top to bottom as "
                                      "docs/MATH.md part I: parameters, the saved states, "
                                      "the forward in the math's order, its mirrored backward, "
                                      "then the notes' variants",
}
#: "path:Class" -> why that class may be longer than MAX_CLASS_LINES
LONG_CLASSES: dict[str, str] = {
    "minillama/model/transformer.py:Transformer": "the forward and the backward side by side "
                                                  "as one reading (llm.c's gpt2_forward and "
                                                  "gpt2_backward); split across mixins they "
                                                  "had to be read across five files",
}


def source_files() -> list[Path]:
    files = sorted((ROOT / "minillama").rglob("*.py")) + sorted((ROOT / "backends").rglob("*.py"))
    assert len(files) > 50, files  # the walk still finds the package
    return files


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def module_name(path: Path) -> str:
    """The import name of a source file (``backends/`` installs as ``minillama.backends``)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "backends":
        parts.insert(0, "minillama")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def top_level_imports(tree: ast.Module) -> list[ast.stmt]:
    """The import statements run when the module is imported: those of the module body and of
    the ``if`` / ``try`` blocks at its top level (not those inside functions)."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If):
            if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody
            for h in node.handlers:
                todo += h.body
    return found


def all_imports(tree: ast.Module) -> list[ast.stmt]:
    """Every import statement of the module, those inside functions included (but not those of
    ``if TYPE_CHECKING:`` blocks, which never run)."""
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
            and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
            for child in node.body for n in ast.walk(child)}
    return [n for n in ast.walk(tree)
            if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skip]


def import_graph(local: bool = False) -> dict[str, set[str]]:
    """Module -> the project modules its top-level imports load (with ``local``: its imports
    inside functions too)."""
    return {name: set(targets) for name, targets in import_edges(local).items()}


def import_edges(local: bool = False) -> dict[str, dict[str, ast.stmt]]:
    """Module -> {imported project module: the import statement}."""
    files = {module_name(p): p for p in source_files()}
    graph: dict[str, dict[str, ast.stmt]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: dict[str, ast.stmt] = {}
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in (all_imports(tree) if local else top_level_imports(tree)):
            if isinstance(node, ast.Import):
                edges |= {a.name: node for a in node.names if a.name in files}
                continue
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            subs = {f"{base}.{a.name}" for a in node.names} & set(files)
            edges |= dict.fromkeys(subs, node)
            if base in files and len(subs) < len(node.names):  # names read from base itself
                edges[base] = node
        edges.pop(name, None)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def definitions(kind):
    """(key, lines) of every ``kind`` node (class or function) of every source file."""
    for path in source_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, kind):
                yield f"{rel(path)}:{node.name}", node.end_lineno - node.lineno + 1


def test_modules_are_short():
    long = {rel(p): n for p in source_files()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
            and rel(p) not in LONG_MODULES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by concern): {long}"


def test_classes_are_short():
    long = {k: n for k, n in definitions(ast.ClassDef)
            if n > MAX_CLASS_LINES and k not in LONG_CLASSES}
    assert not long, f"classes over {MAX_CLASS_LINES} lines (move a concern to a mixin): {long}"


def test_functions_are_short():
    long = {k: n for k, n in definitions((ast.FunctionDef, ast.AsyncFunctionDef))
            if n > MAX_FUNCTION_LINES and k not in LONG_FUNCTIONS}
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split into named steps): {long}"


@pytest.mark.parametrize("table", [LONG_FUNCTIONS, LONG_MODULES, LONG_CLASSES],
                         ids=["functions", "modules", "classes"])
def test_exceptions_are_still_needed(table):
    """An entry whose file or definition shrank below the limit (or went away) is dropped."""
    sizes = dict(definitions((ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))
    sizes |= {rel(p): len(p.read_text(encoding="utf-8").splitlines()) for p in source_files()}
    limit = {id(LONG_FUNCTIONS): MAX_FUNCTION_LINES, id(LONG_MODULES): MAX_MODULE_LINES,
             id(LONG_CLASSES): MAX_CLASS_LINES}[id(table)]
    stale = [k for k in table if sizes.get(k, 0) <= limit]
    assert not stale, f"no longer over the limit, remove from the table: {stale}"


def test_no_import_circle():
    graph = import_graph()
    assert "minillama.backends.numba.backend" in graph  # backends/ resolved as minillama.backends
    # relative imports resolved
    assert "minillama.model.kvcache" in graph["minillama.model.transformer"]
    found = cycles(graph)
    assert not found, f"modules that import each other at import time: {found}"


def test_cycle_finder_finds_a_circle():
    """The checker itself: a circle through three modules is found, a chain is not."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
