"""The thread count of a decode step, chosen by measured speed (the CPU backends).

A decode step runs a few hundred parallel regions (several per layer), each ending at a barrier
where every thread waits for the slowest. On a quiet machine all threads have a core and the
regions split the work; when other processes want the cores, a thread that loses its core holds
every barrier until the scheduler gives it one back, and a step can take a hundred times longer
than on one thread (measured on 2 cores with two busy processes: SmolLM2-135M Q4_1 at 0.8-13
tokens/s on 2 threads, about 40 on 1; docs/BENCHMARKS.md, "Decode on a busy machine"). The
``numpy`` backend's per-op step is the same: OpenBLAS's matrix-vector products end at a barrier
too (a 1536 x 576 product: 49 us quiet on 2 threads, 7.8 ms with two busy processes; 125 and
212 us on one thread).

:class:`ThreadTuner` keeps the seconds per step of the full thread count and of one thread (an
exponential moving average of the recent calls), runs the faster, and now and then times one
step of the other (a probe, whose time replaces the other's stale one). A probe comes once the
steps run since the last one took :data:`PROBE_RATIO` times what the probe is expected to cost
(the first call of each count, which pays for cold caches, is not counted, and a count's first
measure is the fastest of :data:`FIRST_STEPS` steps), so probing costs at most 1 / PROBE_RATIO
of the time on any machine, quiet or busy, and a change of load is followed within PROBE_RATIO
slow steps. The first measures cost up to 2 + 2 x FIRST_STEPS steps per tuner (a new batch size
has its own), a count whose first step is :data:`COLLAPSED` times slower than the other's ending
its measure there.
"""

from __future__ import annotations

import contextlib
import math
import time

#: a probe once the time since the last one is this many times its expected cost
PROBE_RATIO = 40.0
#: weight of the newest call in the moving average of seconds per step
EMA = 0.5
#: steps of a count's first measure (after its warm-up call), of which the fastest counts: one
#: step that meets a stall (a cold cache after a prefill, a woken thread) must not condemn a
#: count until the next probe, which is due only after PROBE_RATIO times the stalled time
FIRST_STEPS = 3
#: ... but a first step this many times slower than the other count's measure ends it at once
#: (a collapse, not a stall: on a busy machine one two-thread step can take a second)
COLLAPSED = 10.0


class ThreadTuner:
    """Chooses between ``most`` threads and one for each call of a decode kernel."""

    def __init__(self, most: int, adapt: bool = True):
        self.most = max(int(most), 1)
        self.adapt = adapt  # False: always ``most`` threads, calls as long as asked
        self.per_step: dict[int, float] = {}  # threads -> average seconds per step
        self.warm: set[int] = set()  # counts whose first call (page faults, caches) is over
        self.since_probe = 0.0  # seconds of steps run since the last probe
        self.first: dict[int, list[float]] = {}  # threads -> seconds per step of its first calls

    def best(self) -> int:
        """The thread count measured fastest (``most`` until both are measured)."""
        if len(self.per_step) < 2:
            return self.most
        return min(self.per_step, key=self.per_step.get)

    @property
    def settled(self) -> bool:
        """Whether every count it chooses between has been measured (before, calls run on
        trial counts)."""
        return self.most == 1 or not self.adapt or {1, self.most} <= self.per_step.keys()

    def plan(self, steps: int, whole: bool = False) -> tuple[int, int]:
        """(threads, steps) of the next call of up to ``steps`` steps: one step of the count
        that is due a probe (or not measured yet, one thread first: :data:`FIRST_STEPS` calls
        of one step each after a warm-up call), else steps on the best count, as many as fit
        before the next probe is due. ``whole``: the call runs all ``steps`` whatever the plan
        says (the rows of one step), so a probe costs that many steps and comes that much more
        rarely."""
        if self.most == 1 or not self.adapt:
            return self.most, steps
        for count in (1, self.most):  # one thread first: cheap on a quiet machine, and on a
            if count not in self.per_step:  # busy one it lets a collapsed first step of the
                return count, 1  # full count end that count's first measure
        best = self.best()
        other = 1 if best == self.most else self.most
        left = PROBE_RATIO * self.per_step[other] * (steps if whole else 1) - self.since_probe
        if left <= 0:
            return other, 1
        return best, max(1, min(steps, math.ceil(left / self.per_step[best])))

    def record(self, threads: int, steps: int, seconds: float) -> None:
        """A call of ``steps`` steps on ``threads`` threads took ``seconds``."""
        if steps <= 0:
            return
        if threads not in self.warm:  # a first call pays for cold caches: not a measure
            self.warm.add(threads)
            return
        t = seconds / steps
        old = self.per_step.get(threads)
        if old is None:  # the first measure: the fastest of its first FIRST_STEPS steps
            got = self.first.setdefault(threads, [])
            got.extend([t] * min(steps, FIRST_STEPS))
            others = [v for k, v in self.per_step.items() if k != threads]
            if len(got) >= FIRST_STEPS or (others and t > COLLAPSED * min(others)):
                self.per_step[threads] = min(got)
                self.since_probe = 0.0
        elif threads != self.best():  # a probe: its time replaces the stale one
            self.per_step[threads] = t
            self.since_probe = 0.0
        else:
            self.per_step[threads] = EMA * t + (1 - EMA) * old
            self.since_probe += seconds

    def run(self, use, call, steps: int, whole: bool = False) -> int:
        """``call(threads, k)`` (runs k <= steps steps on that many threads, returns how many it
        ran) once, with the thread count and step count of :meth:`plan` (``whole``: see there),
        inside ``use(threads)`` (a context manager that sets the team size of the pools the call
        runs on and restores it after). Returns the steps run."""
        threads, k = self.plan(steps, whole)
        with use(threads):
            t0 = time.perf_counter()
            n = call(threads, k)
            self.record(threads, n, time.perf_counter() - t0)
        return n

    @contextlib.contextmanager
    def step(self, use):
        """One step run in the ``with`` block, on the thread count of :meth:`plan` (set by
        ``use(threads)`` as for :meth:`run`) and timed for the next plans. Yields the count."""
        threads, _ = self.plan(1)
        with use(threads):
            t0 = time.perf_counter()
            yield threads
            self.record(threads, 1, time.perf_counter() - t0)
