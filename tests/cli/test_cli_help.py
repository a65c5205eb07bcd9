"""Every command's ``--help`` (whatever :func:`minillama.cli.main.build_parser` registers): a
description, help for every option, defaults stated, plain text (no reST markup from
docstrings), and ``--backend`` naming every registered backend."""

from __future__ import annotations

import argparse
import re

import pytest

from minillama.backends import backend_names
from minillama.cli import main as cli

MARKUP = ("``", ":func:", ":class:", ":mod:", ":meth:", ".. math", ".. ", "%(")


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


COMMANDS = _commands()


def test_the_core_commands_are_registered():
    assert {"generate", "train", "prepare-data", "bench", "backends", "export",
            "convert-gqa"} <= set(COMMANDS)


def _help(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main([*argv, "--help"])
    assert e.value.code == 0
    out, err = capsys.readouterr()
    assert err == ""
    return out


def test_top_level_help_lists_every_command(capsys):
    out = _help(capsys)
    for name in COMMANDS:
        assert name in out


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_is_plain_text_with_defaults(name, capsys):
    out = _help(capsys, name)
    sub = COMMANDS[name]
    for mark in MARKUP:
        assert mark not in out, f"`minillama {name} --help` shows {mark!r}"
    assert sub.description and sub.description.strip(), f"{name} has no description"
    missing_help, missing_default = [], []
    for action in sub._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flag = action.option_strings[0] if action.option_strings else action.dest
        if not action.help or action.help == argparse.SUPPRESS:
            missing_help.append(flag)
            continue
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            # argparse prints the rendered help; the default must be in it
            text = sub._get_formatter()._expand_help(action)  # what --help prints
            if "default" not in text.lower():
                missing_default.append(flag)
    assert not missing_help, f"`minillama {name}`: options without help: {missing_help}"
    assert not missing_default, f"`minillama {name}`: defaults not stated: {missing_default}"
    # every line of the rendered help fits a terminal (argparse wraps at $COLUMNS - 2)
    assert all(len(line) <= 200 for line in out.splitlines())


@pytest.mark.parametrize("name", sorted(n for n in COMMANDS
                                        if "--backend" in COMMANDS[n]._option_string_actions))
def test_backend_help_names_every_backend(name, capsys):
    action = COMMANDS[name]._option_string_actions["--backend"]
    words = set(re.findall(r"[a-z]+", action.help))
    missing = [b for b in backend_names() if b not in words]
    assert not missing, f"`minillama {name} --backend` help omits {missing}: {action.help!r}"


def test_train_flags_are_the_config_fields():
    """Each TrainConfig field is a flag of `train`, with the field's help and default."""
    import dataclasses

    from minillama.train.config import TrainConfig

    train = COMMANDS["train"]
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        action = train._option_string_actions.get(flag)
        assert action is not None, flag
        assert action.help.replace("%%", "%").startswith(f.metadata["help"].split(" (default")[0])
        if f.default is not None:
            shown = str(f.default).lower() if isinstance(f.default, bool) else str(f.default)
            assert f"(default: {shown})" in action.help or "default" in f.metadata["help"]


def test_plain_text_strips_rest():
    text = ("Uses :func:`~minillama.io.load.load_params` and :class:`the trainer <Trainer>`, "
            "``code``.\n\n.. math::\n\n    x = y\n")
    assert cli.plain_text(text).split("\n")[0] == "Uses load_params and the trainer, code."
    assert ".. math" not in cli.plain_text(text)
