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
COMMAND_MODULES = ("minillama.generate", "minillama.train", "minillama.bench",
                   "minillama.export", "minillama.convert", "minillama.finetune")


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


class _Parser(argparse.ArgumentParser):
    """argparse with the project's error format: one line ``minillama: error: ...``, status 2
    (argparse's own prints the usage and then ``minillama generate: error: ...``)."""

    def error(self, message: str):
        cmd = self.prog.removeprefix("minillama").strip()
        where = f"{cmd}: " if cmd else ""
        self.exit(2, f"minillama: error: {where}{message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__  # noqa: PLC0415

    parser = _Parser(
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


def _command_names(parser: argparse.ArgumentParser) -> list[str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices)
    return []


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.error("a command is required: " + ", ".join(_command_names(parser)))
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
