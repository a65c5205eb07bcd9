"""The backends' optional abilities (``decode_step``, ``greedy_steps``, ``exact_products``, ...)
are declared once, on the reference backend (backends/reference.py, ``ABILITIES``), with the
answer of a backend without them, so the layers above use them as plain attributes: every
registered backend class derives from the reference, and the objects that stand in for a
backend (the mixed-precision wrapper; a user's object, completed by get_backend) have them
too."""

from __future__ import annotations

import contextlib
import importlib

import numpy as np
import pytest

from minillama.backends import ABILITIES, BACKENDS, get_backend, with_precision
from minillama.backends.reference import ReferenceBackend
from minillama.core import ops


def test_every_ability_is_declared_on_the_reference():
    assert ABILITIES
    missing = [name for name in ABILITIES if not hasattr(ReferenceBackend, name)]
    assert not missing, missing


@pytest.mark.parametrize("name", list(BACKENDS))
def test_every_backend_class_derives_from_the_reference(name):
    module, cls = BACKENDS[name].split(":")
    try:
        klass = getattr(importlib.import_module(module), cls)
    except ImportError as e:  # its module needs what this machine lacks
        pytest.skip(f"{module}: {e}")
    assert issubclass(klass, ReferenceBackend)


def test_the_reference_takes_none_of_them():
    """Each declaration is the answer of a backend without the ability: decline, no team of its
    own, no fused update, contexts that change nothing."""
    be = get_backend("reference")
    assert be.decode_step(None, np.zeros((1, 1), dtype=np.int64), 0, None) is None
    assert be.greedy_steps(None, np.zeros(2, dtype=np.int64), np.zeros(2), None, 4) is None
    assert be.greedy_decoder(None, 8) is None
    assert be.prompt_rows_invariant(None) is False
    assert be.prefill_decode_invariant(None) is False
    for context in (be.exact_products(), be.decode_threads(1), be.watch_compiles(),
                    be.threads(2)):
        assert isinstance(context, contextlib.nullcontext)
        with context as seen:
            assert seen is None
    assert be.adamw_update is None and be.num_threads is None
    assert be.attention_forward_packed is None and be.attention_backward_packed is None
    assert be.attention_precision is None and be.supports_float64 is True
    assert be.invariance == frozenset()


def test_a_wrapper_of_a_backend_has_them():
    mixed = with_precision(get_backend("numpy"), "bf16")
    for name in ABILITIES:
        assert hasattr(mixed, name), name


class _BareRowOps:
    """A user's class of one op, no helpers and no abilities."""

    def rmsnorm_forward(self, x, g, eps):
        return ops.rmsnorm_forward(x, g, eps)


def test_a_users_bare_class_gets_them_and_keeps_its_own_ops_only():
    from minillama.identities.base import Subject

    be = Subject(_BareRowOps()).backend
    for name in ABILITIES:
        assert hasattr(be, name), name
    assert be.decode_step(None, None, 0, None) is None
    assert hasattr(be, "rmsnorm_forward") and not hasattr(be, "attention_forward")


class _OwnHelpers(_BareRowOps):
    """A user's class with helpers of its own (another array module, say) but no abilities."""

    xp = "my array module"
    device = "my device"

    def asarray(self, a, dtype=None):
        return ("mine", a)


def test_a_users_own_helpers_are_kept_and_the_rest_lent():
    be = get_backend(_OwnHelpers())  # a backend object goes in as it is, completed
    assert be.xp == "my array module" and be.device == "my device"
    assert be.asarray(1) == ("mine", 1)
    assert be.to_numpy is not None and be.name == "_OwnHelpers"
    assert be.decode_step(None, None, 0, None) is None and be.invariance == frozenset()


class _ReferenceOpsOnly:
    """Every op of the reference bound on a class of its own: no helpers, no abilities."""

    def __getattr__(self, key):
        if key.endswith(("_forward", "_backward", "_backward_input")) or "_forward_" in key:
            return getattr(get_backend("reference"), key)
        raise AttributeError(key)


def test_a_model_runs_on_a_backend_object_of_ones_own():
    """The model uses the abilities as plain attributes; get_backend completes an object that
    lacks them, so a model on it computes the reference's logits, cached or not."""
    from minillama.core.config import ModelConfig
    from minillama.model.transformer import Transformer, init_params

    cfg = ModelConfig(dim=16, n_layers=1, n_heads=2, vocab_size=11, hidden_dim=32,
                      max_seq_len=8)
    params = init_params(cfg, seed=1, dtype=np.float64)
    mine = Transformer(cfg, params, backend=_ReferenceOpsOnly(), dtype=np.float64)
    ref = Transformer(cfg, params, backend="reference", dtype=np.float64)
    tok = np.array([[1, 2, 3, 4]])
    np.testing.assert_array_equal(mine.forward(tok), ref.forward(tok))
    cache_a, cache_b = mine.new_cache(1), ref.new_cache(1)
    np.testing.assert_array_equal(mine.forward(tok, 0, cache_a, last_only=True),
                                  ref.forward(tok, 0, cache_b, last_only=True))
    np.testing.assert_array_equal(mine.forward(tok[:, :1], 4, cache_a),
                                  ref.forward(tok[:, :1], 4, cache_b))
