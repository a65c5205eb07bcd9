"""Speculative decoding on the numba backend (:class:`SpeculativeDecoder`): drafts verified by
one fused step of several rows of the same sequence give plain greedy decoding's ids bit for bit,
on GGML block weights with 8-bit products and on float weights, in ``generate`` and in a chat's
second turn on its reused cache; and on the real SmolLM2 file."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from minillama.backends import get_backend
from minillama.core import speculative as spec
from minillama.core.errors import MinillamaError
from minillama.identities import Subject
from minillama.identities.invariance import block_model, float_model
from minillama.infer.generate import GenerationStats, generate


def _numba():
    try:
        return get_backend("numba")
    except MinillamaError as e:  # pragma: no cover - numba missing
        pytest.skip(f"numba backend unavailable: {e}")


class Eager(spec.DraftPolicy):
    """Draft whenever a draft of a tried length is there (every round verifies)."""

    def length(self, available, matched=0):
        return max([k for k in self.lengths if k <= available], default=0)


@pytest.fixture
def eager(monkeypatch):
    monkeypatch.setattr(spec, "DraftPolicy", Eager)


def _oracle(monkeypatch, prompt, want):
    """Drafts that are the plain decoder's own continuation, every 6th token wrong (long runs
    taken, misses at every place in a draft)."""
    truth = list(prompt) + list(want)

    def guess(self, k):
        n = len(self.ids)
        out = [t if i % 6 != 5 else (t + 1) % 61 for i, t in enumerate(truth[n:n + k], n)]
        return out, 16

    monkeypatch.setattr(spec.PromptLookup, "guess", guess)


@pytest.mark.parametrize("make", [block_model, float_model], ids=["blocks", "float32"])
def test_verified_drafts_give_the_plain_greedy_ids(make, eager, monkeypatch):
    """Every round verifies up to 16 rows, drafts taken in part or whole, and the ids stay
    the plain decoder's."""
    monkeypatch.delenv("MINILLAMA_QUANT_DOTS", raising=False)
    model = make(Subject(_numba(), np.float32), 3)
    assert model.backend.speculation_exact(model)
    prompt = [5, 9, 2, 7, 5, 9, 2, 7, 5, 9]
    want = generate(model, prompt, 60, speculate=False)
    _oracle(monkeypatch, prompt, want)
    stats = GenerationStats()
    got = generate(model, prompt, 60, stats=stats)
    assert got == want
    assert stats.drafted > 0 and 0 < stats.accepted < stats.drafted


def test_float_products_on_blocks_do_not_speculate(monkeypatch):
    """With ``MINILLAMA_QUANT_DOTS=float`` a step of several rows is not promised to compute each
    row as alone: plain decoding, no drafts."""
    monkeypatch.setenv("MINILLAMA_QUANT_DOTS", "float")
    model = block_model(Subject(_numba(), np.float32), 4)
    assert not model.backend.speculation_exact(model)
    stats = GenerationStats()
    generate(model, [5, 9, 2, 5, 9, 2], 20, stats=stats)
    assert stats.drafted == 0


def test_a_verification_past_the_cache_is_refused(eager):
    model = float_model(Subject(_numba(), np.float32), 5)
    dec = model.backend.greedy_decoder(model, 8, speculate=True)
    dec.prefill(np.array([[1, 2, 3, 4]]))
    dec.verify_logits([1, 2, 3, 4])  # positions 4..7: the last slot
    with pytest.raises(MinillamaError, match="exceed the KV cache"):
        dec.verify_logits([1, 2, 3, 4, 5])


@pytest.mark.slow
def test_smollm2_repeats_a_paragraph_by_verified_drafts(smollm2_gguf, monkeypatch):
    """The real file, default policy: asked to repeat a paragraph, the greedy text is the plain
    decoder's bit for bit, drafts verified on the way."""
    monkeypatch.delenv("MINILLAMA_QUANT_DOTS", raising=False)
    from minillama.io.chat_template import encode_rendered, render_chat, stop_ids
    from minillama.io.load import load_model

    model, tok = load_model(smollm2_gguf, backend="numba")
    text = ("The violin, sometimes known as a fiddle, is a wooden chordophone, and is the "
            "smallest, and thus highest-pitched instrument in regular use in the violin family. "
            "Most violins have a hollow wooden body, and commonly have four strings.")
    ids = encode_rendered(tok, render_chat(tok, [
        {"role": "user", "content": "Repeat this text exactly:\n\n" + text}]))
    stop = stop_ids(tok)
    want = generate(model, ids, 96, speculate=False, stop_ids=stop)
    stats = GenerationStats()
    got = generate(model, ids, 96, stats=stats, stop_ids=stop)
    assert got == want
    assert stats.drafted > 0 and stats.accepted > 0, (stats.accepted, stats.drafted, len(got))


def _mapped_blocks(s, seed):
    """:func:`block_model` with its blocks read-only, as a GGUF file's memory map gives them."""
    model = block_model(s, seed)
    for w in model.params.values():
        if hasattr(w, "qtype"):
            w.data.flags.writeable = False
    return model


@pytest.mark.parametrize("make", [block_model, _mapped_blocks, float_model],
                         ids=["blocks", "mapped-blocks", "float32"])
def test_the_worker_compiles_the_kernel_a_real_call_takes(make, monkeypatch):
    """The kernel of several rows is compiled apart from a model (:mod:`.rows_compile`): the
    scratch arguments' types are a real verification's, blocks quantized in memory or mapped
    read-only from a file alike, so the worker's code is the code the answer then loads."""
    from minillama.backends.numba import rows_compile

    be = _numba()
    model = make(Subject(be, np.float32), 3)
    kind = "float32" if make is float_model else "quant"
    kind += "-f16" if model.kv_dtype == np.float16 else ""  # the default for blocks
    dispatcher, scratch = rows_compile.scratch_args(kind)
    seen = []
    monkeypatch.setattr(be, "_rows", lambda plan, tok, pos, seq, kc, vc, logits, tuner=None:
                        seen.append(_real_args(be, plan, tok, pos, seq, kc, vc, logits)))
    be.decode_rows(model, [1, 2], [0, 1], [0, 0], model.new_cache(1, 4))
    assert rows_compile.signature(dispatcher, scratch) == rows_compile.signature(dispatcher,
                                                                                 seen[0])


def _real_args(be, plan, tok, pos, seq, kc, vc, logits):
    """The arguments ``_rows`` passes the kernel of several rows (2 threads)."""
    from minillama.backends.numba.backend_decode import _NO_IDS, _NO_IDS_2D, _model_args

    if plan.get("quant"):
        return be._rows_q_args(plan, tok, pos, seq, kc, vc, logits, 2)
    return (tok, pos, seq, *_model_args(plan, kc, vc), logits, 2, _NO_IDS, _NO_IDS_2D)


class _Worker:
    """A stand-in for the compiling process of ``kind``: done after ``polls`` polls, having
    done the worker's job (:func:`.rows_compile.main`, here in this process), so the kernel is
    there whether or not an earlier test compiled it."""

    def __init__(self, polls, kind):
        self.polls, self.kind, self.returncode = polls, kind, None

    def poll(self):
        from minillama.backends.numba import rows_compile

        self.polls -= 1
        if self.polls <= 0 and self.returncode is None:
            self.returncode = rows_compile.main([self.kind])
        return self.returncode


def test_a_cold_kernel_compiles_in_a_worker_and_drafts_start_after_it(eager, monkeypatch):
    """The kernel missing from the cache: the answer starts without drafts (plain steps, the
    same ids) while a worker compiles it, and verifies drafts once the worker has ended."""
    from minillama.backends.numba import rows_compile

    be = _numba()
    monkeypatch.setattr(be, "compile_in_background", True)
    monkeypatch.setattr(be, "_rows_compiled", {}, raising=False)
    model = float_model(Subject(be, np.float32), 8)
    prompt = [5, 9, 2, 7, 5, 9, 2, 7, 5, 9]
    want = generate(model, prompt, 60, speculate=False)
    _oracle(monkeypatch, prompt, want)
    workers = []
    real = rows_compile.loadable
    monkeypatch.setattr(rows_compile, "loadable",
                        lambda d, a: bool(workers) and workers[0].returncode == 0 and real(d, a))
    monkeypatch.setattr(rows_compile, "start_worker",
                        lambda kind: workers.append(_Worker(3, kind)) or workers[0])
    verified = []  # the worker's state at each verification
    rows = be.decode_rows
    monkeypatch.setattr(be, "decode_rows",
                        lambda *a: verified.append(workers[0].returncode) or rows(*a))
    stats = GenerationStats()
    assert generate(model, prompt, 60, stats=stats) == want
    assert len(workers) == 1 and workers[0].returncode == 0
    assert stats.drafted > 0 and verified and set(verified) == {0}  # only after it ended


@pytest.mark.parametrize("target, drafter, seed, itself", [
    (float_model, block_model, 3, False),  # the same weights in GGML blocks
    (block_model, block_model, 3, True),  # the model itself
    (float_model, float_model, 8, False),  # other weights
], ids=["float-by-its-blocks", "blocks-by-itself", "float-by-another"])
def test_a_draft_model_gives_the_plain_greedy_ids(target, drafter, seed, itself, eager,
                                                  monkeypatch):
    """``--draft``: a draft model proposes its greedy continuation (every round, whatever its
    rate: the eager policy); the ids stay the plain decoder's, and the model drafting for itself
    has every draft taken (its cache kept in step with the text). Known ids reach the draft
    model's cache by fused steps (``refeed``), not by its prompt path."""
    monkeypatch.delenv("MINILLAMA_QUANT_DOTS", raising=False)
    be = _numba()
    model = target(Subject(be, np.float32), 3)
    draft = drafter(Subject(be, np.float32), seed)
    prompt = [5, 9, 2, 7, 1, 4, 3, 8]
    want = generate(model, prompt, 60, speculate=False)
    kind = type(be.greedy_decoder(draft, 8))
    refed, real = [], kind.refeed
    monkeypatch.setattr(kind, "refeed", lambda self, p, t: refed.append(len(t)) or real(self, p, t))
    stats = GenerationStats()
    assert generate(model, prompt, 60, stats=stats, draft=draft) == want
    assert stats.drafted > 0 and refed
    if itself:
        assert stats.accepted == stats.drafted


def test_workers_on_one_cold_cache_compile_the_kernel_once(tmp_path):
    """Two workers for one kernel (two processes that each found the cache cold): while one
    holds the lock and compiles, the other waits for it and then finds the kernel there, so
    the kernel is built once (:func:`.rows_compile.compile_once`)."""
    import threading

    from minillama.backends.numba import rows_compile

    pytest.importorskip("fcntl", reason="POSIX file locks")
    path = str(tmp_path / "rows_compile-quant.lock")
    built, state = [], {"ready": False}
    first_in, release = threading.Event(), threading.Event()

    def build_first():
        first_in.set()
        release.wait()
        built.append("first")
        state["ready"] = True

    one = threading.Thread(target=rows_compile.compile_once,
                           args=(path, lambda: state["ready"], build_first))
    one.start()
    first_in.wait()  # the first worker holds the lock and is compiling
    two = threading.Thread(target=rows_compile.compile_once,
                           args=(path, lambda: state["ready"], lambda: built.append("second")))
    two.start()
    release.set()
    one.join()
    two.join()
    assert built == ["first"]
    # a worker on a cache that holds the kernel builds nothing; one on a cold cache builds it
    rows_compile.compile_once(path, lambda: True, lambda: built.append("third"))
    rows_compile.compile_once(path, lambda: False, lambda: built.append("fourth"))
    # no lock file to be had (a folder that does not exist): it builds all the same
    rows_compile.compile_once(str(tmp_path / "none" / "x.lock"), lambda: False,
                              lambda: built.append("fifth"))
    assert built == ["first", "fourth", "fifth"]


_LOADABLE = r"""
import sys
from numba.core import caching
import numpy as np
sys.path.insert(0, sys.argv[1])
import tiny_kernel
from minillama.backends.numba import rows_compile

loads = []
real = caching.Cache.load_overload
caching.Cache.load_overload = lambda self, *a: loads.append(1) or real(self, *a)
args = (np.zeros(3, np.float32),)
print(rows_compile.loadable(tiny_kernel.twice, args), len(loads),
      len(tiny_kernel.twice.overloads))
"""


def test_loadable_reads_a_cached_kernel_once_and_installs_it(tmp_path):
    """:func:`.rows_compile.loadable`: a kernel missing from the disk cache is not loadable (and
    nothing compiles); once cached, a fresh process finds it and installs it with one read of
    the cache (the first verification waited for two reads of the kernel of several rows)."""
    (tmp_path / "tiny_kernel.py").write_text(
        "from numba import njit\n\n\n@njit(cache=True)\ndef twice(x):\n    return 2 * x\n")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}

    def run():
        r = subprocess.run([sys.executable, "-c", _LOADABLE, str(tmp_path)], env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout.split()

    assert run() == ["False", "0", "0"]  # not cached: nothing read, nothing compiled
    subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                    "import numpy as np, tiny_kernel; tiny_kernel.twice(np.zeros(3, np.float32))",
                    str(tmp_path)], env=env, check=True, timeout=600)
    assert run() == ["True", "1", "1"]  # cached: one read, installed
