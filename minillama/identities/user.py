"""The identities as a library for a user's own functions: :func:`check_attention`,
:func:`check_rope` and :func:`check_norm` take a NumPy function, run every identity of the
catalog that needs only that op, and raise :class:`AssertionError` with hypothesis' shrunk
example when one fails. Usable inside a user's pytest test or alone."""

from __future__ import annotations

import random

import numpy as np

from minillama.identities.base import Subject
from minillama.identities.catalog import CATALOG
from minillama.identities.runner import Result, format_failure, run_identity


class CallableSubject(Subject):
    """A :class:`~minillama.identities.base.Subject` whose ops are a user's functions (NumPy in,
    NumPy out) instead of a backend's: ``attention``, ``rope``, ``rmsnorm`` or ``layernorm``,
    each providing one backend op name (``attention_forward``, ...)."""

    OPS = {"attention": "attention_forward", "rope": "rope_forward",
           "rmsnorm": "rmsnorm_forward", "layernorm": "layernorm_forward"}

    def __init__(self, dtype=np.float64, **fns):
        super().__init__(None, dtype)
        self.fns = fns
        self.provides = {self.OPS[k] for k in fns}

    def __repr__(self) -> str:
        return f"<identities subject {sorted(self.fns)} {self.dtype}>"

    def has(self, op: str) -> bool:
        return op in self.provides

    def _call(self, kind: str, shape, *args) -> np.ndarray:
        out = np.asarray(self.fns[kind](*args), dtype=np.float64)
        if out.shape != tuple(shape):
            raise AssertionError(f"{kind} returned shape {out.shape}, expected {tuple(shape)}")
        return out

    def rotate(self, x, positions, theta: float = 10000.0) -> np.ndarray:
        x = np.asarray(x, dtype=self.dtype)
        return self._call("rope", x.shape, x, np.asarray(positions, dtype=np.int64))

    def attention(self, q, k, v, start_pos: int = 0) -> np.ndarray:
        q, k, v = (np.asarray(a, dtype=self.dtype) for a in (q, k, v))
        return self._call("attention", q.shape, q, k, v, int(start_pos))

    def rmsnorm(self, x, g, eps: float) -> np.ndarray:
        x, g = np.asarray(x, dtype=self.dtype), np.asarray(g, dtype=self.dtype)
        return self._call("rmsnorm", x.shape, x, g, eps)

    def layernorm(self, x, g, b, eps: float) -> np.ndarray:
        x, g, b = (np.asarray(a, dtype=self.dtype) for a in (x, g, b))
        return self._call("layernorm", x.shape, x, g, b, eps)


def check_callable(subject: CallableSubject, call: str, examples: int,
                   seed: int | None) -> list[Result]:
    """Run every catalog identity whose ops ``subject`` provides; raise AssertionError listing
    the failures (shrunk example, error / tolerance, and ``call``, the start of the call that
    reruns them, completed with the seed and the examples)."""
    seed = random.randrange(2**32) if seed is None else seed
    results = [run_identity(i, subject, examples, seed) for i in CATALOG
               if i.ops and set(i.ops) <= subject.provides and i.for_functions]
    failed = [r for r in results if r.status == "fail"]
    if failed:
        again = f"{call}seed={seed}, examples={examples})"
        raise AssertionError("\n".join(format_failure(r, again) for r in failed))
    return results


def check_attention(fn, *, examples: int = 50, seed: int | None = None,
                    dtype=np.float64) -> list[Result]:
    """Hold ``fn(q, k, v, start_pos) -> o`` to the attention identities (causal mask, cached
    rows, GQA = repeated MHA, key shift, head permutation, batch independence).

    Layouts: q (B, T, H, hd), k and v (B, S, KVH, hd), o (B, T, H, hd), NumPy arrays of
    ``dtype``. Grouped KV heads: H = G KVH (G >= 1; G = 1 is MHA, KVH = 1 MQA) and query head h
    reads KV head h // G. The mask is given by ``start_pos`` (an int >= 0, S = start_pos + T):
    query t sits at absolute position start_pos + t and may read keys 0..start_pos + t, so a
    plain causal self-attention has start_pos = 0 and S = T, and a decode step with a KV cache
    of S - 1 earlier positions start_pos = S - 1. Scores are scaled by 1 / sqrt(hd).

    Runs ``examples`` hypothesis examples per identity (``seed`` fixes them; default random,
    reported with a failure). Returns the :class:`~minillama.identities.runner.Result` list;
    raises AssertionError naming each failed identity with its shrunk example.
    """
    return check_callable(CallableSubject(dtype, attention=fn), "check_attention(fn, ", examples,
                          seed)


def check_rope(fn, *, theta: float = 10000.0, layout: str = "interleaved", examples: int = 50,
               seed: int | None = None, dtype=np.float64) -> list[Result]:
    """Hold ``fn(x, positions) -> y`` to the RoPE identities (scores depend only on relative
    position, every rotated pair keeps its length, position 0 is the identity, pair i of
    position m turns by m theta^(-2i/hd), and the sinusoidal contrast).

    Layouts: x and y (B, T, nh, hd) in ``dtype``, hd even; positions (T,) int64, the absolute
    position of each row of the T axis. ``layout`` names the rotated pairs: ``"interleaved"``
    (x_2i, x_2i+1: Meta's and llama2.c's layout, minillama's) or ``"half"`` (x_i, x_i+hd/2:
    Hugging Face's). ``theta`` is the base the function is meant to use (10000 is LLaMA 2's,
    500000 Llama 3's): the known-angle identity holds it to that base, which the invariances
    cannot see. The angles should be formed in float64 (positions reach 6000) when ``dtype``
    is float64.

    Runs ``examples`` hypothesis examples per identity; raises AssertionError with the shrunk
    example of each failure. Returns the results.
    """
    if layout not in ("interleaved", "half"):
        raise ValueError(f"layout must be 'interleaved' or 'half', got {layout!r}")
    if not theta > 0:
        raise ValueError(f"theta must be positive, got {theta!r}")
    subject = CallableSubject(dtype, rope=fn)
    subject.rope_layout, subject.rope_theta = layout, float(theta)
    return check_callable(subject, f"check_rope(fn, theta={theta!r}, layout={layout!r}, ",
                          examples, seed)


def check_norm(fn, *, kind: str = "rmsnorm", examples: int = 50, seed: int | None = None,
               dtype=np.float64) -> list[Result]:
    """Hold a row normalisation to its identities: ``kind="rmsnorm"``, ``fn(x, g, eps) -> y``
    (scale invariance with epsilon / a^2, unit-gain RMS, not shift invariant, rows
    independent); ``kind="layernorm"``, ``fn(x, g, b, eps) -> y`` (shift and scale invariance,
    rows independent).

    Layouts: x and y (N, D) in ``dtype``, normalised over the last axis; gain g and bias b (D,);
    eps a float added to the mean square (RMSNorm) or the variance (LayerNorm, biased) before
    the square root.

    Runs ``examples`` hypothesis examples per identity; raises AssertionError with the shrunk
    example of each failure. Returns the results.
    """
    if kind not in ("rmsnorm", "layernorm"):
        raise ValueError(f"kind must be 'rmsnorm' or 'layernorm', got {kind!r}")
    return check_callable(CallableSubject(dtype, **{kind: fn}), f"check_norm(fn, kind={kind!r}, ",
                          examples, seed)
