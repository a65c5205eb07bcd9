"""``minillama compile`` (:mod:`minillama.infer.precompile`) compiles, on its tiny models, every
kernel and signature that ``generate --chat``, ``chat`` and ``serve``'s warm-up compile for the
real SmolLM2-135M-Instruct (its Q4_1 GGUF file, and the same weights as a float32 Hugging Face
folder), and ``generate --exact`` on the GGUF file: after it, their first answer loads its
kernels from the disk cache instead of waiting for Numba. Each side runs in a fresh process on
the same cache (an editable install has filled it already; else this test compiles it, a few
minutes).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("numba")

#: the numba kernels a process holds (compiled or loaded from the cache), as "module.name(sig)"
_KERNELS = r"""
import io, json, sys
from minillama.cli.main import build_parser, main

def kernels():
    from numba.core.dispatcher import Dispatcher
    out = set()
    for name, m in list(sys.modules.items()):
        if name.startswith("minillama.backends.numba") and m is not None:
            for v in vars(m).values():
                if isinstance(v, Dispatcher):
                    key = v.py_func.__module__ + "." + v.py_func.__qualname__
                    out |= {key + str(s) for s in v.signatures}
    return sorted(out)

def run(*argv, stdin=""):
    sys.stdin = io.StringIO(stdin)
    assert main(list(argv)) == 0, argv
"""

_COMPILE = _KERNELS + """
run("compile")
print("KERNELS" + json.dumps(kernels()))
"""

#: the commands' own warm-ups and first answers on the real files (the kernel of several rows
#: compiled in this process, as the test suite has it, not in a worker)
_REAL = _KERNELS + """
from minillama.backends import get_backend
from minillama.cli.serve import load_engine
get_backend("numba").compile_in_background = False
gguf, hf = sys.argv[1], sys.argv[2]
for ckpt in (gguf, hf):
    run("generate", "--chat", "-c", ckpt, "--tokenizer", gguf, "--prompt", "hi", "-n", "4",
        "--temperature", "0")
    run("chat", "-c", ckpt, "--tokenizer", gguf, "--temperature", "0", stdin="hi\\n")
    engine = load_engine(build_parser().parse_args(["serve", "-c", ckpt, "--tokenizer", gguf]))[0]
    engine.close()
run("generate", "--chat", "-c", gguf, "--prompt", "hi", "-n", "4", "--temperature", "0",
    "--exact")
print("KERNELS" + json.dumps(kernels()))
"""


def _kernels(script: str, *args: str) -> set[str]:
    r = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                       timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("KERNELS"))
    return set(json.loads(line.removeprefix("KERNELS")))


@pytest.mark.slow
def test_compile_covers_the_kernels_of_a_real_models_first_answers(smollm2_gguf, tmp_path):
    hf = tmp_path / "smollm2-f32"
    subprocess.run([sys.executable, "-m", "minillama", "export", str(smollm2_gguf), "--format",
                    "hf", "--out", str(hf)], check=True, capture_output=True, timeout=600)
    ahead = _kernels(_COMPILE)
    real = _kernels(_REAL, str(smollm2_gguf), str(hf))
    for step in ("quant_step.decode_step_one_q_kernel(", "float_step.decode_step_one("):
        assert any(step in k for k in real), step  # both real models' decode steps were seen
    missing = sorted(real - ahead)
    assert not missing, "compiled for the real model but not ahead:\n" + "\n".join(missing)
