"""What the backends' multi-step decoders share with the generation loop, below both of them:
the :class:`ChunkDecoder` base, the greedy loop :func:`stream_greedy` that drives one, and the
check that turns non-finite logits into one clear error (:func:`finite_logits`).
"""

from __future__ import annotations

import time

import numpy as np

from minillama.core.errors import MinillamaError


class ChunkDecoder:
    """What the decoders driven by :func:`stream_greedy` share (the numba backend's
    :class:`~minillama.backends.numba.backend_decode.GreedyDecoder` and the CUDA-graph
    :class:`~minillama.backends.cupy.graph.GraphDecoder`): a cache of ``S`` positions, the prompt
    length ``_P`` (None before ``prefill``) and ``_done`` ids decoded so far, the prefill's
    included. Subclasses set those and provide ``prefill`` and ``more``."""

    S: int = 0
    _P: int | None = None
    _done: int = 0
    #: draft tokens verified and taken (:mod:`minillama.core.speculative`; 0 without drafts)
    drafted: int = 0
    accepted: int = 0

    @property
    def positions(self) -> int:
        """The cache positions the sequence holds: the prompt and the ids fed (the last id is
        not fed yet); where the next fed id goes."""
        return 0 if self._P is None else self._P + self._done - 1

    def room(self) -> int:
        """How many more ids :meth:`more` can decode before the cache is full."""
        return 0 if self._P is None else self.S - self._P - self._done + 1

    def _check_more(self, k) -> int:
        """``k`` as an int, after checking that ``prefill`` ran and that k ids fit the cache."""
        k = int(k)
        if self._P is None:
            raise MinillamaError(f"{type(self).__name__}.more: call prefill first")
        if k < 0 or k > self.room():
            raise MinillamaError(f"{k} more tokens after {self._done} decoded from position "
                                 f"{self._P} exceed the cache length {self.S}")
        return k


def stream_greedy(decoder, prompt_ids, max_new_tokens: int, max_seq_len: int,
                  stop_ids=(), stats=None, chunk: int = 16):
    """Greedy generation of one prompt through ``decoder`` (one that decodes several steps per
    call: :class:`~minillama.backends.numba.backend_decode.GreedyDecoder`, the CUDA-graph
    :class:`~minillama.backends.cupy.graph.GraphDecoder` with batch 1, or anything with their
    ``prefill`` / ``more`` / ``room`` methods), yielding lists of
    ``(0, token)`` pairs like :func:`minillama.infer.generate.generate_steps`: the same tokens, the
    same stop rule (a stop id ends the text and is not yielded) and the same budget
    (``max_new_tokens``, capped where the context of ``max_seq_len`` positions ends).

    The decoder runs ``chunk`` steps per call, so Python (and for the graph the host) is back
    once per chunk (the text still streams); ids decoded past a stop token are discarded.
    ``stats`` (a :class:`~minillama.infer.generate.GenerationStats`) is filled in as in the eager
    loop."""
    prompt = [int(t) for t in prompt_ids]
    P = len(prompt)
    budget = int(min(max_new_tokens, max_seq_len - P + 1))
    stop = {int(t) for t in stop_ids}
    if stats is not None:
        stats.batch_size = 1
    if budget <= 0:
        return
    t0 = time.perf_counter()
    first = int(decoder.prefill(np.asarray([prompt], dtype=np.int64))[0])
    if stats is not None:
        stats.prompt_tokens = P
        stats.prefill_s = time.perf_counter() - t0
    if first in stop:
        return
    if stats is not None:
        stats.new_tokens += 1
    yield [(0, first)]
    emitted = 1
    while emitted < budget:
        t0 = time.perf_counter()
        k = min(int(chunk), budget - emitted, decoder.room())
        if k <= 0:
            break
        ids = [int(t) for t in decoder.more(k)[0]]
        out = []
        for t in ids:
            if t in stop:
                break
            out.append((0, t))
        emitted += len(ids)
        if stats is not None:
            stats.decode_steps += len(out) + (len(out) < len(ids))
            stats.new_tokens += len(out)
            stats.decode_s += time.perf_counter() - t0
        if out:
            yield out
        if len(out) < len(ids):
            return


def finite_logits(z: np.ndarray, where: str) -> np.ndarray:
    """The logits, unless they hold NaN/inf: then one clear error instead of sampled garbage
    (weights that load but overflow float32 in the forward pass)."""
    if not np.isfinite(z).all():
        raise nonfinite_error(where)
    return z


def nonfinite_error(where: str) -> MinillamaError:
    """The error for logits holding NaN/inf at ``where`` (e.g. "position 12")."""
    return MinillamaError(f"the model's logits for {where} hold NaN/inf values (its weights "
                          f"overflow the compute dtype; try --dtype float64)")
