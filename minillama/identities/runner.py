"""Running identities with hypothesis: one identity on one subject (:func:`run_identity`), the
catalog on a backend (:func:`run_catalog`), a backend named by a user (:func:`resolve_backend`),
and the results as a table, a failure report or JSON."""

from __future__ import annotations

import difflib
import functools
import importlib
import math
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, Phase, Verbosity, given, settings, target
from hypothesis import seed as fix_seed

from minillama.backends import backend_names, get_backend
from minillama.core.errors import MinillamaError
from minillama.identities.base import Identity, Subject, as_subject, with_helpers
from minillama.identities.catalog import BY_NAME, CATALOG, select

#: examples per identity of ``minillama check`` without ``--examples``
DEFAULT_EXAMPLES = 50
#: the status of a bitwise identity its backend does not promise (it ran, and never fails)
NOT_GUARANTEED = "not guaranteed"


@dataclass
class Result:
    """One identity's run: ``status`` pass, fail, skip or "not guaranteed" (a bitwise identity
    the backend does not promise, run and measured); ``examples`` checks run (shrinking
    included); ``worst`` the largest error / tolerance seen (for a bitwise identity, the largest
    difference relative to the logits' magnitude); ``missing`` the ops a skipped
    subject lacks; ``borrowed`` the ops a user's partial backend lacked and the reference lent
    it; ``note`` why an identity was skipped when no op is missing; for a failure the shrunk
    ``counterexample``, its ratio and the exception (``error``) when the check raised
    instead."""

    name: str
    status: str
    examples: int = 0
    worst: float = 0.0
    seconds: float = 0.0
    missing: tuple[str, ...] = ()
    borrowed: tuple[str, ...] = ()
    note: str | None = None
    counterexample: dict | None = None
    counter_ratio: float | None = None
    error: str | None = None

    def to_dict(self) -> dict:
        """JSON-ready: non-finite ratios as the strings "inf" and "nan"."""
        out = asdict(self)
        for key in ("worst", "counter_ratio"):
            v = out[key]
            if v is not None and not math.isfinite(v):
                out[key] = str(v)
        out["missing"] = list(self.missing)
        out["borrowed"] = list(self.borrowed)
        return out


class _Exceeds(AssertionError):
    """An example whose error exceeds the tolerance."""


def run_identity(identity: Identity, subject, examples: int = DEFAULT_EXAMPLES,
                 seed: int | None = None) -> Result:
    """Check ``identity`` on ``subject`` (a :class:`~minillama.identities.base.Subject` or a
    backend, float64) for up to ``examples`` hypothesis examples; ``seed`` fixes hypothesis'
    choices (None: its own, or the active settings profile's). A failing example is shrunk; the
    :class:`Result` holds the smallest one hypothesis found."""
    subject = as_subject(subject)
    missing = identity.missing(subject)
    if missing:
        return Result(identity.name, "skip", missing=tuple(missing))
    state: dict = {"n": 0, "worst": 0.0, "example": None, "ratio": None, "error": None}
    # a tolerance identity passes up to 1; a bitwise one only at 0 where the backend promises
    # it, and is measured without a limit where it does not
    promised = identity.promised(subject)
    limit = 1.0 if identity.exact is None else (0.0 if promised else math.inf)

    def body(example):
        state["n"] += 1
        try:
            r = float(identity.fn(subject, example))
        except Exception as e:  # the op raised on this example: a failure, shrunk like any
            state.update(example=example, ratio=None, error=f"{type(e).__name__}: {e}")
            raise
        r = r if r == r else math.inf  # NaN counts as the worst
        if identity.exact is not None and not math.isfinite(r):  # NaN/inf: no rounding, a bug
            state.update(example=example, ratio=r, error=None)
            raise _Exceeds(f"{identity.name}: a NaN or infinity on {example}")
        state["worst"] = max(state["worst"], r)
        target(min(r, 1e300), label=identity.name)
        if r > limit:
            state.update(example=example, ratio=r, error=None)
            raise _Exceeds(f"{identity.name}: error / tolerance {r:.3g} on {example}")

    test = given(identity.strategy)(body)
    if seed is not None:
        test = fix_seed(seed)(test)
    extra = {} if seed is None else {"derandomize": False}
    test = settings(max_examples=examples, deadline=None, database=None, print_blob=False,
                    suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet,
                    report_multiple_bugs=False,
                    phases=(Phase.explicit, Phase.generate, Phase.target, Phase.shrink),
                    **extra)(test)
    start = time.perf_counter()
    try:
        test()
        status = "pass" if promised else NOT_GUARANTEED
    except Exception as e:  # the shrunk failure, re-raised by hypothesis (or its complaint)
        status = "fail"
        if state["example"] is None:
            state["error"] = f"{type(e).__name__}: {e}"
    return Result(identity.name, status, state["n"], state["worst"],
                  time.perf_counter() - start, counterexample=state["example"] if
                  status == "fail" else None, counter_ratio=state["ratio"] if
                  status == "fail" else None, error=state["error"] if status == "fail" else None)


def default_dtype(backend):
    """float64, or float32 for a backend that declares no float64 support."""
    return np.float64 if backend.supports_float64 else np.float32


def run_catalog(backend="numpy", names=None, examples: int = DEFAULT_EXAMPLES,
                seed: int | None = None, dtype=None, topics=None, progress=None) -> list[Result]:
    """Run the catalog (or the identities ``names``, or those of ``topics``) on ``backend``
    (a name, ``package.module:Class`` or a backend object) in ``dtype`` (default:
    :func:`default_dtype`). ``progress(result)`` is called after each identity."""
    backend = resolve_backend(backend)
    dtype = dtype if dtype is not None else default_dtype(backend)
    own = partial_ops(backend)
    subject = Subject(backend if own is None else Filled(backend, own), dtype)
    results = []
    for identity in select(names, topics):
        results.append(run_identity(identity, subject, examples, seed) if own is None
                       else _run_partial(identity, subject, own, examples, seed))
        if progress is not None:
            progress(results[-1])
    return results


@functools.cache
def catalog_ops() -> frozenset[str]:
    """Every backend op some identity of the catalog calls."""
    return frozenset(op for identity in CATALOG for op in identity.ops)


def partial_ops(backend) -> set[str] | None:
    """The catalog's ops a NumPy backend of a user's has, when it lacks some (a class with only
    the ops its author wrote); None for a backend with them all, or one on another array
    module (whose arrays the reference's ops could not take). A backward without its forward
    does not count (it could only read the reference's saved context)."""
    if backend.xp is not np:
        return None
    have = {op for op in catalog_ops() if callable(getattr(backend, op, None))}
    if have == catalog_ops():
        return None
    return {op for op in have if not op.endswith(_BACKWARD) and "_backward_" not in op
            or _forward_of(op) in have}


_BACKWARD = "_backward"


def _forward_of(op: str) -> str:
    """The forward an op's backward reads the context of (``linear_backward_input``:
    ``linear_forward``)."""
    return op.split(_BACKWARD)[0] + "_forward"


class _Saved:
    """A user's forward context, with the forward's arguments for a lent backward."""

    def __init__(self, ctx, args, kwargs):
        self.ctx, self.args, self.kwargs = ctx, args, kwargs


class Filled:
    """A user's partial backend, given the reference's op (and helper) wherever it has none, so
    a model identity runs the user's rmsnorm inside the reference's Transformer. Where the user
    wrote a forward and not its backward, the reference's backward is lent on the reference's
    context of the same arguments (the user's forward keeps them beside its own context)."""

    def __init__(self, backend, own: set[str]):
        self._backend, self._own = backend, own
        self._reference = get_backend("reference")
        self.name = backend.name

    def __getattr__(self, key):
        if key in catalog_ops() and key not in self._own:
            if _BACKWARD in key and _forward_of(key) in self._own:
                return self._lent_backward(key)
            return getattr(self._reference, key)
        try:
            fn = getattr(self._backend, key)
        except AttributeError:
            return getattr(self._reference, key)
        if key.endswith("_forward"):  # kept for any backward the reference lends
            return self._keeping_arguments(fn)
        if _BACKWARD in key and _forward_of(key) in self._own:
            return self._own_backward(fn)
        return fn

    @staticmethod
    def _keeping_arguments(forward):
        def call(*args, **kwargs):
            y, ctx = forward(*args, **kwargs)
            return y, _Saved(ctx, args, kwargs)

        return call

    @staticmethod
    def _own_backward(backward):
        def call(dy, saved, *args, **kwargs):
            ctx = saved.ctx if isinstance(saved, _Saved) else saved
            return backward(dy, ctx, *args, **kwargs)

        return call

    def _lent_backward(self, key: str):
        ref = self._reference

        def call(dy, saved):
            _, ctx = getattr(ref, _forward_of(key))(*saved.args, **saved.kwargs)
            return getattr(ref, key)(dy, ctx)

        return call


def _run_partial(identity: Identity, subject: Subject, own: set[str], examples: int,
                 seed: int | None) -> Result:
    """An identity on a partial backend: run when it calls one of the backend's own ops (the
    rest from the reference, listed in ``borrowed``), skipped when it touches none of them."""
    if not identity.ops:
        return Result(identity.name, "skip", note="core code only, none of the backend's")
    if not own & set(identity.ops):
        return Result(identity.name, "skip", missing=identity.ops)
    result = run_identity(identity, subject, examples, seed)
    result.borrowed = tuple(op for op in identity.ops if op not in own)
    return result


def resolve_backend(spec):
    """A backend object: a registered name (:func:`minillama.backends.get_backend`), or
    ``package.module:Class`` (the class instantiated with no arguments; the module imported
    from ``sys.path``, else from the working directory); an object passes through. A user's
    object gets the helpers and optional abilities it lacks (:func:`~.base.with_helpers`). What
    does not import or instantiate is a :class:`MinillamaError`."""
    if not isinstance(spec, str):
        return with_helpers(spec)
    if ":" not in spec:
        if spec in backend_names():
            return get_backend(spec)
        close = difflib.get_close_matches(spec, backend_names(), n=1)
        raise MinillamaError(f"backend {spec!r} is not one of {', '.join(backend_names())}"
                             + (f" (did you mean {close[0]}?)" if close else
                                f"; a class of one's own is named as module:Class{_hint(spec)}"))
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise MinillamaError(f"backend {spec!r}: expected a name or package.module:Class")
    if module_name.endswith(".py") or "/" in module_name or os.sep in module_name:
        raise MinillamaError(f"backend {spec!r}: name the module by its import name, not its "
                             f"file{_hint(module_name, attr)}")
    module = _import(spec, module_name)
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise MinillamaError(f"backend {spec!r}: {module_name} has no {attr}")
        obj = getattr(obj, part)
    try:
        made = obj() if isinstance(obj, type) or callable(obj) else obj
    except Exception as e:
        raise MinillamaError(f"backend {spec!r}: {attr}() raised {type(e).__name__}: {e}") \
            from None
    return with_helpers(made)


def _hint(text: str, attr: str = "Class") -> str:
    """A suggestion ``(e.g. PYTHONPATH=folder ... module:Class)`` for a file, a path or a bare
    module name given where ``module:Class`` belongs."""
    path = text[:-3] if text.endswith(".py") else text
    folder, module = os.path.split(path)
    if not module.isidentifier():
        return ""
    where = f"PYTHONPATH={folder} minillama check --backend " if folder else ""
    return f" (e.g. {where}{module}:{attr})"


def _import(spec: str, module_name: str):
    """``module_name`` imported, retried with the working directory on ``sys.path`` (where a
    user's own backend usually is, and where a console script does not look)."""
    for attempt in range(2):
        try:
            return importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            top = module_name.split(".")[0]
            if attempt or e.name != top or os.getcwd() in sys.path:
                raise MinillamaError(f"backend {spec!r}: cannot import {module_name} "
                                     f"({e})") from None
            sys.path.append(os.getcwd())
        except Exception as e:
            raise MinillamaError(f"backend {spec!r}: importing {module_name} raised "
                                 f"{type(e).__name__}: {e}") from None
    raise AssertionError("unreachable")  # pragma: no cover


# ---------------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------------
def reproduce_command(spec: str, name: str, seed: int, examples: int, dtype=np.float64) -> str:
    """The ``minillama check`` line that runs ``name`` again as it ran, from any folder: a user's
    module comes with ``PYTHONPATH=`` its folder (see :func:`module_folder`)."""
    line = f"minillama check --backend {spec} --only {name} --seed {seed} --examples {examples}"
    folder = module_folder(spec)
    if folder is not None:
        line = f"PYTHONPATH={shlex.quote(folder)} {line}"
    return line if np.dtype(dtype) == np.float64 else line + f" --dtype {np.dtype(dtype).name}"


def module_folder(spec: str) -> str | None:
    """The folder a ``module:Class`` backend was imported from, when that is not where the
    installed packages live (None for a registered name or an installed package)."""
    if ":" not in spec:
        return None
    top = spec.partition(":")[0].split(".")[0]
    module = sys.modules.get(top)
    file = getattr(module, "__file__", None)
    if file is None:
        return None
    path = Path(file).resolve()
    folder = path.parent.parent if path.name == "__init__.py" else path.parent
    if "site-packages" in folder.parts or "dist-packages" in folder.parts:
        return None
    return str(folder)


def _ratio_text(v) -> str:
    return "-" if v is None else ("inf" if math.isinf(v) else f"{v:.2e}")


#: what the err/tol column and the FAILED block's figure are
RATIO_LEGEND = ("err/tol: the worst example's error divided by its tolerance (the error model's "
                "bound); at most 1 passes, and 0 only for the bitwise (invariance) ones a backend "
                "promises")


def table_header(width: int) -> str:
    """The table's first line, names ``width`` wide."""
    return f"{'identity':<{width}}  examples   err/tol  result  seconds"


def format_row(r: Result, width: int) -> str:
    """One row: identity, examples tried, worst error / tolerance, result, seconds (a skipped
    identity: the ops the backend lacks)."""
    if r.status == "skip":
        why = r.note or f"no {', '.join(r.missing)}"
        return f"{r.name:<{width}}  {'-':>8}  {'-':>8}  skip ({why})"
    if r.status == NOT_GUARANTEED:
        return (f"{r.name:<{width}}  {r.examples:>8}  {'-':>8}  not guaranteed (largest "
                f"difference {_ratio_text(r.worst)} of the logits' magnitude)  {r.seconds:7.2f}")
    word = "pass" if r.status == "pass" else "FAIL"
    lent = f"  (reference's {', '.join(r.borrowed)})" if r.borrowed else ""
    return (f"{r.name:<{width}}  {r.examples:>8}  {_ratio_text(r.worst):>8}  {word:<6}  "
            f"{r.seconds:7.2f}{lent}")


def format_table(results: list[Result]) -> str:
    """The whole table of ``results``."""
    width = max([len(r.name) for r in results] + [8])
    return "\n".join([table_header(width)] + [format_row(r, width) for r in results])


def format_failure(r: Result, reproduce: str) -> str:
    """A failed identity: its statement, the shrunk example, its error / tolerance (or what
    raised), and the command that reproduces it."""
    ident = BY_NAME.get(r.name)
    lines = [f"FAILED {r.name}" + (f": {ident.statement}" if ident else "")]
    if r.counterexample is not None:
        lines.append(f"  shrunk example: {r.counterexample}")
    if r.error is not None:
        lines.append(f"  raised {r.error}")
    else:
        lines.append(f"  error / tolerance: {_ratio_text(r.counter_ratio)} (the shrunk "
                     f"example's error divided by its tolerance; at most 1 passes)")
        if ident:
            lines.append(f"  tolerance: {ident.tolerance}")
    lines.append(f"  reproduce: {reproduce}")
    return "\n".join(lines)


def summary(results: list[Result]) -> str:
    """The summary line: how many identities passed, failed and were skipped."""
    count = {s: sum(r.status == s for r in results)
             for s in ("pass", "fail", "skip", NOT_GUARANTEED)}
    noun = "identity" if len(results) == 1 else "identities"
    lent = sum(bool(r.borrowed) for r in results if r.status != "skip")
    loose = count[NOT_GUARANTEED]
    out = (f"{len(results)} {noun}: {count['pass']} passed, {count['fail']} failed, "
           f"{count['skip']} skipped")
    if loose:
        out += f", {loose} not guaranteed by the backend (measured)"
    if lent:
        out += f"; {lent} ran with some of the reference's ops beside the backend's"
    return out
