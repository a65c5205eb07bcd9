"""min-p and the repetition penalty (docs/MATH.md, Sampling): properties that hold for any
logits, and agreement with transformers' logits processors where torch is installed."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from minillama.core.errors import MinillamaError
from minillama.core.sampling import (
    SamplingParams,
    apply_frequency_presence,
    apply_repetition_penalty,
    candidates,
    check_sampling,
    sample,
)

logits_st = arrays(np.float64, st.integers(2, 60),
                   elements=st.floats(-30, 30, allow_nan=False, allow_infinity=False))


def _softmax(z, t):
    e = np.exp((z - z.max()) / t)
    return e / e.sum()


@settings(max_examples=200)
@given(z=logits_st, t=st.floats(0.05, 5.0), min_p=st.floats(0.0, 1.0),
       top_k=st.one_of(st.none(), st.integers(1, 80)))
def test_min_p_keeps_exactly_the_tokens_above_the_threshold(z, t, min_p, top_k):
    """Kept: p_v >= min_p * max_u p_u (p the tempered distribution) among what top-k keeps;
    dropped: below it. The kept probabilities are the tempered ones renormalised."""
    ids, p = candidates(z, t, top_k=top_k, min_p=min_p)
    full = _softmax(z, t)
    allowed = np.zeros(len(z), bool)  # what top-k keeps (the filters intersect)
    allowed[candidates(z, t, top_k=top_k)[0]] = True
    # a margin around the threshold: both sides of a float tie are right
    thr = min_p * full.max()
    above = allowed & (full >= thr * (1 + 1e-9))
    below = ~allowed | (full < thr * (1 - 1e-9))
    kept = set(ids.tolist())
    assert {int(i) for i in np.flatnonzero(above)} <= kept
    assert not kept & {int(i) for i in np.flatnonzero(below)}
    assert int(np.argmax(full)) in kept or not allowed[np.argmax(full)]
    np.testing.assert_allclose(p, full[ids] / full[ids].sum(), rtol=1e-9, atol=1e-12)
    assert abs(p.sum() - 1) < 1e-9


@settings(max_examples=200)
@given(z=logits_st, theta=st.floats(0.1, 10.0), data=st.data())
def test_repetition_penalty_rescales_seen_tokens_only(z, theta, data):
    """Seen tokens: z/theta where positive, z*theta otherwise (once, however often seen); the
    others unchanged; with theta >= 1 an unseen token never loses probability."""
    V = len(z)
    history = data.draw(st.lists(st.integers(0, V - 1), max_size=12))
    last_n = data.draw(st.integers(-1, 12))
    out = apply_repetition_penalty(z, history, theta, last_n)
    recent = set(history if last_n < 0 else history[max(0, len(history) - last_n):] if last_n
                 else [])
    for v in range(V):
        if v in recent:
            want = z[v] / theta if z[v] > 0 else z[v] * theta
        else:
            want = z[v]
        assert out[v] == pytest.approx(want, rel=1e-12, abs=0.0)
    if theta >= 1 and recent:
        p0, p1 = _softmax(z, 1.0), _softmax(np.asarray(out, float), 1.0)
        unseen = [v for v in range(V) if v not in recent]
        assert np.all(p1[unseen] >= p0[unseen] * (1 - 1e-12))


@settings(max_examples=100)
@given(z=logits_st, theta=st.floats(1.0, 10.0), data=st.data())
def test_greedy_with_penalty_is_argmax_of_penalised_logits(z, theta, data):
    history = data.draw(st.lists(st.integers(0, len(z) - 1), max_size=8))
    want = int(np.argmax(apply_repetition_penalty(z, history, theta, -1)))
    assert sample(z, None, 0.0, repeat_penalty=theta, repeat_last_n=-1, history=history) == want


def test_matches_transformers_processors():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    rng = np.random.default_rng(0)
    for _ in range(20):
        z = rng.normal(0, 3, 50)
        hist = rng.integers(0, 50, 15)
        theta = float(rng.uniform(1.0, 3.0))
        ref = transformers.RepetitionPenaltyLogitsProcessor(theta)(
            torch.tensor(hist[None]), torch.tensor(z[None]))[0].numpy()
        np.testing.assert_allclose(apply_repetition_penalty(z, hist.tolist(), theta, -1), ref,
                                   rtol=1e-12)
        min_p, t = float(rng.uniform(0.01, 0.5)), float(rng.uniform(0.5, 2.0))
        scores = transformers.MinPLogitsWarper(min_p)(
            torch.tensor(hist[None]), torch.tensor(z[None] / t))[0].numpy()
        ids, _ = candidates(z, t, min_p=min_p)
        assert set(ids.tolist()) == set(np.flatnonzero(np.isfinite(scores)).tolist())


def test_bad_settings_are_refused():
    for kw in ({"min_p": -0.1}, {"min_p": 1.5}, {"repeat_penalty": 0.0},
               {"repeat_penalty": float("nan")}, {"repeat_last_n": -2}):
        with pytest.raises(MinillamaError):
            check_sampling(**kw)


@settings(max_examples=200)
@given(z=logits_st, freq=st.floats(-2, 2), pres=st.floats(-2, 2), data=st.data())
def test_frequency_and_presence_penalties_subtract_per_count(z, freq, pres, data):
    """z_v - c_v freq - [c_v > 0] pres for the c_v times v occurs in the window; others kept."""
    V = len(z)
    history = data.draw(st.lists(st.integers(0, V - 1), max_size=12))
    last_n = data.draw(st.integers(-1, 12))
    out = apply_frequency_presence(z, history, freq, pres, last_n)
    recent = (history if last_n < 0 else history[max(0, len(history) - last_n):] if last_n
              else [])
    for v in range(V):
        c = recent.count(v)
        want = z[v] - c * freq - (pres if c else 0.0)
        assert out[v] == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_sample_applies_frequency_and_presence_penalties():
    """Greedy picks the runner-up once the leader's count pushes it below; presence counts once."""
    z = np.array([2.0, 1.5, 0.0])
    assert sample(z) == 0
    assert sample(z, history=[0], frequency_penalty=0.6) == 1
    assert sample(z, history=[0], frequency_penalty=0.3) == 0
    assert sample(z, history=[0, 0], frequency_penalty=0.3) == 1  # 2 - 2 * 0.3 < 1.5
    assert sample(z, history=[0, 0, 0], presence_penalty=0.4) == 0  # once: 1.6 > 1.5
    assert sample(z, history=[0], presence_penalty=0.6) == 1


def test_sampling_params_check_and_normalise():
    p = SamplingParams(temperature=0.7, top_p=1.0, min_p=0.0, stop="###")
    assert p.top_p is None and p.min_p is None and p.stop == ("###",)
    for bad in ({"temperature": -1}, {"top_k": 0}, {"top_p": 0.0}, {"min_p": 1.5},
                {"repeat_penalty": 0}, {"repeat_last_n": -2}, {"frequency_penalty": 2.5},
                {"presence_penalty": -3}, {"seed": -1}, {"max_tokens": -1}, {"stop": [1]}):
        with pytest.raises(MinillamaError):
            SamplingParams(**bad)
    assert not SamplingParams().penalised
    assert SamplingParams(presence_penalty=0.5).penalised
    assert not SamplingParams(presence_penalty=0.5, repeat_last_n=0).penalised
    with pytest.raises(MinillamaError):
        p.replace(top_k=-1)


def test_sampling_params_pick_is_sample():
    rng_a, rng_b = np.random.default_rng(3), np.random.default_rng(3)
    z = np.random.default_rng(0).normal(size=50)
    p = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, repeat_penalty=1.3,
                       frequency_penalty=0.2, presence_penalty=0.1)
    hist = [1, 2, 2, 7]
    for _ in range(20):
        assert p.pick(z, rng_a, hist) == sample(z, rng_b, 0.8, 20, 0.9, 0.05, 1.3, 64, hist,
                                                0.2, 0.1)
