"""``--exact`` on every command that runs a quantized model turns the numba backend's 8-bit
activation products off, through the same switch as ``MINILLAMA_QUANT_DOTS=float``."""

from __future__ import annotations

import pytest

from minillama.cli import main as cli

#: each command that runs a model for inference, with the arguments it requires
RUNS_A_MODEL = {"generate": [], "chat": ["-c", "m.gguf"], "serve": [],
                "perplexity": ["--data", "t.txt"]}


@pytest.mark.parametrize("command", RUNS_A_MODEL)
def test_every_inference_command_takes_exact(command):
    need = RUNS_A_MODEL[command]
    assert cli.build_parser().parse_args([command, *need, "--exact"]).exact is True
    assert cli.build_parser().parse_args([command, *need]).exact is False


def test_exact_turns_the_int8_products_off(monkeypatch, capsys):
    qint8 = pytest.importorskip("minillama.backends.numba.quant.int8_dots")
    monkeypatch.delenv("MINILLAMA_QUANT_DOTS", raising=False)
    seen = []
    real = cli.build_parser

    def parser():  # record the switch as the command's own code sees it
        p = real()
        gen = p._subparsers._group_actions[0].choices["generate"]
        run = gen.get_default("func")
        gen.set_defaults(func=lambda a: seen.append(qint8.int8_enabled()) or run(a))
        return p

    monkeypatch.setattr(cli, "build_parser", parser)
    assert cli.main(["generate", "-n", "1", "--backend", "numpy"]) == 0
    assert cli.main(["generate", "-n", "1", "--backend", "numpy", "--exact"]) == 0
    assert cli.main(["generate", "-n", "1", "--backend", "numpy"]) == 0  # no trace left
    assert seen == [True, False, True]
