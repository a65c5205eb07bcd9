"""OpenBLAS's GEMM called from Numba (backends/numba/floats/blas.py): every transpose combination,
beta, both float dtypes, row splits over the threads, and the cases it declines."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

numba_blas = pytest.importorskip("minillama.backends.numba.floats.blas")

pytestmark = pytest.mark.skipif(not numba_blas.available(),
                                reason="NumPy's BLAS is not an OpenBLAS whose GEMM was found")


def _operand(rng, rows, cols, dt, transposed):
    """A (rows, cols) operand, either row-major or the transpose of a row-major array."""
    if transposed:
        return rng.standard_normal((cols, rows)).astype(dt).T
    return rng.standard_normal((rows, cols)).astype(dt)


@pytest.mark.parametrize("dt", [np.float32, np.float64])
@pytest.mark.parametrize("M,K,N", [(300, 64, 48), (3, 5, 7), (64, 700, 16), (1, 4, 1)])
@pytest.mark.parametrize("ta,tb", list(itertools.product([False, True], repeat=2)))
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_matmul_matches_numpy(dt, M, K, N, ta, tb, beta, rng, monkeypatch):
    monkeypatch.setattr(numba_blas, "SPLIT_MIN_MACS", 0)  # split even the small products,
    monkeypatch.setattr(numba_blas, "SPLIT_MIN_ROWS", 1)  # down to one row per thread
    a, b = _operand(rng, M, K, dt, ta), _operand(rng, K, N, dt, tb)
    out0 = rng.standard_normal((M, N)).astype(dt)
    out = out0.copy()
    assert numba_blas.matmul(a, b, out, threads=3 if M >= 2 else 1, beta=beta)
    ref = a.astype(np.float64) @ b + beta * out0
    tol = 1e-5 if dt == np.float32 else 1e-12
    assert np.abs(out - ref).max() <= tol * max(1.0, np.abs(ref).max())


def test_matmul_writes_into_a_view_with_its_leading_dimension(rng):
    """out may be a column block of a wider array (ldc > N); the columns around it stay."""
    a, b = _operand(rng, 40, 8, np.float32, False), _operand(rng, 8, 6, np.float32, True)
    big = np.full((40, 10), 7.0, dtype=np.float32)
    assert numba_blas.matmul(a, b, big[:, 2:8], threads=2)
    np.testing.assert_allclose(big[:, 2:8], a @ b, rtol=1e-5, atol=1e-5)
    assert (big[:, :2] == 7).all() and (big[:, 8:] == 7).all()


def test_matmul_every_other_row(rng):
    """a[::2] is row-major with a leading dimension of twice its width."""
    a = rng.standard_normal((64, 4)).astype(np.float32)
    b = rng.standard_normal((4, 5)).astype(np.float32)
    out = np.zeros((32, 5), dtype=np.float32)
    assert numba_blas.matmul(a[::2], b, out, threads=2)
    np.testing.assert_allclose(out, a[::2] @ b, rtol=1e-5, atol=1e-5)


def test_matmul_declines_what_it_cannot_do(rng):
    a = rng.standard_normal((6, 4)).astype(np.float32)
    b = rng.standard_normal((4, 5)).astype(np.float32)
    out = np.zeros((6, 5), dtype=np.float32)
    assert not numba_blas.matmul(a[:, ::2], b[::2], out, threads=2)  # strided columns
    assert not numba_blas.matmul(a.astype(np.float64), b, out, threads=2)  # mixed dtypes
    assert not numba_blas.matmul(a.astype(np.int32), b.astype(np.int32),
                                 out.astype(np.int32), threads=2)
    assert not numba_blas.matmul(a, b, np.zeros((6, 5), dtype=np.float32).T.copy().T,
                                 threads=2)  # out not row-major
    assert (out == 0).all()


def test_matmul_leaves_few_row_large_products_to_openblas(rng):
    """A prefill-like product (a few rows, large K N) is declined when threads > 1, so that
    OpenBLAS's own threads split its columns; on one thread it runs."""
    a = rng.standard_normal((5, 512)).astype(np.float32)
    b = rng.standard_normal((512, 1024)).astype(np.float32)
    out = np.zeros((5, 1024), dtype=np.float32)
    assert not numba_blas.matmul(a, b, out, threads=2)
    assert not out.any()
    assert numba_blas.matmul(a, b, out, threads=1)
    np.testing.assert_allclose(out, a @ b, rtol=1e-4, atol=1e-4)
