"""The thread tuner of the CPU backends' decode steps (backends/tuner.py): on simulated
timings it keeps the faster thread count, probes the other less and less often while it loses,
and follows a machine whose load changes; on a real model its choice never changes the tokens."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from minillama.backends.tuner import FIRST_STEPS, PROBE_RATIO, ThreadTuner


class _Machine:
    """Seconds per step by thread count, settable (a quiet or a busy machine)."""

    def __init__(self, per_step):
        self.per_step = dict(per_step)

    def drive(self, tuner, steps: int, chunk: int = 16) -> dict[int, int]:
        """Run ``steps`` decode steps in calls of up to ``chunk``; steps run per thread count."""
        ran = {1: 0, tuner.most: 0}
        left = steps
        while left:
            threads, k = tuner.plan(min(chunk, left))
            tuner.record(threads, k, k * self.per_step[threads])
            ran[threads] += k
            left -= k
        return ran


def _cost(m, ran, tuner) -> float:
    """Seconds the steps ``ran`` took beyond running all of them on the best count."""
    best = min(m.per_step, key=m.per_step.get)
    return sum(n * (m.per_step[k] - m.per_step[best]) for k, n in ran.items())


def test_quiet_machine_runs_on_every_thread():
    t, m = ThreadTuner(2), _Machine({2: 0.005, 1: 0.009})
    ran = m.drive(t, 2000)
    assert t.best() == 2
    # the first measure (a warm-up call and FIRST_STEPS steps), then a few one-step probes
    assert 0 < ran[1] < 2000 * 0.005 / (PROBE_RATIO * 0.009) + FIRST_STEPS + 2
    assert _cost(m, ran, t) <= 2000 * 0.005 / PROBE_RATIO  # probing costs at most 1/RATIO


def test_a_stalled_first_step_does_not_condemn_a_count():
    """The first measured step on every thread meets a stall (ten times its time, as a cold
    cache after a server's prefill does): the first measure keeps the fastest of its steps, so
    the tuner still runs on every thread at once, not after PROBE_RATIO stalled steps' time."""
    t, m = ThreadTuner(2), _Machine({2: 0.005, 1: 0.009})
    stalled = iter([True])

    def drive_one():
        threads, k = t.plan(1)
        slow = threads == 2 and 2 in t.warm and next(stalled, False)
        t.record(threads, k, k * m.per_step[threads] * (10 if slow else 1))
        return threads

    ran = [drive_one() for _ in range(200)]
    assert t.best() == 2
    # past both first measures: on 2 threads but for one-step probes
    assert ran[2 * (FIRST_STEPS + 1):].count(1) <= 200 * 0.005 / (PROBE_RATIO * 0.009) + 1


def test_a_collapsed_first_step_ends_the_first_measure():
    """On a machine where two threads collapse (50 times one thread's step), the first measure of
    two threads ends after its first step instead of paying FIRST_STEPS of them."""
    t, m = ThreadTuner(2), _Machine({2: 0.005, 1: 0.009})
    m.per_step = {2: 0.5, 1: 0.01}
    t.per_step[1], t.warm = 0.01, {1, 2}  # one thread measured; two threads' warm-up done
    assert t.plan(16) == (2, 1)
    t.record(2, 1, 0.5)
    assert t.per_step[2] == 0.5 and t.best() == 1


def test_busy_machine_falls_back_to_one_thread_and_back():
    t, m = ThreadTuner(2), _Machine({2: 0.005, 1: 0.009})
    m.drive(t, 200)
    m.per_step = {2: 0.5, 1: 0.025}  # two busy processes: the two-thread barriers stall
    ran = m.drive(t, 2000)
    assert t.best() == 1
    # on two threads: the call that met the change (16 steps), then one-step probes
    assert ran[2] <= 16 + 2000 * 0.025 / (PROBE_RATIO * 0.5) + 1
    assert _cost(m, ran, t) <= 2000 * 0.025 / PROBE_RATIO + 16 * 0.5
    m.per_step = {2: 0.005, 1: 0.009}  # quiet again
    for _ in range(200):
        m.drive(t, 16)
        if t.best() == 2:
            break
    assert t.best() == 2


def test_one_thread_or_fixed_never_probes():
    for t in (ThreadTuner(1), ThreadTuner(4, adapt=False)):
        assert t.plan(16) == (t.most, 16)


def test_tuned_decode_keeps_the_tokens(monkeypatch):
    """Whatever the tuner picks per call (here: forced to alternate), the greedy tokens of the
    fused decoder are those of the numpy backend."""
    from minillama.backends import get_backend
    from minillama.core.config import ModelConfig
    from minillama.infer.generate import generate
    from minillama.model.transformer import Transformer, init_params

    numba_be = get_backend("numba")
    if numba_be.num_threads < 2:
        pytest.skip("needs two Numba threads")
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, hidden_dim=96,
                      max_seq_len=64)
    params = init_params(cfg, seed=0)
    rng = np.random.default_rng(0)
    for v in params.values():
        v[...] = rng.normal(0, 0.4, v.shape) if v.ndim == 2 else rng.uniform(0.5, 1.5, v.shape)
    ref = Transformer(cfg, params, backend="numpy")
    fast = Transformer(cfg, params, backend="numba")
    tuner = ThreadTuner(numba_be.num_threads)
    counts = iter([2, 1] * 100)
    monkeypatch.setattr(tuner, "plan", lambda steps, whole=False: (next(counts), min(steps, 3)))
    monkeypatch.setattr(numba_be, "_tuner", tuner, raising=False)
    assert generate(fast, [1, 5, 9], 40) == generate(ref, [1, 5, 9], 40)
    assert set(tuner.per_step) == {1, 2}  # both counts ran


def test_numpy_decode_step_runs_on_the_tuned_team(monkeypatch):
    """On the numpy backend a per-op decode step runs its row threads and OpenBLAS on the count
    the tuner plans for that step (here alternating 2 and 1), both as before after the step, and
    the greedy tokens are the reference backend's whatever the count."""
    from minillama.backends import get_backend
    from minillama.backends.numpy import threads
    from minillama.core.config import ModelConfig
    from minillama.infer.generate import generate
    from minillama.model.transformer import Transformer, init_params

    be = get_backend("numpy")
    api = threads.openblas_api()
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, hidden_dim=96,
                      max_seq_len=64)
    params = init_params(cfg, seed=1)
    tuner = ThreadTuner(2)
    counts = iter([2, 1] * 100)
    monkeypatch.setattr(tuner, "plan", lambda steps: (next(counts), 1))
    monkeypatch.setattr(be, "_step_tuners", {1: tuner})
    seen = []
    norm = be.rmsnorm_forward

    def spy(*a, **k):
        seen.append((threads.num_threads(), api[0]() if api is not None else None))
        return norm(*a, **k)

    monkeypatch.setattr(be, "rmsnorm_forward", spy)
    outside = (threads.num_threads(), api[0]() if api is not None else None)
    ref = Transformer(cfg, params, backend="reference")
    fast = Transformer(cfg, params, backend="numpy")
    assert generate(fast, [1, 5, 9], 12) == generate(ref, [1, 5, 9], 12)
    steps = seen[2 * cfg.n_layers + 1:]  # after the prompt's forward
    assert {n for n, _ in steps} == {1, 2}
    if api is not None:
        assert all(b == n for n, b in steps)  # OpenBLAS follows the team
    assert (threads.num_threads(), api[0]() if api is not None else None) == outside
    assert set(tuner.per_step) == {1, 2}


def test_teams_in_two_threads_leave_openblas_as_it_was():
    """Two threads enter and leave teams of different sizes, interleaved (A enters, B enters, A
    leaves, B leaves): OpenBLAS's count is the one from before both, not a team's."""
    from minillama.backends.numpy import threads

    api = threads.openblas_api()
    if api is None:
        pytest.skip("OpenBLAS not found")
    before = api[0]()
    a_in, b_in, a_out = (threading.Event() for _ in range(3))

    def a():
        with threads.team(1):
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def b():
        a_in.wait(10)
        with threads.team(before + 1):
            b_in.set()
            a_out.wait(10)

    ts = [threading.Thread(target=f) for f in (a, b)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(20)
    assert api[0]() == before
    with threads.team(1):
        with threads.team(2):
            assert threads.num_threads() == 2
        assert threads.num_threads() == 1 and api[0]() == 1  # the outer team's size again
    assert api[0]() == before


def test_settled_once_both_counts_are_measured():
    t, m = ThreadTuner(2), _Machine({2: 0.005, 1: 0.009})
    assert not t.settled
    m.drive(t, 2 + FIRST_STEPS)  # one thread's warm-up and first measure
    assert 1 in t.per_step and not t.settled
    m.drive(t, 2 + FIRST_STEPS)
    assert t.settled and set(t.per_step) == {1, 2}
    assert ThreadTuner(1).settled and ThreadTuner(2, adapt=False).settled


def test_a_whole_call_prices_its_probe_as_all_its_steps():
    """A call that always runs its B steps at once (the rows of one verification step) is
    probed B times more rarely, so probing still costs at most 1 / PROBE_RATIO of the time."""
    t, m = ThreadTuner(2), _Machine({2: 0.005, 1: 0.009})
    m.drive(t, 4 * (2 + FIRST_STEPS))
    seen = []
    for _ in range(200):
        threads, _k = t.plan(16, whole=True)
        t.record(threads, 16, 16 * m.per_step[threads])
        seen.append(threads)
    probes = seen.count(1)
    assert 0 < probes and probes * 16 * 0.009 <= 200 * 16 * 0.005 / PROBE_RATIO + 16 * 0.009
