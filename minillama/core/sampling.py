r"""Choosing the next token from logits: greedy, temperature, top-k, top-p (nucleus), min-p, a
repetition penalty and frequency / presence penalties; :class:`SamplingParams` holds every setting
once for all front ends (``generate``, ``chat``, the batching engine, the server).

With logits z (V,) and temperature \tau > 0 the model's distribution is

    p_v = e^{z_v / \tau} / \sum_u e^{z_u / \tau}.

top-k keeps the k most likely tokens; top-p keeps the smallest set of most likely tokens whose
mass reaches p; min-p keeps the tokens with p_v \ge p_{min} \max_u p_u (transformers'
``min_p``: on the tempered distribution). All renormalise what is kept; a token must pass every
filter. \tau = 0 is greedy: \arg\max_v z_v.

The repetition penalty \theta (CTRL; transformers' ``repetition_penalty``, llama.cpp's
``--repeat-penalty``) first rescales the logits of every token that occurs among the last n
tokens of the context, before temperature and before greedy's argmax:
z_v \leftarrow z_v / \theta if z_v > 0 else z_v \theta (each token once, however often it
occurs).
The frequency and presence penalties (OpenAI's ``frequency_penalty`` / ``presence_penalty``,
llama.cpp's ``--frequency-penalty`` / ``--presence-penalty``) subtract from the logit of every
token seen c_v > 0 times among the same last n tokens:
z_v \leftarrow z_v - c_v \alpha_{freq} - [c_v > 0] \alpha_{pres}.
The candidate sets are found with ``np.argpartition`` (linear time); only the kept candidates are
sorted, never the whole vocabulary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from minillama.core.errors import MinillamaError


def check_sampling(temperature: float = 0.0, top_k: int | None = None,
                   top_p: float | None = None, min_p: float | None = None,
                   repeat_penalty: float = 1.0, repeat_last_n: int = 64) -> None:
    """Raise :class:`MinillamaError` for settings outside their ranges."""
    if min_p is not None and not (0.0 <= min_p <= 1.0):
        raise MinillamaError(f"min_p must lie in [0, 1], got {min_p}")
    if not (repeat_penalty > 0.0) or not np.isfinite(repeat_penalty):
        raise MinillamaError(f"repeat_penalty must be a finite number > 0, got {repeat_penalty}")
    if isinstance(repeat_last_n, bool) or int(repeat_last_n) != repeat_last_n \
            or repeat_last_n < -1:
        raise MinillamaError(f"repeat_last_n must be an integer >= -1, got {repeat_last_n}")
    if not (temperature >= 0.0) or not np.isfinite(temperature):
        raise MinillamaError(f"temperature must be a finite number >= 0, got {temperature}")
    if top_k is not None and (isinstance(top_k, bool) or int(top_k) != top_k or top_k < 1):
        raise MinillamaError(f"top_k must be a positive integer, got {top_k}")
    if top_p is not None and not (0.0 < top_p <= 1.0):
        raise MinillamaError(f"top_p must lie in (0, 1], got {top_p}")


def check_penalties(frequency_penalty: float = 0.0, presence_penalty: float = 0.0) -> None:
    """Raise :class:`MinillamaError` for frequency / presence penalties outside [-2, 2] (OpenAI's
    range)."""
    for name, v in (("frequency_penalty", frequency_penalty),
                    ("presence_penalty", presence_penalty)):
        if not (-2.0 <= v <= 2.0):
            raise MinillamaError(f"{name} must lie in [-2, 2], got {v}")


@dataclass(frozen=True)
class SamplingParams:
    """Every setting of how tokens are chosen, checked once when made: the one object that
    ``generate``, ``chat``, :class:`~minillama.infer.engine.Engine` and the server take.

    ``temperature`` 0 is greedy; ``top_p`` >= 1 and ``min_p`` 0 are stored as None (off);
    ``repeat_last_n`` is the window of the repetition, frequency and presence penalties (-1: the
    whole context); ``seed`` seeds the random draws; ``stop`` are texts that end the output;
    ``max_tokens`` is the most new tokens (None: up to the context)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    max_tokens: int | None = None

    def __post_init__(self):
        check_sampling(self.temperature, self.top_k, self.top_p, self.min_p,
                       self.repeat_penalty, self.repeat_last_n)
        check_penalties(self.frequency_penalty, self.presence_penalty)
        if self.seed is not None and (isinstance(self.seed, bool) or int(self.seed) != self.seed
                                      or self.seed < 0):
            raise MinillamaError(f"seed must be a non-negative integer, got {self.seed}")
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool)
                                            or int(self.max_tokens) != self.max_tokens
                                            or self.max_tokens < 0):
            raise MinillamaError(f"max_tokens must be a non-negative integer, got "
                                 f"{self.max_tokens}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(t, str) for t in stop):
            raise MinillamaError("stop must be a text or a list of texts")
        object.__setattr__(self, "stop", stop)
        if self.top_p is not None and self.top_p >= 1.0:
            object.__setattr__(self, "top_p", None)  # keeps everything
        if not self.min_p:
            object.__setattr__(self, "min_p", None)

    @classmethod
    def of(cls, params: SamplingParams | None = None, **settings) -> SamplingParams:
        """``params`` (default: greedy) with the named ``settings`` replaced (fields of this
        class); an unknown name is a :class:`MinillamaError`."""
        base = params if params is not None else cls()
        unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise MinillamaError(f"unknown sampling setting {unknown[0]!r}")
        return dataclasses.replace(base, **settings) if settings else base

    def replace(self, **changes) -> SamplingParams:
        """A copy with ``changes``, checked again."""
        return dataclasses.replace(self, **changes)

    @property
    def penalised(self) -> bool:
        """Whether any penalty looks at the context (so a greedy pick depends on it)."""
        return self.repeat_last_n != 0 and (self.repeat_penalty != 1.0
                                            or self.frequency_penalty != 0.0
                                            or self.presence_penalty != 0.0)

    def pick(self, logits, rng: np.random.Generator | None = None, history=()) -> int:
        """One token id from logits (V,) under these settings (see :func:`sample`)."""
        return sample(logits, rng, self.temperature, self.top_k, self.top_p, self.min_p,
                      self.repeat_penalty, self.repeat_last_n, history,
                      self.frequency_penalty, self.presence_penalty)


def top_indices(z: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest entries of z (V,), in descending order of z (ties: lower id
    first)."""
    V = z.shape[0]
    if k >= V:
        idx = np.arange(V)
    else:
        idx = np.argpartition(-z, k - 1)[:k]
    order = np.lexsort((idx, -z[idx]))
    return idx[order]


def apply_repetition_penalty(logits, history, penalty: float, last_n: int = 64) -> np.ndarray:
    r"""The logits (V,) with the repetition penalty \theta applied to the distinct tokens of the
    last ``last_n`` ids of ``history`` (-1: all of them, 0: none):
    z_v \leftarrow z_v / \theta if z_v > 0 else z_v \theta. A new array; \theta = 1 returns
    the input."""
    z = np.asarray(logits)
    if penalty == 1.0 or last_n == 0 or len(history) == 0:
        return z
    recent = history if last_n < 0 else history[-int(last_n):]
    ids = np.unique(np.asarray(recent, dtype=np.int64))
    ids = ids[(ids >= 0) & (ids < z.shape[-1])]
    z = np.array(z, dtype=np.float64 if z.dtype == np.float64 else np.float32)
    seen = z[ids]
    z[ids] = np.where(seen > 0, seen / penalty, seen * penalty)
    return z


def apply_frequency_presence(logits, history, frequency: float, presence: float,
                             last_n: int = 64) -> np.ndarray:
    r"""The logits (V,) less c_v \alpha_{freq} + [c_v > 0] \alpha_{pres} for each token v seen
    c_v times among the last ``last_n`` ids of ``history`` (-1: all, 0: none). A new array; both
    0 return the input."""
    z = np.asarray(logits)
    if (frequency == 0.0 and presence == 0.0) or last_n == 0 or len(history) == 0:
        return z
    recent = history if last_n < 0 else history[-int(last_n):]
    ids, counts = np.unique(np.asarray(recent, dtype=np.int64), return_counts=True)
    keep = (ids >= 0) & (ids < z.shape[-1])
    ids, counts = ids[keep], counts[keep]
    z = np.array(z, dtype=np.float64 if z.dtype == np.float64 else np.float32)
    z[ids] -= counts * frequency + presence
    return z


def candidates(logits, temperature: float = 1.0, top_k: int | None = None,
               top_p: float | None = None,
               min_p: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    r"""The tokens that may be sampled and their renormalised probabilities.

    logits: (V,). Returns (ids (K,), probs (K,)) with probs summing to 1; with a filter the ids
    are sorted by decreasing probability, without one they are the whole vocabulary in id order
    (no sort needed to sample). top-p keeps the shortest prefix of that order whose mass
    \sum p \ge top\_p (the token that crosses the threshold is kept). min-p then keeps those
    with p_v \ge min\_p \cdot \max_u p_u (the most likely token always stays).
    """
    ids, p = _candidates(logits, temperature, top_k, top_p)
    if min_p:
        keep = p >= min_p * p.max()
        ids, p = ids[keep], p[keep]
        p = p / p.sum()
    return ids, p


def _candidates(logits, temperature, top_k, top_p) -> tuple[np.ndarray, np.ndarray]:
    """:func:`candidates` before min-p."""
    z = np.asarray(logits, dtype=np.float64).reshape(-1)
    V = z.shape[0]
    t = float(temperature) if temperature > 0 else 1.0
    k = V if top_k is None else min(int(top_k), V)
    # log-sum-exp over the whole vocabulary gives exact probabilities of any candidate subset
    zmax = z.max()
    logZ = zmax / t + np.log(np.exp((z - zmax) / t).sum())
    if top_p is None or top_p >= 1.0:
        ids = np.arange(V) if top_k is None else top_indices(z, k)
        p = np.exp(z[ids] / t - logZ)
        return ids, p / p.sum()
    # nucleus: grow a partially selected candidate set until it holds mass >= top_p
    m = min(k, 64)
    while True:
        ids = top_indices(z, m)
        p = np.exp(z[ids] / t - logZ)
        c = np.cumsum(p)
        if c[-1] >= top_p or m >= k:
            n = min(int(np.searchsorted(c, top_p)) + 1, m)  # first index with c >= top_p
            ids, p = ids[:n], p[:n]
            return ids, p / p.sum()
        m = min(4 * m, k)


def sample(logits, rng: np.random.Generator | None = None, temperature: float = 0.0,
           top_k: int | None = None, top_p: float | None = None, min_p: float | None = None,
           repeat_penalty: float = 1.0, repeat_last_n: int = 64, history=(),
           frequency_penalty: float = 0.0, presence_penalty: float = 0.0) -> int:
    """One token id from logits (V,): argmax when ``temperature == 0`` else a draw from the
    (top-k / top-p / min-p filtered) tempered distribution using ``rng``; the repetition
    penalty, then the frequency and presence penalties, over the ids of ``history`` (the context
    so far) apply first in both cases."""
    z = apply_repetition_penalty(logits, history, repeat_penalty, repeat_last_n)
    z = apply_frequency_presence(z, history, frequency_penalty, presence_penalty, repeat_last_n)
    if temperature == 0.0:
        return int(np.argmax(z))
    if rng is None:
        raise MinillamaError("sampling with temperature > 0 needs a random generator")
    ids, p = candidates(z, temperature, top_k, top_p, min_p)
    u = rng.random()
    j = int(np.searchsorted(np.cumsum(p), u, side="right"))
    return int(ids[min(j, len(ids) - 1)])


def first_stop(text: str, stops: Iterable[str]) -> int | None:
    """Where the earliest complete stop string of ``stops`` in ``text`` starts (None:
    nowhere)."""
    found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(found) if found else None


class StopText:
    """Cuts streamed text at the first occurrence of any of some stop strings.

    :meth:`push` takes the next piece of text and returns what may be shown now: everything up to
    a stop string once one appears (then :attr:`hit` is set), else everything except a tail that
    could still be the start of a stop string (held back until the next piece decides it)."""

    def __init__(self, stops: Iterable[str] = ()):
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=1)
        self.held = ""
        self.hit = False

    def push(self, piece: str) -> str:
        if self.hit:
            return ""
        text = self.held + piece
        first = first_stop(text, self.stops)
        end = len(text) if first is None else first
        # a tail that begins a stop which more text could complete before `end`: wait for it
        for j in range(max(0, len(text) - self.longest + 1), end):
            if any(len(s) > len(text) - j and s.startswith(text[j:]) for s in self.stops):
                self.held = text[j:]
                return text[:j]
        self.held = ""
        self.hit = first is not None
        return text[:end]

    def flush(self) -> str:
        """The held-back tail, once no more text comes (cut at a stop string it holds)."""
        out, self.held = ("" if self.hit else self.held), ""
        first = first_stop(out, self.stops)
        if first is not None:
            self.hit = True
            out = out[:first]
        return out
