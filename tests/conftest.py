"""Shared fixtures: the backends to parametrise over, the shared test data, hypothesis profiles."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from minillama.backends import backend_names, get_backend
from minillama.errors import MinillamaError

settings.register_profile(
    "default", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "ci", deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "default")

#: ../shared/data beside the repository root (absent outside this project's machines)
SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def _backend_params():
    params = []
    for name in backend_names():
        try:
            get_backend(name)
        except MinillamaError as e:
            params.append(pytest.param(name, id=name, marks=pytest.mark.skip(
                reason=f"backend {name} unavailable: {e}")))
        else:
            params.append(pytest.param(name, id=name))
    return params


BACKEND_PARAMS = _backend_params()


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
