r"""Packed rows: several examples in one (B, T) row, each computing what it computes alone
(``minillama finetune --pack``; docs/MATH.md 5). :func:`draw_packed` fills the rows from the
data order and :func:`pack_batch` lays them out with their ``segments``.

``segments`` (B, T) gives the example of every token (each example one contiguous run). While a
forward (or a training step) runs with :func:`packed`, the model's ``segments`` is set and

* positions restart at every example, m_{b,t} = t - (start of its run)
  (:func:`minillama.core.ops.segment_positions`): RoPE takes its angles there (:func:`rope_rows`),
  sinusoidal tables their rows (:func:`positions`);
* attention reads only keys of the query's own example (the block-diagonal causal mask):
  :func:`attention_ops` gives the backend's packed pair when it has one (``numpy``, and ``numba``
  which inherits it) or the reference's (``reference``, ``cupy``).
"""

from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager

import numpy as np

from minillama.core import ops
from minillama.core.errors import MinillamaError


@contextmanager
def packed(model, segments, shape):
    """Run the body with ``model.segments`` set to ``segments`` (checked against the tokens'
    ``shape``); None leaves the model as it is."""
    if segments is None:
        yield
        return
    seg = np.asarray(model.backend.to_numpy(segments))
    if seg.ndim == 1:
        seg = seg[None, :]
    if seg.shape != tuple(shape) or not np.issubdtype(seg.dtype, np.integer):
        raise MinillamaError(f"segments must be (B, T) integers like the tokens {tuple(shape)}, "
                             f"got {seg.dtype} {seg.shape}")
    model.segments = seg
    try:
        yield
    finally:
        model.segments = None


def takes_segments(method):
    """Give a model method (``forward``, ``loss``, ``loss_and_grads``) a ``segments=None``
    keyword: with it the call runs on packed rows (:func:`packed`), from position 0, no cache."""
    sig = inspect.signature(method)

    @functools.wraps(method)
    def call(model, tokens, *args, segments=None, **kwargs):
        if segments is None:
            return method(model, tokens, *args, **kwargs)
        given = sig.bind(model, tokens, *args, **kwargs).arguments
        start = given.get("start_pos", 0)
        if given.get("cache") is not None or np.ndim(start) or start:
            raise MinillamaError("packed rows (segments) start at 0 and take no KV cache")
        tok = model._tokens(tokens)
        with packed(model, segments, tok.shape):
            return method(model, tok, *args, **kwargs)

    return call


def positions(model):
    """(B, T) positions restarting per example, on the model's backend, checked against the
    context."""
    pos = ops.segment_positions(model.segments)
    if pos.size and pos.max() >= model.cfg.max_seq_len:
        raise MinillamaError(f"a packed example of {pos.max() + 1} tokens exceeds the model "
                             f"context of {model.cfg.max_seq_len}")
    return model.backend.asarray(pos)


def rope_rows(model, T: int):
    """cos/sin (B, T, hd/2) at the restarting positions; (None, None) without RoPE."""
    if model.segments.shape[1] != T:
        raise MinillamaError(f"segments cover {model.segments.shape[1]} positions, not {T}")
    pos = positions(model)
    if model.cfg.pos_encoding != "rope":
        return None, None
    cos, sin = model._rope_table(int(pos.max()) + 1)
    return cos[pos], sin[pos]


def attention_ops(model, S: int, window=None):
    """The attention (forward, backward) pair for packed rows: the backend's
    ``attention_forward_packed`` when it has one, else the reference; a sliding ``window`` that
    hides keys takes the reference with both masks."""
    if S != model.segments.shape[1]:
        raise MinillamaError("packed rows cannot read a KV cache")
    seg = model.backend.asarray(model.segments)
    be = model.backend
    if window is None and be.attention_forward_packed is not None:
        fwd, bwd = be.attention_forward_packed, be.attention_backward_packed
        return (lambda q, k, v, start_pos: fwd(q, k, v, start_pos, segments=seg)), bwd
    return (lambda q, k, v, start_pos: ops.attention_forward(q, k, v, start_pos, window=window,
                                                             segments=seg),
            ops.attention_backward)


# ---------------------------------------------------------------------------------------------
# the data side: examples laid end to end in rows
# ---------------------------------------------------------------------------------------------
def pack_batch(rows: list[list], pad_id: int = 0):
    """(tokens, targets, segments), each (B, T) with T = the fullest row: row b is its examples'
    (:class:`minillama.train.finetune.Example`) x = ids[:-1] one after the other, targets ids[1:]
    where trained and -1 elsewhere, ``segments`` the index of the example each token belongs to; the
    padding after the last example is one more segment, its targets ignored."""
    T = max(sum(len(e.ids) - 1 for e in row) for row in rows)
    x = np.full((len(rows), T), pad_id, dtype=np.int64)
    y = np.full((len(rows), T), -1, dtype=np.int64)
    seg = np.empty((len(rows), T), dtype=np.int64)
    for b, row in enumerate(rows):
        at = 0
        for k, e in enumerate(row):
            n = len(e.ids) - 1
            x[b, at:at + n] = e.ids[:-1]
            y[b, at:at + n] = np.where(e.train[1:], e.ids[1:], -1)
            seg[b, at:at + n] = k
            at += n
        seg[b, at:] = len(row)
    return x, y, seg


def draw_packed(examples: list, sampler, B: int, T: int) -> list[list]:
    """B rows of whole examples in the sampler's order, each row filled while the next example
    fits in its T tokens (an example that fits no more starts the next row; one that fits no row
    left stays first in the sampler)."""
    rows, used = [[]], [0]
    while True:
        n = len(examples[sampler.peek()].ids) - 1
        if rows[-1] and used[-1] + n > T:
            if len(rows) == B:
                return rows
            rows.append([])
            used.append(0)
        rows[-1].append(examples[sampler.next(1)[0]])
        used[-1] += n
