"""docs/MATH.md is the math-to-code map, and minillama/core/ops.py (with the notes' other pieces in
minillama/core/notes_ops.py) the reference it points at: both are checked here so that neither
drifts.

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
import math
import re
from pathlib import Path

import numpy as np
import pytest

from minillama.core import notes_ops, ops
from minillama.mathmap import citations, sections

ROOT = Path(__file__).resolve().parents[2]
MATH = ROOT / "docs" / "MATH.md"
#: the backends' notes, which MATH.md links
KERNELS = ROOT / "docs" / "KERNELS.md"
OPS = ROOT / "minillama" / "core" / "ops.py"
NOTES_OPS = ROOT / "minillama" / "core" / "notes_ops.py"
#: the reference: ops.py, the notes' ops beside it and the RoPE table builders ops.py re-exports
#: (held to the same plainness)
REFERENCE_FILES = (OPS, NOTES_OPS, ROOT / "minillama" / "core" / "rope_scaling.py")
#: the modules of the reference ops: LLaMA's, and the notes' other pieces
REFERENCE_MODULES = (ops, notes_ops)

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
    """The public forward/backward functions of minillama.core.ops and minillama.core.notes_ops,
    by name."""
    return [name for module in REFERENCE_MODULES
            for name, fn in inspect.getmembers(module, inspect.isfunction)
            if fn.__module__ == module.__name__ and not name.startswith("_")
            and name.endswith(("_forward", "_backward"))]


def reference_module(name: str):
    """The module of :data:`REFERENCE_MODULES` that defines the function ``name``."""
    return next(m for m in REFERENCE_MODULES
                if getattr(getattr(m, name, None), "__module__", None) == m.__name__)


def reference_file(name: str) -> str:
    """The file of the reference function ``name`` as MATH.md cites it
    (``minillama/core/ops.py``)."""
    return reference_module(name).__name__.replace(".", "/") + ".py"


def test_math_md_cites_something():
    cites = math_citations()
    assert len(cites) >= 20, cites  # the parser still understands the file's citation style
    assert ("minillama/core/ops.py", "attention_forward") in cites


@pytest.mark.parametrize("doc", [MATH, KERNELS], ids=lambda p: p.name)
def test_every_citation_exists(doc):
    missing = []
    cache: dict[str, set[str]] = {}
    for path, name in citations(doc.read_text(encoding="utf-8")):
        file = ROOT / path
        if not file.is_file():
            missing.append(f"{path} (no such file)")
            continue
        if path not in cache:
            cache[path] = defined_names(file)
        if name not in cache[path]:
            missing.append(f"{path}:{name}")
    assert not missing, f"docs/{doc.name} cites what does not exist: {missing}"


def test_reference_ops_found():
    names = reference_ops()
    for op in ("embedding", "linear", "rmsnorm", "rope", "attention", "swiglu", "cross_entropy"):
        assert f"{op}_forward" in names and f"{op}_backward" in names


@pytest.mark.parametrize("name", reference_ops())
def test_reference_docstring_has_equation_and_shapes(name):
    doc = inspect.getdoc(getattr(reference_module(name), name)) or ""
    assert "=" in doc and LATEX.search(doc), f"ops.{name}: no equation (LaTeX) in the docstring"
    assert SHAPE.search(doc), f"ops.{name}: no shapes such as (B, T, D) in the docstring"


def test_math_md_lists_every_reference_op():
    cited = set(math_citations())
    missing = [name for name in reference_ops() if (reference_file(name), name) not in cited]
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
    (``\\text``, ``\\bar``, ``\\frac`` become a tab, a backspace, a form feed). Lines are cut at
    newlines only: ``str.splitlines`` would also cut at the form feed it is looking for."""
    text = MATH.read_text(encoding="utf-8")
    bad = [(n, line[:40]) for n, line in enumerate(text.split("\n"), 1)
           if re.search(r"[\x00-\x08\x0b-\x1f]|\t", line)]
    assert not bad, bad


# ---------------------------------------------------------------------------------------------
# what the text says about the code, held against the code
# ---------------------------------------------------------------------------------------------
U64 = float(np.finfo(np.float64).eps) / 2  # unit roundoff of float64


def math_section(number: str) -> str:
    """The text of MATH.md's section ``number`` ("4", "9b", "19.1"), heading included."""
    for sec in sections(MATH):
        if re.match(rf"#+ {re.escape(number)}[. ]", sec.heading):
            return sec.text()
    raise AssertionError(f"docs/MATH.md has no section {number}")


def test_rope_backward_is_the_transpose_not_the_inverse_with_yarn():
    """With YaRN the tables carry the attention factor a (> 1), so RoPE is a R and its gradient
    a R^T: the adjoint identity <f(x), dy> = <x, f'(dy)> holds, and f'(f(x)) = a^2 x, not x."""
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    hd, T = 16, 12
    cos, sin = ops.rope_tables(hd, T, dtype=np.float64, scaling=scaling)
    a = ops.rope_frequencies(hd, scaling=scaling)[1]
    assert a == pytest.approx(0.1 * np.log(4.0) + 1) and a > 1.1
    rng = np.random.default_rng(0)
    x, dy = rng.standard_normal((2, 2, T, 3, hd))
    y, ctx = ops.rope_forward(x, cos, sin)
    dx = ops.rope_backward(dy, ctx)
    n = x.size  # terms of each inner product; each term a few roundings deep
    bound = (n + 8) * U64 * (np.sum(np.abs(y * dy)) + np.sum(np.abs(x * dx)))
    assert abs(np.sum(y * dy) - np.sum(x * dx)) <= bound
    back = ops.rope_backward(y, ctx)  # a^2 x: the transpose, not the inverse rotation
    pair = np.abs(x[..., 0::2]) + np.abs(x[..., 1::2])  # each entry mixes its pair's two
    tol = np.repeat(8 * U64 * a * a * pair, 2, axis=-1)  # values: a few roundings of each
    assert np.all(np.abs(back - a * a * x) <= tol)
    assert np.max(np.abs(back - x)) > 0.1 * np.max(np.abs(x))
    text = math_section("4")
    assert r"\bar{x} = \mathrm{mscale}\,\bar{y} R" in text
    assert r"inverse rotation only when $\mathrm{mscale} = 1$" in text
    assert "transpose" in inspect.getdoc(ops.rope_backward)


def test_hf_rope_permutation_is_the_one_section_4_describes():
    """Section 4 states the HF row order (row c hd/2 + i of HF = row 2i + c of the interleaved
    matrix) and cites the function; that function does exactly this, head by head."""
    from minillama.io import hf

    text = math_section("4")
    assert "`minillama/io/hf.py:hf_to_interleaved`" in text
    H, hd, D = 3, 8, 2
    w_hf = np.arange(H * hd * D, dtype=np.float64).reshape(H * hd, D)
    got = hf.hf_to_interleaved(w_hf, H)
    for h in range(H):
        for c in (0, 1):
            for i in range(hd // 2):
                assert np.array_equal(got[h * hd + 2 * i + c], w_hf[h * hd + c * hd // 2 + i])
    assert np.array_equal(hf.interleaved_to_hf(got, H), w_hf)


SECTION_REF = re.compile(r"(?:sections?|§)\s*(\d+(?:\.\d+)?[a-z]?)(?:\s*(?:-|and)\s*(\d+))?")


def _section_numbers(text: str) -> set[str]:
    return {m.group(1) for m in re.finditer(r"^#+ (\d+(?:\.\d+)?[a-z]?)[. ]", text, re.M)}


def _references(text: str) -> set[str]:
    return {n for m in SECTION_REF.finditer(text) for n in m.groups() if n}


def test_section_references_name_existing_sections():
    """Every "section N" / "sections N-M" / "§N" of MATH.md and KERNELS.md names a section that
    exists: of the same page, of KERNELS.md after a link to it, of MATH.md after its name."""
    math, kernels = MATH.read_text(encoding="utf-8"), KERNELS.read_text(encoding="utf-8")
    to_kernels = r"\[KERNELS\.md\]\(KERNELS\.md\),?\s*" + SECTION_REF.pattern
    to_math = r"MATH\.md(?:'s)?\s*" + SECTION_REF.pattern
    wrong = []
    for text, own, other, link in ((math, math, kernels, to_kernels),
                                   (kernels, kernels, math, to_math)):
        linked = "".join(m.group(0) for m in re.finditer(link, text))
        wrong += sorted(_references(linked) - _section_numbers(other))
        wrong += sorted(_references(re.sub(link, "", text)) - _section_numbers(own))
    assert _references(math) and not wrong, f"no such sections: {wrong}"


def test_q4_1_and_q5_1_add_their_min_in_the_text_as_in_the_code():
    """Q4_1 and Q5_1 store d and m and decode x = d q + m (llama.cpp's sign): a block built by
    hand decodes so, and every equation the docs give for them has + m."""
    from minillama.core import quant

    d, m = np.float16(0.5), np.float16(-3.0)
    q = np.arange(32) % 16
    block = np.concatenate([np.frombuffer(np.array([d, m], "<f2").tobytes(), np.uint8),
                            (q[:16] | q[16:] << 4).astype(np.uint8)])[None]
    assert np.array_equal(quant.dequantize_q4_1(block)[0], np.float32(d) * q + np.float32(m))
    docs = [MATH.read_text(encoding="utf-8")]
    kernels = ROOT / "docs" / "KERNELS.md"
    docs += [kernels.read_text(encoding="utf-8")] if kernels.is_file() else []
    signs = []
    for text in docs:
        for row in re.findall(r"^\| Q[45]_1 \|.*$", text, re.M):
            signs += re.findall(r"d\\,c_j ([+-]) \\mathit\{min\}", row)
        for sign, types in re.findall(r"\$w = d\\,c ([+-]) \\mathit\{min\}\$ \(([^)]*)", text):
            signs += [sign] if re.search(r"Q[45]_1", types) else []
    assert len(signs) >= 3 and set(signs) == {"+"}, signs


def test_ffn_hidden_formula_as_written_is_the_code():
    """F = multiple_of ceil(floor(m floor(8D/3)) / multiple_of): the formula of section 7,
    transcribed, equals llama_hidden_dim; the inner floor matters (D = 48, m = 1.004: 128, not
    the 160 of rounding m floor(8D/3) up directly)."""
    from minillama.core.config import llama_hidden_dim

    assert (r"\lceil \lfloor \mathit{mult} \lfloor 8D/3 \rfloor \rfloor"
            r" / \mathit{multiple\_of} \rceil" in math_section("7"))

    def as_written(D, mult, m):
        return mult * math.ceil(math.floor(m * math.floor(8 * D / 3)) / mult)

    for D in (48, 64, 96, 288, 576, 768, 4096):
        for mult in (32, 64, 256):
            for m in (None, 1.004, 1.3, 0.75):
                assert llama_hidden_dim(D, mult, m) == as_written(D, mult, m or 1.0), (D, mult, m)
    assert llama_hidden_dim(48, 32, 1.004) == 128
    assert 32 * math.ceil(1.004 * math.floor(8 * 48 / 3) / 32) == 160


def test_files_named_in_the_package_exist():
    """A ``path.py`` or ``dir/file.py`` named in the package's sources (docstrings and
    comments) is a file of the repository: under the repository, ``minillama/`` or
    ``backends/`` for a path, anywhere for a bare name."""
    files = [*(ROOT / "minillama").rglob("*.py"), *(ROOT / "backends").rglob("*.py")]
    names = {p.name for p in ROOT.rglob("*.py") if ".venv" not in p.parts}
    missing = []
    for file in files:
        for named in re.findall(r"``([\w./-]+\.py)``", file.read_text(encoding="utf-8")):
            if "/" in named:
                ok = any((base / named).is_file()
                         for base in (ROOT, ROOT / "minillama", ROOT / "backends", file.parent))
            else:
                ok = named in names
            if not ok:
                missing.append(f"{file.relative_to(ROOT)}: {named}")
    assert not missing, missing


def test_kept_rows_are_one_symbol_in_the_docs_and_the_docstrings():
    r"""Cross-entropy's kept rows are \mathcal{K} in MATH.md and in the ops' docstrings alike."""
    used = set(re.findall(r"\\mathcal\{(\w)\}", math_section("9")))
    for name in ("cross_entropy_forward", "cross_entropy_backward",
                 "linear_cross_entropy_forward"):
        used |= set(re.findall(r"\\mathcal\{(\w)\}", inspect.getdoc(getattr(ops, name))))
    assert used == {"K", "L"}, used  # \mathcal{L} the loss, \mathcal{K} the kept rows


def test_sinusoidal_embedding_is_scaled_as_the_docstrings_say():
    """h_0 = sqrt(D) E[x] + P, in the model and in every docstring that writes it."""
    from minillama.core.config import ModelConfig
    from minillama.model.transformer import Transformer

    cfg = ModelConfig(dim=16, n_layers=1, n_heads=2, vocab_size=11, max_seq_len=8,
                      pos_encoding="sinusoidal")
    model = Transformer(cfg, backend="reference", dtype=np.float64)
    tok = np.array([[3, 1, 4, 1, 5]])
    h, _ = model._embed(tok)
    E = model.params["tok_embeddings.weight"]
    want = np.sqrt(16) * E[tok] + notes_ops.sinusoidal_positions(8, 16, dtype=np.float64)[:5]
    assert np.allclose(h, want, rtol=4 * U64, atol=0)
    for doc in (inspect.getdoc(notes_ops.sinusoidal_positions),
                inspect.getdoc(Transformer._embed)):
        assert re.search(r"h_0 = \\sqrt\{D\}\\?,? ?E_\{\\mathrm\{tok\}\} \+ E\^\{pos\}", doc), doc


def test_the_default_backend_is_auto_in_the_text():
    """No backend but ``auto`` is called the default, and auto's chooser is cited."""
    text = MATH.read_text(encoding="utf-8") + KERNELS.read_text(encoding="utf-8")
    defaults = set(re.findall(r"`([\w-]+)` \(default\)", text))
    assert defaults <= {"auto"}, defaults
    assert "`backends/__init__.py:auto_backend`" in text


def test_what_the_training_code_takes_from_the_optimizer_is_in_math_md():
    """Every name that minillama/train/ imports from its optimizer module (AdamW, the clipping,
    the schedule) is cited by a heading of MATH.md, with AdamW's update itself."""
    heads = {c for sec in sections(MATH) for c in citations(sec.heading)}
    optim = "minillama/train/optim.py"
    used = set()
    for file in (ROOT / "minillama" / "train").glob("*.py"):
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module == "minillama.train.optim":
                used |= {a.name for a in node.names}
    assert {"AdamW", "lr_at", "clip_grad_norm"} <= used, used
    cited = {name.split(".")[0] for path, name in heads if path == optim}
    assert not used - cited, f"MATH.md has no section for {sorted(used - cited)}"
    assert (optim, "AdamW.step") in heads


# ---------------------------------------------------------------------------------------------
# one notation: the table at the top of MATH.md, used by MATH.md and the reference docstrings
# ---------------------------------------------------------------------------------------------
def notation() -> dict[str, str]:
    """MATH.md's notation table: each symbol (LaTeX, as written between $...$) -> its meaning."""
    table = {}
    for row in re.findall(r"^\| (\$.*?) \| (.*) \|$", math_section_named("Notation"), re.M):
        for sym in re.findall(r"\$([^$]+)\$", row[0]):
            for part in sym.split(";"):
                part = part.strip()
                assert part not in table, f"{part} is in the notation table twice"
                table[part] = row[1]
    return table


def math_section_named(title: str) -> str:
    return next(s.text() for s in sections(MATH) if s.title == title)


def parts_i_to_iii() -> str:
    """MATH.md up to Part IV (which the identities catalog writes with its own letters)."""
    text = MATH.read_text(encoding="utf-8")
    return text[:text.index("# Part IV")]


def reference_docstrings() -> dict[str, str]:
    return {name: inspect.getdoc(fn) or "" for module in REFERENCE_MODULES
            for name, fn in inspect.getmembers(module, inspect.isfunction)
            if fn.__module__ == module.__name__}


def test_notation_table_defines_each_symbol_once():
    table = notation()
    for sym in ("B", "T", "S", "D", "V", "M_{tj}", r"\mathcal{K}", r"\delta^{(h)}_t",
                r"A^{(h)}_{tj}", r"W_\downarrow", r"\theta_i", r"\mathrm{base}", r"m_w", "z"):
        assert sym in table, sym


def test_shapes_in_the_docstrings_use_the_size_letters():
    """Every letter inside a shape of a reference docstring ((B, T, H, hd), (rank, in)) is a size
    of the notation table (no ``nh``, no ``M``/``L`` for counts the table names T and S)."""
    sizes = {"B", "T", "S", "D", "F", "V", "L", "H", "KVH", "G", "hd", "N", "in", "out", "rank",
             "C", "max_seq_len", "spatial", "r", "heads"}
    table = notation()
    assert {"B", "T", "S", "D", "F", "V", "H", "KVH", "G", "hd", "N", r"\mathit{rank}"} <= set(
        t for sym in table for t in [sym.strip()])
    wrong = []
    for name, doc in reference_docstrings().items():
        for shape in re.findall(r":\s*(" + SHAPE.pattern + ")", doc):  # "x: (B, T, D)"
            for word in re.findall(r"[A-Za-z_]+", shape.replace(" or ", ", ")):
                if word not in sizes:
                    wrong.append(f"{name}: {shape}")
    assert not wrong, wrong


def test_calligraphic_letters_are_in_the_table():
    r"""Every \mathcal{X} of MATH.md (Parts I-III) and of the reference docstrings is a symbol of
    the notation table (the kept rows are \mathcal{K}, never \mathcal{V})."""
    table = notation()
    used = set(re.findall(r"\\mathcal\{\w\}", parts_i_to_iii()))
    for doc in reference_docstrings().values():
        used |= set(re.findall(r"\\mathcal\{\w\}", doc))
    assert used and not {u for u in used if u not in table}, used - set(table)


def test_vectors_are_rows_everywhere():
    """A weight multiplies from the right (x W^T), never a column vector from the left (W_1 n),
    in MATH.md and in the docstrings of ops.py and the model's modules."""
    texts = {"MATH.md": parts_i_to_iii()}
    texts.update({f"ops.{n}": d for n, d in reference_docstrings().items()})
    for file in (ROOT / "minillama" / "model").glob("*.py"):
        texts[file.name] = file.read_text(encoding="utf-8")
    left = re.compile(r"\bW_\{?(?:q|k|v|o|1|2|3|out|\\mathrm\{out\})\}?(?:\\,)?\s*"
                      r"(?:\\mathrm\{\w+\}\(|\(|\\hat\{h\}|[hnx]\b)")
    found = [f"{where}: {m.group(0)}" for where, text in texts.items()
             for m in left.finditer(text)]
    assert not found, found


#: symbols the table retires (each had a second meaning), as they were written
RETIRED = {r"D_t": r"\delta_t (D is the model width)", "nh": "H or KVH",
           r"\mathcal{V}": r"\mathcal{K} (V is the vocabulary)",
           r"\sigma(a)": r"\mathrm{sigmoid}(a) (\sigma^2 is a variance)",
           r"a_\ell": "h'_l (a_1 is SwiGLU's gate)",
           r"\phi(": r"\mathrm{act}( (\varphi is an angle)"}


def test_retired_symbols_are_gone():
    texts = [parts_i_to_iii(), *reference_docstrings().values()]
    found = [f"{old} (now {new})" for old, new in RETIRED.items()
             for text in texts if re.search(r"(?<![\w\\])" + re.escape(old) + r"(?![\w{])", text)]
    assert not found, found
