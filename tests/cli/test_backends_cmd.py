"""``minillama backends`` says what ``auto`` picks, from the code that picks it."""

from __future__ import annotations

import minillama.backends as backends
from minillama.cli import main as cli


def _default_line(capsys) -> str:
    assert cli.main(["backends"]) == 0
    return next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("default:"))


def test_backends_states_what_auto_picks(capsys, monkeypatch):
    line = _default_line(capsys)
    has = backends.numba_installed()
    assert f"GGUF file): {'numba' if has else 'reference'};" in line
    assert f"parameters: {'numba' if has else 'numpy'};" in line
    assert "a smaller one: reference;" in line
    assert line.endswith("training and fine-tuning: numpy")
    monkeypatch.setattr(backends, "numba_installed", lambda: False)  # what auto does without it
    line = _default_line(capsys)
    assert "GGUF file): reference;" in line and "parameters: numpy;" in line
