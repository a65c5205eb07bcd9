"""The catalog's bitwise identities (:mod:`minillama.identities.invariance`): held to zero
difference where a backend promises them, measured and reported "not guaranteed" where it does
not, and able to catch the bug they are for: a product whose float order depends on how many
rows are multiplied at once (a GEMV for a few rows, a blocked GEMM for more)."""

from __future__ import annotations

import numpy as np
import pytest

from minillama.backends import get_backend
from minillama.core.errors import MinillamaError
from minillama.core.quant import QuantMatrix, dequantize
from minillama.identities import BY_NAME, Subject, run_identity, select
from minillama.identities.runner import NOT_GUARANTEED, format_row, summary

NAMES = ("batch_invariance", "prefix_cache_invariance", "chunked_prefill_invariance",
         "next_turn_invariance",
         "thread_invariance", "prefill_decode_invariance", "float_decode_batch_invariance",
         "float_decode_thread_invariance", "float_prefill_decode_invariance",
         "speculative_equals_greedy")
#: what numba promises on float weights whatever the product mode
FLOATS = {"float_decode_batch", "float_decode_threads"}


def _numba():
    try:
        return get_backend("numba")
    except MinillamaError as e:  # pragma: no cover - numba missing
        pytest.skip(f"numba backend unavailable: {e}")


def test_the_catalog_holds_the_ten_and_the_reference_promises_none():
    assert [i.name for i in select(topics=("invariance",))] == list(NAMES)
    assert all(BY_NAME[n].exact for n in NAMES)
    assert get_backend("reference").invariance == frozenset()


def test_numba_keeps_its_promises_bit_for_bit(monkeypatch):
    """numba promises batch, prefix-cache and thread invariance on GGML blocks with 8-bit
    products, the drafts' verification step against the decode steps and the prefill against
    the decode steps (the catalog's model has blocks of 32); on float weights, the decode
    steps' batch and thread invariance, but not their prefill against the decode steps, which
    it reports with a figure."""
    monkeypatch.delenv("MINILLAMA_QUANT_DOTS", raising=False)
    be = _numba()
    assert be.invariance == {"batch", "prefix_cache", "threads", "speculative",
                             "prefill_decode"} | FLOATS
    results = [run_identity(BY_NAME[n], Subject(be, np.float32), examples=8, seed=1)
               for n in NAMES]
    unpromised = (8,)  # the prefill against the decode steps on float weights
    assert [r.status for r in results] == [NOT_GUARANTEED if i in unpromised else "pass"
                                           for i in range(len(NAMES))]
    assert all(r.worst == 0.0 for i, r in enumerate(results) if i not in unpromised)
    assert "not guaranteed (largest difference" in format_row(results[8], 30)
    assert "1 not guaranteed by the backend" in summary(results)
    monkeypatch.setenv("MINILLAMA_QUANT_DOTS", "float")  # float products: the floats' left
    assert be.invariance == FLOATS


def test_an_unpromised_identity_is_measured_and_never_fails():
    r = run_identity(BY_NAME["batch_invariance"], Subject(get_backend("numpy"), np.float32),
                     examples=4, seed=2)
    assert r.status == NOT_GUARANTEED and r.examples >= 4 and r.worst >= 0.0


def _row_count_dependent(be):
    """``be``'s class with a linear whose float order depends on the rows multiplied at once:
    up to 8 rows one dot per output, more rows as two half-sums added (a split-K GEMM)."""

    class RowCountDependent(type(be)):
        invariance = frozenset({"batch", "prefix_cache"})

        def linear_forward(self, x, w):
            y, ctx = super().linear_forward(x, w)
            if x.reshape(-1, x.shape[-1]).shape[0] <= 8:
                return y, ctx
            h = x.shape[-1] // 2
            lo = super().linear_forward(np.ascontiguousarray(x[..., :h]),
                                        np.ascontiguousarray(self._dense(w)[:, :h]))[0]
            hi = super().linear_forward(np.ascontiguousarray(x[..., h:]),
                                        np.ascontiguousarray(self._dense(w)[:, h:]))[0]
            return lo + hi, ctx

        @staticmethod
        def _dense(w):
            return dequantize(w).astype(np.float32) if isinstance(w, QuantMatrix) else w

    return RowCountDependent()


def test_a_product_order_that_follows_the_row_count_fails_batch_invariance():
    """The bug the identity is for (the 8-bit GEMV for a few rows, the GEMM tiles for more
    once summed in other orders): a prompt alone (few rows) and in a padded group (many). The
    same identity passes on the backend without the bug (above)."""
    be = _row_count_dependent(_numba())  # numba keeps batch invariance: the bug breaks it
    r = run_identity(BY_NAME["batch_invariance"], Subject(be, np.float32), examples=30, seed=3)
    assert r.status == "fail", format_row(r, 30)
    assert r.counter_ratio is not None and r.counter_ratio > 0


def test_a_batched_float_step_that_falls_back_to_the_per_op_path_fails():
    """A float model's step of several sequences that declines the fused kernel (the per-op
    path: a Numba GEMV for up to 4 rows, BLAS above) sums its products in another order than
    the one-sequence step."""
    be = _numba()

    class PerOpWhenBatched(type(be)):
        def decode_step(self, model, tok, start_pos, cache):
            return None if tok.shape[0] > 1 else super().decode_step(model, tok, start_pos,
                                                                     cache)

    r = run_identity(BY_NAME["float_decode_batch_invariance"],
                     Subject(PerOpWhenBatched(), np.float32), examples=30, seed=5)
    assert r.status == "fail", format_row(r, 30)


def test_drafts_verified_as_a_prompt_chunk_fail_the_speculative_identity():
    """Verifying drafts by the prompt path (the rows as the prompt's next chunk: the 8-bit
    GEMM and the prompt's attention) gives logits that differ from the decode steps' in the
    last bits, so speculative decoding would change greedy tokens on near-ties."""
    be = _numba()

    class PromptPathVerify(type(be)):
        def greedy_decoder(self, model, max_seq_len, stop_ids=(), speculate=False, cache=None,
                           cached=0):
            return None  # the identity then verifies by a forward of the rows

    r = run_identity(BY_NAME["speculative_equals_greedy"], Subject(PromptPathVerify(), np.float32),
                     examples=30, seed=7)
    assert r.status == "fail", format_row(r, 30)


def test_a_nan_fails_even_where_nothing_is_promised():
    """A difference is measured where a backend promises nothing; a NaN or an infinity is no
    rounding and fails."""

    class NanWhenBatched(type(get_backend("numpy"))):
        def linear_forward(self, x, w):
            y, ctx = super().linear_forward(x, w)
            return (y * np.nan if x.reshape(-1, x.shape[-1]).shape[0] > 8 else y), ctx

    be = NanWhenBatched()
    assert be.invariance == frozenset()
    r = run_identity(BY_NAME["batch_invariance"], Subject(be, np.float32), examples=10, seed=4)
    assert r.status == "fail", format_row(r, 30)
