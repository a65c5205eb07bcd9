"""The package's layers (CONTRIBUTING.md, "Layers"): each module imports only modules of its own
layer or of the layers below it, at module level and inside functions alike, and nothing imports
in a circle.

    core  <-  backends  <-  model  <-  io, identities  <-  infer, train, mathmap  <-  cli

``io`` and ``identities`` (the catalog of transformer identities, which builds whole models)
share a rank and import neither each other nor the layers above; ``infer``, ``train`` and
``mathmap`` (the math-to-code map behind ``minillama explain``, which reads the identities'
catalog) sit side by side and import none of the others. The package root
(``minillama/__init__.py``) re-exports the main entry points of every layer and is imported by
nothing but the CLI (for ``__version__``).

Imports inside functions are kept only where :data:`LOCAL_IMPORTS` names them with the reason:
the backends' compiled kernels, which load (and compile, or read Numba's cache) only when an op
first needs them. Optional heavy dependencies (CuPy, mpi4py, the server stack, torch in tests)
are third-party and not counted here.
"""

from __future__ import annotations

from tests.project.test_layout import cycles, import_edges, import_graph

#: layer name -> rank; a module may import modules of rank <= its own (but not its SIBLINGS)
LAYERS = {"core": 0, "backends": 1, "model": 2, "io": 3, "corpus": 3, "identities": 3,
          "infer": 4, "train": 4, "mathmap": 4, "cli": 5, "__main__": 5}
SIBLINGS = {("infer", "train"), ("train", "infer"), ("io", "identities"), ("identities", "io"),
            ("mathmap", "infer"), ("infer", "mathmap"), ("mathmap", "train"),
            ("train", "mathmap")}

_KERNELS = "Numba kernels load (compile, or read the cache) only when an op first needs them"
#: (importer, imported) -> why that import sits inside a function
LOCAL_IMPORTS = {
    ("minillama.backends.numba.backend_decode", "minillama.backends.numba.quant.int8_lanes"):
        _KERNELS,
    ("minillama.backends.numba.quant.matmul", "minillama.backends.numba.quant.int8_lanes"):
        _KERNELS,
    ("minillama.backends.numba.backend_rows", "minillama.backends.numba.backend_decode"):
        "backend_decode's mixin imports the row ops' module: at the top the two would cycle",
    ("minillama.backends.numba.backend", "minillama.backends.numba.kernels"): _KERNELS,
    ("minillama.backends.numba.backend", "minillama.backends.numba.floats.gemv"): _KERNELS,
    ("minillama.backends.numba.backend", "minillama.backends.numba.floats.blas"): _KERNELS,
    ("minillama.backends.numba.backend", "minillama.backends.numba.quant.int8_dots"): _KERNELS,
    ("minillama.backends.numba.backend", "minillama.backends.numba.quant.matmul"): _KERNELS,
    ("minillama.backends.numba.backend", "minillama.backends.numba.floats.adamw"): _KERNELS,
    ("minillama.backends.numba.backend_decode", "minillama.backends.numba.decode.float_step"):
        _KERNELS,
    ("minillama.backends.numba.backend_decode", "minillama.backends.numba.decode.quant_step"):
        _KERNELS,
    ("minillama.backends.numba.backend_decode", "minillama.backends.numba.quant.int8_dots"):
        _KERNELS,
    ("minillama.backends.numba.backend_decode", "minillama.backends.numba.rows_compile"):
        _KERNELS,
    ("minillama.backends.numba.quant.matmul", "minillama.backends.numba.quant.int8_dots"): _KERNELS,
    ("minillama.backends.numba.quant.matmul", "minillama.backends.numba.quant.int8_gemm"): _KERNELS,
    ("minillama.backends.cupy.mixed_precision", "minillama.backends.cupy.build"):
        "the CUDA kernels compile (NVRTC) only when the bf16 path first runs",
    ("minillama.backends", "minillama.backends.cupy.graph"):
        "the CUDA-graph decoder loads only when a model on the cupy backend asks for it",
}
MAX_LOCAL_IMPORTS = 25


def layer(module: str) -> str:
    """``minillama.io.gguf`` -> ``io``; the package root -> ``root``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "root"


def test_imports_follow_the_layers():
    wrong = []
    for importer, targets in import_edges(local=True).items():
        src = layer(importer)
        for target in targets:
            dst = layer(target)
            if src == "root":
                continue  # the facade re-exports every layer
            if dst == "root":
                ok = src in ("cli", "__main__")
            else:
                ok = LAYERS[dst] <= LAYERS[src] and (src, dst) not in SIBLINGS
            if not ok:
                wrong.append(f"{importer} ({src}) imports {target} ({dst})")
    assert not wrong, "imports against the layer order:\n" + "\n".join(sorted(wrong))


def test_no_circle_counting_imports_inside_functions():
    found = cycles(import_graph(local=True))
    assert not found, f"modules that import each other (imports inside functions counted): {found}"


def test_imports_inside_functions_are_the_named_ones():
    top = import_graph()
    local = {(m, t) for m, targets in import_graph(local=True).items() for t in targets
             if t not in top[m]}
    unnamed = sorted(local - set(LOCAL_IMPORTS))
    assert not unnamed, ("project imports inside functions; move them to the module's top "
                         f"or name them with the reason in LOCAL_IMPORTS: {unnamed}")
    stale = sorted(set(LOCAL_IMPORTS) - local)
    assert not stale, f"no longer imported inside a function, remove from LOCAL_IMPORTS: {stale}"
    assert len(LOCAL_IMPORTS) <= MAX_LOCAL_IMPORTS


def test_layer_checker_sees_a_wrong_arrow():
    """The checker itself: every source layer is known, and the order refuses upward arrows."""
    assert {layer(m) for m in import_graph()} - {"root"} <= set(LAYERS)
    assert LAYERS["core"] < LAYERS["backends"] < LAYERS["model"] < LAYERS["io"] < LAYERS["cli"]
