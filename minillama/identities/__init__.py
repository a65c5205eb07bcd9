"""Transformer identities as a product: a catalog of named, checkable statements of the math
(RoPE depends only on relative position, RMSNorm is scale invariant, attention is causal, the KV
cache changes nothing, GQA is MHA with repeated heads, quantization stays within half a step,
a LoRA adapter equals its merge, ...), the known answers the invariances cannot see
(attention's score scale, RoPE's base, the norms' and the loss's values), and a gradient
identity for every op with a backward (the backward's directional derivative against the
central difference of the forward). docs/IDENTITIES.md says what each kind catches and what
the catalog's mutation score is.

* :data:`CATALOG`: every :class:`Identity` (name, statement, equation, hypothesis strategy,
  tolerance with its reason, the backend ops it needs, and ``check(backend, example)``);
* :func:`run_catalog` / :func:`run_identity`: run them with hypothesis against a backend (what
  ``minillama check`` does), failures shrunk to the smallest example;
* :func:`check_attention`, :func:`check_rope`, :func:`check_norm`: hold a user's own NumPy
  function to the identities of its op, from the user's own tests;
* :mod:`minillama.identities.strategies`: the hypothesis strategies, for users' own properties.

Example::

    from minillama.identities import check_attention
    check_attention(my_attention)   # AssertionError with a shrunk example if an identity fails

The package root ``minillama`` does not import this package.
"""

from __future__ import annotations

from minillama.identities import strategies
from minillama.identities.base import Identity, Subject
from minillama.identities.catalog import BY_NAME, CATALOG, select
from minillama.identities.runner import (
    DEFAULT_EXAMPLES,
    Result,
    resolve_backend,
    run_catalog,
    run_identity,
)
from minillama.identities.user import check_attention, check_norm, check_rope

__all__ = ["BY_NAME", "CATALOG", "DEFAULT_EXAMPLES", "Identity", "Result", "Subject",
           "check_attention", "check_norm", "check_rope", "resolve_backend", "run_catalog",
           "run_identity", "select", "strategies"]
