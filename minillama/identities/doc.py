"""The "Identities" part of docs/MATH.md, generated from the catalog: one entry per identity with
its name, topic, the backend ops it needs, its statement, its equation and its tolerance.

``python -m minillama.identities.doc docs/MATH.md`` rewrites that part (from its heading to the
end of the file, where it sits) and leaves the rest of the file as it is.
"""

from __future__ import annotations

import sys
from pathlib import Path

from minillama.identities.catalog import CATALOG

#: the heading of the part; it runs to the end of MATH.md
HEADING = "# Part IV. Identities"

_INTRO = """\
Each identity below is one object of the catalog `minillama.identities` (its name, statement,
equation, the hypothesis strategy it draws inputs from, its tolerance and the backend ops it
calls). `minillama check --backend B` runs them all against a backend (a registered name, or
`package.module:Class` for one's own), `check_attention`, `check_rope` and `check_norm` hold a
user's NumPy function to the ones of its op, and the test suite runs the same objects on every
backend (`tests/identities/test_properties.py`, `tests/identities/test_notes_properties.py`,
`tests/identities/test_identities_grads.py`); [IDENTITIES.md](IDENTITIES.md) says what each kind of
identity catches, with the catalog's mutation score. This part is generated
from the catalog (`python -m minillama.identities.doc docs/MATH.md`);
`tests/identities/test_identities.py` fails when the two differ.

Tolerances follow the float error model: with $u$ the unit roundoff of the dtype ($2^{-53}$ in
float64, $2^{-24}$ in float32), a sum of $n$ terms is within about $n u \\sum |\\text{terms}|$ of
the exact one, so each tolerance is a small constant times $u$ times what the result is made
from (never the result's own norm, which may cancel to almost nothing), and an identity holds
for every example its strategy draws, in float64 and in float32. A contrast (two things that
must differ, e.g. BatchNorm's rows) asks for a difference well above the rounding."""


def markdown() -> str:
    """The part, heading included, ending in one newline."""
    out = [HEADING, "", _INTRO, ""]
    for ident in CATALOG:
        ops = ", ".join(f"`{op}`" for op in ident.ops) or "none (core code)"
        out += [f"**`{ident.name}`** ({ident.topic}; backend ops: {ops}). {ident.statement}", "",
                f"$${ident.equation}$$", "", f"Tolerance: {ident.tolerance}.", ""]
    return "\n".join(out).rstrip("\n") + "\n"


def section(text: str) -> str | None:
    """The part in a MATH.md text: from its heading to the end, or None without it."""
    at = text.find("\n" + HEADING + "\n")
    return None if at < 0 else text[at + 1:]


def update(path: Path) -> bool:
    """Write the generated part into the MATH.md at ``path`` (replacing the old one, or appended
    after a rule). Returns whether the file changed."""
    text = path.read_text(encoding="utf-8")
    old = section(text)
    head = text[:len(text) - len(old)] if old is not None else text.rstrip("\n") + "\n\n---\n\n"
    new = head + markdown()
    if new == text:
        return False
    path.write_text(new, encoding="utf-8")
    return True


if __name__ == "__main__":  # pragma: no cover
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/MATH.md")
    print(f"{target}: {'updated' if update(target) else 'already up to date'}")
