"""``minillama explain``: every op that docs/MATH.md maps has a name, and each name prints its
equations, its reference source, the backends that replace it and the tests that hold it, read
from the same files tests/mathmap/test_math_map.py checks. Both ways the package runs are covered: a
checkout (docs/MATH.md and tests/ beside the package) and an installed wheel (no docs, no tests:
the equations come from the reference docstrings).

What the backends replace is read from their sources without importing them; here it is held to
Python's own answer (the imported classes' attributes), for every backend and op.
"""

from __future__ import annotations

import ast
import inspect
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from minillama import mathmap
from minillama.backends import BACKENDS
from minillama.cli import main as cli
from minillama.cli.explain import explain
from minillama.mathmap.mathtext import latex_to_text, to_text
from minillama.mathmap.overrides import BackendClasses
from tests.mathmap.test_math_map import MATH, ROOT, reference_file, reference_ops

CHECKOUT = mathmap.Sources.installed()
#: the package as a wheel installs it: no docs/MATH.md, no tests/
WHEEL = mathmap.Sources(CHECKOUT.package, CHECKOUT.backends)
NAMES = [e.name for e in mathmap.ENTRIES]


def heading_citations() -> list[tuple[str, str]]:
    """Every (path, name) that a heading of docs/MATH.md cites."""
    return [c for line in MATH.read_text(encoding="utf-8").splitlines()
            if line.startswith("#") for c in mathmap.citations(line)]


def reference_functions_in_headings() -> list[tuple[str, str]]:
    """The functions of the reference (``minillama/core/``) that MATH.md's headings cite."""
    found = []
    for path, name in heading_citations():
        if path.startswith("minillama/core/"):
            tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
            if any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body):
                found.append((path, name))
    return list(dict.fromkeys(found))


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(["explain", *argv])
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------------------------------------
# the names cover the map
# ---------------------------------------------------------------------------------------------
def test_sources_of_a_checkout_are_found():
    assert CHECKOUT.math == MATH and CHECKOUT.tests == ROOT / "tests"
    assert (CHECKOUT.backends / "numpy" / "backend.py").is_file()


def test_every_reference_function_of_the_map_has_a_name():
    funcs = reference_functions_in_headings()
    assert len(funcs) >= 40, funcs  # the heading parser still understands the file
    assert ("minillama/core/rope_scaling.py", "rope_tables") in funcs
    missing = [f"{p}:{n}" for p, n in funcs
               if f"{p}:{n}" not in mathmap.lookup(n).code]
    assert not missing, f"`minillama explain` has no name for: {missing} (add to ENTRIES)"


def test_every_reference_op_pair_has_a_name():
    missing = [op for op in reference_ops()
               if f"{reference_file(op)}:{op}" not in mathmap.lookup(op).code]
    assert not missing, missing


def test_entries_name_existing_code():
    missing = [c for e in mathmap.ENTRIES for c in (*e.code, *e.related)
               if mathmap.definition(CHECKOUT, c) is None]
    assert not missing, missing


def test_names_are_unique():
    seen: dict[str, str] = {}
    clashes = []
    for e in mathmap.ENTRIES:
        for key in e.keys():
            if seen.setdefault(key, e.name) != e.name:
                clashes.append(f"{key}: {seen[key]} and {e.name}")
    assert not clashes, clashes


@pytest.mark.parametrize("asked,name", [("RMSNorm", "rmsnorm"), ("attn", "attention"),
                                        ("Q4_K", "q4_k"), ("cross-entropy", "cross_entropy"),
                                        ("rope_tables", "rope"), ("KV cache", "kv_cache")])
def test_names_are_case_insensitive_with_aliases(asked, name):
    assert mathmap.lookup(asked).name == name


def test_listing_names_every_entry(capsys):
    code, out, err = _run(capsys)
    assert code == 0 and err == ""
    listed = {line.split()[0] for line in out.splitlines() if line.startswith("  ")
              and not line.startswith("   ")}
    assert listed == set(NAMES)


def test_unknown_name_is_one_line_and_status_2(capsys):
    code, out, err = _run(capsys, "rmsnrom")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("minillama: error: ")
    assert "'rmsnrom'" in err and "(known: " in err and "rmsnorm" in err


# ---------------------------------------------------------------------------------------------
# what each name prints
# ---------------------------------------------------------------------------------------------
def _backend_classes() -> dict[str, type]:
    classes = {}
    for name, spec in BACKENDS.items():
        module, cls = spec.split(":")
        classes[name] = getattr(__import__(module, fromlist=[cls]), cls)  # no CuPy needed
    return classes


def _real_where(cls: type, attr: str) -> str | None:
    """``path:qualname`` of what Python runs for ``cls.attr`` (None: not a plain function)."""
    for klass in cls.__mro__:
        if attr in vars(klass):
            value = vars(klass)[attr]
            fn = inspect.unwrap(getattr(value, "__func__", value))  # a decorated method: its own
            # source (e.g. a context manager's generator)
            if not inspect.isfunction(fn):
                return None
            path = Path(fn.__code__.co_filename).resolve().relative_to(ROOT).as_posix()
            return f"{path}:{fn.__qualname__}"
    return None


def test_backend_implementations_match_python():
    """The sources read without importing name the function Python itself runs, for every op
    attribute of every registered backend."""
    classes, read = _backend_classes(), BackendClasses(CHECKOUT.package, CHECKOUT.backends)
    attrs = read.attributes()
    assert {"rmsnorm_forward", "attention_forward_packed", "lora_backward"} <= attrs
    wrong, checked = [], 0
    for backend, cls in classes.items():
        for attr in sorted(attrs):
            real = _real_where(cls, attr)
            if real is None:
                continue
            impl = read.implementation(backend, attr)
            checked += 1
            if impl is None or impl.where != real:
                wrong.append(f"{backend}.{attr}: read {impl and impl.where}, Python runs {real}")
    assert checked > 100 and not wrong, wrong


@pytest.mark.parametrize("name", NAMES)
def test_checkout_output_has_math_code_backends_tests(name):
    entry = mathmap.lookup(name)
    out = explain(name, CHECKOUT)
    assert out.startswith(f"{entry.name}: {entry.title}")
    assert "Equations (docs/MATH.md)" in out
    cited = {(p, n) for p, n in heading_citations()}
    math = MATH.read_text(encoding="utf-8")
    for cite in entry.code:
        assert f"# {cite}\n" in out
        kind = "class" if cite.rpartition(":")[2].rpartition(".")[2][0].isupper() else "def"
        assert f"{kind} {cite.rpartition('.')[2].rpartition(':')[2]}" in out
        path, fn = cite.split(":")
        if (path, fn) in cited:  # its section's display equations, as plain text
            heading = next(ln for ln in math.splitlines()
                           if ln.startswith("#") and (path, fn) in mathmap.citations(ln))
            section = mathmap.Section(heading, ())
            assert section.title in out
            body = math.split(heading, 1)[1].split("\n#", 1)[0]
            for line in body.splitlines():
                if line.startswith("$$"):
                    assert to_text(line).strip() in out, line
    assert "Backends that replace it" in out and "Tests that hold it" in out
    assert "no tests/ folder" not in out


@pytest.mark.parametrize("name", NAMES)
def test_every_replacing_backend_is_listed(name):
    """Where a backend's class runs something other than the reference for an op of the entry,
    the output names that backend and its function."""
    entry = mathmap.lookup(name)
    out = explain(name, CHECKOUT)
    classes = _backend_classes()
    ref = classes["reference"]
    expected = []
    for fn in entry.replaceable():
        for backend, cls in classes.items():
            if hasattr(ref, fn) and getattr(cls, fn) is not getattr(ref, fn):
                expected.append((backend, _real_where(cls, fn)))
    for backend, where in expected:
        assert any(line.split()[:2] == [backend, where] for line in out.splitlines()
                   if line.startswith("  ")), f"{name}: {backend} {where} not listed"
    if name in ("rmsnorm", "rope", "attention", "swiglu", "cross_entropy", "linear"):
        assert {b for b, _ in expected} == {"numpy", "numba", "cupy"}
    for cite in entry.related:
        assert cite in out


def test_rmsnorm_in_full():
    out = explain("rmsnorm", CHECKOUT)
    assert "r = 1/√((1/D)Σ_i x_i² + ε)" in out  # forward, as text
    assert "x̄ = r(x̂̄ - x̂" in out  # backward
    assert inspect.getsource(__import__("minillama.core.ops", fromlist=["x"]).rmsnorm_backward
                             ).strip() in out
    assert "  numba      backends/numba/backend_rows.py:RowOps.rmsnorm_forward" in out
    assert "tests/core/test_ops_grad.py: test_rmsnorm_grad" in out
    assert "test_rope_grad" not in out


def test_tests_found_by_call_table_and_dispatcher():
    uses = {(u.file, u.name) for u in mathmap.tests_for(mathmap.lookup("rmsnorm"), CHECKOUT)}
    assert ("tests/core/test_ops_grad.py", "test_rmsnorm_grad") in uses  # calls ops.rmsnorm_forward
    # parametrised over a table of op names (CASES), calls getattr(be, f"{op}_forward")
    assert ("tests/backends/numpy/test_backend.py", "test_numpy_op_matches_reference") in uses
    assert ("tests/core/test_ops_grad.py", "test_rope_grad") not in uses
    q4k = {(u.file, u.name) for u in mathmap.tests_for(mathmap.lookup("q4_k"), CHECKOUT)}
    # parametrised over every type, through the dispatcher dequantize()
    assert ("tests/core/test_quant.py", "test_bit_for_bit_equal_to_the_gguf_package") in q4k


# ---------------------------------------------------------------------------------------------
# as installed from a wheel: the docstrings, and no tests/
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_wheel_output_reads_the_docstrings(name):
    entry = mathmap.lookup(name)
    out = explain(name, WHEEL)
    assert "docs/MATH.md is not installed" in out and "Equations (docs/MATH.md)" not in out
    assert "no tests/ folder here" in out
    for cite in entry.code:
        doc = mathmap.docstring(WHEEL, cite)
        if doc:
            first = to_text(cli.plain_text(doc).strip()).splitlines()[0]
            assert f"{cite}\n    {first}" in out
        assert f"# {cite}\n" in out


def test_wheel_rmsnorm_has_forward_and_backward_equations():
    out = explain("rmsnorm", WHEEL)
    assert "y = x r ⊙ g, r = 1 / √(mean(x²) + ε)" in out
    assert "x̄ = r (x̂̄ - x̂  mean(x̂̄ ⊙ x̂))" in out


def test_runs_from_a_copy_laid_out_as_a_wheel(tmp_path):
    """The package copied as a wheel installs it (``backends/`` inside as
    ``minillama/backends``, no docs/, no tests/, no pyproject.toml), run in a fresh
    interpreter: the docstrings' equations, no tests/, and neither CuPy nor Numba imported."""
    skip = shutil.ignore_patterns("__pycache__", "*.safetensors", "*.tar.xz", "*.pyc")
    shutil.copytree(ROOT / "minillama", tmp_path / "minillama", ignore=skip)
    shutil.copytree(ROOT / "backends", tmp_path / "minillama" / "backends", ignore=skip)
    code = ("import sys, minillama\n"
            "assert minillama.__file__.startswith(sys.argv[1]), minillama.__file__\n"
            "from minillama.cli.main import main\n"
            "rc = main(['explain', 'rmsnorm'])\n"
            "print('IMPORTED', [m for m in ('cupy', 'numba') if m in sys.modules])\n"
            "raise SystemExit(rc)\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "docs/MATH.md is not installed" in r.stdout
    assert "r = 1 / √(mean(x²) + ε)" in r.stdout
    assert "no tests/ folder here" in r.stdout
    assert "backends/numba/backend_rows.py:RowOps.rmsnorm_forward" in r.stdout
    assert r.stdout.rstrip().endswith("IMPORTED []")


# ---------------------------------------------------------------------------------------------
# identities
# ---------------------------------------------------------------------------------------------
def test_identities_of_the_catalog_are_listed(monkeypatch):
    def ident(name, ops, statement="", topic=""):
        return types.SimpleNamespace(name=name, ops=ops, statement=statement, topic=topic)

    fake = types.ModuleType(mathmap.IDENTITIES_MODULE)
    fake.CATALOG = [ident(name="rmsnorm_scale", ops=("rmsnorm",), statement="RMSNorm(ax) = ..."),
                    ident(name="rope_relative", ops=("minillama.core.ops.rope_forward",)),
                    ident(name="q8_0_roundtrip", ops=()),
                    ident(name="whole_model", ops=("rmsnorm_forward", "linear_forward")),
                    ident(name="model_kv_cache_decode", ops=("rmsnorm_forward", "rope_forward"))]
    monkeypatch.setitem(sys.modules, mathmap.IDENTITIES_MODULE, fake)
    out = explain("rmsnorm", CHECKOUT)
    assert "  rmsnorm_scale: RMSNorm(ax) = ..." in out and "rope_relative" not in out
    assert "  through a whole model or more ops: whole_model, model_kv_cache_decode" in out
    assert "  model_kv_cache_decode" in explain("kv_cache", CHECKOUT).splitlines()  # its name
    assert "  rope_relative" in explain("rope", CHECKOUT).splitlines()
    assert "  q8_0_roundtrip" in explain("q8_0", CHECKOUT).splitlines()
    assert "none of the catalog's identities uses it" in explain("gelu", CHECKOUT)


def test_the_real_catalog_is_read():
    out = explain("rmsnorm", CHECKOUT)
    assert "rmsnorm_scale_invariance [norm]: " in out


# ---------------------------------------------------------------------------------------------
# LaTeX as text
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("latex,text", [
    (r"r = \frac{1}{\sqrt{\frac{1}{D}\sum_i x_i^2 + \epsilon}}", "r = 1/√((1/D)Σ_i x_i² + ε)"),
    (r"\bar{x} \odot \hat{x}", "x̄ ⊙ x̂"),
    (r"\bar{\hat{x}}", "x̂̄"),  # an accent on an accented letter
    (r"y = x W^\top", "y = x Wᵀ"),
    (r"\theta_i = \mathrm{base}^{-2i/hd}", "θ_i = base^(-2i/hd)"),
    (r"\begin{pmatrix} a & b \\ c & d \end{pmatrix}", "[a, b; c, d]"),
    (r"\cos\varphi_{m,i}", "cos φ_{m,i}"),
    (r"\left(u - v\right)", "(u - v)"),
    (r"$h_{b,t} = E_{x_{b,t}}$", "h_{b,t} = E_{x_{b,t}}"),
    (r"\mathbb{R}^{V \times D}", "ℝ^(V × D)"),
    ("\x08ar{x}", "arx"),  # a control character never reaches the terminal
])
def test_latex_to_text(latex, text):
    assert latex_to_text(latex) == text


def test_latex_flag_prints_the_math_as_written(capsys):
    code, out, _ = _run(capsys, "rmsnorm", "--latex")
    assert code == 0 and r"\frac{1}{\sqrt{\frac{1}{D}\sum_i x_i^2 + \epsilon}}" in out


def test_code_spans_print_as_written():
    assert to_text("as `clip_grad_norm_` step by $\\bar{w}_i$") == "as clip_grad_norm_ step by w̄_i"
    assert to_text("``x_{b}`` and $x_{b}$") == "x_{b} and x_b"


def test_adamw_in_full():
    """The optimizer the trainer runs has its equations, its code and its fused backends."""
    out = explain("adamw", CHECKOUT)
    assert mathmap.lookup("optimizer").name == mathmap.lookup("lr_at").name == "adamw"
    assert "m_w ← β_1 m_w + (1 - β_1) w̄" in out  # the moment, as text
    assert "w ← w - ((η_{it})/(1 - β_1^it))" in out  # the bias-corrected update
    assert "# minillama/train/optim.py:lr_at\ndef lr_at(" in out
    assert "  numba      backends/numba/backend.py:NumbaBackend.adamw_update" in out
    assert "tests/train/test_optim.py: " in out and "test_adamw_matches_hand_computed_steps" in out


@pytest.mark.parametrize("name", ["q4_0", "attention", "rope", "linear"])
def test_math_and_reference_code_come_before_the_backends_notes(name):
    """The equations and the reference code are printed first; what the backends do for speed
    (docs/KERNELS.md) only after them, never inside the equations."""
    out = explain(name, CHECKOUT)
    eq, code = out.index("Equations (docs/MATH.md)"), out.index("Reference code")
    notes = out.find("How the backends compute it (docs/KERNELS.md)")
    assert eq < code < out.index("Backends that replace it")
    assert notes == -1 or code < notes
    for word in ("vpdpbusd", "3xTF32", "single-threaded BLAS", "CUDA graph"):
        assert word not in out[eq:code], word
    if name in ("q4_0", "attention"):
        assert notes > 0
