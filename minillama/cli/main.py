"""The ``minillama`` command line: ``minillama generate|train|...``.

Each sub-command lives in the module that implements it and registers itself through an
``add_cli(subparsers)`` function. Errors caused by bad input (:class:`MinillamaError`, missing
files) print one line ``minillama: error: ...`` and exit with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import textwrap

from minillama import __version__
from minillama.backends import set_threads
from minillama.cli.common import add_threads_flag, apply_exact
from minillama.core.errors import MinillamaError
from minillama.core.extras import missing_error

#: modules that provide ``add_cli(subparsers)``
COMMAND_MODULES = ("minillama.cli.generate", "minillama.cli.train", "minillama.cli.finetune",
                   "minillama.cli.bench", "minillama.cli.convert", "minillama.cli.perplexity",
                   "minillama.cli.chat", "minillama.cli.serve", "minillama.cli.explain",
                   "minillama.cli.check")



def plain_text(text: str) -> str:
    """reST of a docstring as plain text for ``--help``: ``code`` -> code, :role:`~a.b.c` -> c,
    :role:`title <target>` -> title, ``.. math::`` and other directive lines dropped."""
    def role(m: re.Match) -> str:
        body = m.group(1)
        titled = re.match(r"(.*?)\s*<[^>]*>$", body, re.S)
        if titled:
            return titled.group(1)
        return body[1:].split(".")[-1] if body.startswith("~") else body

    text = re.sub(r":[a-z:]+:`([^`]+)`", role, text)
    text = re.sub(r"``([^`]+)``", r"\1", text)
    return re.sub(r"^\s*\.\. [a-z-]+::.*$", "", text, flags=re.M)


class HelpFormatter(argparse.HelpFormatter):
    """``--help`` of every command: plain text (no reST markup), paragraphs and bullet lists
    kept, and each option's default stated (``(default: X)``) unless its help already says what
    happens without it (a ``default`` word, or a flag that is off unless given)."""

    def _fill_text(self, text, width, indent):
        paragraphs = re.split(r"\n\s*\n", textwrap.dedent(plain_text(text)).strip())
        out = []
        for para in paragraphs:
            items = re.split(r"\n(?=\s*[*-] )", para)
            for item in items:
                item = " ".join(item.split())
                bullet = item[:2] if item[:2] in ("* ", "- ") else ""
                out.append(textwrap.fill(item, width, initial_indent=indent,
                                         subsequent_indent=indent + " " * len(bullet)))
            out.append("")
        return "\n".join(out).rstrip()

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.default in (None, False, argparse.SUPPRESS) or "default" in text.lower()
                or not action.option_strings or isinstance(action, argparse._VersionAction)):
            return text
        return text + " (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """argparse with the project's error format: one line ``minillama: error: ...``, status 2
    (argparse's own prints the usage and then ``minillama generate: error: ...``), and the
    project's :class:`HelpFormatter` for every command."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        cmd = self.prog.removeprefix("minillama").strip()
        where = f"{cmd}: " if cmd else ""
        self.exit(2, f"minillama: error: {where}{message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
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
    for command in sub.choices.values():  # every command: one flag, one meaning
        add_threads_flag(command)
    return parser


def _command_names(parser: argparse.ArgumentParser) -> list[str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices)
    return []


def main(argv: list[str] | None = None) -> int:
    command = "minillama"
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.error("a command is required: " + ", ".join(_command_names(parser)))
        command = f"minillama {args.command}"
        if getattr(args, "threads", None) is not None:
            set_threads(args.threads)
        with apply_exact(args):
            return int(args.func(args) or 0)
    except MinillamaError as e:
        print(f"minillama: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    except ModuleNotFoundError as e:  # an optional dependency that some path imports directly
        if not e.name or e.name.split(".")[0] == "minillama":
            raise

        print(f"minillama: error: {missing_error(e.name, f'`{command}`')}",
              file=sys.stderr)
        return 2
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
