r"""Continuous batching: many requests share one model through one batched KV cache.

The :class:`Engine` owns the queue of waiting requests and a scheduler thread; its
:class:`~minillama.infer.slots.SlotBatch` owns a cache of ``max_batch`` slots (rows) of ``S``
positions and the requests running in them. Each iteration of the scheduler
(:meth:`~minillama.infer.slots.SlotBatch.step`)

1. drops the requests that were cancelled (a client that went away) and frees their slots, so a
   cancelled request leaves within one decode step;
2. admits waiting requests while slots are free: a prompt that starts with ids whose K/V a cache
   row already holds (a shared system prompt, a conversation's earlier turns) takes that row and
   prefills only the rest (:mod:`minillama.infer.slots`); the others are prefilled into free rows
   together, right-padded, in one forward over a view of those rows (up to ``prefill_tokens``
   padded tokens per forward); each first token is sampled from its last prompt position;
3. decodes one token for every running request in one batched forward: row b feeds the token
   it sampled last at its own position p_b (``start_pos`` is the (n,) array of the p_b), so
   rows at different positions share the step; attention reads positions 0..p_b of row b only;
4. hands each request its token; a request that sampled a stop id, reached ``max_tokens`` or the
   end of the context leaves and frees its row.

The running requests always occupy rows 0..n-1: a leaving row trades places with the last one
(cached positions exchanged), so each step is one forward over a contiguous view of the first n
rows, never over idle slots. Stale K/V left in a reused row lie beyond the new request's
positions, which attention masks.

Request b samples with its own generator (``seed``), so its tokens do not depend on which other
requests share the batch; greedy tokens equal those of :func:`minillama.infer.generate.generate`.
At most ``max_batch + max_queue`` requests are in the engine at once (:class:`QueueFull` beyond).
Nothing here knows HTTP: :mod:`minillama.infer.serve` is one client of it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

from minillama.core.errors import MinillamaError
from minillama.core.sampling import SamplingParams, StopText
from minillama.infer.metrics import EngineStats
from minillama.infer.slots import SlotBatch

__all__ = ["Engine", "QueueFull", "Request", "SlotBatch", "StopText"]

#: the most alternatives a request may ask log-probabilities for, per token
MAX_TOP_LOGPROBS = 20

#: an event handed to a request's listener: ("token", id), ("done", finish_reason) or
#: ("error", message); "done" and "error" are the last event of a request
Event = tuple


class QueueFull(MinillamaError):
    """The engine holds as many requests as it may (running and waiting): try again later."""


class Request:
    """One generation running in an :class:`Engine`. Its events go to ``on_event`` (called on the
    scheduler thread: keep it short) or, without one, to a queue read by :meth:`events`.

    With ``logprobs`` k (not None) each generated token's entry of :attr:`token_logprobs` is
    (log p of the token, its k most likely alternatives as (id, log p)), appended before the
    token's event is handed over; p is the softmax of the model's raw logits at that step (the
    model's distribution: before penalties, temperature and filters)."""

    _ids = itertools.count()

    def __init__(self, engine, prompt_ids: list[int], max_tokens: int, params: SamplingParams,
                 stop_ids: set[int], on_event: Callable[[Event], None] | None,
                 logprobs: int | None = None):
        self.id = next(self._ids)
        self.prompt_ids = prompt_ids
        self.prompt_array = np.asarray(prompt_ids, dtype=np.int64)
        self.max_tokens = max_tokens
        self.params = params
        self.stop_ids = stop_ids
        self.logprobs = logprobs
        self.rng = np.random.default_rng(params.seed)
        self.tokens: list[int] = []  #: the ids generated so far (stop ids excluded)
        self.token_logprobs: list[tuple[float, list[tuple[int, float]]]] = []
        self.finish_reason: str | None = None  #: "stop", "length", "cancelled" or "error"
        self.cached_tokens = 0  #: prompt tokens whose K/V were reused, not prefilled
        self.t_submit = time.perf_counter()
        self.t_last: float | None = None  #: when its last token was sampled
        #: the engine's decode steps when cancel() was called and when the request ended
        self.cancel_step: int | None = None
        self.end_step: int | None = None
        self._engine = engine
        self._cancelled = False
        self.cancel_reason = "cancelled"
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

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop generating; the slot is freed at the next step, and the request ends with
        ``reason``: ``cancelled`` (the client disconnected), ``stop`` (the caller met a stop
        string), ``length`` (cut short, e.g. by a shutdown). The first call's reason counts."""
        if not self._cancelled and self.finish_reason is None:
            self.cancel_step = self._engine.decode_steps
            self.cancel_reason = reason
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
        self.end_step = self._engine.decode_steps
        self._engine.finished[reason] += 1
        self._emit(("done", reason))

    def _fail(self, message: str) -> None:
        self.finish_reason = "error"
        self.end_step = self._engine.decode_steps
        self._engine.finished["error"] += 1
        self._emit(("error", message))


def _checked_request(prompt_ids, logprobs, V: int, S: int) -> list[int]:
    """The prompt's ids as ints, after checking them (not empty, in the vocabulary of V, at
    most S) and ``logprobs`` (None or 0..MAX_TOP_LOGPROBS); one clear error otherwise."""
    if logprobs is not None and (isinstance(logprobs, bool) or int(logprobs) != logprobs
                                 or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
        raise MinillamaError(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got "
                             f"{logprobs}")
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise MinillamaError("the prompt must hold at least one token")
    if min(prompt) < 0 or max(prompt) >= V:
        raise MinillamaError(f"prompt token ids must lie in [0, {V})")
    if len(prompt) > S:
        raise MinillamaError(f"the prompt of {len(prompt)} tokens is longer than the context "
                             f"of {S} tokens")
    return prompt


class Calls:
    """Work handed to the engine's scheduler thread (:meth:`Engine.run_in_thread`), run there
    between two steps. Work on the model belongs on that thread: Numba's parallel kernels (GNU
    OpenMP) ran a decode step 2x slower on a second OS thread than on the first one that ran
    them (SmolLM2 Q4_1, 2 threads: 10-11 ms a step against 4.5-5.4 ms, the first thread's
    speed with ``GOMP_SPINCOUNT=0``: each parallel region woke sleeping workers), and a server
    whose warm-up ran on the main thread served one client at 0.65x its speed."""

    def __init__(self, cv: threading.Condition):
        self.cv = cv  # the engine's lock and wake-up
        self.queue: collections.deque = collections.deque()  # (fn, args, future)
        self.closed = False

    def __bool__(self) -> bool:
        return bool(self.queue)

    def put(self, fn: Callable, args: tuple) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self.cv:
            if self.closed:
                raise MinillamaError("the engine is closed")
            self.queue.append((fn, args, future))
            self.cv.notify()
        return future

    def take(self) -> Callable[[], None] | None:
        """The next call (lock held), as a function that runs it and hands its outcome over."""
        if not self.queue:
            return None
        fn, args, future = self.queue.popleft()

        def run() -> None:
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # the waiting caller gets it
                future.set_exception(e)

        return run

    def refuse(self) -> None:
        """The engine closed (lock held): every waiting call fails, and any later one."""
        self.closed = True
        while self.queue:
            self.queue.popleft()[2].set_exception(MinillamaError("the engine is closed"))


class Engine:
    r"""Continuous batching over ``model`` (a
    :class:`~minillama.model.transformer.Transformer`) with up to ``max_batch`` concurrent
    requests, each within a context of ``max_seq_len`` positions (default and cap: the model's).
    The cache holds 2 \cdot L \cdot (max\_batch + prefix\_rows) \cdot S \cdot KVH \cdot hd
    floats, allocated once.

    ``max_queue`` bounds the requests waiting for a slot (None: no bound): :meth:`submit` raises
    :class:`QueueFull` when ``max_batch + max_queue`` requests are in the engine.
    ``prefix_reuse`` lets a prompt start from the K/V a row already holds for its first tokens
    (:mod:`minillama.infer.slots`); the free slots keep what their last request held, and
    ``prefix_rows`` more rows keep it only for that. ``speculate``: greedy requests verify
    prompt-lookup drafts in the batched steps where the backend computes them exactly
    (:mod:`minillama.infer.slot_drafts`; the same tokens). :attr:`stats` counts tokens and
    latencies (:class:`~minillama.infer.metrics.EngineStats`).

    :meth:`submit` queues a request and returns at once; the scheduler thread starts on the first
    submit (or :meth:`start`) and stops with :meth:`close`.
    """

    def __init__(self, model, max_batch: int = 8, max_seq_len: int | None = None,
                 prefill_tokens: int = 4096, max_queue: int | None = None,
                 prefix_reuse: bool = True, prefix_rows: int = 0, speculate: bool = True):
        for name, v, lo in (("max_batch", max_batch, 1), ("prefix_rows", prefix_rows, 0),
                            ("max_queue", 0 if max_queue is None else max_queue, 0)):
            if isinstance(v, bool) or int(v) != v or v < lo:
                raise MinillamaError(f"{name} must be an integer >= {lo}, got {v}")
        ctx = model.cfg.max_seq_len
        self.S = int(min(max_seq_len or ctx, ctx))
        if self.S < 1:
            raise MinillamaError(f"the context must hold at least one position, got {self.S}")
        self.model = model
        self.max_batch = int(max_batch)
        self.max_queue = None if max_queue is None else int(max_queue)
        #: the most (padded) prompt tokens prefilled in one forward: new requests arriving
        #: together are prefilled together up to this size
        self.prefill_tokens = int(prefill_tokens)
        self.stats = EngineStats()
        self.batch = SlotBatch(model, self.max_batch, self.S, self.prefill_tokens, self.stats,
                               extra_rows=int(prefix_rows), reuse=bool(prefix_reuse))
        self.batch.speculate = bool(speculate)
        self._slots = self.batch.slots
        self._pending: collections.deque[Request] = collections.deque()
        self._in_step = 0  # the requests the running step holds (those it admits included)
        self._cv = threading.Condition()
        self._calls = Calls(self._cv)  # work handed to the scheduler thread
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
               logprobs: int | None = None, **settings) -> Request:
        """Queue one generation and return its :class:`Request`: ``params`` (a
        :class:`~minillama.core.sampling.SamplingParams`, default greedy) with ``settings`` (its
        field names, e.g. ``max_tokens=64, temperature=0.7``) replaced; ``max_tokens`` defaults
        to 16; ``logprobs`` k in 0..20 records each token's log-probability and its k likeliest
        alternatives (:class:`Request`). Bad arguments (an empty prompt or one longer than the
        context, ids outside the vocabulary, settings out of range) raise
        :class:`MinillamaError` before anything runs; a full engine raises :class:`QueueFull`."""
        prompt = _checked_request(prompt_ids, logprobs, self.model.cfg.vocab_size, self.S)
        params = SamplingParams.of(params, **settings)
        max_tokens = 16 if params.max_tokens is None else params.max_tokens
        req = Request(self, prompt, int(max_tokens), params, {int(t) for t in stop_ids}, on_event,
                      None if logprobs is None else int(logprobs))
        with self._cv:
            if self._closed:
                raise MinillamaError("the engine is closed")
            held = len(self._pending) + max(self._in_step, len(self._slots))
            if self.max_queue is not None and held >= self.max_batch + self.max_queue:
                raise QueueFull(f"the server is busy: {self.max_batch} requests may run and "
                                f"{self.max_queue} wait, and all places are taken; retry later")
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

    def run_in_thread(self, fn: Callable, *args):
        """``fn(*args)`` run on the scheduler thread between two steps (:class:`Calls` says
        why); returns its result or raises its error."""
        future = self._calls.put(fn, args)
        self.start()
        return future.result()

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
            self._calls.refuse()
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
                while (not self._closed and not self._pending and not self._slots
                       and not self._calls):
                    self._cv.wait()
                if self._closed:  # close() refused the calls
                    return
                call = self._calls.take()
                if call is None and any(r.cancelled for r in self._pending):  # cancelled waiting
                    for r in [r for r in self._pending if r.cancelled]:
                        r._finish(r.cancel_reason)
                    self._pending = collections.deque(r for r in self._pending
                                                      if r.finish_reason is None)
                new = [] if call is not None else self._take_pending()
            if call is not None:
                call()
                continue
            try:
                self.batch.step(list(new), more=functools.partial(self._more, new))
            except Exception as e:  # an unexpected failure ends these requests,
                msg = str(e).splitlines()[0] if str(e) else type(e).__name__  # not the server
                for r in new + [s.req for s in self._slots]:
                    if r.finish_reason is None:
                        r._fail(f"generation failed: {msg}")
                self._slots.clear()
                self.batch.rows.reset()
            self._in_step = len(self._slots)

    def _take_pending(self) -> list:
        """Pop the pending requests that fit beside the running ones (lock held); they count as
        in the step for the queue bound."""
        new = []
        while self._pending and len(self._slots) + len(new) < self.max_batch:
            new.append(self._pending.popleft())
        self._in_step = len(self._slots) + len(new)
        return new

    def _more(self, taken: list) -> list:
        """Requests that arrived while a step admitted others, to admit in the same step (also
        appended to ``taken``, the step's new requests, which a failing step ends)."""
        with self._cv:
            more = [] if self._closed else self._take_pending()
        taken.extend(more)
        return more

    @property
    def cache(self):
        """The KV cache of the slots (rows 0..active-1 hold the running requests; the rest are
        free, holding what their last requests left for prompt reuse)."""
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
