"""Counters and latency histograms of a serving engine, and their Prometheus text form.

:class:`EngineStats` is filled by the :class:`~minillama.infer.engine.Engine`'s scheduler thread
(prompt tokens in, how many of them were prefilled and how many came from the prefix cache,
completion tokens out, time to first token, time between tokens); :class:`HTTPCounts` by the
server, one count per answered request by route and status code. :func:`prometheus_text` writes
both, with the engine's queue depth and active slots, in the text exposition format that
Prometheus scrapes (``# HELP`` / ``# TYPE`` lines, then ``name{label="value"} number``).

Updates happen on one thread and reads on another without a lock: each value is one Python
object swapped whole, and a histogram's count is written as the sum of the bucket counts it is
printed with, so a scrape always shows a consistent histogram.
"""

from __future__ import annotations

import bisect
import collections

#: bucket bounds (seconds) for the time to first token: prefill of a long prompt takes seconds
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: bucket bounds (seconds) for the time between two tokens of one request (one decode step)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    """Observations counted into buckets with upper bounds ``bounds`` (and one above all)."""

    def __init__(self, bounds):
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def lines(self, name: str) -> list[str]:
        """``name_bucket{le=...}`` (cumulative), ``name_sum`` and ``name_count``."""
        counts, total = list(self.counts), self.sum
        out, run = [], 0
        for bound, c in zip(self.bounds + (float("inf"),), counts):
            run += c
            le = "+Inf" if bound == float("inf") else f"{bound:g}"
            out.append(f'{name}_bucket{{le="{le}"}} {run}')
        out += [f"{name}_sum {total:.6f}", f"{name}_count {run}"]
        return out


class EngineStats:
    """What an engine has done since it started; :attr:`prompt_tokens` counts every admitted
    prompt's tokens, of which :attr:`cached_tokens` came from the KV cache (a reused prefix) and
    :attr:`prefilled_tokens` ran through a prefill forward (padding not counted)."""

    def __init__(self):
        self.requests = 0
        self.prompt_tokens = 0
        self.prefilled_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.token_latency = Histogram(TOKEN_BUCKETS)


class HTTPCounts:
    """Answered HTTP requests by (route, status code); routes outside ``routes`` count as
    ``other`` so that probing clients cannot grow the table (:class:`CountedApp` counts)."""

    def __init__(self, routes):
        self.routes = frozenset(routes)
        self.counts: collections.Counter = collections.Counter()

    def add(self, path: str, status: int) -> None:
        self.counts[(path if path in self.routes else "other", int(status))] += 1


class CountedApp:
    """An ASGI application around ``app`` that counts each response's status in ``counts`` as
    the response starts (errors answered by ``app``'s outermost handlers included)."""

    def __init__(self, app, counts: HTTPCounts):
        self.app, self.counts = app, counts
        self.state = getattr(app, "state", None)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, counts = scope.get("path", ""), self.counts

        async def counted(message):
            if message["type"] == "http.response.start":
                counts.add(path, message["status"])
            await send(message)

        return await self.app(scope, receive, counted)


def _metric(out: list[str], name: str, kind: str, help_: str, lines) -> None:
    out.append(f"# HELP {name} {help_}")
    out.append(f"# TYPE {name} {kind}")
    out.extend(lines)


def prometheus_text(engine, http: HTTPCounts | None = None, prefix: str = "minillama") -> str:
    """The engine's counters, gauges and histograms (and ``http``'s request counts) in
    Prometheus' text exposition format."""
    s, p, out = engine.stats, prefix, []
    if http is not None:
        rows = sorted(dict(http.counts).items())
        _metric(out, f"{p}_requests_total", "counter",
                "HTTP requests answered, by route and status code.",
                [f'{p}_requests_total{{route="{r}",code="{c}"}} {n}' for (r, c), n in rows])
    finished = sorted(dict(engine.finished).items())
    _metric(out, f"{p}_generations_finished_total", "counter",
            "Generations ended, by reason (stop, length, cancelled, error).",
            [f'{p}_generations_finished_total{{reason="{r}"}} {n}' for r, n in finished])
    for name, value, help_ in (
            ("prompt_tokens_total", s.prompt_tokens, "Prompt tokens admitted."),
            ("prompt_tokens_cached_total", s.cached_tokens,
             "Prompt tokens whose keys and values were reused from the cache, not prefilled."),
            ("prefill_tokens_total", s.prefilled_tokens, "Prompt tokens run through prefill."),
            ("completion_tokens_total", s.completion_tokens, "Tokens generated."),
            ("decode_steps_total", engine.decode_steps, "Batched decode steps run."),
            ("draft_tokens_total", engine.batch.drafted,
             "Prompt-lookup draft tokens verified in decode steps."),
            ("draft_tokens_accepted_total", engine.batch.accepted,
             "Verified draft tokens the model chose (each one a decode step saved).")):
        _metric(out, f"{p}_{name}", "counter", help_, [f"{p}_{name} {value}"])
    for name, value, help_ in (
            ("queue_depth", engine.waiting, "Requests waiting for a slot."),
            ("active_slots", engine.active, "Requests decoding now."),
            ("slots", engine.max_batch, "Requests that can decode together."),
            ("queue_limit", -1 if engine.max_queue is None else engine.max_queue,
             "Most requests that may wait for a slot (-1: no limit).")):
        _metric(out, f"{p}_{name}", "gauge", help_, [f"{p}_{name} {value}"])
    _metric(out, f"{p}_time_to_first_token_seconds", "histogram",
            "Time from a request's arrival at the engine to its first sampled token.",
            s.ttft.lines(f"{p}_time_to_first_token_seconds"))
    _metric(out, f"{p}_time_per_output_token_seconds", "histogram",
            "Time between two consecutive tokens of one request.",
            s.token_latency.lines(f"{p}_time_per_output_token_seconds"))
    return "\n".join(out) + "\n"
