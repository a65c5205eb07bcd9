"""The ``minillama`` command line: ``minillama generate|train|...``.

Each sub-command lives in the module that implements it and registers itself through an
``add_cli(subparsers)`` function. Errors caused by bad input (:class:`MinillamaError`, missing
files) print one line ``minillama: error: ...`` and exit with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .errors import MinillamaError

#: modules that provide ``add_cli(subparsers)``
COMMAND_MODULES = ("minillama.generate", "minillama.train", "minillama.bench")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__  # noqa: PLC0415

    parser = argparse.ArgumentParser(
        prog="minillama",
        description="A LLaMA-family model in NumPy with hand-written backprop.")
    parser.add_argument("--version", action="version", version=f"minillama {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # that command is not built yet
                continue
            raise
        module.add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except MinillamaError as e:
        print(f"minillama: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    except OSError as e:  # a missing file, a folder given for a file, a full disk...
        where = f": {e.filename}" if e.filename else ""
        print(f"minillama: error: {e.strerror or e}{where}", file=sys.stderr)
        return 2
    except MemoryError:
        print("minillama: error: out of memory", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("minillama: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
