#!/usr/bin/env python
"""Products with GGML-block weights (minillama's numba backend, ``backends/numba/quant/matmul.py``)
next to the float32 products of the same backend on the same shape: the linear layers of the 134M
llama2.c shape (dim 768, hidden 2048, vocab 32000).

* M = 1 (decoding): ``qmatmul`` (8-bit activation dots of ``quant/int8_dots.py``) against the
  float32 Numba GEMV (``floats/gemv.py``, one thread by design); effective GB/s = bytes of W / time;
  ratio = float32 time / quantized time.
* M = ``--prefill`` rows (prefill): ``qmatmul`` (the integer GEMM of ``quant/int8_gemm.py``) against
  the float32 GEMM (``floats/blas.py:matmul``, rows over the Numba threads).

``MINILLAMA_QUANT_DOTS=float`` times the float32-activation paths instead (block kernels of
``quant/unpack.py``, dequantized tiles + OpenBLAS GEMM).

The weights are random valid blocks (random bytes, fp16 scales finite and modest): the time of
these kernels does not depend on the values. Sides are interleaved: each repeat times every side
once, best of ``--reps``.

    python -m scripts.bench_quant --threads 2 --types Q8_0,Q4_0,Q4_K,Q6_K
"""

from __future__ import annotations

import argparse

from scripts._measure import best_interleaved, model_shape, pin_threads


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--types", default="Q8_0,Q4_0,Q4_1,Q4_K,Q5_K,Q6_K")
    ap.add_argument("--shapes", default="768x768,2048x768,768x2048,32000x768",
                    help="comma list of NxK (out x in)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--prefill", type=int, default=512, help="rows of x of the prefill product "
                    "(0: skip)")
    ap.add_argument("--decode", default="", metavar="TYPES",
                    help="comma list of weight types (Q8_0, Q4_0, Q4_K_M = Q4_K with Q6_K for "
                         "the embedding, W_v and W_2) for a whole-model decode of the s110 shape "
                         "(the fused step, one sequence) next to the float32 model; skips the "
                         "matrix tables")
    ap.add_argument("--tokens", type=int, default=32, help="decode steps timed per repeat")
    ap.add_argument("--cold", type=int, default=0, metavar="MB",
                    help="M = 1: cycle through copies of each matrix totalling at least MB "
                         "megabytes per side, so that W comes from memory as in a model's decode "
                         "step rather than from the cache (default 0: one copy, cache-hot)")
    return ap.parse_args(argv)


ARGS = parse_args()
pin_threads(ARGS.threads)

import numpy as np  # noqa: E402

from minillama.backends.numba.floats import blas, gemv  # noqa: E402
from minillama.backends.numba.quant import matmul as Q  # noqa: E402
from minillama.core.quant import QUANT_TYPES, QuantMatrix  # noqa: E402


def random_matrix(qtype, N, K, rng):
    per, size = QUANT_TYPES[qtype].block_elems, QUANT_TYPES[qtype].block_bytes
    nb = K // per
    data = rng.integers(0, 256, size=(N, nb, size), dtype=np.uint8)
    for o in QUANT_TYPES[qtype].scale_fields:
        h = (rng.uniform(-1, 1, size=(N, nb)) * 0.01).astype(np.float16)
        data[:, :, o:o + 2] = h.view(np.uint8).reshape(N, nb, 2)
    return QuantMatrix(qtype, (N, K), data.reshape(N, nb * size))


def copies(nbytes):
    """How many copies of a matrix of nbytes make --cold megabytes."""
    return max(1, -(-ARGS.cold * 2**20 // nbytes))


def decode_models(types):
    """(name, model) pairs: the float32 s110 model, then one per type with random blocks in
    place of its matrices (tied embedding and classifier)."""
    from minillama.core.config import ModelConfig
    from minillama.model.transformer import Transformer, init_params

    rng = np.random.default_rng(0)
    cfg = ModelConfig(**model_shape("s110", max_seq_len=256))
    params = init_params(cfg, seed=0, dtype=np.float32)
    yield "float32", Transformer(cfg, params, backend="numba", dtype=np.float32)
    for t in types:
        m = Transformer(cfg, params, backend="numba", dtype=np.float32)
        for name, v in params.items():
            if v.ndim != 2:
                continue
            qt = t
            if t == "Q4_K_M":
                six = name == "tok_embeddings.weight" or name.endswith(
                    ("attention.wv.weight", "feed_forward.w2.weight"))
                qt = "Q6_K" if six else "Q4_K"
            m.params[name] = random_matrix(qt, v.shape[0], v.shape[1], rng)
        yield t, m


def decode_table(types):
    print(f"threads={ARGS.threads}; s110 shape (dim 768, 12 layers, hidden 2048, vocab 32000); "
          f"{ARGS.tokens} decode steps from position 8, best of {ARGS.reps}; ratio = tokens/s "
          "over float32's")
    rows = []
    for name, m in decode_models(types):
        cache = m.new_cache(1, 256)

        def run():
            for p in range(8, 8 + ARGS.tokens):
                m.forward(np.array([[p % 100]]), start_pos=p, cache=cache, last_only=True)

        run()
        t = best_interleaved([run], ARGS.reps)[0]
        nbytes = sum(w.nbytes for w in m.params.values())
        rows.append((name, ARGS.tokens / t, nbytes))
        print(f"{name:>8} {ARGS.tokens / t:8.1f} tokens/s  weights {nbytes / 2**20:7.1f} MiB  "
              f"ratio {ARGS.tokens / t / rows[0][1]:5.2f}", flush=True)


def main():
    if ARGS.decode:
        return decode_table(ARGS.decode.split(","))
    rng = np.random.default_rng(0)
    types = ARGS.types.split(",")
    shapes = [tuple(int(v) for v in s.split("x")) for s in ARGS.shapes.split(",")]
    print(f"threads={ARGS.threads}; times in microseconds (best of {ARGS.reps}); GB/s = bytes "
          "of W / time; ratio = float32 time / quantized time")
    print(f"\nM = 1 (decode): qmatmul vs float32 Numba GEMV "
          f"({'cache-hot' if not ARGS.cold else f'cycling through {ARGS.cold} MB per side'})")
    print(f"{'N x K':>11} {'type':>7} {'quant us':>9} {'GB/s':>6} {'f32 us':>8} {'f32 GB/s':>8} "
          f"{'ratio':>6}")
    for N, K in shapes:
        wf = rng.standard_normal((N, K)).astype(np.float32)
        x = rng.standard_normal((1, K)).astype(np.float32)
        wfs = [wf] + [wf.copy() for _ in range(copies(wf.nbytes) - 1)]
        for qt in types:
            w = random_matrix(qt, N, K, rng)
            ws = [w] + [QuantMatrix(qt, w.shape, w.data.copy())
                        for _ in range(copies(w.nbytes) - 1)]
            it = {"q": 0, "f": 0}

            def quant():
                it["q"] += 1
                Q.qmatmul(x, ws[it["q"] % len(ws)])

            def f32():
                it["f"] += 1
                gemv.gemv(x, wfs[it["f"] % len(wfs)])

            tq, tf = best_interleaved([quant, f32], ARGS.reps)
            print(f"{N:>5} x {K:<4} {qt:>7} {tq * 1e6:9.1f} {w.nbytes / tq / 1e9:6.1f} "
                  f"{tf * 1e6:8.1f} {wf.nbytes / tf / 1e9:8.1f} {tf / tq:6.2f}", flush=True)
    if not ARGS.prefill:
        return
    M = ARGS.prefill
    print(f"\nM = {M} (prefill): qmatmul vs float32 GEMM (OpenBLAS, rows over the Numba threads)")
    print(f"{'N x K':>11} {'type':>7} {'quant ms':>9} {'GFLOP/s':>8} {'f32 ms':>8} "
          f"{'f32 GFLOP/s':>11} {'ratio':>6}")
    for N, K in shapes:
        wf = rng.standard_normal((N, K)).astype(np.float32)
        x = rng.standard_normal((M, K)).astype(np.float32)
        out = np.empty((M, N), dtype=np.float32)
        flop = 2.0 * M * N * K

        def f32():
            if not blas.matmul(x, wf.T, out, ARGS.threads):
                np.matmul(x, wf.T, out=out)

        for qt in types:
            w = random_matrix(qt, N, K, rng)
            tq, tf = best_interleaved([lambda: Q.qmatmul(x, w), f32], max(3, ARGS.reps // 3))
            print(f"{N:>5} x {K:<4} {qt:>7} {tq * 1e3:9.2f} {flop / tq / 1e9:8.1f} "
                  f"{tf * 1e3:8.2f} {flop / tf / 1e9:11.1f} {tf / tq:6.2f}", flush=True)


if __name__ == "__main__":
    main()
