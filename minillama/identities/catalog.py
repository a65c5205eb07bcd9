"""The catalog: every identity in one tuple, in the order of docs/MATH.md (the LLaMA ops, the
whole model, the notes' other pieces, the weights' other forms)."""

from __future__ import annotations

import difflib

from minillama.core.errors import MinillamaError
from minillama.identities import attention, grads, invariance, known, model, notes, numeric, rows
from minillama.identities.base import Identity

#: every identity, by topic: rope, norm, softmax, attention (invariances, then known answers),
#: model, invariance (bitwise, where a backend promises it), notes, quant, lora, grad (each
#: backward against its forward)
CATALOG: tuple[Identity, ...] = tuple(rows.IDENTITIES + attention.IDENTITIES + known.IDENTITIES
                                      + model.IDENTITIES + invariance.IDENTITIES
                                      + notes.IDENTITIES + numeric.IDENTITIES + grads.IDENTITIES)
#: name -> identity
BY_NAME: dict[str, Identity] = {i.name: i for i in CATALOG}
assert len(BY_NAME) == len(CATALOG), "identity names must be unique"


def select(names=None, topics=None) -> list[Identity]:
    """The identities named in ``names`` (all when None), in catalog order, of the ``topics``
    given (all when None). An unknown name is a :class:`MinillamaError` naming the close
    matches."""
    if names:
        unknown = [n for n in names if n not in BY_NAME]
        if unknown:
            close = difflib.get_close_matches(unknown[0], BY_NAME, n=4, cutoff=0.6)
            near = f"did you mean {', '.join(close)}?" if close else "see minillama check --list"
            raise MinillamaError(f"unknown identity {unknown[0]!r}; {near}")
    return [i for i in CATALOG if (not names or i.name in names)
            and (topics is None or i.topic in topics)]
