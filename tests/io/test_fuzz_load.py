"""Fuzz every reader: a few hundred seeded mutations per format, each run under a time bound.

A case passes when it ends in a clean one-line MinillamaError or loads and gives finite logits
(see ``tests/support/fuzzing.py``); a traceback, a time-out or NaN/inf logits fails the test, which
prints each failing case's mutation and how to replay it. ``MINILLAMA_FUZZ_CASES`` changes the
number of cases per format (default 200); ``scripts/fuzz_load.py`` runs the same cases at length.
"""

from __future__ import annotations

import collections
import os

import pytest

from tests.support.fuzzing import BAD, make_targets, run_case

CASES = int(os.environ.get("MINILLAMA_FUZZ_CASES", "200"))
SEED = 17
TIME_LIMIT = 10.0  # seconds per case; loading a seed takes milliseconds
TARGETS = ["minillama", "llama2c_v0", "llama2c_v1", "hf", "hf_sharded", "hf_qwen2", "hf_mistral",
           "hf_bpe", "tokenizer_bin", "train_config", "data", "train_ckpt", "gguf", "gguf_qwen2",
           "gguf_quant"]


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    return make_targets(tmp_path_factory.mktemp("fuzz"))


@pytest.mark.parametrize("name", TARGETS)
def test_fuzz_format(targets, name, tmp_path):
    if name not in targets:
        pytest.skip(f"no {name} seed here (its optional package or reader is absent)")
    t = targets[name]
    assert t.load(t.folder) == "ok", "the unmutated seed must load"
    tally: collections.Counter = collections.Counter()
    failures = []
    for i in range(CASES):
        r = run_case(t, i, SEED, tmp_path / "case", TIME_LIMIT)
        tally[r.status] += 1
        if r.status in BAD:
            failures.append(f"  case {i}: {r.status}: {r.mutation}\n      -> {r.detail}")
    assert not failures, (
        f"{len(failures)} of {CASES} mutated {name} inputs did not end in a clean error or a "
        f"finite load ({dict(tally)}); replay one with `python -m scripts.fuzz_load --target "
        f"{name} --seed {SEED} --case N -v`:\n" + "\n".join(failures[:30]))
    # the mutations must exercise both outcomes, or the fuzzer tests nothing
    assert tally["error"] > 0 and tally["ok"] > 0, dict(tally)
