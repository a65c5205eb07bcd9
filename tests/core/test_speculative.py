"""Prompt-lookup drafts, their acceptance and the draft-length policy
(:mod:`minillama.core.speculative`), and the speculative loop on a toy decoder whose "model" is a
function of the context: whatever the drafts, the ids are plain greedy decoding's."""

from __future__ import annotations

import numpy as np
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
