r"""Continuous batching: many requests share one model through one batched KV cache.

The :class:`Engine` owns the queue of waiting requests and a scheduler thread; its
:class:`SlotBatch` owns a cache of ``max_batch`` slots (rows) of ``S`` positions and the requests
running in them. Each iteration of the scheduler (:meth:`SlotBatch.step`)

1. drops the requests that were cancelled (a client that went away) and frees their slots;
2. admits waiting requests while slots are free: their prompts are prefilled into free rows
   (together, right-padded, in one forward over a view of those rows, up to ``prefill_tokens``
   padded tokens per forward) and each first token is sampled from its last prompt position;
3. decodes one token for every running request in one batched forward: row b feeds the token
   it sampled last at its own position p_b (``start_pos`` is the (n,) array of the p_b), so
   rows at different positions share the step; attention reads positions 0..p_b of row b only;
4. hands each request its token; a request that sampled a stop id, reached ``max_tokens`` or the
   end of the context leaves and frees its row.

The running requests always occupy rows 0..n-1: a leaving row is replaced by the last one (its
cached positions 0..p-1 are copied over), so each step is one forward over a contiguous view of
the first n rows, never over idle slots. Stale K/V left in a reused row lie beyond the new
request's positions, which attention masks.

Request b samples with its own generator (``seed``), so its tokens do not depend on which other
requests share the batch; greedy tokens equal those of :func:`minillama.infer.generate.generate`.
Nothing here knows HTTP: :mod:`minillama.infer.serve` is one client of it.
"""

from __future__ import annotations

import collections
import itertools
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

from minillama.core.errors import MinillamaError
from minillama.core.sampling import SamplingParams

#: an event handed to a request's listener: ("token", id), ("done", finish_reason) or
#: ("error", message); "done" and "error" are the last event of a request
Event = tuple


class Request:
    """One generation running in an :class:`Engine`. Its events go to ``on_event`` (called on the
    scheduler thread: keep it short) or, without one, to a queue read by :meth:`events`."""

    _ids = itertools.count()

    def __init__(self, engine, prompt_ids: list[int], max_tokens: int, params: SamplingParams,
                 stop_ids: set[int], on_event: Callable[[Event], None] | None):
        self.id = next(self._ids)
        self.prompt_ids = prompt_ids
        self.max_tokens = max_tokens
        self.params = params
        self.stop_ids = stop_ids
        self.rng = np.random.default_rng(params.seed)
        self.tokens: list[int] = []  #: the ids generated so far (stop ids excluded)
        self.finish_reason: str | None = None  #: "stop", "length", "cancelled" or "error"
        self._engine = engine
        self._cancelled = False
        self._queue: queue.Queue | None = queue.Queue() if on_event is None else None
        self._on_event = on_event if on_event is not None else self._queue.put

    def recent(self) -> list[int]:
        """The context's last ``repeat_last_n`` ids (all for -1) that the penalties look at,
        without copying the whole prompt at every step."""
        n, toks = self.params.repeat_last_n, self.tokens
        if n < 0:
            return self.prompt_ids + toks
        if len(toks) >= n:
            return toks[len(toks) - n:]
        return self.prompt_ids[max(len(self.prompt_ids) - (n - len(toks)), 0):] + toks

    def cancel(self) -> None:
        """Stop generating (e.g. the client disconnected); the slot is freed at the next step."""
        self._cancelled = True
        self._engine._wake()

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """The events of a request submitted without ``on_event``, ending with its last one."""
        if self._queue is None:
            raise MinillamaError("this request hands its events to its on_event callback")
        while True:
            ev = self._queue.get(timeout=timeout)
            yield ev
            if ev[0] != "token":
                return

    def _emit(self, ev: Event) -> None:
        try:
            self._on_event(ev)
        except Exception:  # a listener's failure must not stop the batch
            self._cancelled = True

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        self._engine.finished[reason] += 1
        self._emit(("done", reason))

    def _fail(self, message: str) -> None:
        self.finish_reason = "error"
        self._engine.finished["error"] += 1
        self._emit(("error", message))


class _Slot:
    """A running request: ``pos`` is where its next fed token goes (= prompt length + tokens fed
    so far), ``last`` the token to feed, ``budget`` the most tokens it may produce."""

    __slots__ = ("req", "pos", "last", "budget", "done")

    def __init__(self, req: Request, pos: int, budget: int):
        self.req, self.pos, self.last, self.budget, self.done = req, pos, -1, budget, False


class Engine:
    r"""Continuous batching over ``model`` (a
    :class:`~minillama.model.transformer.Transformer`) with up to ``max_batch`` concurrent
    requests, each within a context of ``max_seq_len`` positions (default and cap: the model's).
    The cache holds 2 \cdot L \cdot max\_batch \cdot S \cdot KVH \cdot hd floats, allocated once.

    :meth:`submit` queues a request and returns at once; the scheduler thread starts on the first
    submit (or :meth:`start`) and stops with :meth:`close`.
    """

    def __init__(self, model, max_batch: int = 8, max_seq_len: int | None = None,
                 prefill_tokens: int = 4096):
        if isinstance(max_batch, bool) or int(max_batch) != max_batch or max_batch < 1:
            raise MinillamaError(f"max_batch must be a positive integer, got {max_batch}")
        ctx = model.cfg.max_seq_len
        self.S = int(min(max_seq_len or ctx, ctx))
        if self.S < 1:
            raise MinillamaError(f"the context must hold at least one position, got {self.S}")
        self.model = model
        self.max_batch = int(max_batch)
        #: the most (padded) prompt tokens prefilled in one forward: new requests arriving
        #: together are prefilled together up to this size
        self.prefill_tokens = int(prefill_tokens)
        self.batch = SlotBatch(model, self.max_batch, self.S, self.prefill_tokens)
        self._slots = self.batch.slots
        self._pending: collections.deque[Request] = collections.deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.finished: collections.Counter = collections.Counter()  #: finish reason -> count

    # -- the caller's side ---------------------------------------------------------------------
    @property
    def active(self) -> int:
        """How many requests hold a slot now."""
        return len(self._slots)

    @property
    def waiting(self) -> int:
        """How many submitted requests wait for a slot."""
        return len(self._pending)

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams | None = None,
               stop_ids: Iterable[int] = (), on_event: Callable[[Event], None] | None = None,
               **settings) -> Request:
        """Queue one generation and return its :class:`Request`: ``params`` (a
        :class:`~minillama.core.sampling.SamplingParams`, default greedy) with ``settings`` (its
        field names, e.g. ``max_tokens=64, temperature=0.7``) replaced; ``max_tokens`` defaults
        to 16. Bad arguments (an empty prompt or one longer than the context, ids outside the
        vocabulary, settings out of range) raise :class:`MinillamaError` before anything
        runs."""
        params = SamplingParams.of(params, **settings)
        max_tokens = 16 if params.max_tokens is None else params.max_tokens
        prompt = [int(t) for t in prompt_ids]
        V = self.model.cfg.vocab_size
        if not prompt:
            raise MinillamaError("the prompt must hold at least one token")
        if min(prompt) < 0 or max(prompt) >= V:
            raise MinillamaError(f"prompt token ids must lie in [0, {V})")
        if len(prompt) > self.S:
            raise MinillamaError(f"the prompt of {len(prompt)} tokens is longer than the context "
                                 f"of {self.S} tokens")
        req = Request(self, prompt, int(max_tokens), params, {int(t) for t in stop_ids}, on_event)
        with self._cv:
            if self._closed:
                raise MinillamaError("the engine is closed")
            self._pending.append(req)
            self._cv.notify()
        self.start()
        return req

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams | None = None,
                 **kw) -> tuple[list[int], str]:
        """Submit one request (arguments as :meth:`submit`) and wait for it: (generated ids,
        finish reason)."""
        req = self.submit(prompt_ids, params, **kw)
        for kind, val in req.events():
            if kind == "error":
                raise MinillamaError(val)
        return req.tokens, req.finish_reason

    def start(self) -> None:
        with self._cv:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._loop, name="minillama-engine",
                                                daemon=True)
                self._thread.start()

    def close(self) -> None:
        """Stop the scheduler; requests still waiting or running end with an error event."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        for r in list(self._pending) + [s.req for s in self._slots]:
            r._fail("the server is shutting down")
        self._pending.clear()
        self._slots.clear()

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify()

    # -- the scheduler thread ------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not self._pending and not self._slots:
                    self._cv.wait()
                if self._closed:
                    return
                new = []
                while self._pending and len(self._slots) + len(new) < self.max_batch:
                    new.append(self._pending.popleft())
            try:
                self.batch.step(new)
            except Exception as e:  # an unexpected failure ends these requests,
                msg = str(e).splitlines()[0] if str(e) else type(e).__name__  # not the server
                for r in new + [s.req for s in self._slots]:
                    if r.finish_reason is None:
                        r._fail(f"generation failed: {msg}")
                self._slots.clear()

    @property
    def cache(self):
        """The KV cache of the slots (rows 0..active-1 hold the running requests)."""
        return self.batch.cache

    @property
    def decode_steps(self) -> int:
        """Batched decode steps run so far."""
        return self.batch.decode_steps

    @property
    def prefills(self) -> int:
        """Prefill forwards run so far (each may hold several prompts)."""
        return self.batch.prefills

    @property
    def max_active(self) -> int:
        """The most requests that ever decoded in one step."""
        return self.batch.max_active

    @max_active.setter
    def max_active(self, n: int) -> None:
        self.batch.max_active = n


class SlotBatch:
    """The rows of the KV cache and the requests running in them: prefills new requests into
    free rows, runs one batched decode step over all of them, samples and hands over each one's
    token, and keeps the running requests in rows 0..n-1 as others finish."""

    def __init__(self, model, max_batch: int, S: int, prefill_tokens: int):
        self.model = model
        self.S = S
        self.prefill_tokens = prefill_tokens
        self.cache = model.new_cache(max_batch, S)
        self._views: dict[tuple[int, int], object] = {}
        self._slots: list[_Slot] = []
        self.slots = self._slots
        self.decode_steps = 0
        self.prefills = 0
        self.max_active = 0

    def step(self, new: list[Request]) -> None:
        for s in self._slots:
            if s.req.cancelled:
                s.done = True
                s.req._finish("cancelled")
        self._compact()
        group: list[Request] = []
        for r in new:
            if r.cancelled:
                r._finish("cancelled")
            elif min(r.max_tokens, self.S - len(r.prompt_ids) + 1) <= 0:
                r._finish("length")
            else:
                longest = max([len(q.prompt_ids) for q in group] + [len(r.prompt_ids)])
                if group and longest * (len(group) + 1) > self.prefill_tokens:
                    self._admit(group)
                    group = []
                group.append(r)
        if group:
            self._admit(group)
        self._compact()
        if self._slots:
            self._decode()
            self._compact()

    def _view(self, lo: int, hi: int):
        """The cache rows lo..hi-1 (views made once each, so backends may key plans on them)."""
        v = self._views.get((lo, hi))
        if v is None:
            v = self._views[(lo, hi)] = self.cache.rows(lo, hi)
        return v

    def _admit(self, group: list[Request]) -> None:
        """Prefill the prompts of ``group`` into the next free rows in one forward (right-padded
        to the longest; the padding's K/V lie beyond each row's positions, masked and later
        overwritten) and sample each one's first token from its last prompt position."""
        row, k = len(self._slots), len(group)
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
        for b, r in enumerate(group):
            slot = _Slot(r, int(lens[b]), min(r.max_tokens, self.S - int(lens[b]) + 1))
            self._slots.append(slot)
            self._take(slot, z[b])

    def _decode(self) -> None:
        """One batched step: row b feeds its last token at its own position p_b."""
        n = len(self._slots)
        tok = np.array([[s.last] for s in self._slots], dtype=np.int64)
        pos = np.array([s.pos for s in self._slots], dtype=np.int64)
        logits = self.model.forward(tok, pos, self._view(0, n), last_only=True)
        z = self.model.backend.to_numpy(logits).reshape(n, -1)
        self.decode_steps += 1
        self.max_active = max(self.max_active, n)
        for b, s in enumerate(self._slots):
            s.pos += 1
            self._take(s, z[b])

    def _take(self, s: _Slot, z: np.ndarray) -> None:
        """Sample s's next token from its logits z (V,) and hand it over, or end s."""
        r = s.req
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
        r.tokens.append(t)
        s.last = t
        r._emit(("token", t))
        if len(r.tokens) >= s.budget:
            s.done = True
            r._finish("length")

    def _compact(self) -> None:
        """Remove the finished slots; the last running row moves into each freed one (its cached
        positions 0..p-1 copied), so the running requests stay rows 0..n-1."""
        for i in range(len(self._slots) - 1, -1, -1):
            if not self._slots[i].done:
                continue
            last = len(self._slots) - 1
            if i != last:
                moved = self._slots[last]
                p = moved.pos
                for a in self.cache.k + self.cache.v:
                    a[i, :p] = a[last, :p]
                self._slots[i] = moved
            self._slots.pop()




class StopText:
    """Cuts streamed text at the first occurrence of any of some stop strings.

    :meth:`push` takes the next piece of text and returns what may be shown now: everything up to
    a stop string once one appears (then :attr:`hit` is set), else everything except a tail that
    could still be the start of a stop string (held back until the next piece decides it)."""

    def __init__(self, stops: Iterable[str] = ()):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.hit = False

    def push(self, piece: str) -> str:
        if self.hit:
            return ""
        text = self.held + piece
        first = self._first_stop(text)
        end = len(text) if first is None else first
        # a tail that begins a stop which more text could complete before `end`: wait for it
        longest = max((len(s) for s in self.stops), default=1)
        for j in range(max(0, len(text) - longest + 1), end):
            if any(len(s) > len(text) - j and s.startswith(text[j:]) for s in self.stops):
                self.held = text[j:]
                return text[:j]
        self.held = ""
        self.hit = first is not None
        return text[:end]

    def _first_stop(self, text: str) -> int | None:
        """Where the earliest complete stop string in ``text`` starts (None: nowhere)."""
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def flush(self) -> str:
        """The held-back tail, once no more text comes (cut at a stop string it holds)."""
        out, self.held = ("" if self.hit else self.held), ""
        first = self._first_stop(out)
        if first is not None:
            self.hit = True
            out = out[:first]
        return out
