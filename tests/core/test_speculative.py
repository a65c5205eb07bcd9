"""Prompt-lookup drafts, their acceptance and the draft-length policy
(:mod:`minillama.core.speculative`), and the speculative loop on a toy decoder whose "model" is a
function of the context: whatever the drafts, the ids are plain greedy decoding's."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillama.core import speculative as spec
from minillama.core.decoding import ChunkDecoder, stream_greedy
from minillama.core.speculative import (
    DraftPolicy,
    PromptLookup,
    Speculation,
    accepted_length,
)


def test_a_draft_is_what_followed_the_latest_earlier_occurrence():
    look = PromptLookup([5, 6, 7, 1, 2, 5, 6, 9, 4, 5, 6])
    assert look.draft(3) == [9, 4, 5]  # "5 6" last seen before 9 (not before 7)
    look = PromptLookup([1, 2, 3, 8, 2, 3, 9, 1, 2, 3])
    assert look.draft(2) == [8, 2]  # the trigram "1 2 3" wins over the later bigram "2 3"
    assert PromptLookup([1, 2, 3, 4]).draft(4) == []  # nothing repeats
    assert PromptLookup([1, 2, 1, 2]).draft(0) == []


def test_a_draft_past_the_context_end_repeats_its_period():
    look = PromptLookup([7, 1, 2, 3, 1, 2])  # "1 2" was followed by 3, two tokens back... period 3
    assert look.draft(7) == [3, 1, 2, 3, 1, 2, 3]
    look.extend([3, 1, 2])
    assert look.draft(2) == [3, 1]


def test_accepted_length_counts_up_to_the_first_miss():
    assert accepted_length([4, 5, 6], [4, 5, 6, 7]) == 3
    assert accepted_length([4, 5, 6], [4, 9, 6, 7]) == 1
    assert accepted_length([4], [3, 1]) == 0
    assert accepted_length([], [3]) == 0


def test_a_guess_says_how_long_a_run_the_context_shares_with_its_source():
    look = PromptLookup([4, 1, 2, 3, 9, 8, 7, 1, 2, 3])
    assert look.guess(2) == ([9, 8], 3)  # "1 2 3" shared, "4" / "7" differ
    look = PromptLookup([5, 6, 1, 2, 3, 9, 5, 6, 1, 2, 3])
    assert look.guess(1) == ([9], 5)


def test_the_policy_drafts_long_on_accepted_drafts_and_stops_on_rejected_ones():
    pol = DraftPolicy()
    pol.timed(1, 1.0)
    for _ in range(40):
        pol.observe(7, 7, matched=9)
    assert pol.rates[DraftPolicy.bucket(9)] > 0.95 and pol.length(15, 9) == 15
    assert pol.length(10, 9) == 7 and pol.length(2, 9) == 0  # only the lengths it tries
    for _ in range(60):
        pol.observe(3, 0, matched=9)
    assert pol.rates[2] < 0.05 and pol.length(15, 9) == 0
    # each run length learns apart: short matches kept their prior
    assert pol.rates[0] == DraftPolicy().rates[0]


def test_the_policy_weighs_measured_step_times():
    pol = DraftPolicy(rate=0.999, memory=1.0)
    pol.timed(1, 1.0)
    assert pol.length(15) == 15
    pol.timed(16, 40.0)  # a 16-row step far dearer than its prior: 12 rows instead
    assert pol.length(15) == 11
    # a miss counts once, the tokens after it are untested
    pol = DraftPolicy(rate=0.0, memory=0.5)
    pol.observe(7, 2)
    assert pol.rates[0] == 0.5 * (0.5 * (0.5 * 0 + 0.5) + 0.5)  # hit, hit, miss


V = 13


def _next(ctx) -> int:
    """The toy model's greedy choice after ``ctx``: counting on modulo 5 (a loop prompt lookup
    finds), thrown off it at every 23rd position (drafts that miss)."""
    return (ctx[-1] + 1) % 5 + (5 + len(ctx) % 3 if len(ctx) % 23 == 0 else 0)


class ToyDecoder(Speculation, ChunkDecoder):
    """A decoder of the toy model with the speculative loop: ``verify`` answers each row from
    the context, as a batch-invariant backend's step does; its steps are priced by the policy's
    prior, never by the clock (the test's outcome does not depend on the machine's speed)."""

    def __init__(self, S: int, stop=()):
        self.S, self.stop, self.calls = S, np.array(sorted(stop), dtype=np.int64), []

    def prefill(self, prompt):
        self.ctx = [int(t) for t in np.asarray(prompt).reshape(-1)]
        self._P, self._done = len(self.ctx), 1
        self._last = _next(self.ctx)
        self._start_lookup(self.ctx, self._last)
        return np.array([self._last])

    def _plain(self, n):
        self.calls.append(("plain", n))
        out = []
        for _ in range(n):
            self.ctx.append(self._last)
            self._last = _next(self.ctx)
            self._done += 1
            out.append(self._last)
            if self._last in self.stop:
                break
        return out

    def verify(self, tokens):
        self.calls.append(("verify", len(tokens)))
        assert tokens[0] == self._last and self._P + self._done - 1 + len(tokens) <= self.S
        ctx = list(self.ctx)
        picks = []
        for t in tokens:
            ctx.append(int(t))
            picks.append(_next(ctx))
        return picks

    def timing_settled(self):
        return False  # the toy's wall times are noise: the policy prices steps by its prior

    def _take(self, ids):
        self.ctx.extend([self._last, *ids[:-1]])
        self._done += len(ids)
        self._last = ids[-1]


def _plain_ids(prompt, n, stop=()):
    ctx, out = list(prompt), []
    for _ in range(n):
        t = _next(ctx)
        if t in stop:
            break
        out.append(t)
        ctx.append(t)
    return out


class Eager(DraftPolicy):
    """A policy that always drafts as long as it may (the verification path every round)."""

    def length(self, available, matched=0):
        return max([k for k in self.lengths if k <= available], default=0)


@settings(max_examples=60, deadline=None)
@given(prompt=st.lists(st.integers(0, V - 1), min_size=1, max_size=30),
       n=st.integers(1, 60), eager=st.booleans(), stop=st.sets(st.integers(0, V - 1), max_size=2))
def test_speculative_ids_are_the_plain_greedy_ids(prompt, n, eager, stop):
    """Whatever the drafts and whichever path each round takes, the ids (stop rule and budget
    included) are plain greedy decoding's; the cache is never asked past its end."""
    S = len(prompt) + n
    dec = ToyDecoder(S, stop)
    old = spec.DraftPolicy
    spec.DraftPolicy = Eager if eager else DraftPolicy
    try:
        got = [t for step in stream_greedy(dec, prompt, n, S, stop) for _, t in step]
    finally:
        spec.DraftPolicy = old
    assert got == _plain_ids(prompt, n, stop)
    assert dec.accepted <= dec.drafted


def test_a_loop_is_decoded_by_verified_drafts():
    """The toy model loops: with the default policy the loop is learned from plain steps'
    shadow drafts and then verified 4 to 16 rows at a time, most drafted tokens taken."""
    prompt = [7, 1, 9, 8]
    n = 120
    dec = ToyDecoder(len(prompt) + n)
    got = [t for step in stream_greedy(dec, prompt, n, len(prompt) + n) for _, t in step]
    assert got == _plain_ids(prompt, n)
    verified = [rows for kind, rows in dec.calls if kind == "verify"]
    assert verified and set(verified) <= {4, 8, 12, 16}
    assert dec.accepted > 0.5 * dec.drafted
    assert len(dec.calls) < 0.5 * n  # fewer model calls than tokens


def _draft_fn(seed: int):
    """A toy draft model: its greedy choice after ``ctx`` depends on every position of it (a
    draft cache holding one wrong position changes its drafts); seed 0 is the toy model itself."""
    def fn(ctx):
        return _next(ctx) if seed == 0 else (sum((i + seed) * t for i, t in enumerate(ctx))
                                             + len(ctx)) % V
    return fn


class ToyDraft(ChunkDecoder):
    """A plain greedy decoder of a toy draft model over a cache of S positions: ``prefill``
    keeps the first ``cached`` positions, ``more`` feeds ids one by one, and ``refeed`` (where
    ``fused``) writes known ids at any positions; each id is computed from the cache."""

    def __init__(self, S, fn, fused):
        self.S, self.fn, self.cache, self.cached, self.fused = S, fn, [None] * S, 0, fused
        self.fed = 0  # positions written

    def prefill(self, prompt):
        ids = [int(t) for t in np.asarray(prompt).reshape(-1)]
        for i in range(self.cached, len(ids)):
            self.cache[i] = ids[i]
        self.fed += len(ids) - self.cached
        self._P, self._done = len(ids), 1
        self._last = self.fn(self.cache[:len(ids)])
        return np.array([self._last])

    def more(self, k):
        out = []
        for _ in range(k):
            p = self.positions
            self.cache[p], self._done = self._last, self._done + 1
            self.fed += 1
            self._last = self.fn(self.cache[:p + 1])
            out.append(self._last)
        return np.array([out])

    def __getattr__(self, name):
        if name == "refeed" and self.__dict__.get("fused"):
            return self._refeed
        raise AttributeError(name)

    def _refeed(self, positions, tokens):
        for i, t in enumerate(tokens):
            self.cache[positions + i] = int(t)
        self.fed += len(tokens)
        self._done = positions + len(tokens) - self._P + 1
        self._last = self.fn(self.cache[:positions + len(tokens)])
        return self._last


def _source(decoder):
    src = spec.DraftModel(None)
    src.decoder = decoder
    return src


def _greedy(fn, ctx, k):
    ctx, out = list(ctx), []
    for _ in range(k):
        out.append(fn(ctx))
        ctx.append(out[-1])
    return out


@settings(max_examples=80, deadline=None)
@given(prompt=st.lists(st.integers(0, V - 1), min_size=1, max_size=12), seed=st.integers(0, 3),
       fused=st.booleans(), rounds=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6),
                                                      st.integers(0, V - 1)), max_size=12))
def test_a_model_draft_is_the_draft_models_greedy_continuation_of_the_context(
        prompt, seed, fused, rounds):
    """Whatever was drafted before and however much of it the context then took (a prefix of
    the draft and one other id, or ids without a draft), each draft is the draft model's greedy
    continuation of the whole context, computed from scratch: the positions its cache keeps
    hold the context."""
    fn = _draft_fn(seed)
    draft = spec.ModelDraft(_source(ToyDraft(64, fn, fused)), prompt)
    for k, taken, other in rounds:
        got, _ = draft.guess(k)
        assert got == _greedy(fn, draft.ids, min(k, 64 - len(draft.ids) + 1))
        ids = got[:min(taken, len(got))] + [other]
        if len(draft.ids) + len(ids) + 8 > 64:
            break
        draft.extend(ids)
        assert draft.guess(2)[0] == _greedy(fn, draft.ids, 2)


def test_drafts_the_context_confirms_are_not_fed_again():
    """After a draft taken up to its third token, only the id after them is fed to the draft
    model (with fused steps of known ids), not the whole context."""
    fn = _draft_fn(0)
    dec = ToyDraft(64, fn, fused=True)
    draft = spec.ModelDraft(_source(dec), [1, 2, 3, 4])
    guess, _ = draft.guess(5)
    fed = dec.fed
    draft.extend(guess[:3] + [(guess[3] + 1) % V])
    draft.guess(1)
    assert dec.fed - fed == 1  # the new id only: the three drafts it took stayed in the cache


@settings(max_examples=40, deadline=None)
@given(prompt=st.lists(st.integers(0, V - 1), min_size=1, max_size=20), n=st.integers(1, 60),
       seed=st.integers(0, 3), fused=st.booleans())
def test_a_draft_model_gives_the_plain_greedy_ids(prompt, n, seed, fused):
    """The speculative loop drafting from a draft model (a right one, seed 0, or a wrong one)
    decodes the plain greedy ids; a right draft model has its drafts verified and taken."""
    S = len(prompt) + n
    dec = ToyDecoder(S)
    dec.draft_source = _source(ToyDraft(S, _draft_fn(seed), fused))
    got = [t for step in stream_greedy(dec, prompt, n, S) for _, t in step]
    assert got == _plain_ids(prompt, n)
    verified = [rows for kind, rows in dec.calls if kind == "verify"]
    if seed == 0 and n > 8:
        assert verified and dec.accepted == dec.drafted


def test_a_draft_model_is_priced_with_its_steps():
    """A draft token costs a draft-model step: with it priced the policy drafts shorter, and
    not at all when drafting costs as much as the model's own step."""
    pol = DraftPolicy(rate=0.9, memory=1.0, priced_drafts=True)
    pol.timed(1, 1.0)
    for B, c in ((4, 1.8), (8, 3.9), (12, 5.9), (16, 7.9)):
        pol.timed(B, c)
    free = DraftPolicy(rate=0.9, memory=1.0)
    free.cost = dict(pol.cost)
    assert free.length(15) > 0
    pol.drafted(3, 0.3)
    assert 0 < pol.length(15) <= free.length(15)
    pol.drafted(1, 5.0)  # the running mean of a draft token's cost grows past a plain step
    pol.drafted(1, 5.0)
    assert pol.draft_cost > 1.0 and pol.length(15) == 0


def test_a_draft_models_cache_serves_the_next_generation():
    """A chat's next turn (a new ModelDraft on the same DraftModel) feeds the draft model only
    what follows the text its cache holds, and drafts the continuation of the whole text."""
    fn = _draft_fn(2)
    dec = ToyDraft(96, fn, fused=True)
    src = _source(dec)
    first = spec.ModelDraft(src, [1, 2, 3, 4, 5])
    guess, _ = first.guess(4)
    first.extend(guess[:2] + [(guess[2] + 1) % V])  # the turn ends here
    turn = first.ids + [7, 8, 9]  # the next turn's text: the conversation and a new message
    fed = dec.fed
    second = spec.ModelDraft(src, turn)
    assert second.valid == len(first.ids) - 1  # all but the last id, which was never fed
    assert second.guess(3)[0] == _greedy(fn, turn, 3)
    assert dec.fed - fed == 4 + 2  # the 4 ids after the cached text, then 2 drafts fed


def test_the_one_row_time_follows_from_a_measured_step_when_none_was_timed():
    """A draft model that drafts every round leaves no plain step timed: c(1) then follows
    from the smallest measured step and its prior, in the same units."""
    pol = DraftPolicy()
    pol.timed(4, 0.02)
    c1 = 0.02 / (0.36 + 0.466 * 4)
    assert pol.price(1) == pytest.approx(c1) and pol.price(4) == 0.02
    assert pol.price(8) == pytest.approx(0.02 * (0.36 + 0.466 * 8) / (0.36 + 0.466 * 4))
