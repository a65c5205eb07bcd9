"""Which backends replace an op of the reference, read from the backends' sources.

A backend (:data:`minillama.backends.BACKENDS`) is a class whose attributes are the ops; each
replaces only some of the reference's and inherits the rest. :class:`BackendClasses` parses the
backend modules with :mod:`ast` (nothing is imported: reading the cupy backend needs no CuPy and
the numba kernels are never compiled), follows each class's bases through the modules' imports,
orders them as Python does (C3), and answers, per backend and op, which ``file:function`` runs
and which registered backend's own classes define it (``numba`` inherits some of ``numpy``'s).
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

from minillama.backends import BACKENDS

#: (module, class name)
ClassKey = tuple[str, str]
REFERENCE = "reference"


@dataclass(frozen=True)
class Impl:
    """The code a backend runs for one op attribute."""

    backend: str
    attr: str
    #: ``path.py:qualname`` as docs/MATH.md writes paths (``backends/numpy/backend.py:...``)
    where: str
    #: the registered backend whose own classes define it
    owner: str

    @property
    def is_reference(self) -> bool:
        """Whether this is the reference code itself (the ``reference`` backend's class, or a
        function of ``minillama/core``)."""
        return self.owner == REFERENCE or self.where.startswith("minillama/core/")


@dataclass
class _Module:
    name: str
    path: str
    tree: ast.Module
    #: local name -> (module, attribute or None for a module)
    imports: dict[str, tuple[str, str | None]]


class BackendClasses:
    """The registered backends' classes, read from ``backends_dir`` and ``package_dir`` (the
    folders of ``minillama.backends`` and ``minillama``)."""

    def __init__(self, package_dir: Path, backends_dir: Path,
                 registry: dict[str, str] | None = None) -> None:
        self.package_dir, self.backends_dir = package_dir, backends_dir
        specs = registry if registry is not None else BACKENDS
        self.registry: dict[str, ClassKey] = {
            name: tuple(spec.split(":")) for name, spec in specs.items()}  # type: ignore[misc]
        self._modules: dict[str, _Module | None] = {}
        self._mro: dict[ClassKey, tuple[ClassKey, ...]] = {}
        self._members: dict[ClassKey, dict[str, str]] = {}

    # -- modules -------------------------------------------------------------------------------
    def _file(self, module: str) -> tuple[Path, str] | None:
        """The source file of a project module and its path as docs/MATH.md writes it."""
        parts = module.split(".")
        if parts[:2] == ["minillama", "backends"]:
            root, rel = self.backends_dir, parts[2:]
            shown = "backends"
        elif parts[0] == "minillama":
            root, rel, shown = self.package_dir, parts[1:], "minillama"
        else:
            return None
        for file, tail in ((root.joinpath(*rel).with_suffix(".py") if rel else None, rel),
                           (root.joinpath(*rel, "__init__.py"), [*rel, "__init__"])):
            if file is not None and file.is_file():
                return file, "/".join([shown, *tail]) + ".py"
        return None

    def module(self, name: str) -> _Module | None:
        if name not in self._modules:
            found = self._file(name)
            self._modules[name] = None if found is None else self._read(name, *found)
        return self._modules[name]

    @staticmethod
    def _read(name: str, file: Path, path: str) -> _Module:
        tree = ast.parse(file.read_text(encoding="utf-8"))
        package = name if file.name == "__init__.py" else name.rpartition(".")[0]
        imports: dict[str, tuple[str, str | None]] = {}
        for node in tree.body:
            if isinstance(node, ast.Import):
                for a in node.names:
                    imports[a.asname or a.name.split(".")[0]] = (
                        a.name if a.asname else a.name.split(".")[0], None)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                for a in node.names:
                    imports[a.asname or a.name] = (base, a.name)
        return _Module(name, path, tree, imports)

    def _top(self, module: str, name: str) -> ast.stmt | None:
        mod = self.module(module)
        if mod is None:
            return None
        for node in mod.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if node.name == name:
                    return node
            elif isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return node
        return None

    def resolve(self, module: str, name: str, depth: int = 0) -> tuple[str, str | None] | None:
        """Where ``name`` read in ``module`` is defined: (module, name), or (module, None) when
        it is a module itself; None outside the project or past 8 re-exports."""
        if depth > 8 or self.module(module) is None:
            return None
        if self._top(module, name) is not None:
            return module, name
        target = self.module(module).imports.get(name)
        if target is None:
            return None
        base, attr = target
        if attr is None:
            return (base, None) if self.module(base) else None
        if self.module(f"{base}.{attr}") is not None:
            return f"{base}.{attr}", None
        return self.resolve(base, attr, depth + 1)

    def _expr(self, module: str, node: ast.expr) -> tuple[str, str | None] | None:
        if isinstance(node, ast.Name):
            return self.resolve(module, node.id)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            owner = self.resolve(module, node.value.id)
            if owner and owner[1] is None:
                return self.resolve(owner[0], node.attr)
        return None

    # -- classes -------------------------------------------------------------------------------
    def _class(self, key: ClassKey) -> ast.ClassDef | None:
        node = self._top(*key)
        return node if isinstance(node, ast.ClassDef) else None

    def bases(self, key: ClassKey) -> list[ClassKey]:
        node = self._class(key)
        found = []
        for base in node.bases if node else []:
            target = self._expr(key[0], base)
            if target and target[1] and self._class(target):  # type: ignore[arg-type]
                found.append(target)
        return found  # type: ignore[return-value]

    def mro(self, key: ClassKey) -> tuple[ClassKey, ...]:
        """The class and its project bases in Python's method resolution order (C3)."""
        if key not in self._mro:
            self._mro[key] = self._c3(key)
        return self._mro[key]

    def _c3(self, key: ClassKey) -> tuple[ClassKey, ...]:
        seqs = [list(self.mro(b)) for b in self.bases(key)] + [self.bases(key)]
        out = [key]
        while any(seqs):
            seqs = [s for s in seqs if s]
            head = next((s[0] for s in seqs if not any(s[0] in t[1:] for t in seqs)), None)
            if head is None:  # no consistent order: Python refuses such a class too
                break
            out.append(head)
            seqs = [s[1:] if s[0] == head else s for s in seqs]
        return tuple(out)

    def members(self, key: ClassKey) -> dict[str, str]:
        """Attribute -> ``path.py:qualname`` of what the class body itself defines: a method,
        or an assignment (``staticmethod(f)`` or ``f``) resolved to the function it names."""
        if key not in self._members:
            self._members[key] = self._body(key)
        return self._members[key]

    def _body(self, key: ClassKey) -> dict[str, str]:
        node, mod = self._class(key), self.module(key[0])
        found: dict[str, str] = {}
        for stmt in node.body if node else []:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found[stmt.name] = f"{mod.path}:{key[1]}.{stmt.name}"
            elif isinstance(stmt, ast.Assign):
                value = stmt.value
                if (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
                        and value.func.id in ("staticmethod", "classmethod") and value.args):
                    value = value.args[0]
                target = self._expr(key[0], value)
                for t in stmt.targets:
                    if isinstance(t, ast.Name):
                        found[t.id] = (f"{self.module(target[0]).path}:{target[1]}"
                                       if target and target[1] else f"{mod.path}:{key[1]}.{t.id}")
        return found

    def owner(self, key: ClassKey) -> str:
        """The registered backend that brings ``key`` in: of those whose class order holds it,
        the one with the shortest order (``LoRAOps``: ``numpy``, not ``numba``)."""
        holding = [(len(self.mro(k)), name) for name, k in self.registry.items()
                   if key in self.mro(k)]
        return min(holding)[1] if holding else ""

    # -- answers -------------------------------------------------------------------------------
    def attributes(self) -> set[str]:
        """Every attribute some registered backend's classes define."""
        return {a for k in self.registry.values() for c in self.mro(k) for a in self.members(c)}

    def implementation(self, backend: str, attr: str) -> Impl | None:
        """What ``backend`` runs for ``attr``: the first class of its order that defines it."""
        for key in self.mro(self.registry[backend]):
            where = self.members(key).get(attr)
            if where is not None:
                return Impl(backend, attr, where, self.owner(key))
        return None

    def overrides(self, attrs: list[str]) -> list[Impl]:
        """For every backend and each of ``attrs``, the implementation that is not the
        reference's."""
        found = []
        for backend in self.registry:
            for attr in attrs:
                impl = self.implementation(backend, attr)
                if impl is not None and not impl.is_reference:
                    found.append(impl)
        return found


@functools.cache
def backend_classes(package_dir: Path, backends_dir: Path) -> BackendClasses:
    """The (cached) :class:`BackendClasses` of the registered backends read from these
    folders."""
    return BackendClasses(package_dir, backends_dir)


def op_attributes(functions: list[str], classes: BackendClasses) -> list[str]:
    """The backend attributes that stand for ``functions``: the same name, and for a
    ``*_forward``/``*_backward`` its variants (``attention_forward_packed``,
    ``linear_backward_input``)."""
    attrs = classes.attributes()
    found = []
    for f in functions:
        found += [f] if f in attrs else []
        if f.endswith(("_forward", "_backward")):
            found += sorted(a for a in attrs if a.startswith(f + "_"))
    return list(dict.fromkeys(found))
