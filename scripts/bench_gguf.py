#!/usr/bin/env python
"""GGUF files, minillama against llama.cpp on the same file and thread count: batch-1 decode
(llama-bench's ``tg``) and prompt processing (``pp``) in tokens/s, and minillama's peak resident
memory against the file size.

    python -m scripts.bench_gguf --llama-cpp ~/llama.cpp/build/bin --types F32,Q8_0,Q4_K_M,Q4_0

Without ``--gguf`` files, the script writes the ``s110`` shape (dim 768, 12 layers, 32k vocabulary,
the llama2.c "110M" layout; random weights) with llama2.c's ``tokenizer.bin`` (``--tokenizer``,
default ``../shared/data/tokenizer.bin``) as an F32 GGUF, and makes every other type from it with
llama.cpp's ``llama-quantize``. Each repetition runs ``llama-bench -r 1`` and then a fresh minillama
process (``--child``) on the same file, so the two take turns under the same background load; the
best repetition of each counts and the median is printed beside it. llama.cpp is a peer here, never
a dependency: build it from the source inside the ``llama-cpp-python`` sdist (``pip download
--no-binary :all: --no-deps llama-cpp-python``, then ``cmake -B build && cmake --build build -j
--target llama-bench llama-quantize`` in its ``vendor/llama.cpp``).

Both round the activations of the decode products to 8-bit blocks (minillama's numba backend by
default, ``MINILLAMA_QUANT_DOTS=float`` for float32 activations; see docs/MATH.md); minillama's
prefill multiplies dequantized float32 tiles, llama.cpp's integer blocks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts._measure import model_shape, pin_threads

HERE = Path(__file__).resolve().parent
DEFAULT_TOKENIZER = HERE.parent.parent / "shared" / "data" / "tokenizer.bin"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", type=Path,
                    help="folder holding llama-bench and llama-quantize (without it: minillama "
                         "alone, its files made by `minillama quantize`, e.g. on a GPU machine)")
    ap.add_argument("--gguf", nargs="*", type=Path, default=[],
                    help="GGUF files to measure (default: write s110 and quantize it)")
    ap.add_argument("--types", default="F32,Q8_0,Q4_K_M,Q4_0",
                    help="llama-quantize types made from the F32 file (default %(default)s)")
    ap.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER,
                    help="llama2.c tokenizer.bin written into the generated file")
    ap.add_argument("--workdir", type=Path, help="where generated files go (default: a temp dir)")
    ap.add_argument("--backend", default="numba", help="minillama backend (default %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="threads of both (default %(default)s)")
    ap.add_argument("--tg", type=int, default=128, help="decoded tokens (default %(default)s)")
    ap.add_argument("--pp", type=int, default=512, help="prompt tokens (default %(default)s)")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions (default 3)")
    ap.add_argument("--make-files", action="store_true",
                    help="write the --types files into --workdir and stop (no measurement)")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def child(args) -> None:
    """One minillama measurement in this fresh process; prints one JSON line."""
    pin_threads(args.threads)
    import resource

    import numpy as np

    from minillama.infer.generate import GenerationStats, generate, graph_decoder_for
    from minillama.io.load import load_model

    t0 = time.perf_counter()
    model, _ = load_model(args.child, backend=args.backend)
    load_s = time.perf_counter() - t0
    V = model.cfg.vocab_size
    rng = np.random.default_rng(0)
    generate(model, [[1] * 8], max_new_tokens=4)  # compile / warm up (cached kernels load)
    generate(model, [rng.integers(3, V, 64).tolist()], max_new_tokens=1)
    tg = GenerationStats()
    generate(model, [[1]], max_new_tokens=args.tg + 1, stats=tg)
    pp = GenerationStats()
    generate(model, [rng.integers(3, V, args.pp).tolist()], max_new_tokens=1, stats=pp)
    out = {"tg": tg.decode_tokens_per_s, "pp": pp.prefill_tokens_per_s}
    # on the GPU, greedy decode as `minillama generate` runs it: one CUDA graph per step
    dec = graph_decoder_for(model, "auto", 0.0, args.tg + 2)
    if dec is not None:
        dec.generate([[1]], 4)  # captures the graph
        dec.prefill([[1]])
        t0 = time.perf_counter()
        dec.decode(args.tg + 1)
        out = {**out, "tg_eager": out["tg"], "tg": args.tg / (time.perf_counter() - t0)}
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({**out, "rss_mb": rss_mb, "load_s": load_s}))


def run_minillama(path: Path, args) -> dict:
    cmd = [sys.executable, "-m", "scripts.bench_gguf", "--child", str(path), "--backend",
           args.backend, "--threads", str(args.threads), "--tg", str(args.tg), "--pp", str(args.pp)]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_llama_bench(path: Path, args) -> dict:
    cmd = [str(args.llama_cpp / "llama-bench"), "-m", str(path), "-p", str(args.pp),
           "-n", str(args.tg), "-t", str(args.threads), "-r", "1", "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["failed"])[-1]}
    out = {}
    for test in json.loads(r.stdout):
        out["pp" if test["n_prompt"] else "tg"] = float(test["avg_ts"])
    return out


def make_files(args, work: Path) -> list[Path]:
    """s110 as F32 with llama2.c's tokenizer, and each requested type made by llama-quantize."""
    import numpy as np

    from minillama.core.config import ModelConfig
    from minillama.io.gguf import save_gguf
    from minillama.io.tokenizer import load_tokenizer
    from minillama.model.transformer import init_params

    f32 = work / "s110-F32.gguf"
    if not f32.exists():
        cfg = ModelConfig(**model_shape("s110"))
        tok = load_tokenizer(str(args.tokenizer)) if args.tokenizer.is_file() else None
        if tok is None:  # minillama times its decode from ids; llama.cpp needs a vocabulary
            print(f"# {args.tokenizer} not found: the file gets no tokenizer")
        save_gguf(f32, cfg, init_params(cfg, seed=0, dtype=np.float32), tokenizer=tok)
    files = []
    for t in args.types.split(","):
        if t == "F32":
            files.append(f32)
            continue
        out = work / f"s110-{t}.gguf"
        if out.exists():
            pass
        elif args.llama_cpp is not None:
            subprocess.run([str(args.llama_cpp / "llama-quantize"), str(f32), str(out), t,
                            str(args.threads)], check=True, capture_output=True)
        else:
            from minillama.cli.main import main as minillama_main

            if minillama_main(["quantize", str(f32), str(out), "--type", t]) != 0:
                sys.exit(f"bench_gguf: minillama quantize --type {t} failed")
        files.append(out)
    return files


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    pin_threads(args.threads)
    if args.llama_cpp is not None and not (args.llama_cpp / "llama-bench").exists():
        sys.exit("bench_gguf: --llama-cpp must name the folder holding llama-bench")
    tmp = tempfile.TemporaryDirectory() if args.workdir is None else None
    work = Path(tmp.name) if tmp else args.workdir
    work.mkdir(parents=True, exist_ok=True)
    files = args.gguf or make_files(args, work)
    if args.make_files:
        for f in files:
            print(f"{f} {f.stat().st_size / 2**20:.1f} MiB")
        return 0
    load = os.getloadavg()
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} threads={args.threads} backend={args.backend} "
          f"tg={args.tg} pp={args.pp} reps={args.reps} load={load[0]:.2f},{load[1]:.2f}")
    results = {f: {"ml": [], "cpp": []} for f in files}
    for _ in range(args.reps):
        for f in files:  # interleaved: llama.cpp then minillama, file by file, rep by rep
            if args.llama_cpp is not None:
                results[f]["cpp"].append(run_llama_bench(f, args))
            results[f]["ml"].append(run_minillama(f, args))
    head = (f"{'file':<22} {'MB':>6} | {'tg llama.cpp':>12} {'minillama':>10} {'ratio':>6} | "
            f"{'pp llama.cpp':>12} {'minillama':>10} {'ratio':>6} | {'peak MB':>8} {'x file':>6}")
    print(head)
    print("-" * len(head))
    for f in files:
        mb = f.stat().st_size / 2**20
        errs = [r["error"] for side in ("ml", "cpp") for r in results[f][side] if "error" in r]
        if errs:
            print(f"{f.name:<22} {mb:6.0f} | {errs[0]}")
            continue
        row = [f"{f.name:<22} {mb:6.0f}"]
        for key in ("tg", "pp"):
            cpp = [r[key] for r in results[f]["cpp"]] or [float("nan")]
            ml = [r[key] for r in results[f]["ml"]]
            row.append(f"{max(cpp):8.1f} ({statistics.median(cpp):.0f}) "
                       f"{max(ml):6.1f} ({statistics.median(ml):.0f}) {max(ml) / max(cpp):6.2f}")
        rss = max(r["rss_mb"] for r in results[f]["ml"])
        row.append(f"{rss:8.0f} {rss / mb:6.2f}")
        print(" | ".join(row))
    print("best (median) tokens/s; ratio > 1: minillama is faster; peak MB: minillama's peak "
          "resident memory")
    for f in files:
        eager = [r["tg_eager"] for r in results[f]["ml"] if "tg_eager" in r]
        if eager:
            print(f"{f.name}: tg through the CUDA-graph decoder (as `minillama generate`); "
                  f"op by op {max(eager):.1f} ({statistics.median(eager):.0f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
