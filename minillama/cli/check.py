"""``minillama check``: run the catalog of transformer identities (:mod:`minillama.identities`)
against a backend with hypothesis and print a table; exit status 1 when one fails, with its
shrunk counterexample and the command line that reproduces it."""

from __future__ import annotations

import json
import random
import sys
import time

import numpy as np

from minillama.backends import backend_names
from minillama.cli.common import positive_int
from minillama.core.errors import MinillamaError
from minillama.identities import CATALOG, DEFAULT_EXAMPLES, resolve_backend, run_catalog, select
from minillama.identities.runner import (
    RATIO_LEGEND,
    default_dtype,
    format_failure,
    format_row,
    reproduce_command,
    summary,
    table_header,
)


def add_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "check", help="run the transformer identities against a backend",
        description="Run the catalog of transformer identities (RoPE depends only on relative "
                    "position, RMSNorm is scale invariant, attention is causal, the KV cache "
                    "and GQA change nothing, quantization stays within half a step, a LoRA "
                    "adapter equals its merge, ...) against a backend with hypothesis: one row "
                    "per identity with the examples tried, the worst error against its "
                    "tolerance, pass or fail, and the seconds taken. Exit status 1 when one "
                    "fails, with hypothesis' shrunk counterexample and a command line that "
                    "reproduces it. The numba backend compiles its kernels on first use (a "
                    "minute or two on a fresh install, cached afterwards).")
    p.add_argument("--backend", default="numpy",
                   help=f"a registered backend ({', '.join(backend_names())}), or "
                        f"package.module:Class, a backend class of one's own (imported from "
                        f"PYTHONPATH or the working directory), instantiated with no "
                        f"arguments. A NumPy class with only some ops runs every identity that "
                        f"calls one of them, the other ops lent by the reference backend (the "
                        f"table says which); identities that touch none of its ops are skipped")
    p.add_argument("--examples", type=positive_int, default=DEFAULT_EXAMPLES,
                   help="hypothesis examples per identity")
    p.add_argument("--only", nargs="+", metavar="NAME", default=None,
                   help="run only the identities named (see --list)")
    p.add_argument("--seed", type=int, default=None,
                   help="hypothesis seed, for a reproducible run (default: a random one, "
                        "printed)")
    p.add_argument("--dtype", choices=("float64", "float32"), default=None,
                   help="the dtype the identities compute in (default: float64, or float32 "
                        "for a backend that declares no float64 support)")
    p.add_argument("--list", action="store_true",
                   help="list the identities (name, backend ops, statement) and exit")
    p.add_argument("--json", action="store_true",
                   help="print the results as one JSON object (for CI)")
    p.set_defaults(func=run_check)


def _list() -> int:
    width = max(len(i.name) for i in CATALOG)
    for i in CATALOG:
        print(f"{i.name:<{width}}  [{', '.join(i.ops) or 'core'}]  {i.statement}")
    return 0


def run_check(args) -> int:
    if args.list:
        return _list()
    if args.seed is not None and args.seed < 0:
        raise MinillamaError(f"--seed must be a non-negative integer, got {args.seed}")
    chosen = select(args.only)  # an unknown name is an error before anything runs
    backend = resolve_backend(args.backend)
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    dtype = np.dtype(args.dtype) if args.dtype else np.dtype(default_dtype(backend))
    width = max(len(i.name) for i in chosen)
    if not args.json:
        if backend.name == "numba":
            print("numba compiles its kernels on first use (cached afterwards): the first run "
                  "takes longer", file=sys.stderr)
        print(f"minillama check: backend {args.backend}, {dtype.name}, {args.examples} "
              f"examples per identity, seed {seed}")
        print(table_header(width), flush=True)

    def show(result):
        if not args.json:
            print(format_row(result, width), flush=True)

    start = time.perf_counter()
    results = run_catalog(backend, args.only, args.examples, seed, dtype, progress=show)
    seconds = time.perf_counter() - start
    failed = [r for r in results if r.status == "fail"]
    again = {r.name: reproduce_command(args.backend, r.name, seed, args.examples, dtype)
             for r in failed}
    if args.json:
        print(json.dumps({
            "backend": args.backend, "dtype": dtype.name, "seed": seed,
            "examples": args.examples, "passed": not failed, "seconds": round(seconds, 2),
            "results": [{**r.to_dict(), **({"reproduce": again[r.name]} if r.name in again
                                           else {})} for r in results]}))
    else:
        print(RATIO_LEGEND)
        print(f"{summary(results)} in {seconds:.1f} s")
        for r in failed:
            print()
            print(format_failure(r, again[r.name]))
    return 1 if failed else 0
