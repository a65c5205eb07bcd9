"""The math-to-code map as data, for ``minillama explain``: the names of the equations
(:data:`ENTRIES`), and for each the code that computes it, its text in docs/MATH.md or in that
code's docstrings, and the tests and identities that hold it.

Everything is read from where the rest of the project keeps it, never copied: the sections of
docs/MATH.md (the file ``tests/mathmap/test_math_map.py`` checks), the docstrings and sources of the
reference functions (parsed from their files), the ``tests/`` folder. A repository checkout has
all three; an installed wheel has only the package, so the equations come from the reference
docstrings (each public ``*_forward`` / ``*_backward`` carries its equation and shapes there) and
the tests are reported missing. Which backends override an op is
:mod:`minillama.mathmap.overrides`; :mod:`minillama.mathmap.mathtext` turns the LaTeX into
terminal text.
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
from dataclasses import dataclass
from pathlib import Path

from minillama import backends as backends_pkg
from minillama.core.errors import MinillamaError
from minillama.core.quant import QUANT_TYPES

OPS = "minillama/core/ops.py"
#: the notes' other pieces (docs/MATH.md part II)
NOTES_OPS = "minillama/core/notes_ops.py"
QUANT = "minillama/core/quant.py"
#: where ``explain`` looks for the identities catalog: an iterable ``CATALOG`` (or a dict of
#: them) whose items have ``name`` and ``ops`` (op names such as "rmsnorm", or function names)
IDENTITIES_MODULE = "minillama.identities"
#: test files about ``explain`` itself: they name every op without holding any
EXPLAIN_TESTS = ("test_explain.py",)
#: a citation of docs/MATH.md: `path.py:name` followed by any number of `, `name`` (as
#: tests/mathmap/test_math_map.py reads them)
CITE = re.compile(r"`([\w./-]+\.py):([\w.]+)`((?:,\s*`[\w.]+`)*)")


@dataclass(frozen=True)
class Entry:
    """One name of ``minillama explain``: what it computes and where."""

    name: str
    title: str
    #: ``path.py:name`` (``name`` may be ``Class.method``) of the code that computes it
    code: tuple[str, ...]
    aliases: tuple[str, ...] = ()
    #: other code names whose tests hold it too (the dispatcher a parametrised test calls)
    via: tuple[str, ...] = ()
    #: string constants that name it in a test (a quantization type: "Q4_K")
    words: tuple[str, ...] = ()
    #: backend code that computes it outside the backends' op methods (``path.py:name``)
    related: tuple[str, ...] = ()

    def functions(self) -> list[str]:
        """The bare names of :attr:`code` (``KVCache.update`` -> ``update``)."""
        return [c.rpartition(":")[2].rpartition(".")[2] for c in self.code]

    def replaceable(self) -> list[str]:
        """The names of its module-level functions in the package (not in a backend): those a
        backend class may replace by an attribute of the same name."""
        return [c.rpartition(":")[2] for c in self.code
                if c.startswith("minillama/") and "." not in c.rpartition(":")[2]]

    def keys(self) -> list[str]:
        """Every name the entry answers to: its name, its aliases and the names of its
        module-level functions (``rmsnorm_forward``, ``dequantize_q4_k``), normalized."""
        top = [c.rpartition(":")[2] for c in self.code if "." not in c.rpartition(":")[2]]
        return list(dict.fromkeys(normalize(k) for k in (self.name, *self.aliases, *top)))

    def op_names(self) -> set[str]:
        """The entry's name and its functions' names less ``_forward`` / ``_backward``."""
        return {self.name} | {re.sub(r"_(forward|backward)$", "", f) for f in self.functions()}


def _pairs(*ops: str) -> tuple[str, ...]:
    return tuple(f"{OPS}:{op}_{d}" for op in ops for d in ("forward", "backward"))


def _at(path: str, *names: str) -> tuple[str, ...]:
    return tuple(f"{path}:{n}" for n in names)


_QUANT_BACKENDS = ("backends/numpy/backend.py:quant_linear_forward",
                   "backends/numpy/backend.py:quant_linear_backward",
                   "backends/numba/quant/matmul.py:qmatmul",
                   "backends/numba/quant/matmul.py:qmatmul_t")
#: types the cupy backend keeps in their blocks (backends/cupy/common.py:QUANT_KERNELS)
_CUPY_BLOCKS = ("Q8_0", "Q4_K", "Q6_K")


def _quant_entries() -> list[Entry]:
    """One entry per GGML block type of :data:`minillama.core.quant.QUANT_TYPES`."""
    cupy = ("backends/cupy/backend.py:CupyBackend._qlinear_forward",)
    return [Entry(t.name.lower(), f"{t.name} block dequantization ({t.block_elems} values in "
                                  f"{t.block_bytes} bytes)",
                  _at(QUANT, t.dequantize.__name__), via=("dequantize", "dequantize_rows"),
                  words=(t.name,), related=_QUANT_BACKENDS + (cupy if t.name in _CUPY_BLOCKS
                                                              else ()))
            for t in QUANT_TYPES.values()]


#: every name, in the order of docs/MATH.md
ENTRIES: tuple[Entry, ...] = (
    Entry("embedding", "Token embedding", _pairs("embedding"), ("embed", "emb", "tok_embeddings")),
    Entry("linear", "Linear layer y = x W^T", _pairs("linear"), ("matmul", "dense", "gemm")),
    Entry("bias", "Bias of a linear layer", _pairs("bias")),
    Entry("lora", "LoRA adapter on a frozen linear layer", _pairs("lora"), ("adapter",)),
    Entry("rmsnorm", "RMSNorm", _pairs("rmsnorm"), ("rms_norm", "rms", "norm")),
    Entry("rope", "Rotary position embedding (RoPE) and its scalings",
          _at("minillama/core/rope_scaling.py", "rope_frequencies", "rope_tables")
          + _pairs("rope"), ("rotary", "rope_scaling", "yarn")),
    Entry("attention", "Causal attention with grouped KV heads (MHA, GQA, MQA)",
          _pairs("attention") + _at(OPS, "causal_mask", "softmax", "segment_positions"),
          ("attn", "sdpa", "gqa", "mqa", "mha", "flash_attention")),
    Entry("kv_cache", "KV cache", _at("minillama/model/kvcache.py", "KVCache.update"),
          ("kvcache", "cache"), via=("KVCache",)),
    Entry("swiglu", "SwiGLU feed-forward gate", _pairs("swiglu") + _at(OPS, "sigmoid"),
          ("ffn", "silu", "glu")),
    Entry("block", "Pre-norm residual blocks and the head",
          _at("minillama/model/transformer.py", "Transformer._run", "Transformer._embed",
              "Transformer._head", "Transformer._head_backward", "Transformer._block_forward",
              "Transformer._attention_sublayer", "Transformer._ffn_sublayer",
              "Transformer._block_backward"),
          ("residual", "transformer", "prenorm", "pre_norm"), via=("loss_and_grads",)),
    Entry("cross_entropy", "Softmax cross-entropy with ignore index", _pairs("cross_entropy"),
          ("ce", "xent", "loss", "nll")),
    Entry("linear_cross_entropy", "The loss head as one op (output projection + cross-entropy)",
          _pairs("linear_cross_entropy"), ("lce", "loss_head")),
    Entry("quant", "GGML block quantization", _at(QUANT, "QuantMatrix", "dequantize",
                                                    "dequantize_rows"),
          ("quantization", "gguf_blocks", "ggml"), related=_QUANT_BACKENDS),
    *_quant_entries(),
    Entry("sampling", "Choosing the next token: penalties, temperature, top-k/top-p/min-p",
          _at("minillama/core/sampling.py", "apply_repetition_penalty",
              "apply_frequency_presence", "candidates", "sample"),
          ("top_k", "top_p", "min_p", "temperature", "repetition_penalty", "penalties")),
    Entry("adamw", "Training: gradient clipping, AdamW and the learning-rate schedule",
          _at("minillama/train/optim.py", "AdamW.step", "clip_grad_norm", "global_grad_norm",
              "lr_at"),
          ("adam", "optimizer", "optim", "lr_schedule", "schedule", "warmup", "cosine",
           "clipping", "weight_decay"), via=("AdamW",),
          related=("backends/numba/backend.py:NumbaBackend.adamw_update",
                   "backends/cupy/backend.py:CupyBackend.adamw_update")),
    Entry("layernorm", "LayerNorm", _at(NOTES_OPS, "layernorm_forward", "layernorm_backward"),
          ("layer_norm", "ln")),
    Entry("batchnorm", "BatchNorm", _at(NOTES_OPS, "batchnorm_forward", "batchnorm_backward",
                                        "batchnorm_inference"), ("batch_norm", "bn")),
    Entry("sinusoidal", "Sinusoidal absolute positions", _at(NOTES_OPS, "sinusoidal_positions"),
          ("absolute_positions", "positional_encoding")),
    Entry("gelu", "GELU (tanh form)", _at(NOTES_OPS, "gelu_forward", "gelu_backward")),
    Entry("relu", "ReLU", _at(NOTES_OPS, "relu_forward", "relu_backward")),
    Entry("mlp", "Two-matrix feed-forward network (GELU or ReLU)",
          _at(NOTES_OPS, "mlp_forward", "mlp_backward"), ("two_matrix_ffn",)),
    Entry("postnorm", "Post-norm residual",
          _at(NOTES_OPS, "postnorm_residual_forward", "postnorm_residual_backward"),
          ("post_norm",)),
    Entry("logit_scale", "Logit scale",
          _at(NOTES_OPS, "logit_scale_forward", "logit_scale_backward")),
    Entry("cross_attention", "Cross-attention",
          _at(NOTES_OPS, "cross_attention_forward", "cross_attention_backward"), ("xattn",)),
    Entry("latent", "The latent (Perceiver) block",
          _at(NOTES_OPS, "latent_expand_forward", "latent_expand_backward")
          + _at("minillama/core/notes_latent.py", "latent_block_forward", "latent_block_backward"),
          ("perceiver", "latent_block")),
    Entry("variants", "The model's swappable pieces: norm, its position, FFN, positions",
          _at("minillama/model/transformer.py", "Transformer._norm", "Transformer._norm_backward",
              "Transformer._postnorm_block_forward", "Transformer._postnorm_block_backward",
              "Transformer._mlp_sublayer", "Transformer._mlp_sublayer_backward"),
          ("model_variants",)),
    Entry("gqa_convert", "MHA to GQA by mean-pooling the K/V heads",
          _at("minillama/model/gqa.py", "convert_gqa"), ("convert_gqa", "mean_pool")),
    Entry("mixed_precision", "bf16/TF32 products with float32 sums",
          _at("backends/cupy/mixed_precision.py", "MixedPrecisionBackend.linear_forward",
              "MixedPrecisionBackend.linear_backward", "bf16_bits", "round_tf32"),
          ("bf16", "tf32", "precision")),
    Entry("greedy", "Greedy decoding, many steps per call", _at("minillama/core/decoding.py",
                                                                "stream_greedy"),
          ("argmax", "cuda_graph"),
          related=("backends/cupy/graph.py:GraphDecoder",
                   "backends/numba/backend_decode.py:GreedyDecoder",
                   "backends/numba/backend_decode.py:FusedDecode.greedy_steps")),
    Entry("speculative", "Speculative decoding by prompt lookup",
          _at("minillama/core/speculative.py", "PromptLookup.guess", "accepted_length",
              "DraftPolicy.length", "batch_lengths", "Speculation.more"),
          ("prompt_lookup", "draft", "drafts", "speculation"),
          related=("backends/numba/backend_decode.py:SpeculativeDecoder",
                   "backends/numba/backend_decode.py:DraftSteps.decode_rows",
                   "minillama/infer/slot_drafts.py:DraftRows")),
)


def normalize(name: str) -> str:
    """The form names are compared in: lower case, ``-`` and spaces as ``_``."""
    return re.sub(r"[-\s]+", "_", name.strip().lower())


@functools.cache
def name_table() -> dict[str, Entry]:
    """Every name ``explain`` answers to -> its entry (:meth:`Entry.keys`)."""
    table: dict[str, Entry] = {}
    for e in ENTRIES:
        table.setdefault(e.name, e)
    for e in ENTRIES:
        for key in e.keys():
            table.setdefault(key, e)
    return table


def lookup(name: str) -> Entry:
    """The entry for ``name`` (case-insensitive); an unknown name is a :class:`MinillamaError`
    that lists the known ones."""
    entry = name_table().get(normalize(name))
    if entry is None:
        known = ", ".join(e.name for e in ENTRIES)
        raise MinillamaError(f"explain: no equation named {name!r} (known: {known})")
    return entry


# ---------------------------------------------------------------------------------------------
# where the sources are: a checkout (docs/, tests/ beside the package) or an installed wheel
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sources:
    """The files ``explain`` reads: the package, the backends, and when the package runs from a
    checkout of its repository, docs/MATH.md, docs/KERNELS.md and tests/ (None when absent, as
    in a wheel)."""

    package: Path
    backends: Path
    math: Path | None = None
    tests: Path | None = None
    #: docs/KERNELS.md, the backends' notes (None when absent)
    kernels: Path | None = None

    @classmethod
    def installed(cls) -> Sources:
        """The sources of the running package; docs/ and tests/ only when its parent folder is
        the minillama repository (its pyproject.toml names the project)."""
        package = Path(__file__).resolve().parents[1]  # minillama/mathmap/ -> minillama/
        backends = Path(backends_pkg.__file__).resolve().parent
        root = package.parent
        project = root / "pyproject.toml"
        if not (project.is_file() and re.search(r'^name\s*=\s*"minillama"',
                                                project.read_text(encoding="utf-8"), re.M)):
            return cls(package, backends)
        math, tests = root / "docs" / "MATH.md", root / "tests"
        kernels = root / "docs" / "KERNELS.md"
        return cls(package, backends, math if math.is_file() else None,
                   tests if tests.is_dir() else None, kernels if kernels.is_file() else None)

    def file(self, path: str) -> Path:
        """The file of a path as docs/MATH.md writes it (``minillama/core/ops.py``,
        ``backends/numpy/backend.py``)."""
        head, _, rest = path.partition("/")
        return (self.backends if head == "backends" else self.package) / rest


# ---------------------------------------------------------------------------------------------
# docs/MATH.md
# ---------------------------------------------------------------------------------------------
def citations(text: str) -> list[tuple[str, str]]:
    """Every (path, name) that a passage of docs/MATH.md cites."""
    found = []
    for m in CITE.finditer(text):
        found.append((m.group(1), m.group(2)))
        found += [(m.group(1), n) for n in re.findall(r"`([\w.]+)`", m.group(3))]
    return found


def split_cite(cite: str) -> tuple[str, str]:
    path, _, name = cite.partition(":")
    return path, name


@dataclass(frozen=True)
class Section:
    """One heading of docs/MATH.md and the lines under it up to the next heading."""

    heading: str
    body: tuple[str, ...]

    @property
    def title(self) -> str:
        return self.heading.lstrip("#").split(" — ")[0].strip()

    def cites(self) -> list[tuple[str, str]]:
        return citations(self.heading)

    def text(self) -> str:
        return "\n".join((self.heading, *self.body)).strip()


@functools.cache
def sections(math: Path) -> tuple[Section, ...]:
    """The sections of docs/MATH.md, in order."""
    found: list[Section] = []
    heading, body = "", []
    for line in math.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            found.append(Section(heading, tuple(body)))
            heading, body = line, []
        elif line.strip() != "---":
            body.append(line)
    found.append(Section(heading, tuple(body)))
    return tuple(s for s in found if s.heading)


def _blocks(lines: tuple[str, ...]) -> list[list[str]]:
    """Runs of non-blank lines."""
    blocks: list[list[str]] = [[]]
    for line in lines:
        if line.strip():
            blocks[-1].append(line)
        elif blocks[-1]:
            blocks.append([])
    return [b for b in blocks if b]


def excerpt(section: Section, cite: tuple[str, str]) -> str | None:
    """The paragraph of ``section`` that cites ``cite``; for a table row, the paragraph before
    the table, the table's header and that row. None when the section does not cite it."""
    blocks = _blocks(section.body)
    for i, block in enumerate(blocks):
        if block[0].lstrip().startswith("|"):
            rows = [r for r in block[2:] if cite in citations(r)]
            if rows:
                before = blocks[i - 1] if i and not blocks[i - 1][0].startswith("|") else []
                return "\n".join((section.heading, "", *before, "", *block[:2], *rows))
        elif cite in citations("\n".join(block)):
            return "\n".join((section.heading, "", *block))
    return None


def math_passages(entry: Entry, math: Path) -> list[str]:
    """What docs/MATH.md says about ``entry``: every section whose heading cites its code, and
    for code cited only inside a section, the passage that cites it; then the sections whose
    heading cites its :attr:`~Entry.related` backend code."""
    cites = [split_cite(c) for c in entry.code]
    passages: list[str] = []
    covered: set[tuple[str, str]] = set()
    for section in sections(math):
        if any(c in section.cites() for c in cites):
            passages.append(section.text())
            covered.update(section.cites())
    for cite in cites:
        if cite in covered:
            continue
        for section in sections(math):
            found = excerpt(section, cite)
            if found:
                passages.append(found)
                break
    related = [split_cite(c) for c in entry.related]
    passages += [s.text() for s in sections(math) if any(c in s.cites() for c in related)]
    return list(dict.fromkeys(passages))


def kernel_passages(entry: Entry, kernels: Path, backend_code: list[str]) -> list[str]:
    """What docs/KERNELS.md says about how the backends compute ``entry``: the sections whose
    heading cites its :attr:`~Entry.related` code, then the paragraph citing each function of
    ``backend_code`` (``path.py:Class.method`` as a backend class defines it; KERNELS.md may cite
    the method by its bare name)."""
    related = [split_cite(c) for c in entry.related]
    passages = [s.text() for s in sections(kernels) if any(c in s.cites() for c in related)]
    covered = {c for s in sections(kernels) if s.text() in passages for c in s.cites()}
    for cite in backend_code:
        path, name = split_cite(cite)
        for candidate in dict.fromkeys([(path, name), (path, name.rpartition(".")[2])]):
            if candidate in covered:
                break
            found = next((e for s in sections(kernels) if (e := excerpt(s, candidate))), None)
            if found:
                passages.append(found)
                break
    return list(dict.fromkeys(passages))


# ---------------------------------------------------------------------------------------------
# the code: parsed from its file, never imported (backend files need no CuPy or Numba)
# ---------------------------------------------------------------------------------------------
@functools.cache
def _parse(file: Path) -> tuple[ast.Module, str]:
    text = file.read_text(encoding="utf-8")
    return ast.parse(text), text


def definition(sources: Sources, cite: str) -> tuple[ast.AST, str] | None:
    """The AST node of ``path.py:name`` (``name`` may be ``Class.member``) and its file's text;
    None when the file or the name is missing."""
    path, name = split_cite(cite)
    file = sources.file(path)
    if not file.is_file():
        return None
    tree, text = _parse(file)
    body: list[ast.stmt] = tree.body
    node: ast.AST | None = None
    for part in name.split("."):
        node = next((n for n in body if _defines(n, part)), None)
        if node is None:
            return None
        body = getattr(node, "body", [])
    return node, text


def _defines(node: ast.stmt, name: str) -> bool:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name == name
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
    return isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == name


def source(sources: Sources, cite: str) -> str:
    """The source text of ``path.py:name``, decorators included."""
    found = definition(sources, cite)
    if found is None:
        raise MinillamaError(f"explain: {cite} is not in the installed package")
    node, text = found
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    lines = text.splitlines()[first - 1:node.end_lineno]
    indent = min(len(ln) - len(ln.lstrip()) for ln in lines if ln.strip())
    return "\n".join(ln[indent:] for ln in lines)


def docstring(sources: Sources, cite: str) -> str:
    """The docstring of ``path.py:name`` ("" when it has none)."""
    found = definition(sources, cite)
    node = found[0] if found else None
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return ast.get_docstring(node) or ""
    return ""


# ---------------------------------------------------------------------------------------------
# the tests that hold an entry
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Usage:
    """What one test function reads: the names (variables, attributes), the short string
    constants, and the op names that stand in a table of ops (a tuple, list or dict keys of two
    or more op names, as parametrised parity tests use), counting one level of the module's
    helpers and tables it refers to."""

    file: str
    name: str
    names: frozenset[str]
    strings: frozenset[str]
    table_ops: frozenset[str]


@functools.cache
def op_names() -> frozenset[str]:
    """Every op name of every entry (what a table of ops in a test may list)."""
    return frozenset(n for e in ENTRIES for n in e.op_names())


def _reads(nodes: list[ast.AST]) -> tuple[set[str], set[str], set[str]]:
    names, strings, tables = set(), set(), set()
    ops = op_names()
    for top in nodes:
        for n in ast.walk(top):
            if isinstance(n, ast.Name):
                names.add(n.id)
            elif isinstance(n, ast.Attribute):
                names.add(n.attr)
            elif isinstance(n, ast.Constant) and isinstance(n.value, str) and len(n.value) < 40:
                strings.add(n.value)
            if isinstance(n, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
                items = n.keys if isinstance(n, ast.Dict) else n.elts
                listed = {i.value for i in items if isinstance(i, ast.Constant)
                          and isinstance(i.value, str)} & ops
                if len(listed) >= 2:
                    tables |= listed
    return names, strings, tables


@functools.cache
def usages(file: Path, rel: str) -> tuple[Usage, ...]:
    """The :class:`Usage` of every test function of one test file."""
    tree, _ = _parse(file)
    helpers: dict[str, ast.AST] = {}
    tests: list[tuple[str, ast.AST]] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.name.startswith("test"):
                tests.append((node.name, node))
            else:
                helpers[node.name] = node
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            tests += [(f"{node.name}::{f.name}", f) for f in node.body
                      if isinstance(f, ast.FunctionDef) and f.name.startswith("test")]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            helpers.update({t.id: node for t in targets if isinstance(t, ast.Name)})
    uses = []
    for name, node in tests:
        direct = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        names, strings, tables = _reads([node, *(helpers[h] for h in direct if h in helpers)])
        uses.append(Usage(rel, name, frozenset(names), frozenset(strings), frozenset(tables)))
    return tuple(uses)


def holds(entry: Entry, use: Usage) -> bool:
    """Whether the test ``use`` calls ``entry``'s code (or the code it runs through), names it
    by a string, or lists it in a table of ops."""
    code = {c.rpartition(":")[2] for c in entry.code}
    called = any(all(part in use.names for part in name.split(".")) for name in code)
    return (called or bool(set(entry.via) & use.names) or bool(set(entry.words) & use.strings)
            or bool(entry.op_names() & use.table_ops))


def tests_for(entry: Entry, sources: Sources) -> list[Usage] | None:
    """The test functions under tests/ that hold ``entry``; None when there is no tests/ folder
    (an installed wheel)."""
    if sources.tests is None:
        return None
    needles = [*entry.functions(), *entry.via, *entry.words, *entry.op_names()]
    found = []
    for file in sorted(sources.tests.rglob("test_*.py")):
        if file.name in EXPLAIN_TESTS:
            continue
        text = _parse(file)[1]
        if any(n in text for n in needles):
            rel = f"tests/{file.relative_to(sources.tests).as_posix()}"
            found += [u for u in usages(file, rel) if holds(entry, u)]
    return found


# ---------------------------------------------------------------------------------------------
# identities (minillama.identities, when installed)
# ---------------------------------------------------------------------------------------------
def identities_catalog() -> list:
    """The identities of ``minillama.identities`` (imported when first asked for: it imports
    hypothesis, which the other commands need not load)."""
    return list(importlib.import_module(IDENTITIES_MODULE).CATALOG)


def _op_key(op: str) -> str:
    """An identity's op as a name: its last dotted or ``:`` part."""
    return normalize(re.split(r"[.:]", op)[-1])


def identities_for(entry: Entry) -> tuple[list, list]:
    """The identities of the catalog that use ``entry``, as (about it, through more ops): an
    identity is about ``entry`` when its own name starts with one of the entry's names and ``_``
    (``softmax_shift_invariance``, ``quant_round_trip``), holds one of five letters or more
    between ``_`` (``model_kv_cache_decode``), or all its ``ops`` are the entry's (by
    its name, an alias, or a function's name with or without ``_forward``/``_backward``); it
    uses it through more ops (a whole model) when its ``ops`` name the entry among others."""
    catalog = identities_catalog()
    keys = {normalize(k) for k in (*entry.keys(), *entry.functions())} | entry.op_names()
    about, through = [], []
    for ident in catalog:
        ops = {_op_key(o) for o in ident.ops}
        name = normalize(ident.name)
        named = any(name.startswith(k + "_") or (len(k) >= 5 and f"_{k}_" in name)
                    for k in keys)
        if named or (ops and ops <= keys):
            about.append(ident)
        elif ops & keys:
            through.append(ident)
    return about, through
