"""Running identities with hypothesis: one identity on one subject (:func:`run_identity`), the
catalog on a backend (:func:`run_catalog`), a backend named by a user (:func:`resolve_backend`),
and the results as a table, a failure report or JSON."""

from __future__ import annotations

import importlib
import math
import os
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
from hypothesis import HealthCheck, Phase, Verbosity, given, settings, target
from hypothesis import seed as fix_seed

from minillama.backends import get_backend
from minillama.core.errors import MinillamaError
from minillama.identities.base import Identity, Subject, as_subject
from minillama.identities.catalog import BY_NAME, select

#: examples per identity of ``minillama check`` without ``--examples``
DEFAULT_EXAMPLES = 50


@dataclass
class Result:
    """One identity's run: ``status`` pass, fail or skip; ``examples`` checks run (shrinking
    included); ``worst`` the largest error / tolerance seen; ``missing`` the ops a skipped
    subject lacks; for a failure the shrunk ``counterexample``, its ratio and the exception
    (``error``) when the check raised instead."""

    name: str
    status: str
    examples: int = 0
    worst: float = 0.0
    seconds: float = 0.0
    missing: tuple[str, ...] = ()
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

    def body(example):
        state["n"] += 1
        try:
            r = float(identity.fn(subject, example))
        except Exception as e:  # the op raised on this example: a failure, shrunk like any
            state.update(example=example, ratio=None, error=f"{type(e).__name__}: {e}")
            raise
        r = r if r == r else math.inf  # NaN counts as the worst
        state["worst"] = max(state["worst"], r)
        target(min(r, 1e300), label=identity.name)
        if r > 1.0:
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
        status = "pass"
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
    return np.float64 if getattr(backend, "supports_float64", True) else np.float32


def run_catalog(backend="numpy", names=None, examples: int = DEFAULT_EXAMPLES,
                seed: int | None = None, dtype=None, topics=None, progress=None) -> list[Result]:
    """Run the catalog (or the identities ``names``, or those of ``topics``) on ``backend``
    (a name, ``package.module:Class`` or a backend object) in ``dtype`` (default:
    :func:`default_dtype`). ``progress(result)`` is called after each identity."""
    backend = resolve_backend(backend)
    subject = Subject(backend, dtype if dtype is not None else default_dtype(backend))
    results = []
    for identity in select(names, topics):
        results.append(run_identity(identity, subject, examples, seed))
        if progress is not None:
            progress(results[-1])
    return results


def resolve_backend(spec):
    """A backend object: a registered name (:func:`minillama.backends.get_backend`), or
    ``package.module:Class`` (the class instantiated with no arguments; the module imported
    from ``sys.path``, else from the working directory); an object passes through. What does
    not import or instantiate is a :class:`MinillamaError`."""
    if not isinstance(spec, str):
        return spec
    if ":" not in spec:
        return get_backend(spec)
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise MinillamaError(f"backend {spec!r}: expected a name or package.module:Class")
    module = _import(spec, module_name)
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise MinillamaError(f"backend {spec!r}: {module_name} has no {attr}")
        obj = getattr(obj, part)
    try:
        return obj() if isinstance(obj, type) or callable(obj) else obj
    except Exception as e:
        raise MinillamaError(f"backend {spec!r}: {attr}() raised {type(e).__name__}: {e}") \
            from None


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
    """The ``minillama check`` line that runs ``name`` again as it ran."""
    line = f"minillama check --backend {spec} --only {name} --seed {seed} --examples {examples}"
    return line if np.dtype(dtype) == np.float64 else line + f" --dtype {np.dtype(dtype).name}"


def _ratio_text(v) -> str:
    return "-" if v is None else ("inf" if math.isinf(v) else f"{v:.2e}")


def table_header(width: int) -> str:
    """The table's first line, names ``width`` wide."""
    return f"{'identity':<{width}}  examples   err/tol  result  seconds"


def format_row(r: Result, width: int) -> str:
    """One row: identity, examples tried, worst error / tolerance, result, seconds (a skipped
    identity: the ops the backend lacks)."""
    if r.status == "skip":
        return f"{r.name:<{width}}  {'-':>8}  {'-':>8}  skip (no {', '.join(r.missing)})"
    word = "pass" if r.status == "pass" else "FAIL"
    return (f"{r.name:<{width}}  {r.examples:>8}  {_ratio_text(r.worst):>8}  {word:<6}  "
            f"{r.seconds:7.2f}")


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
        lines.append(f"  error / tolerance: {_ratio_text(r.counter_ratio)}"
                     + (f"  (tolerance: {ident.tolerance})" if ident else ""))
    lines.append(f"  reproduce: {reproduce}")
    return "\n".join(lines)


def summary(results: list[Result]) -> str:
    """The summary line: how many identities passed, failed and were skipped."""
    count = {s: sum(r.status == s for r in results) for s in ("pass", "fail", "skip")}
    noun = "identity" if len(results) == 1 else "identities"
    return (f"{len(results)} {noun}: {count['pass']} passed, {count['fail']} failed, "
            f"{count['skip']} skipped")
