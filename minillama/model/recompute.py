r"""Gradient checkpointing (``--recompute``): keep each block's input, rebuild its ``ctx`` in the
backward.

Without it the forward keeps every op's ``ctx`` for all L blocks (:mod:`minillama.train.memplan`
counts them). With ``model.recompute`` set,
:meth:`Transformer._run <minillama.model.transformer.Transformer._run>` keeps per block only what
:func:`keep` returns: the block input x_{l-1} (B, T, D) and the state
of the LoRA dropout generator; the backward, going from the last block down, calls
:func:`rebuild` to run that block's forward again from x_{l-1} (the same ops on the same inputs,
with the same dropout masks) and hands its fresh ``ctx`` to the block's backward, which then drops
it. The gradients are those of the plain backward bit for bit (same backend, same inputs, same
order of operations); the extra cost is one more forward per block (about a third of a step).
"""

from __future__ import annotations


class Kept:
    """What the forward keeps of one block under recompute: its input and the dropout RNG state
    at its start (None without LoRA dropout)."""

    __slots__ = ("x", "rng_state")

    def __init__(self, x, rng_state):
        self.x, self.rng_state = x, rng_state


def _rng(model):
    lora = model.lora
    if lora is None or not lora.training or not lora.lc.dropout:
        return None
    return lora.rng


def keep(model, x) -> Kept:
    """Called before block l's forward with its input x (B, T, D)."""
    rng = _rng(model)
    return Kept(x, None if rng is None else rng.bit_generator.state)


def rebuild(model, layer: int, kept, cos, sin):
    """The ctx of block ``layer``: its forward run again from the kept input, the dropout
    generator rewound to where it stood then (and put back afterwards); a ctx that is not a
    :class:`Kept` (no recompute) comes back as it is."""
    if not isinstance(kept, Kept):
        return kept
    rng = _rng(model)
    now = None
    if rng is not None and kept.rng_state is not None:
        now = rng.bit_generator.state
        rng.bit_generator.state = kept.rng_state
    try:
        _, ctx = model._block_forward(layer, kept.x, cos, sin, None, 0)
    finally:
        if now is not None:
            rng.bit_generator.state = now
    return ctx
