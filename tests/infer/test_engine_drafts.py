"""Speculative decoding inside the engine's batches (minillama/infer/slot_drafts.py): greedy
requests verify drafts in the batched steps, beside sampled requests and requests that want
log-probabilities, and every request gets the tokens (and log-probabilities) of the engine
without drafts; the counts reach /metrics."""

from __future__ import annotations

import numpy as np
import pytest

from minillama.backends import get_backend
from minillama.core import speculative as spec
from minillama.core.errors import MinillamaError
from minillama.identities import Subject
from minillama.identities.invariance import VOCAB, block_model
from minillama.infer import slot_drafts
from minillama.infer.engine import Engine
from minillama.infer.metrics import prometheus_text

PROMPTS = [[5, 9, 2, 7, 5, 9], [1, 2, 3], [40, 41, 42, 43, 44, 45, 46, 47], [8] * 12]
#: (settings, logprobs) per request: greedy, greedy with log-probabilities, sampled, greedy
KINDS = [({"temperature": 0}, None), ({"temperature": 0}, 3),
         ({"temperature": 0.9, "seed": 4}, None), ({"temperature": 0}, None)]


def _numba():
    try:
        return get_backend("numba")
    except MinillamaError as e:  # pragma: no cover - numba missing
        pytest.skip(f"numba backend unavailable: {e}")


def _run(model, speculate: bool, max_tokens: int = 40):
    eng = Engine(model, max_batch=4, speculate=speculate)
    try:
        reqs = [eng.submit(p, max_tokens=max_tokens, logprobs=lp, **kw)
                for p, (kw, lp) in zip(PROMPTS, KINDS)]
        for r in reqs:
            list(r.events())
        return [(r.tokens, r.token_logprobs) for r in reqs], eng
    finally:
        eng.close()


def test_drafts_in_a_batch_keep_every_request_s_tokens(monkeypatch):
    """Drafts that are each greedy request's own continuation, every 5th token wrong, and a
    batch planner that always drafts: the steps carry up to 16 rows per request, taken in part
    or whole, and every request (sampled ones included) gets the tokens and log-probabilities
    of the engine without drafts."""
    monkeypatch.delenv("MINILLAMA_QUANT_DOTS", raising=False)
    model = block_model(Subject(_numba(), np.float32), 6)
    want, _ = _run(model, speculate=False)
    truth = [p + w[0] for p, w in zip(PROMPTS, want)]

    def guess(self, k):
        for t in truth:
            if t[:len(self.ids)] == self.ids:
                n = len(self.ids)
                return [x if i % 5 != 4 else (x + 1) % VOCAB
                        for i, x in enumerate(t[n:n + k], n)], 16
        return [], 0

    def eager(cands, price, rows, lengths=spec.LENGTHS):
        return [max([k for k in lengths if k <= n], default=0) for _, n in cands]

    monkeypatch.setattr(spec.PromptLookup, "guess", guess)
    monkeypatch.setattr(slot_drafts, "batch_lengths", eager)
    got, eng = _run(model, speculate=True)
    assert got == want
    assert eng.batch.drafted > 0 and 0 < eng.batch.accepted < eng.batch.drafted
    text = prometheus_text(eng)
    assert f"minillama_draft_tokens_total {eng.batch.drafted}" in text
    assert f"minillama_draft_tokens_accepted_total {eng.batch.accepted}" in text


def test_a_backend_without_exact_rows_runs_plain_steps():
    """On numpy (whose batched products follow BLAS's blocking, so a draft row would not be
    a one-row step) the engine never drafts, even on a prompt that repeats itself."""
    model = block_model(Subject(get_backend("numpy"), np.float32), 6)
    got, eng = _run(model, speculate=True, max_tokens=12)
    assert eng.batch.drafted == 0 and all(len(t) == 12 for t, _ in got)
