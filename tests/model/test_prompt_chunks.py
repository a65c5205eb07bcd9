"""A prompt's rows in the cache are a prefill's, however the prompt is cut and whether a
prefill or decode steps wrote them (numba on GGML blocks of 32, whose decode steps compute a
position as the prefill does): on the real SmolLM2 Q4_1 file a prompt prefilled in chunks leaves
the K/V of one prefill bit for bit and gets its logits and those of the steps after it, and a
reply fed by decode steps leaves the rows a prefill of prompt and reply writes, so a kept prefix
(``Transformer.reusable_rows``) may hold every row."""

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


def test_smollm2_decode_steps_write_a_prefills_rows(smol):
    """A prompt prefilled, then a reply fed one token at a time by decode steps: every K/V row
    and the last logits are those of one prefill of prompt and reply, bit for bit, so
    reusable_rows keeps every position and prefill_start leaves one token."""
    model, tok = smol
    prompt, reply = tok.encode(TEXT), tok.encode(" Its sound is warm and bright.")
    turn = prompt + reply
    assert model.backend.prefill_decode_invariant(model) and not model.decode_rows_differ
    assert model.reusable_rows(len(prompt), len(turn)) == len(turn)
    assert model.prefill_start(len(prompt), len(prompt)) == len(prompt) - 1
    cold, want = _run(model, turn, [], [])
    stepped, got = _run(model, prompt, [], reply)
    assert np.array_equal(want[0], got[-1])
    for a, b in zip(cold.k + cold.v, stepped.k + stepped.v):
        assert np.array_equal(a[:, :len(turn)], b[:, :len(turn)])
