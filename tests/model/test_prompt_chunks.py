"""A prompt's rows in the cache are a prefill's, however the prompt is cut (numba on GGML
blocks, whose decode step sums in another order than a prefill): on the real SmolLM2 Q4_1 file
a prompt prefilled in chunks leaves the K/V of one prefill bit for bit and gets its logits and
those of the steps after it; a kept prefix (``Transformer.reusable_rows``) holds no row a decode
step wrote, and ``prefill_start`` never leaves one token to prefill."""

from __future__ import annotations

import numpy as np
import pytest

from minillama.backends import available_backends

TEXT = ("Tell me about a violin. It is a string instrument played with a bow; it has four "
        "strings tuned in fifths, and its body is carved from spruce and maple.")


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    if "numba" not in available_backends():
        pytest.skip("numba is not installed")
    from minillama.io.load import load_model

    return load_model(smollm2_gguf, backend="numba")


@pytest.fixture(autouse=True)
def _int8_products(monkeypatch):
    monkeypatch.delenv("MINILLAMA_QUANT_DOTS", raising=False)  # the default 8-bit products


def _run(model, prompt, cuts, follow):
    """The prompt prefilled in the chunks between ``cuts``, then ``follow`` stepped: (the cache,
    the last chunk's logits and each step's)."""
    cache = model.new_cache(1, 128)
    bounds = [0, *cuts, len(prompt)]
    for a, b in zip(bounds, bounds[1:]):
        z = model.forward(np.asarray(prompt[a:b])[None], start_pos=a, cache=cache, last_only=True)
    out = [np.asarray(z)]
    for i, t in enumerate(follow):
        out.append(np.asarray(model.forward(np.array([[t]]), start_pos=len(prompt) + i,
                                            cache=cache, last_only=True)))
    return cache, out


def test_smollm2_prompt_cut_into_chunks_equals_one_prefill_bit_for_bit(smol):
    model, tok = smol
    prompt = tok.encode(TEXT)
    follow = tok.encode(" Its sound")
    n = len(prompt) + len(follow)
    one, want = _run(model, prompt, [], follow)
    for cuts in ([2], [10], [7, 19], [3, 5, len(prompt) - 2]):
        cache, got = _run(model, prompt, cuts, follow)
        for w, g in zip(want, got):
            assert np.array_equal(w, g), cuts
        for a, b in zip(one.k + one.v, cache.k + cache.v):
            assert np.array_equal(a[:, :n], b[:, :n]), cuts


def test_smollm2_kept_rows_are_a_prefills(smol):
    """The rows reusable_rows keeps of a prompt and its decode steps are those of a prefill of
    the prompt: a prefill of the prompt and the reply from there gives the cold run's logits."""
    model, tok = smol
    prompt, reply = tok.encode(TEXT), tok.encode(" Its sound is warm and bright.")
    assert model.reusable_rows(len(prompt), len(prompt) + len(reply)) == len(prompt)
    assert model.reusable_rows(1, 5) == 0  # a one-token prompt is a decode step
    assert model.prefill_start(len(prompt), len(prompt)) == len(prompt) - 2
    assert model.prefill_start(3, 2) == 0
    # every row of the prompt cached: one token fed, its row kept by the caller
    assert model.prefill_start(len(prompt), len(prompt), keep_last=True) == len(prompt) - 1
    assert model.prefill_start(len(prompt) - 1, len(prompt), keep_last=True) == len(prompt) - 2
    turn = prompt + reply
    _, want = _run(model, turn, [], [])
    _, got = _run(model, turn, [len(prompt)], [])
    assert np.array_equal(want[0], got[0])
    # the rows of a decode step are not a prefill's: keeping the reply's would show
    cache = model.new_cache(1, 128)
    model.forward(np.asarray(prompt)[None], cache=cache, last_only=True)
    for i, t in enumerate(reply[:-1]):
        model.forward(np.array([[t]]), start_pos=len(prompt) + i, cache=cache, last_only=True)
    z = model.forward(np.array([[reply[-1]]]), start_pos=len(turn) - 1, cache=cache,
                      last_only=True)
    assert not np.array_equal(want[0], np.asarray(z))
