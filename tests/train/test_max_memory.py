"""The memory plan of ``finetune`` and ``train`` against what the run really takes, and
``--max-memory`` as a limit.

The plan is made for the batches the data makes (short records: their padded length, not
``--context``); its total is held within 1.5x of the peak resident memory (``VmHWM``) of a
subprocess running the command, on short records and on text that fills the context, and so is
its part above the process's memory before the command (the measured peak increase). A limit
below the plan stops the run before training with one error line naming what fits, and what it
names then runs under that limit; a limit that recompute meets turns recompute on and says so."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from minillama.cli import main as cli
from minillama.io.load import DEFAULT_CHECKPOINT, load_params
from minillama.train import memplan
from minillama.train.finetune import prompt_example

#: prints the process's memory before and after ``minillama ARGS`` as one JSON line on stderr
MEASURE = r"""
import json, sys
from minillama.cli import main as cli

def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key))

base = status("VmRSS:")
rc = cli.main(sys.argv[1:])
print("measured " + json.dumps({"rc": rc, "base": base, "peak": status("VmHWM:")}),
      file=sys.stderr)
"""

UNITS = {"B": 1, "KiB": 1024, "MiB": 1024 ** 2, "GiB": 1024 ** 3}
PLAN = re.compile(r"^memory plan: ([0-9.]+) (B|KiB|MiB|GiB) at peak = .*B x T = (\d+) x (\d+)",
                  re.M)


def short_records(path, n: int = 8) -> int:
    """``n`` short prompt/completion records; returns the longest one's length in tokens of the
    shipped model (its example: prompt and completion with the tokens the tokenizer adds)."""
    tok = load_params(DEFAULT_CHECKPOINT)[3]
    with open(path, "w") as f:
        longest = 0
        for i in range(n):
            p, c = f"question {i}: what did the cat do?", f" it sat on mat {i}."
            f.write(json.dumps({"prompt": p, "completion": c}) + "\n")
            longest = max(longest, len(prompt_example(tok, p, c).ids))
    return longest


def long_text(path, n_bytes: int = 14000) -> None:
    words = "the cat sat on a mat and the dog ran to the red barn while birds sang".split()
    text = " ".join(words[(i * 7) % len(words)] for i in range(n_bytes // 4))
    path.write_text(text[:n_bytes])


def plan_of(err: str) -> tuple[int, int, int]:
    """(total bytes, B, T) of the last memory plan line in ``err``."""
    m = PLAN.findall(err)[-1]
    return int(float(m[0]) * UNITS[m[1]]), int(m[2]), int(m[3])


def finetune_args(data, out, *more) -> list[str]:
    return ["finetune", "-c", str(DEFAULT_CHECKPOINT), "--data", str(data), "--out", str(out),
            "--batch-size", "8", "--context", "256", "--backend", "numpy", "--no-progress",
            "--eval-interval", "50", *more]


def train_args(data, out, *more) -> list[str]:
    return ["train", "--data", str(data), "--out", str(out), "--dim", "128", "--n-layers", "4",
            "--n-heads", "4", "--n-kv-heads", "2", "--context", "128", "--batch-size", "16",
            "--eval-iters", "1", "--no-progress", "--plot", "false", "--backend", "numpy", *more]


def measured(args) -> tuple[dict, str]:
    got = subprocess.run([sys.executable, "-c", MEASURE, *args], capture_output=True,
                         text=True, timeout=600)
    line = next(x for x in got.stderr.splitlines() if x.startswith("measured "))
    return json.loads(line[len("measured "):]), got.stderr


# ---------------------------------------------------------------------------------------------
# the plan's shapes
# ---------------------------------------------------------------------------------------------
def test_finetune_plans_the_batches_the_data_makes_not_the_context(tmp_path, capsys):
    longest = short_records(tmp_path / "short.jsonl")
    assert cli.main(finetune_args(tmp_path / "short.jsonl", tmp_path / "a", "--steps", "1")) == 0
    _, B, T = plan_of(capsys.readouterr().err)
    assert (B, T) == (8, longest - 1)  # x = ids[:-1] of the longest record, not --context 256
    assert cli.main(finetune_args(tmp_path / "short.jsonl", tmp_path / "b", "--steps", "1",
                                  "--pack")) == 0
    assert plan_of(capsys.readouterr().err)[1:] == (8, 256)  # packed rows fill the context


# ---------------------------------------------------------------------------------------------
# the plan against the measured peak (a subprocess per run)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["finetune-short", "finetune-long", "train"])
def test_plan_is_within_1_5x_of_the_measured_peak(tmp_path, case):
    if case == "finetune-short":
        short_records(tmp_path / "d.jsonl")
        args = finetune_args(tmp_path / "d.jsonl", tmp_path / "o", "--steps", "2")
    else:
        long_text(tmp_path / "d.txt")
        args = (finetune_args(tmp_path / "d.txt", tmp_path / "o", "--steps", "2")
                if case == "finetune-long" else
                train_args(tmp_path / "d.txt", tmp_path / "o", "--steps", "2"))
    got, err = measured(args)
    assert got["rc"] == 0, err
    total, B, T = plan_of(err)
    rise, planned_rise = got["peak"] - got["base"], total - got["base"]
    assert 1 / 1.5 <= total / got["peak"] <= 1.5, (total, got)
    assert 1 / 1.5 <= planned_rise / rise <= 1.5, (planned_rise, rise, err)
    if case == "finetune-short":
        assert T < 64  # the records' padded length
    else:
        assert T == {"finetune-long": 256, "train": 128}[case]  # windows fill the context


def test_smollm2_short_chat_plan_is_within_1_5x_of_the_measured_peak(smollm2_gguf, tmp_path):
    """The real quantized base on 8 short chat records: the plan is that of the ~40-token
    batches, near the measured peak, not of --context."""
    with open(tmp_path / "chat.jsonl", "w") as f:
        for q, a in [("what is the capital of france?", "paris."), ("name a color.", "blue."),
                     ("2+2?", "4."), ("say hi.", "hi!"), ("what is water made of?", "hydrogen "
                     "and oxygen."), ("largest planet?", "jupiter."), ("a fruit?", "an apple."),
                     ("opposite of hot?", "cold.")]:
            f.write(json.dumps({"messages": [{"role": "user", "content": q},
                                             {"role": "assistant", "content": a}]}) + "\n")
    got, err = measured(["finetune", "-c", str(smollm2_gguf), "--data",
                         str(tmp_path / "chat.jsonl"), "--out", str(tmp_path / "o"), "--steps",
                         "1", "--backend", "numpy", "--no-progress"])
    assert got["rc"] == 0, err
    total, B, T = plan_of(err)
    assert 1 / 1.5 <= (total - got["base"]) / (got["peak"] - got["base"]) <= 1.5, (total, got)
    assert B == 4 and T < 64


# ---------------------------------------------------------------------------------------------
# --max-memory (in this process, its resident size held fixed so that the plan is exact)
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def fixed_resident(monkeypatch):
    monkeypatch.setattr(memplan, "resident_bytes", lambda: 60 * 1024 ** 2)


@pytest.mark.parametrize("command", ["finetune", "train"])
def test_a_max_memory_below_the_plan_refuses_naming_what_fits(command, tmp_path, capsys,
                                                              fixed_resident):
    long_text(tmp_path / "d.txt")
    args = finetune_args if command == "finetune" else train_args
    assert cli.main(args(tmp_path / "d.txt", tmp_path / "x", "--max-memory", "100G",
                         "--steps", "1")) == 0
    total = plan_of(capsys.readouterr().err)[0]
    limit = f"{int(total * 0.45 / 1024 ** 2)}M"  # recompute alone does not get there
    rc = cli.main(args(tmp_path / "d.txt", tmp_path / "o", "--max-memory", limit, "--steps", "1"))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("minillama: error: the memory plan, ")
    assert f"exceeds --max-memory {limit[:-1]}.00 MiB" in err[-1] and "what fits: " in err[-1]
    assert not any(line.startswith("step ") for line in err)  # refused before training
    assert not (tmp_path / "o" / "ckpt.safetensors").exists()
    fits = re.search(r"what fits: ((?:--recompute )?--batch-size \d+(?: --grad-accum \d+)?)",
                     err[-1])
    assert fits is not None, err[-1]
    rc = cli.main(args(tmp_path / "d.txt", tmp_path / "o", "--max-memory", limit, "--steps", "1",
                       *fits.group(1).split()))
    assert rc == 0  # what it names runs under the same limit
    assert plan_of(capsys.readouterr().err)[0] <= memplan.parse_size(limit)


@pytest.mark.parametrize("command", ["finetune", "train"])
def test_a_max_memory_that_recompute_meets_turns_it_on_and_says_so(command, tmp_path, capsys,
                                                                   fixed_resident):
    long_text(tmp_path / "d.txt")
    args = finetune_args if command == "finetune" else train_args
    assert cli.main(args(tmp_path / "d.txt", tmp_path / "x", "--steps", "1")) == 0
    total, B, T = plan_of(capsys.readouterr().err)
    limit = f"{int(total * 0.8 / 1024 ** 2)}M"
    assert cli.main(args(tmp_path / "d.txt", tmp_path / "o", "--max-memory", limit,
                         "--steps", "1")) == 0
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "--recompute turned on" in line]
    assert len(said) == 1 and f"exceeds --max-memory {limit[:-1]}.00 MiB" in said[0]
    assert "(--recompute: block inputs + one block)" in err
    assert plan_of(err)[1:] == (B, T)  # the batch is the one asked for


def test_a_max_memory_nothing_meets_says_why(tmp_path, capsys, fixed_resident):
    long_text(tmp_path / "d.txt")
    rc = cli.main(finetune_args(tmp_path / "d.txt", tmp_path / "o", "--max-memory", "10M"))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and "nothing fits: the runtime, weights, adapters, gradients and AdamW alone " \
                       "take" in err[-1]
