"""The numba kernels on a CPU without AVX-512, VNNI, GFNI or F16C (an SSE4.2 x86 target, as
``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES`` make Numba compile for it on any x86 host): the
hand-written IR then takes its portable paths (integer dots without ``vpdpbusd``, 4-bit codes
without table lookups, halves by integer operations) and a GGUF model of every integer-kernel
block type still loads, prefills and decodes. Its logits with float32 products equal the numpy
backend's on the same blocks within the error model of the half cache's rows (each may land one
half step apart: a logit moves by about 2^-11 of the largest), and the default 8-bit products
give finite logits near them. Runs in a subprocess with a cache folder of its own (a minute of
compiling)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("numba")
if platform.machine().lower() not in ("x86_64", "amd64"):  # pragma: no cover - other hosts
    pytest.skip("the emulated target is an x86 CPU", allow_module_level=True)

#: an x86-64 CPU of 2008 (Nehalem): SSE4.2, no AVX, no F16C
FEATURES = "+sse2,+sse3,+ssse3,+sse4.1,+sse4.2,+popcnt,+cx16"

_RUN = r"""
import os, sys
import numpy as np
from minillama.backends.numba.floats import half
from minillama.backends.numba.quant import int8_dots, unpack
from minillama.io.load import load_model

print("PATHS", int8_dots.VNNI, int8_dots.GFNI, unpack.LOOKUP, half.NATIVE)
model, _ = load_model(sys.argv[1], backend="numba")
ids = np.arange(1, 12)[None] % model.cfg.vocab_size
out = []
for dots in ("float", "int8"):
    os.environ["MINILLAMA_QUANT_DOTS"] = dots
    cache = model.new_cache(1, 32)
    out.append(model.forward(ids, 0, cache, last_only=True))
    out.append(model.forward(np.array([[5]]), ids.shape[1], cache, last_only=True))  # fused
np.save(sys.argv[2], np.concatenate(out))
"""


@pytest.mark.slow
def test_a_gguf_model_runs_on_a_cpu_without_avx512_or_f16c(tmp_path):
    from minillama.infer.precompile import write_tiny_gguf
    from minillama.io.load import load_model

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    env = {**os.environ, "NUMBA_CPU_NAME": "nehalem", "NUMBA_CPU_FEATURES": FEATURES,
           "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("MINILLAMA_QUANT_DOTS", None)
    r = subprocess.run([sys.executable, "-c", _RUN, str(path), str(tmp_path / "z.npy")], env=env,
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "PATHS False False False False" in r.stdout  # every portable path taken
    got = np.load(tmp_path / "z.npy")
    ref, _ = load_model(path, backend="numpy")  # dequantized blocks, float32 products
    cache = ref.new_cache(1, 32)
    assert cache.k[0].dtype == np.float16  # the same half cache
    ids = np.arange(1, 12)[None] % ref.cfg.vocab_size
    want = np.concatenate([ref.forward(ids, 0, cache, last_only=True),
                           ref.forward(np.array([[5]]), ids.shape[1], cache, last_only=True)])
    scale = np.abs(want).max()
    np.testing.assert_allclose(got[:2], want, rtol=0, atol=2.0 ** -11 * scale)
    assert np.isfinite(got[2:]).all()
    # 8-bit activations: about 2e-2 of the largest logit from float32 products (README)
    np.testing.assert_allclose(got[2:], want, rtol=0, atol=5e-2 * scale)
