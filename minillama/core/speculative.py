r"""Exact speculative decoding by prompt lookup: guess the next tokens from the context, check
them all in one model call, keep the ones the model would have chosen.

**Drafts** (:class:`PromptLookup`, Saxena 2023's prompt lookup decoding): if the context's last n
tokens (n = 3, then 2) occurred earlier, the tokens that followed their latest earlier occurrence
are the draft d_1 ... d_k (continued periodically past the context's end: a loop repeats). Text
that copies from its context (a repeated or rewritten passage, extracted fields, an edited piece
of code) gets long right drafts; free text gets few.

**Verification**: with t_0 the last token chosen, at position p, one step of the model over the
k + 1 rows (t_0, d_1, ..., d_k) at positions p ... p + k, each row attending to the cache up to its
own position (the rows' K/V are written before any row attends), gives the logits z_0 ... z_k.
Greedy: g_i = argmax z_i. The draft is accepted up to its first miss,

    a = max { j : d_i = g_{i-1} for every i <= j },

and the new tokens are g_0 ... g_a (a + 1 of them: the accepted drafts and the model's own next
token). Row i's logits are those of a one-token decode step at position p + i given the tokens
before it; where the backend computes each row of a step as it would alone (the batch-invariant
decode steps), they are equal bit for bit, so the tokens are plain greedy decoding's, only fewer
reads of the weights. K/V rows written for rejected drafts lie beyond the sequence's end and are
overwritten by the next step.

**How long a draft** (:class:`DraftPolicy`): drafting k tokens pays when the expected tokens per
verification, E_k = 1 + a + ... + a^k for an acceptance rate a, grow faster than the step's cost
c(k + 1) over a one-token step's c(1). a is estimated apart for short and long runs of context
shared with the earlier occurrence (a copied passage shares long runs), from every lookup, also
those not verified (a plain step's token shows whether the lookup's guess was right); c from the
measured times of the steps. k maximizes E_k / c(k + 1), so the policy drafts long on copied text
and stops drafting where drafts are not taken; plain steps then run several per call.
"""

from __future__ import annotations

import time

import numpy as np

from minillama.core.errors import MinillamaError

#: the lengths n of the context suffix looked up, longest first
NGRAMS = (3, 2)
#: the longest shared run of tokens :meth:`PromptLookup.guess` measures
MATCH_MAX = 16
#: the shared runs at which a draft's acceptance is estimated apart (:class:`DraftPolicy`): a
#: draft after a long shared run (a passage being copied) is taken more often than one after a
#: common pair of tokens
MATCH_BUCKETS = (2, 4, 8, 16)
#: how much more a draft must promise than plain steps (tokens per second): the rates and times
#: are running estimates, and a draft not taken costs its rows
MARGIN = 1.05
#: the draft lengths tried: verification steps of 4, 8, 12 or 16 rows (the 8-bit products take
#: activation rows by fours; a step of 2 rows costs 1.6 one-row steps, one of 4 rows 2)
LENGTHS = (3, 7, 11, 15)
#: the prior acceptance rate of a draft model's tokens (:class:`ModelDraft`), and the least and
#: most plain tokens between two probes where the policy would not draft from it
#: (:meth:`Speculation._model_guess`)
MODEL_RATE = 0.6
PROBE_MIN, PROBE_MAX = 16, 1024


class PromptLookup:
    """The context's tokens and, for each n in :data:`NGRAMS`, where each n-gram last occurred
    with a token after it; :meth:`draft` proposes what followed the current suffix."""

    def __init__(self, ids, ngrams=NGRAMS):
        self.ids: list[int] = []
        self.ngrams = tuple(ngrams)
        #: n-gram -> the index of the token after its latest occurrence
        self._next: dict[tuple, int] = {}
        self.extend(ids)

    def extend(self, ids) -> None:
        """Append tokens to the context, indexing the n-grams that now have a follower."""
        ctx = self.ids
        for t in ids:
            ctx.append(int(t))
            i = len(ctx) - 1  # the new token follows the n-grams ending at i - 1
            for n in self.ngrams:
                if i >= n:
                    self._next[tuple(ctx[i - n:i])] = i

    def draft(self, k: int) -> list[int]:
        """The tokens of :meth:`guess`."""
        return self.guess(k)[0]

    def guess(self, k: int) -> tuple[list[int], int]:
        """(``k`` tokens that followed the latest earlier occurrence of the context's last n
        tokens, the longest n of :data:`NGRAMS` that occurred; how many tokens the context and
        that occurrence share, up to :data:`MATCH_MAX`), ``([], 0)`` when none occurred. Where
        the occurrence is s tokens back, the context is taken to repeat with period s: a draft
        longer than what followed it continues with its own tokens s back."""
        ctx = self.ids
        if k <= 0:
            return [], 0
        for n in self.ngrams:
            if len(ctx) > n:
                j = self._next.get(tuple(ctx[-n:]))
                if j is not None:
                    out = ctx[j:j + k]
                    s = len(ctx) - j
                    while len(out) < k:
                        out.append(out[len(out) - s])
                    m = n
                    while m < min(MATCH_MAX, j) and ctx[j - 1 - m] == ctx[-1 - m]:
                        m += 1
                    return out, m
        return [], 0


class DraftModel:
    """A draft model (``--draft``) with, from one generation to the next, its decoder and the
    ids its cache holds (a chat's turns share them: a turn feeds the draft model only what
    follows the text the last turn left in its cache)."""

    def __init__(self, model):
        self.model = model
        self.decoder = None
        #: the :class:`ModelDraft` that last used the decoder (None: its cache holds nothing)
        self.last: ModelDraft | None = None

    @property
    def held(self) -> list[int]:
        """The leading ids of the text that the decoder's cache holds."""
        return [] if self.last is None else self.last.ids[:self.last.valid]


class ModelDraft:
    """Drafts from a smaller model with the same tokenizer (``--draft``): its own greedy
    continuation of the context, from ``decoder``, a plain greedy decoder of the draft model
    (:class:`~minillama.core.decoding.ChunkDecoder`: ``prefill`` with ``cached``, ``more``, and
    where it has one ``refeed``, fused steps over known ids). The draft model's cache follows the
    context: the positions it holds that the context confirms (the context itself, and the drafts
    fed after it up to the first one rejected) are kept, and the next :meth:`guess` feeds only
    the rest. A draft costs draft-model steps, so it is made only for the length the policy
    chose (``priced``: the caller asks for that many), and plain steps are not shadow-scored."""

    priced = True

    def __init__(self, source: DraftModel, ids):
        self.dec = source.decoder
        self.ids = [int(t) for t in ids]
        held, n = source.held, 0
        while n < min(len(held), len(self.ids)) and held[n] == self.ids[n]:
            n += 1
        self.valid = n  # the leading context positions the draft model's cache holds
        source.last = self
        self._fed: list[int] = []  # drafts fed after the context by the last guess
        #: the seconds of one of the draft model's steps in the last guess (None: none ran)
        self.step_time: float | None = None

    def extend(self, ids) -> None:
        """Append tokens to the context; the drafts they confirm stay in the draft cache."""
        ids = [int(t) for t in ids]
        if self.valid == len(self.ids):  # the cache holds the context, then self._fed
            a = 0
            while a < min(len(ids), len(self._fed)) and ids[a] == self._fed[a]:
                a += 1
            self.valid += a
        self._fed = []
        self.ids += ids

    def guess(self, k: int) -> tuple[list[int], int]:
        """(the draft model's next ``k`` greedy tokens after the context, or fewer where its
        cache ends; 0: no shared run is measured)."""
        n = len(self.ids)
        k = min(int(k), self.dec.S - n + 1)
        if k <= 0:
            return [], 0
        v = min(self.valid, n - 1)  # the last token is fed again: its logits
        first = self.dec.refeed(v, self.ids[v:]) if v and hasattr(self.dec, "refeed") else None
        if first is None:  # the first draft, or a decoder without fused steps of known ids
            self.dec.cached = v
            first = self.dec.prefill(np.asarray([self.ids], dtype=np.int64))[0]
        out, self.step_time = [int(first)], None
        if k > 1:
            t0 = time.perf_counter()
            out += [int(t) for t in self.dec.more(k - 1)[0]]
            self.step_time = (time.perf_counter() - t0) / (len(out) - 1)
        self.valid, self._fed = n, out[:-1]
        return out, 0


def accepted_length(draft, picks) -> int:
    """How many leading draft tokens the model confirms: the largest a with draft[i] ==
    picks[i] for i < a (picks[i] the model's token after the context and draft[:i])."""
    a = 0
    while a < len(draft) and int(draft[a]) == int(picks[a]):
        a += 1
    return a


class DraftPolicy:
    """The draft length that maximizes the expected tokens per second of step time.

    ``rates[i]``: the acceptance rate a of drafted tokens after a shared run of context of at
    least :data:`MATCH_BUCKETS` [i] tokens (running means, fed by :meth:`observe`; ``rate``,
    their priors, grow with the run); ``cost[B]``: the measured time of a step of B rows (running
    means, fed by :meth:`timed`); a B not measured yet is priced from the one-row time c_1 as
    c_1 (0.36 + 0.466 B) (SmolLM2-135M Q4_1 on two cores: 4, 8 and 16 rows), scaled as the
    largest measured B' < B compares with its own such price; the measured times replace it.
    ``lengths``: the draft lengths k considered. ``draft_cost``: what making one draft token
    costs (a draft model's step; 0 for a lookup), priced with the verification (:meth:`length`),
    from a prior of a quarter of c_1 until :meth:`drafted` measures it."""

    def __init__(self, lengths=LENGTHS, rate=(0.4, 0.5, 0.6, 0.7), memory: float = 0.85,
                 priced_drafts: bool = False):
        self.lengths = tuple(sorted(lengths))
        self.k_max = self.lengths[-1]
        rate = (rate,) * len(MATCH_BUCKETS) if isinstance(rate, (int, float)) else rate
        self.rates = [float(r) for r in rate]
        self.memory = float(memory)
        self.cost: dict[int, float] = {}
        self.priced_drafts = bool(priced_drafts)
        self._draft_cost: float | None = None

    @property
    def draft_cost(self) -> float:
        """A draft token's price in the units of :meth:`price`: the measured time once steps are
        timed too (before, prices are the prior's, in one-row steps: then the prior's quarter)."""
        if not self.priced_drafts:
            return 0.0
        if self._draft_cost is None or not self.cost:
            return 0.25 * self.price(1)
        return self._draft_cost

    def drafted(self, k: int, seconds: float) -> None:
        """Making ``k`` draft tokens took ``seconds``."""
        c, per = self._draft_cost, seconds / max(1, k)
        self._draft_cost = per if c is None else 0.8 * c + 0.2 * per

    @staticmethod
    def bucket(matched: int) -> int:
        """The index of the last :data:`MATCH_BUCKETS` entry <= ``matched``."""
        return max(0, sum(1 for b in MATCH_BUCKETS if matched >= b) - 1)

    def observe(self, drafted: int, taken: int, matched: int = 0) -> None:
        """``taken`` of ``drafted`` tokens matched (a verified or a shadow draft, after a shared
        run of ``matched`` tokens). Each drafted token counts once, up to the first miss: the
        tokens after it were never tested."""
        i = self.bucket(matched)
        for t in range(min(drafted, taken + 1)):
            hit = 1.0 if t < taken else 0.0
            self.rates[i] = self.memory * self.rates[i] + (1 - self.memory) * hit

    def timed(self, B: int, seconds: float) -> None:
        """A step of B rows took ``seconds``."""
        c = self.cost.get(B)
        self.cost[B] = seconds if c is None else 0.8 * c + 0.2 * seconds

    def price(self, B: int) -> float:
        """c(B): measured, else the prior scaled as the nearest measured B' < B compares with
        its own prior (so a cheap measured step makes the larger ones worth a try)."""
        if B in self.cost:
            return self.cost[B]
        c1 = self._c1()
        below = [n for n in self.cost if 1 < n < B]
        scale = self.cost[max(below)] / (c1 * _rows(max(below))) if below else 1.0
        return c1 * _rows(B) * scale

    def _c1(self) -> float:
        """The one-row step's time: measured, else as the smallest measured step's prior says
        (a draft model drafting every round leaves no plain step timed), else 1."""
        if 1 in self.cost:
            return self.cost[1]
        measured = [n for n in self.cost if n > 1]
        return self.cost[min(measured)] / _rows(min(measured)) if measured else 1.0

    def length(self, available: int, matched: int = 0) -> int:
        """The draft length k of :attr:`lengths`, k <= ``available``, with the most expected
        tokens (1 - a^(k+1)) / (1 - a) per unit of step time, a the rate after a shared run of
        ``matched`` tokens; 0 when plain one-token steps are expected to be faster."""
        a, c = self.rates[self.bucket(matched)], self.draft_cost
        price = self.price if not c else (lambda B: self.price(B) + (B - 1) * c)
        return batch_lengths([(a, available)], price, 1, self.lengths)[0]


def _rows(B: int) -> float:
    """The prior price of a step of B rows in one-row steps: 0.36 + 0.466 B (SmolLM2-135M Q4_1
    on two cores, fitted to 4, 8 and 16 rows), 1 for one row."""
    return 1.0 if B == 1 else 0.36 + 0.466 * B


def batch_lengths(cands, price, rows: int, lengths=LENGTHS) -> list[int]:
    """Draft lengths for the sequences of one batched step of ``rows`` plain rows (one per
    sequence): ``cands`` holds, per sequence, (a, available), the acceptance rate of its draft
    and how many draft tokens it has; ``price(B)`` the time of a step of B rows. Taking the
    likeliest drafts first, a sequence drafts the k of ``lengths`` that raises the step's
    expected tokens per second, (T + E_k - 1) / price(R + k), E_k = (1 - a^(k+1)) / (1 - a), T
    and R the tokens and rows so far, above :data:`MARGIN` T / price(R); in a step whose rows
    already keep the cores busy a draft row pays only when it is nearly sure to be taken."""
    ks = [0] * len(cands)
    T, R = float(rows), rows
    for i in sorted(range(len(cands)), key=lambda i: -cands[i][0]):
        a, available = min(cands[i][0], 0.999), cands[i][1]
        best_k, best = 0, MARGIN * T / price(R)
        for k in lengths:
            if k > available:
                break
            value = (T + (1 - a ** (k + 1)) / (1 - a) - 1) / price(R + k)
            if value > best:
                best_k, best = k, value
        if best_k:
            ks[i] = best_k
            T += (1 - a ** (best_k + 1)) / (1 - a) - 1
            R += best_k
    return ks


class Speculation:
    """Greedy decoding with prompt-lookup drafts, a mixin for a decoder driven by
    :func:`minillama.core.decoding.stream_greedy` (the interface of
    :class:`~minillama.core.decoding.ChunkDecoder`). The decoder provides ``_plain(n)`` (n plain
    greedy steps in one call, taken: their ids, ending early at a stop id), ``verify(tokens)``
    (one step over the rows ``tokens``, the first the last id taken, fed at the positions after
    it: each row's argmax; nothing taken) and ``_take(ids)`` (ids chosen from a verification:
    the next one is fed after them); :meth:`more` chooses between them. ``drafted`` and
    ``accepted`` count the verified draft tokens."""

    drafted = 0
    accepted = 0
    _plain_calls = 0  # plain calls since the last verification
    _plain_tokens = 0  # and the ids they took
    _probe_gap = 0  # plain ids before a draft model's next probe (:meth:`_model_guess`)
    #: the context's drafts and the draft length, set by the prefill
    lookup: PromptLookup | None = None
    policy: DraftPolicy | None = None

    #: a draft model with its decoder (:class:`DraftModel`, ``--draft``) to draft from instead
    #: of the lookup
    draft_source: DraftModel | None = None

    def _start_lookup(self, prompt, first: int) -> None:
        """The context after the prefill: the prompt's ids and the first id chosen."""
        ids = [*map(int, prompt), int(first)]
        if self.draft_source is not None:
            self.lookup = ModelDraft(self.draft_source, ids)
            self.policy = DraftPolicy(rate=MODEL_RATE, priced_drafts=True)
        else:
            self.lookup = PromptLookup(ids)
            self.policy = DraftPolicy()
        self.drafted = self.accepted = self._plain_calls = self._plain_tokens = 0
        self._probe_gap = 0

    def more(self, k):
        """1 to ``k`` more greedy ids, (1, k'), from one model call (a stop id among them is the
        last): a verified draft where the policy expects one to pay, plain steps elsewhere."""
        k = self._check_more(k)
        if k == 0:
            return np.zeros((1, 0), dtype=np.int64)
        return np.array([self._round(k, {int(t) for t in self.stop})], dtype=np.int64)

    def _round(self, want: int, stop) -> list[int]:
        """One model call's new ids (at most ``want``, ending at a stop id): a verified draft,
        or plain steps: 1, 2, 4, 8, then 16 per call as plain calls follow one another (a passage
        that starts being copied is met within a few tokens, free text pays few returns to
        Python)."""
        pol, look = self.policy, self.lookup
        priced = getattr(look, "priced", False)
        if priced:
            guess, matched = self._model_guess(want)
            if guess is None:  # the draft model failed: prompt lookup from here on
                return self._round(want, stop)
            d = len(guess)
        else:
            guess, matched = look.guess(min(want - 1, pol.k_max))
            d = pol.length(len(guess), matched) if guess and self.verify_ready() else 0
        if d > 0:
            return self._verified(guess[:d], matched, stop)
        t0 = time.perf_counter()
        ids = [int(t) for t in self._plain(min(want, 16, 1 << self._plain_calls))]
        self._plain_calls += 1
        self._plain_tokens += len(ids)
        self._timed(1, (time.perf_counter() - t0) / max(1, len(ids)))
        for t in ids:  # score what the lookup would have drafted, then take the id
            g, m = look.guess(1) if not priced else ([], 0)
            if g:
                pol.observe(1, int(g[0] == t), m)
            look.extend([t])
        return ids

    def _model_guess(self, want: int):
        """A draft model's draft for this round, ([], 0) for none, None where the draft model's
        logits went non-finite (the lookup then replaces it). The length is the policy's; where
        the policy would not draft, a probe of the shortest length is made after
        ``_probe_gap`` plain tokens (a draft model's rate and costs are seen only by drafting),
        the gap doubling after each probe (16 up to 1024) and back to 16 after a draft the policy
        chose, so that a draft model that does not pay costs less and less."""
        pol, look = self.policy, self.lookup
        avail = min(want - 1, pol.k_max)
        ready = avail >= pol.lengths[0] and self.verify_ready()
        d = pol.length(avail) if ready else 0
        if d:
            self._probe_gap = PROBE_MIN
        elif ready and self._plain_tokens >= self._probe_gap:
            d = pol.lengths[0]
            self._probe_gap = min(PROBE_MAX, max(PROBE_MIN, 2 * self._probe_gap))
        if not d:
            return [], 0
        try:
            guess, matched = look.guess(d)
        except MinillamaError:
            self.lookup, self.policy = PromptLookup(look.ids), DraftPolicy()
            return None, 0
        if look.step_time is not None:  # a draft token costs about one draft-model step (feeding
            pol.drafted(1, look.step_time)  # the text's new ids is a step too, of a few rows)
        return guess, matched

    def _verified(self, draft, matched: int, stop) -> list[int]:
        """Verify ``draft`` in one step and take what the model confirms (ending at a stop id)."""
        pol, d = self.policy, len(draft)
        t0 = time.perf_counter()
        picks = self.verify([self._last, *draft])
        self._timed(d + 1, time.perf_counter() - t0)
        a = accepted_length(draft, picks)
        self.drafted += d
        self.accepted += a
        pol.observe(d, a, matched)
        ids = [int(t) for t in picks[:a + 1]]
        for i, t in enumerate(ids):  # a stop id ends the ids
            if t in stop:
                ids = ids[:i + 1]
                break
        self._take(ids)
        self.lookup.extend(ids)
        self._plain_calls = self._plain_tokens = 0
        return ids

    def _timed(self, B: int, seconds: float) -> None:
        """Price steps of B rows for the policy by their wall time, once the backend's timing is
        settled (:meth:`timing_settled`); until then the policy's prior stands."""
        if self.timing_settled():
            self.policy.timed(B, seconds)

    def timing_settled(self) -> bool:
        """Whether the steps' times are those of their settled configuration (a backend that
        tries thread counts on its first steps says no until it has chosen)."""
        return True

    def verify_ready(self) -> bool:
        """Whether :meth:`verify` can run now without waiting (a backend whose kernel for it is
        still compiling elsewhere says no: plain steps meanwhile)."""
        return True
