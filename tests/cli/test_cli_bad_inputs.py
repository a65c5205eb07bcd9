"""Every bad command line is one line ``minillama: error: ...`` on stderr and exit status 2.

A table: each row is an invocation (a flag's bad value, a missing or wrong file, an unusable
output path, a garbage ``MINILLAMA_BACKEND``) and words its error line must contain. The CLI
runs in-process (``minillama.cli.main.main``); one row also runs as a real subprocess.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from minillama.cli import main as cli
from minillama.core.config import ModelConfig
from minillama.io.checkpoint import save_checkpoint
from minillama.io.load import save_llama2c
from minillama.io.tokenizer import ByteTokenizer
from minillama.model.transformer import init_params
from tests.support.fuzzing import _write_tokenizer_bin

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Small real inputs and deliberately wrong ones."""
    d = tmp_path_factory.mktemp("cli")
    cfg = ModelConfig(dim=16, n_layers=1, n_heads=2, vocab_size=ByteTokenizer.vocab_size,
                      hidden_dim=24, max_seq_len=32)
    f = {"d": d}
    f["ckpt"] = save_checkpoint(d / "m.safetensors", cfg, init_params(cfg),
                                tokenizer=ByteTokenizer())
    lc = ModelConfig(dim=16, n_layers=1, n_heads=2, vocab_size=40, hidden_dim=24, max_seq_len=32)
    f["l2c"] = save_llama2c(d / "m.bin", lc, init_params(lc))
    f["tokbin"] = _write_tokenizer_bin(d / "tokenizer.bin")  # 381 tokens: fits no model here
    f["text"] = d / "notes.txt"
    f["text"].write_text("To be, or not to be: that is the question.\n" * 40)
    f["empty"] = d / "empty.txt"
    f["empty"].write_text("")
    f["binary"] = d / "blob.bin"
    f["binary"].write_bytes(bytes(range(256)) * 8)
    f["folder"] = d / "folder"
    f["folder"].mkdir()
    f["file"] = d / "a_file"
    f["file"].write_text("x")
    f["missing"] = d / "missing"
    f["fifo"] = d / "fifo"
    os.mkfifo(f["fifo"])  # opening it to read would block forever
    (d / "broken.toml").write_text("steps = = 3\n")
    (d / "unknown.json").write_text(json.dumps({"dimm": 64}))
    (d / "wrongtype.json").write_text(json.dumps({"steps": "ten"}))
    (d / "list.json").write_text("[1, 2]")
    (d / "deep.json").write_text("[" * 50000)
    (d / "nested.toml").write_text("[train]\nsteps = 5\n[other]\nx = 1\n")
    (d / "tiny.model").write_bytes(b"\x0a\x00")
    # a run folder whose checkpoint is corrupt, and one whose checkpoint holds no training state
    (d / "corrupt_run").mkdir()
    (d / "corrupt_run" / "ckpt.safetensors").write_bytes(f["ckpt"].read_bytes()[:-40])
    (d / "model_run").mkdir()
    (d / "model_run" / "ckpt.safetensors").write_bytes(f["ckpt"].read_bytes())
    return f


def _table(f):
    d = f["d"]
    out = ["--out", str(d / "run_never_made")]
    data = ["--data", str(f["text"])]
    ck = ["-c", str(f["ckpt"])]
    gen = [
        (["-c", str(f["missing"])], "not found"),
        (["-c", str(f["folder"])], "without config.json"),
        (["-c", str(f["text"])], "not a recognised checkpoint"),
        (["-c", str(f["binary"])], "not a recognised checkpoint"),
        (["-c", str(f["fifo"])], "not a regular file"),
        ([*ck, "-n", "x"], "invalid int value"),
        ([*ck, "--kv-cache", "f8"], "invalid choice"),
        ([*ck, "--kv-cache", "f16", "--dtype", "float64"], "a float16 KV cache needs a float32"),
        ([*ck, "-n", "-1"], "max-new-tokens"),
        ([*ck, "--temperature", "-1"], "temperature"),
        ([*ck, "--temperature", "nan"], "temperature"),
        ([*ck, "--temperature", "inf"], "temperature"),
        ([*ck, "--temperature", "hot"], "invalid float value"),
        ([*ck, "--top-k", "0"], "top_k"),
        ([*ck, "--top-k", "1.5"], "invalid int value"),
        ([*ck, "--top-p", "0"], "top_p"),
        ([*ck, "--draft", str(f["ckpt"]), "--temperature", "0.8"], "greedy decoding only"),
        ([*ck, "--draft", str(f["ckpt"]), "--temperature", "0", "--no-speculate"],
         "contradict"),
        ([*ck, "--draft", str(f["ckpt"]), "--temperature", "0"], "does not verify drafts"),
        ([*ck, "--backend", "numba", "--draft", str(f["l2c"]), "--temperature", "0"],
         "vocabulary differs"),
        ([*ck, "--backend", "numba", "--draft", str(f["missing"]), "--temperature", "0"],
         "not found"),
        ([*ck, "--top-p", "1.5"], "top_p"),
        ([*ck, "--top-p", "nan"], "top_p"),
        ([*ck, "--min-p", "1.5"], "min_p"),
        ([*ck, "--min-p", "-0.1"], "min_p"),
        ([*ck, "--repeat-penalty", "0"], "repeat_penalty"),
        ([*ck, "--repeat-penalty", "inf"], "repeat_penalty"),
        ([*ck, "--repeat-last-n", "-5"], "repeat_last_n"),
        ([*ck, "--seed", "-1"], "--seed must be a non-negative integer"),
        ([*ck, "--seed", "one"], "invalid int value"),
        ([*ck, "--backend", "tpu"], "unknown backend 'tpu'"),
        ([*ck, "--dtype", "float16"], "invalid choice"),
        ([*ck, "--tokenizer", str(f["missing"])], "tokenizer not found"),
        ([*ck, "--tokenizer", str(f["folder"])], "tokenizer not found"),
        ([*ck, "--tokenizer", str(f["text"])], "not a llama2.c tokenizer.bin"),
        ([*ck, "--tokenizer", str(d / "tiny.model")], "SentencePiece .model files"),
        ([*ck, "--tokenizer", str(f["tokbin"])], "does not match the model vocabulary"),
        (["-c", str(f["l2c"]), "--prompt", "hi"], "has no tokenizer"),
        ([*ck, "--prompt", "x" * 100], "longer than the model context"),
        ([*ck, "--prompt", "\udcff"], "not valid UTF-8"),
        ([*ck, "--bogus"], "unrecognized arguments"),
    ]
    train = [
        (["--out", str(f["file"]), *data], "is a file, not a folder"),
        (["--out", str(f["file"] / "sub"), *data], "which is a file, not a folder"),
        ([*out, *data, "--export", str(f["folder"])], "--export file"),
        ([*out, *data, "--export", str(f["file"] / "m.safetensors")], "is a file, not a folder"),
        ([*out, *data, "--steps", "0"], "steps must be a positive integer"),
        ([*out, *data, "--steps", "x"], "invalid int value"),
        ([*out, *data, "--lr", "nan"], "lr must be a number"),
        ([*out, *data, "--lr", "-1"], "lr must be a number"),
        ([*out, *data, "--lr", "1e-4", "--min-lr", "1e-3"], "min_lr"),
        ([*out, *data, "--beta1", "1.5"], "beta1"),
        ([*out, *data, "--eps", "0"], "eps must be"),
        ([*out, *data, "--grad-clip", "-1"], "grad_clip"),
        ([*out, *data, "--weight-decay", "inf"], "weight_decay"),
        ([*out, *data, "--warmup", "-1"], "warmup"),
        ([*out, *data, "--seed", "-1"], "seed"),
        ([*out, *data, "--context", "0"], "context must be a positive integer"),
        ([*out, *data, "--context", str(10 ** 12)], "context"),
        ([*out, *data, "--batch-size", "0"], "batch_size"),
        ([*out, *data, "--batch-size", str(10 ** 9)], "batch_size must be <="),
        ([*out, *data, "--grad-accum", "0"], "grad_accum"),
        ([*out, *data, "--eval-interval", "0"], "eval_interval"),
        ([*out, *data, "--eval-iters", "0"], "eval_iters"),
        ([*out, *data, "--ckpt-interval", "0"], "ckpt_interval"),
        ([*out, *data, "--dim", "0"], "dim"),
        ([*out, *data, "--dim", "30", "--n-heads", "4"], "dim % n_heads"),
        ([*out, *data, "--n-heads", "6", "--n-kv-heads", "4"], "n_heads % n_kv_heads"),
        ([*out, *data, "--n-layers", str(10 ** 12)], "n_layers"),
        ([*out, *data, "--hidden-dim", "-1"], "hidden_dim"),
        ([*out, *data, "--multiple-of", "0"], "multiple_of"),
        ([*out, *data, "--tie-embeddings", "maybe"], "expected true/false"),
        ([*out, *data, "--decay-embeddings", "2"], "expected true/false"),
        ([*out, *data, "--dtype", "float16"], "dtype must be float32 or float64"),
        ([*out, *data, "--backend", "tpu"], "unknown backend"),
        ([*out, *data, "--time-limit", "0"], "time_limit"),
        ([*out, *data, "--time-limit", "nan"], "time_limit"),
        ([*out, *data, "--stop-at", "0"], "--stop-at must be >= 1"),
        ([*out, *data, "--export-dtype", "int8"], "invalid choice"),
        ([*out, "--data", str(f["missing"])], "data file not found"),
        ([*out, "--data", str(f["folder"])], "has no train.bin"),
        ([*out, "--data", str(f["binary"])], "not UTF-8 text"),
        ([*out, "--data", str(f["empty"])], "is empty"),
        ([*out, *data, "--config", str(f["missing"])], "config file not found"),
        ([*out, *data, "--config", str(f["folder"])], "config file not found"),
        ([*out, *data, "--config", str(f["binary"])], "not UTF-8 text"),
        ([*out, *data, "--config", str(d / "broken.toml")], "cannot parse config file"),
        ([*out, *data, "--config", str(d / "unknown.json")], "unknown field(s) dimm"),
        ([*out, *data, "--config", str(d / "wrongtype.json")], "steps must be a positive"),
        ([*out, *data, "--config", str(d / "list.json")], "must hold a table/object"),
        ([*out, *data, "--config", str(d / "deep.json")], "cannot parse config file"),
        ([*out, *data, "--config", str(d / "nested.toml")], "unknown field(s)"),
        (["--resume", "--out", str(f["missing"])], "no checkpoint"),
        (["--resume", "--out", str(d / "corrupt_run")], "corrupt or truncated"),
        (["--resume", "--out", str(d / "model_run")], "no training state"),
    ]
    prep = [
        (["--data", str(f["missing"]), "--out", str(d / "p")], "data file not found"),
        (["--data", str(f["folder"]), "--out", str(d / "p")], "not a file"),
        (["--data", str(f["binary"]), "--out", str(d / "p")], "not UTF-8 text"),
        (["--data", str(f["empty"]), "--out", str(d / "p")], "is empty"),
        (["--data", str(f["text"]), "--out", str(f["file"])], "is a file, not a folder"),
    ]
    bench = [
        (["--backend", "tpu"], "unknown backend"),
        (["--batch", "0"], "expected a positive integer"),
        (["--seq", "0"], "expected a positive integer"),
        (["--seq", "100000"], "must fit the context"),
        (["--repeats", "-2"], "expected a positive integer"),
        (["--decode-tokens", "0"], "expected a positive integer"),
        (["--shape", "huge"], "invalid choice"),
    ]
    ck_only = [str(f["ckpt"])]
    export = [
        ([str(f["missing"]), "--format", "hf", "--out", str(d / "e")], "not found"),
        ([str(f["binary"]), "--format", "hf", "--out", str(d / "e")], "not a recognised"),
        ([*ck_only, "--format", "onnx", "--out", str(d / "e")], "invalid choice"),
        ([*ck_only, "--out", str(d / "e")], "the following arguments are required: --format"),
        ([*ck_only, "--format", "gguf", "--gguf-type", "Q4_0", "--out", str(d / "e.gguf")],
         "invalid choice"),
        ([*ck_only, "--format", "hf", "--out", str(f["file"])], "is a file, not a folder"),
        ([*ck_only, "--format", "llama2c", "--out", str(f["folder"])], "is a folder, not a file"),
        ([*ck_only, "--format", "gguf", "--out", str(f["folder"])], "is a folder, not a file"),
        ([*ck_only, "--format", "gguf", "--out", str(f["file"] / "m.gguf")], "is a file"),
    ]
    rows = [(["generate", *a], w) for a, w in gen] + [(["train", "--no-progress", *a], w)
                                                       for a, w in train]
    rows += [(["prepare-data", *a], w) for a, w in prep] + [(["bench", *a], w) for a, w in bench]
    rows += [(["export", *a], w) for a, w in export]
    rows += [(["nope"], "invalid choice: 'nope'"), ([], "a command is required")]
    return rows


def _run(argv) -> int:
    try:
        return cli.main(argv)
    except SystemExit as e:  # argparse
        return e.code


def test_every_bad_invocation_is_one_error_line(files, capsys, monkeypatch):
    monkeypatch.delenv("MINILLAMA_BACKEND", raising=False)
    bad = []
    rows = _table(files)
    for argv, words in rows:
        rc = _run(argv)
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        ok = (rc == 2 and len(lines) == 1 and lines[0].startswith("minillama: error: ")
              and words in lines[0] and "Traceback" not in err)
        if (files["d"] / "run_never_made").exists():  # refused before any work is done
            ok = False
            shutil.rmtree(files["d"] / "run_never_made")
        if not ok:
            bad.append(f"{argv}: rc={rc}, expected {words!r}, stderr={err[-400:]!r}")
    assert not bad, f"{len(bad)} of {len(rows)} rows:\n" + "\n".join(bad)


@pytest.mark.parametrize("garbage", ["tpu", "nump y", "NUMPY;rm -rf", "\u00fc", "cupy2"])
def test_minillama_backend_garbage(files, capsys, monkeypatch, garbage):
    monkeypatch.setenv("MINILLAMA_BACKEND", garbage)
    rc = _run(["generate", "-c", str(files["ckpt"]), "-n", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("minillama: error: unknown backend")


def test_backend_garbage_in_a_real_process(files):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MINILLAMA_BACKEND": "garbage"}
    r = subprocess.run([sys.executable, "-m", "minillama", "generate", "-c", str(files["ckpt"]),
                        "-n", "1"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert r.stderr.startswith("minillama: error: unknown backend 'garbage'")


# ---------------------------------------------------------------------------------------------
# an optional dependency missing: one line naming the extra that installs it, on every path
# ---------------------------------------------------------------------------------------------
def _without(modules, argv, env=None):
    """``minillama ARGV`` in a fresh interpreter in which importing ``modules`` fails as for a
    package that is not installed (``sys.modules[name] = None``)."""
    code = ("import sys\n"
            f"for m in {list(modules)!r}:\n"
            "    sys.modules[m] = None\n"
            "from minillama.cli.main import main\n"
            f"sys.exit(main({list(argv)!r}))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    env.pop("MINILLAMA_BACKEND", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.fixture(scope="module")
def extras_files(files):
    """A GGUF model, an HF folder with a chat template, a byte-level BPE tokenizer.json."""
    d = files["d"] / "extras"
    d.mkdir()
    out = {}
    assert cli.main(["export", str(files["ckpt"]), "--format", "hf", "--out", str(d / "hf")]) == 0
    conf = d / "hf" / "tokenizer_config.json"
    conf.write_text(json.dumps({**json.loads(conf.read_text()),
                                "chat_template": "{{ bos_token }}{{ messages[0].content }}"}))
    out["hf"] = d / "hf"
    if importlib.util.find_spec("gguf") is not None:
        assert cli.main(["export", str(files["ckpt"]), "--format", "gguf",
                         "--out", str(d / "m.gguf")]) == 0
        out["gguf"] = d / "m.gguf"
    from minillama.io.bpe import byte_alphabet, byte_level_json

    alphabet = byte_alphabet()
    tokens = [alphabet[b] for b in range(256)] + ["<|bos|>", "<|eos|>"]
    (d / "bl.json").write_text(json.dumps(byte_level_json(tokens, [], [256, 257])))
    out["byte_level"] = d / "bl.json"
    return out


def _extras_rows(f, x, d):
    ck = ["-c", str(f["ckpt"]), "-n", "2"]
    rows = [
        (["gguf"], ["export", str(f["ckpt"]), "--format", "gguf", "--out", str(d / "n.gguf")],
         "gguf", None),
        (["jinja2"], ["generate", "-c", str(x["hf"]), "--chat", "--prompt", "hi", "-n", "2"],
         "hf", None),
        (["tokenizers", "regex"], [*ck, "--tokenizer", str(x["byte_level"]), "--prompt", "hi"],
         "hf", None),
        (["cupy"], [*ck, "--backend", "cupy"], "gpu", None),
        (["cupy"], ["train", "--backend", "cupy", "--out", str(d / "never")], "gpu", None),
        (["mpi4py"], ["train", "--out", str(d / "never"), "--data", str(f["text"])], "mpi",
         {"PMI_RANK": "0", "PMI_SIZE": "2"}),
    ]
    return rows


def test_reading_gguf_needs_no_gguf_package(extras_files):
    """GGUF files are parsed by minillama itself: only writing them needs the ``gguf`` extra."""
    if "gguf" not in extras_files:
        pytest.skip("the gguf package is needed to write the test file")
    r = _without(["gguf"], ["generate", "-c", str(extras_files["gguf"]), "-n", "2"])
    assert r.returncode == 0, r.stderr[-600:]


def test_a_missing_extra_is_one_line_naming_it(files, extras_files):
    bad = []
    rows = _extras_rows(files, extras_files, files["d"])
    for modules, argv, extra, env in rows:
        if argv[0] == "-c":
            argv = ["generate", *argv]
        r = _without(modules, argv, env)
        lines = r.stderr.strip().splitlines()
        want = f'pip install "minillama[{extra}]"'
        if not (r.returncode == 2 and len(lines) == 1 and lines[0].startswith("minillama: error:")
                and (want in lines[0] or f"pip install 'minillama[{extra}]'" in lines[0])):
            bad.append(f"without {modules}: {argv}: rc={r.returncode}, stderr={r.stderr[-600:]!r}")
    assert not bad, f"{len(bad)} of {len(rows)} rows:\n" + "\n".join(bad)
    assert not (files["d"] / "n.gguf").exists()


def test_the_cli_names_the_extra_of_any_missing_optional_module(monkeypatch, capsys):
    """The last resort: a path that imports an optional package directly still ends in one line."""
    def boom(args):
        raise ModuleNotFoundError("No module named 'gguf'", name="gguf")

    parser = cli.build_parser()
    args = parser.parse_args(["bench"])
    monkeypatch.setattr(cli, "build_parser", lambda: _Fixed(parser, args, boom))
    assert cli.main(["bench"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ['minillama: error: `minillama bench` needs the optional package `gguf`: '
                   'pip install "minillama[gguf]"']


class _Fixed:
    def __init__(self, parser, args, func):
        self.parser, self.args = parser, args
        args.func = func

    def parse_args(self, argv):
        return self.args

    def error(self, message):  # pragma: no cover
        self.parser.error(message)
