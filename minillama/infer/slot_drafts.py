r"""Speculative decoding inside the engine's batches (:mod:`minillama.core.speculative`), a mixin
of :class:`~minillama.infer.slots.SlotBatch`.

Each running greedy request keeps a prompt lookup over its prompt and reply and its own acceptance
rates. Before a batched step, every request with a draft is offered rows for it; the step's rows
are then each request's last token and the drafted tokens chosen for it
(:func:`~minillama.core.speculative.batch_lengths` weighs the expected tokens against the step's
measured time by row count), all in one call of the backend's ``decode_rows`` (row r at its
request's next positions in its cache row). Each request takes its tokens from its rows in order,
as plain steps would have given them, up to the first draft the model did not choose: where the
backend computes every row as a one-row step (``decode_rows`` answers), the text is the plain
greedy text whatever the drafts and the companions. Sampled requests and requests that want
log-probabilities of a penalised context run plain rows in the same step.
"""

from __future__ import annotations

import time

import numpy as np

from minillama.core.speculative import DraftPolicy, PromptLookup, batch_lengths


class DraftRows:
    """What :class:`~minillama.infer.slots.SlotBatch` adds for drafts: :attr:`speculate`,
    :attr:`drafted` / :attr:`accepted` counts, and :meth:`_drafted_step`, which runs a step with
    drafts when any request has one worth its rows (False: the caller runs the plain step)."""

    #: greedy requests verify prompt-lookup drafts (the engine's ``speculate``)
    speculate = True
    drafted = 0
    accepted = 0
    _exact: bool | None = None  # whether the backend verifies exactly (asked once)
    _ready = False  # and has the kernel for it (asked until it has)

    def _lookup_for(self, s):
        """s's prompt lookup, made on its first step (None: s does not draft)."""
        if s.lookup is None and s.drafts_ok is None:
            p = s.req.params
            s.drafts_ok = bool(self.speculate and p.temperature == 0 and not p.penalised
                               and self._exact is not False)
            if s.drafts_ok:
                s.lookup = PromptLookup([*s.req.prompt_ids, *s.req.tokens])
                s.policy = DraftPolicy()
        return s.lookup

    def _exact_rows(self) -> bool:
        """Whether the backend verifies drafts exactly (asked once) and its kernel for that is
        compiled (asked each step until it is: on a cold cache it compiles in another process
        meanwhile)."""
        if self._exact is None:
            self._exact = bool(self.model.backend.speculation_exact(self.model))
        self._ready = self._ready or (self._exact and
                                      self.model.backend.verification_ready(self.model))
        return self._exact and self._ready

    def _drafted_step(self) -> bool:
        """One batched step with the drafts worth their rows; False (nothing run) when none
        is. Plain steps' tokens score each request's guess (:meth:`_shadow`)."""
        slots = self._slots
        self._guesses = guesses = []
        if not self._exact_rows():
            return False
        for s in slots:
            look = self._lookup_for(s)
            room = min(s.budget - len(s.req.tokens) - 1, self.S - 1 - s.pos, 15)
            guesses.append(look.guess(room) if look is not None and room > 0 else ([], 0))
        if not any(g for g, _ in guesses):
            return False
        cands = [(s.policy.rates[s.policy.bucket(m)] if g else 0.0, len(g))
                 for s, (g, m) in zip(slots, guesses)]
        ks = batch_lengths(cands, self._step_price, len(slots))
        if not any(ks):
            return False
        rows = [[s.last, *g[:k]] for s, (g, _), k in zip(slots, guesses, ks)]
        tok = np.array([t for r in rows for t in r], dtype=np.int64)
        pos = np.array([s.pos + i for s, r in zip(slots, rows) for i in range(len(r))])
        seq = np.array([b for b, r in enumerate(rows) for _ in r], dtype=np.int64)
        t0 = time.perf_counter()
        z = self.model.backend.decode_rows(self.model, tok, pos, seq, self._view(0, len(slots)))
        if z is None:  # the backend declined after all: plain steps from now on
            self._exact = False
            return False
        self._step_timed(len(tok), time.perf_counter() - t0)
        self._take_rows(rows, ks, guesses, z)
        return True

    def _take_rows(self, rows, ks, guesses, z) -> None:
        """Each request takes its rows' tokens in order while its draft holds."""
        now = time.perf_counter()
        self.decode_steps += 1
        self.max_active = max(self.max_active, len(self._slots))
        r0 = 0
        for s, row, k, (g, m) in zip(self._slots, rows, ks, guesses):
            taken = 0
            for i in range(len(row)):
                before = len(s.req.tokens)
                s.pos += 1
                self._take(s, z[r0 + i], now)
                if s.done or i == k or s.req.tokens[before:] != [row[i + 1]]:
                    break
                taken += 1
            if k:
                self.drafted += k
                self.accepted += taken
                s.policy.observe(k, taken, m)
            self._settle(s, g if not k else (), m)
            r0 += len(row)

    def _shadow(self) -> None:
        """After a plain step: score each request's guess against the token it took."""
        for s, (g, m) in zip(self._slots, getattr(self, "_guesses", ())):
            self._settle(s, g, m)

    @staticmethod
    def _settle(s, g, m) -> None:
        """After s took a plain row's token: score its guess g (after a shared run of m
        tokens) against it; then s's lookup takes s's new tokens."""
        if s.lookup is None:
            return
        if g and not s.done:
            s.policy.observe(1, int(s.last == g[0]), m)
        s.lookup.extend(s.req.tokens[len(s.lookup.ids) - len(s.req.prompt_ids):])

    def _step_price(self, B: int) -> float:
        return self._costs.price(B)

    def _step_timed(self, B: int, seconds: float) -> None:
        """A step of B rows took ``seconds``; the first few of each B (kernels loading, thread
        counts tried) are not taken."""
        seen = self._seen_steps = getattr(self, "_seen_steps", {})
        seen[B] = seen.get(B, 0) + 1
        if seen[B] > 3:
            self._costs.timed(B, seconds)

    @property
    def _costs(self) -> DraftPolicy:
        """The measured step times by row count (a :class:`DraftPolicy`'s price table)."""
        if self.__dict__.get("_cost_table") is None:
            self._cost_table = DraftPolicy()
        return self._cost_table
