r"""The rows of a continuous-batching engine's KV cache: which request runs in which row, and what
the free rows still hold for the next prompts that start the same way.

:class:`SlotBatch` runs the requests of an :class:`~minillama.infer.engine.Engine` (see there for
the scheduler): it prefills new requests into free rows, runs one batched decode step over the
running rows 0..n-1, samples each row's token and keeps the running rows contiguous as requests
finish.

Prompt reuse. K/V at position j depend only on the tokens at positions 0..j (positions are
absolute and attention is causal), so a row whose positions 0..c-1 were computed for the ids
a_0..a_{c-1} serves any prompt that starts with those c ids: only the rest is prefilled, starting
at position c. :class:`PrefixRows` keeps, for every free row, the ids whose K/V it holds (the
prompt and the fed reply of the request that last ran there); a new request takes the row (free,
or a running one whose prompt it shares, then copied) with the longest common prefix, when that
prefix holds at least :attr:`SlotBatch.min_reuse` tokens. A request that reuses nothing gets the
free row unused the longest, so the most recent conversations stay. Free rows are the
``max_batch`` slots not running plus ``extra_rows`` rows kept only for this.
"""

from __future__ import annotations

import time

import numpy as np

from minillama.core.errors import MinillamaError
from minillama.core.sampling import top_indices
from minillama.infer.slot_drafts import DraftRows
from minillama.io.chat_template import common_prefix


def token_logprobs(z: np.ndarray, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    r"""log softmax of the logits z (V,) at ``token``, and the ``k`` most likely ids with theirs
    (descending; ties: lower id first): \log p_v = z_v - \log \sum_u e^{z_u}, in float64."""
    z = np.asarray(z, dtype=np.float64)
    zmax = z.max()
    lse = zmax + np.log(np.exp(z - zmax).sum())
    top = [(int(i), float(z[i] - lse)) for i in top_indices(z, k)] if k > 0 else []
    return float(z[token] - lse), top


class _Slot:
    """A running request: ``pos`` is where its next fed token goes (= prompt length + tokens fed
    so far), ``last`` the token to feed, ``budget`` the most tokens it may produce."""

    __slots__ = ("req", "pos", "last", "budget", "done", "lookup", "policy", "drafts_ok")

    def __init__(self, req, pos: int, budget: int):
        self.req, self.pos, self.last, self.budget, self.done = req, pos, -1, budget, False
        # its drafts (:mod:`.slot_drafts`): prompt lookup and policy, made on its first step
        self.lookup = self.policy = self.drafts_ok = None


class PrefixRows:
    """Per cache row, the token ids whose K/V the row holds at positions 0..len-1 (None: nothing
    worth keeping, or a running row) and when it was released; moves rows' contents."""

    def __init__(self, cache, n_rows: int):
        self.arrays = cache.k + cache.v
        self.held: list[np.ndarray | None] = [None] * n_rows
        self.stamp = [-1] * n_rows
        self.clock = 0

    def reset(self) -> None:
        self.held = [None] * len(self.held)
        self.stamp = [-1] * len(self.stamp)

    def _len(self, row: int) -> int:
        h = self.held[row]
        return 0 if h is None else len(h)

    def release(self, row: int, ids: np.ndarray | None) -> None:
        """``row`` is free and holds the K/V of ``ids``."""
        self.clock += 1
        self.held[row], self.stamp[row] = ids, (self.clock if ids is not None else -1)

    def take(self, row: int) -> None:
        """``row`` is about to be written by a new request."""
        self.held[row], self.stamp[row] = None, -1

    def copy(self, src: int, dst: int, p: int) -> None:
        """K/V positions 0..p-1 of row ``src`` into row ``dst``."""
        if p > 0 and src != dst:
            for a in self.arrays:
                a[dst, :p] = a[src, :p]

    def swap(self, i: int, j: int, p: int) -> None:
        """Exchange rows i and j (K/V positions 0..p-1, and what they hold)."""
        if i == j:
            return
        if p > 0:
            for a in self.arrays:
                a[[i, j], :p] = a[[j, i], :p]  # the right side is gathered first (a copy)
        self.held[i], self.held[j] = self.held[j], self.held[i]
        self.stamp[i], self.stamp[j] = self.stamp[j], self.stamp[i]

    def vacate(self, row: int) -> None:
        """Make ``row`` ready to be overwritten: what it holds moves to the free row (at or after
        it) unused the longest, whose own contents are dropped."""
        if self.held[row] is not None:
            victim = min(range(row, len(self.held)), key=lambda j: (self.stamp[j], j))
            if victim != row:
                self.copy(row, victim, self._len(row))
                self.held[victim], self.stamp[victim] = self.held[row], self.stamp[row]
        self.take(row)

    def best(self, prompt: np.ndarray, free_from: int, running, model) -> tuple[int, int]:
        """(row, c): the row whose cached ids share the longest prefix c with ``prompt``, among
        the free rows ``free_from``.. and the prompts of the ``running`` slots (rows 0..), of
        which the first ``model.reusable_rows(len(p), len(p))`` rows of a prompt p may be kept;
        c is where the prefill starts (``model.prefill_start``: a token or two are always fed;
        one with its row kept only from a free row, which moves whole); (-1, 0) when none
        shares any."""
        P = len(prompt)
        best, best_c = -1, 0
        for row in range(free_from, len(self.held)):
            h = self.held[row]
            if h is not None:
                c = model.prefill_start(common_prefix(h, prompt), P, keep_last=True)
                if c > best_c or (c == best_c and c and self.stamp[row] > self.stamp[best]):
                    best, best_c = row, c
        for row, s in enumerate(running):
            n = len(s.req.prompt_array)
            common = min(common_prefix(s.req.prompt_array, prompt), model.reusable_rows(n, n))
            c = model.prefill_start(common, P)
            if c > best_c:
                best, best_c = row, c
        return best, best_c


class Admission:
    """How :class:`SlotBatch` starts new requests: prefilled into the next free rows, from the
    cached prefix a row holds where one does (several such in one padded forward, each row from
    its own position), the others together from position 0. Uses the batch's ``model``,
    ``rows``, ``S``, ``prefill_tokens``, ``reuse``, ``min_reuse``, ``_slots``, ``_view`` and
    ``_start``."""

    def _admit_new(self, new: list) -> None:
        """Prefill ``new`` into the next free rows: from cached prefixes where rows hold them
        (:meth:`_admit_warm`), the others together from position 0 (:meth:`_admit`)."""
        cold: list = []
        warm: list = []  # (request, cached prefix length), placed in rows n, n + 1, ...
        for r in new:
            if r.cancelled:
                r._finish(r.cancel_reason)
            elif min(r.max_tokens, self.S - len(r.prompt_ids) + 1) <= 0:
                r._finish("length")
            else:
                row, c = self._best(r, warm)
                if c >= self.min_reuse and warm and not self._fits(warm + [(r, c)]):
                    self._admit_warm(warm)  # the group is full: prefill it, start another
                    warm = []
                    row, c = self._best(r, warm)
                if c >= self.min_reuse:
                    self._place_warm(row, len(self._slots) + len(warm), c)
                    warm.append((r, c))
                else:
                    cold.append(r)
        if warm:
            self._admit_warm(warm)
        group: list = []
        for r in cold:
            longest = max([len(q.prompt_ids) for q in group] + [len(r.prompt_ids)])
            if group and longest * (len(group) + 1) > self.prefill_tokens:
                self._admit(group)
                group = []
            group.append(r)
        if group:
            self._admit(group)
        self._compact()

    def _best(self, r, warm: list) -> tuple[int, int]:
        """(row, c) of :meth:`PrefixRows.best` for ``r`` among the free rows and the running
        ones, and the rows of the ``warm`` requests placed before it (row n + j holds the K/V of
        the first c_j ids of its prompt); (-1, 0) without prefix reuse."""
        if not self.reuse:
            return -1, 0
        n, P = len(self._slots), len(r.prompt_ids)
        row, c = self.rows.best(r.prompt_array, n + len(warm), self._slots, self.model)
        for j, (q, cq) in enumerate(warm):
            cj = self.model.prefill_start(min(common_prefix(q.prompt_array, r.prompt_array),
                                              cq), P)
            if cj > c:
                row, c = n + j, cj
        return row, c

    def _fits(self, group: list) -> bool:
        """Whether the (request, c) of ``group`` can share one padded prefill: the padding stays
        within the cache and the padded tokens within :attr:`prefill_tokens`."""
        L = max(len(r.prompt_ids) - c for r, c in group)
        return (all(c + L <= self.S for _, c in group)
                and L * len(group) <= max(self.prefill_tokens, L))

    def _place_warm(self, src: int, n: int, c: int) -> None:
        """Row n (free) gets the K/V of the first ``c`` positions of row ``src``: moved there
        from the free row ``src``, or copied from the running row ``src``."""
        if src >= n:
            self.rows.swap(src, n, max(self.rows._len(src), self.rows._len(n)))
        else:
            self.rows.vacate(n)
            self.rows.copy(src, n, c)
        self.rows.take(n)

    def _admit_warm(self, group: list) -> None:
        """Start the requests of ``group`` ((request, c) each, placed by :meth:`_place_warm` in
        the next free rows, in order; :meth:`_fits`) by prefilling the rest of each prompt from
        its position c, all in one forward (right-padded to the longest rest, each row at its own
        start; the padding's K/V lie beyond each row's positions, masked and later
        overwritten)."""
        n, k = len(self._slots), len(group)
        rests = [r.prompt_ids[c:] for r, c in group]
        L = max(len(x) for x in rests)
        self.prefills += 1
        block = np.zeros((k, L), dtype=np.int64)
        for b, x in enumerate(rests):
            block[b, :len(x)] = x
        starts = np.array([c for _, c in group], dtype=np.int64)
        # a prompt whose last token's row is cached (a free row moved here whole) has that row
        # kept while the decode step gives its logits (``prefill_start``'s keep_last)
        last = [b for b, x in enumerate(rests) if len(x) == 1] if (
            self.model.decode_rows_differ) else []
        try:
            with self._view(n, n + k).kept(last, starts[last]):
                if k == 1:
                    logits = self.model.forward(block, int(starts[0]), self._view(n, n + 1),
                                                last_only=True)
                else:
                    logits = self.model.forward(block, starts, self._view(n, n + k),
                                                output_index=np.array([len(x) - 1
                                                                       for x in rests]))
        except MinillamaError as e:
            for r, _ in group:
                r._fail(str(e))
            return
        z = self.model.backend.to_numpy(logits).reshape(k, -1)
        now = time.perf_counter()
        for b, (r, c) in enumerate(group):
            self._start(r, c, z[b], now)

    def _admit(self, group: list) -> None:
        """Prefill the prompts of ``group`` into the next free rows in one forward (right-padded
        to the longest; the padding's K/V lie beyond each row's positions, masked and later
        overwritten) and sample each one's first token from its last prompt position."""
        row, k = len(self._slots), len(group)
        for t in range(k):
            self.rows.vacate(row + t)
        self.prefills += 1
        lens = np.array([len(r.prompt_ids) for r in group], dtype=np.int64)
        block = np.zeros((k, int(lens.max())), dtype=np.int64)
        for b, r in enumerate(group):
            block[b, :lens[b]] = r.prompt_ids
        try:
            if k == 1:
                logits = self.model.forward(block, 0, self._view(row, row + 1), last_only=True)
            else:
                logits = self.model.forward(block, 0, self._view(row, row + k),
                                            output_index=lens - 1)
        except MinillamaError as e:
            for r in group:
                r._fail(str(e))
            return
        z = self.model.backend.to_numpy(logits).reshape(k, -1)
        now = time.perf_counter()
        for b, r in enumerate(group):
            self._start(r, 0, z[b], now)

class SlotBatch(DraftRows, Admission):
    """The rows of the KV cache and the requests running in them: prefills new requests into
    free rows (reusing cached prefixes), runs one batched decode step over all of them (with
    the drafts of :class:`~minillama.infer.slot_drafts.DraftRows` where they pay), samples and
    hands over each one's tokens, and keeps the running requests in rows 0..n-1."""

    #: the fewest cached prompt tokens worth reusing (below this a request joins the padded
    #: prefill from position 0 of the others arriving with it)
    min_reuse = 8

    def __init__(self, model, max_batch: int, S: int, prefill_tokens: int, stats,
                 extra_rows: int = 0, reuse: bool = True):
        self.model, self.S, self.prefill_tokens, self.stats = model, S, prefill_tokens, stats
        self.reuse, self.max_batch = reuse, max_batch
        self.cache = model.new_cache(max_batch + extra_rows, S)
        self.rows = PrefixRows(self.cache, max_batch + extra_rows)
        self._views: dict[tuple[int, int], object] = {}
        self._slots: list[_Slot] = []
        self.slots = self._slots
        self.decode_steps = 0
        self.prefills = 0
        self.max_active = 0

    def step(self, new: list, more=None) -> None:
        """Admit the ``new`` requests, then those ``more()`` hands over while they were
        prefilled (requests arriving a moment apart start in the same step instead of waiting
        for a decode step of the others), and run one decode step of every running row."""
        for s in self._slots:
            if s.req.cancelled:
                s.done = True
                s.req._finish(s.req.cancel_reason)
        self._compact()
        admitted = 0
        while new:  # at most max_batch requests a step, however fast they end
            self._admit_new(new)
            admitted += len(new)
            new = more() if more is not None and admitted < self.max_batch else []
        if self._slots:
            self._decode()
            self._compact()

    def _view(self, lo: int, hi: int):
        """The cache rows lo..hi-1 (views made once each, so backends may key plans on them)."""
        v = self._views.get((lo, hi))
        if v is None:
            v = self._views[(lo, hi)] = self.cache.rows(lo, hi)
        return v

    def _start(self, r, cached: int, z: np.ndarray, now: float) -> None:
        """``r``'s prompt is in the next row (``cached`` ids of it reused): it runs."""
        P = len(r.prompt_ids)
        r.cached_tokens = cached
        st = self.stats
        st.requests += 1
        st.prompt_tokens += P
        st.cached_tokens += cached
        st.prefilled_tokens += P - cached
        slot = _Slot(r, P, min(r.max_tokens, self.S - P + 1))
        self._slots.append(slot)
        self._take(slot, z, now)

    def _decode(self) -> None:
        """One batched step: row b feeds its last token at its own position p_b (and, where
        drafts pay, its drafted tokens at the positions after it: :meth:`_drafted_step`)."""
        self._guesses = []
        if self.speculate and self._drafted_step():
            return
        n = len(self._slots)
        tok = np.array([[s.last] for s in self._slots], dtype=np.int64)
        pos = np.array([s.pos for s in self._slots], dtype=np.int64)
        t0 = time.perf_counter()
        logits = self.model.forward(tok, pos, self._view(0, n), last_only=True)
        z = self.model.backend.to_numpy(logits).reshape(n, -1)
        now = time.perf_counter()
        self._step_timed(n, now - t0)
        self.decode_steps += 1
        self.max_active = max(self.max_active, n)
        for b, s in enumerate(self._slots):
            s.pos += 1
            self._take(s, z[b], now)
        self._shadow()

    def _take(self, s: _Slot, z: np.ndarray, now: float) -> None:
        """Sample s's next token from its logits z (V,) and hand it over, or end s."""
        r = s.req
        if r.t_last is None:
            self.stats.ttft.observe(now - r.t_submit)
        else:
            self.stats.token_latency.observe(now - r.t_last)
        r.t_last = now
        if not np.isfinite(z).all():
            s.done = True
            r._fail("the model's logits hold NaN/inf values (its weights overflow the compute "
                    "dtype)")
            return
        t = r.params.pick(z, r.rng, r.recent() if r.params.penalised else ())
        if t in r.stop_ids:
            s.done = True
            r._finish("stop")
            return
        if r.logprobs is not None:
            r.token_logprobs.append(token_logprobs(z, t, r.logprobs))
        r.tokens.append(t)
        self.stats.completion_tokens += 1
        s.last = t
        r._emit(("token", t))
        if len(r.tokens) >= s.budget:
            s.done = True
            r._finish("length")

    def _held(self, s: _Slot) -> np.ndarray | None:
        """The ids whose K/V rows of s's row a later prompt may keep (its prompt and fed reply,
        as far as the model's ``reusable_rows`` allows), None when not kept."""
        r = s.req
        if not self.reuse or r.finish_reason == "error":
            return None
        P = len(r.prompt_ids)
        fed = np.asarray(r.tokens[:s.pos - P], dtype=np.int64)
        return np.concatenate([r.prompt_array, fed])[:self.model.reusable_rows(P, s.pos)]

    def _compact(self) -> None:
        """Remove the finished slots; the last running row trades places with each freed one
        (its cached positions exchanged), so the running requests stay rows 0..n-1 and the freed
        rows keep what they held for later prompts."""
        slots = self._slots
        for i in range(len(slots) - 1, -1, -1):
            if not slots[i].done:
                continue
            last = len(slots) - 1
            held = self._held(slots[i])
            if i != last:
                moved = slots[last]
                if held is None:
                    self.rows.copy(last, i, moved.pos)
                else:
                    self.rows.swap(i, last, max(moved.pos, len(held)))
                slots[i] = moved
            slots.pop()
            self.rows.release(last, held)
