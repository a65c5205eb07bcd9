"""`minillama generate`: streaming output, stats on stderr, and one-line errors with exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import minillama.cli.generate as gen
from minillama.cli.main import main
from minillama.core.config import ModelConfig
from minillama.io.checkpoint import save_checkpoint
from minillama.io.load import save_llama2c
from minillama.io.tokenizer import ByteTokenizer
from minillama.model.transformer import init_params

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def byte_ckpt(tmp_path):
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=258, hidden_dim=40,
                      max_seq_len=48)
    return save_checkpoint(tmp_path / "m.safetensors", cfg, init_params(cfg, seed=3),
                           tokenizer=ByteTokenizer())


def _err_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("minillama: error: ")
    return err[0]


def test_stories260k_greedy_ids_via_cli(shared_data, capsys, backend):
    gold = (shared_data / "stories260K.greedy.txt").read_text().split()
    rc = main(["generate", "--checkpoint", str(shared_data / "stories260K.bin"),
               "--temperature", "0", "-n", "64", "--backend", backend.name])
    out, err = capsys.readouterr()
    assert rc == 0
    assert out.split() == gold
    assert "prefill:" in err and "decode:" in err and "tok/s" in err and "KV cache:" in err
    assert "KVH=4" in err


def test_text_generation_streams_prompt_and_continuation(byte_ckpt, capsys):
    rc = main(["generate", "-c", str(byte_ckpt), "--prompt", "To be", "-n", "20",
               "--temperature", "0.8", "--top-k", "50", "--seed", "1"])
    out, err = capsys.readouterr()
    assert rc == 0 and out.startswith("To be")
    assert len(out.encode()) >= len("To be")
    rc = main(["generate", "-c", str(byte_ckpt), "--prompt", "To be", "-n", "20",
               "--temperature", "0.8", "--top-k", "50", "--seed", "1"])
    assert capsys.readouterr().out == out  # the seed makes it reproducible
    # the kv cache line reports 2 * L * B * S * KVH * hd * 4 bytes, S = 1 + 5 + 20
    kib = 2 * 2 * 1 * 26 * 2 * 8 * 4 / 1024
    assert f"KV cache: {kib:.1f} KiB" in err


def test_llama2c_model_with_tokenizer(shared_data, tmp_path, capsys):
    cfg = ModelConfig(dim=16, n_layers=1, n_heads=2, vocab_size=32000, hidden_dim=16,
                      max_seq_len=32, tie_embeddings=True)
    path = save_llama2c(tmp_path / "m.bin", cfg, init_params(cfg, seed=0), version=1)
    rc = main(["generate", "-c", str(path), "--tokenizer", str(shared_data / "tokenizer.bin"),
               "--prompt", "Once upon a time", "-n", "5", "--temperature", "0"])
    out = capsys.readouterr().out
    assert rc == 0 and out.startswith("Once upon a time")


def test_default_checkpoint_missing_and_present(monkeypatch, tmp_path, byte_ckpt, capsys):
    monkeypatch.setattr(gen, "DEFAULT_CHECKPOINT", tmp_path / "absent.safetensors")
    assert main(["generate"]) == 2
    assert "no default checkpoint ships yet" in _err_line(capsys)
    monkeypatch.setattr(gen, "DEFAULT_CHECKPOINT", byte_ckpt)
    assert main(["generate", "-n", "3", "--prompt", "Hi", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("Hi")


def test_errors_are_one_line(shared_data, tmp_path, byte_ckpt, capsys):
    stories = str(shared_data / "stories260K.bin")
    cases = [
        (["-c", str(tmp_path / "missing.bin")], "not found"),
        (["-c", stories, "--backend", "nope"], "unknown backend"),
        (["-c", stories, "--tokenizer", str(shared_data / "tokenizer.bin")],
         "does not match the model vocabulary"),
        (["-c", stories, "--prompt", "hello"], "has no tokenizer"),
        (["-c", str(byte_ckpt), "--prompt", "x" * 60], "longer than the model context"),
        (["-c", str(byte_ckpt), "--temperature", "-1"], "temperature"),
        (["-c", str(byte_ckpt), "--top-p", "0"], "top_p"),
        (["-c", str(byte_ckpt), "-n", "-3"], "max-new-tokens"),
    ]
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"JUNK" * 4 + b"\xff" * 64)
    cases.append((["-c", str(junk)], "not a recognised checkpoint"))
    trunc = tmp_path / "trunc.bin"
    trunc.write_bytes((shared_data / "stories260K.bin").read_bytes()[:50000])
    cases.append((["-c", str(trunc)], "truncated"))
    bad_st = tmp_path / "bad.safetensors"
    bad_st.write_bytes(byte_ckpt.read_bytes()[:-100])
    cases.append((["-c", str(bad_st)], "corrupt or truncated"))
    for args, msg in cases:
        assert main(["generate", *args]) == 2, args
        assert msg in _err_line(capsys), args


def test_python_m_minillama_generate_subprocess(shared_data):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "minillama", "generate", "-c",
                        str(shared_data / "stories260K.bin"), "--temperature", "0", "-n", "10"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    gold = (shared_data / "stories260K.greedy.txt").read_text().split()[:10]
    assert r.stdout.split() == gold
    assert "tok/s" in r.stderr
    r = subprocess.run([sys.executable, "-m", "minillama", "generate", "-c", "/no/such/file"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert "Traceback" not in r.stderr
    np.testing.assert_equal(r.stdout, "")


def test_hf_directory_with_tokenizer_json(tmp_path, capsys, hf_tokenizer_json):
    import tokenizers

    from minillama.io.load import save_hf
    V = tokenizers.Tokenizer.from_file(str(hf_tokenizer_json)).get_vocab_size(
        with_added_tokens=True)
    cfg = ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=V, hidden_dim=40,
                      max_seq_len=32, tie_embeddings=False)
    d = save_hf(tmp_path / "hf", cfg, init_params(cfg, seed=1))
    (d / "tokenizer.json").write_bytes(hf_tokenizer_json.read_bytes())
    rc = main(["generate", "-c", str(d), "--prompt", "the cat", "-n", "6", "--seed", "0"])
    out, err = capsys.readouterr()
    assert rc == 0 and out.startswith("the cat"), (out, err)
    assert "tok/s" in err


def test_shipped_default_checkpoint(capsys):
    if not gen.DEFAULT_CHECKPOINT.is_file():
        pytest.skip("no default checkpoint shipped")
    rc = main(["generate", "--prompt", "ROMEO:", "-n", "40", "--temperature", "0"])
    out, err = capsys.readouterr()
    assert rc == 0 and out.startswith("ROMEO:") and len(out) > len("ROMEO:") + 5
    assert "KV cache:" in err
    rc = main(["generate", "--prompt", "ROMEO:", "-n", "40", "--temperature", "0"])
    assert capsys.readouterr().out == out  # greedy is deterministic


def test_default_command_prints_clean_text(capsys):
    """`minillama generate` with no prompt: the shipped byte model starts at a line start, so its
    sampled text holds only the ASCII it was trained on (a bare BOS start gave U+FFFD noise)."""
    if not gen.DEFAULT_CHECKPOINT.is_file():
        pytest.skip("no default checkpoint shipped")
    for seed in range(6):
        assert main(["generate", "-n", "60", "--seed", str(seed)]) == 0
        out = capsys.readouterr().out
        assert out.isascii() and "\ufffd" not in out, (seed, out)


def test_training_run_folder_is_a_checkpoint(tmp_path, capsys):
    """The folder that ``minillama train --out`` writes is accepted wherever a checkpoint is
    (generate, export): it stands for its ckpt.safetensors."""
    run = tmp_path / "run"
    rc = main(["train", "--steps", "2", "--dim", "32", "--n-layers", "1", "--n-heads", "2",
               "--context", "16", "--batch-size", "2", "--plot", "false", "--no-progress",
               "--out", str(run)])
    assert rc == 0 and (run / "ckpt.safetensors").is_file()
    capsys.readouterr()
    args = ["--prompt", "To be", "-n", "8", "--temperature", "0"]
    assert main(["generate", "-c", str(run)] + args) == 0
    from_folder = capsys.readouterr().out
    assert main(["generate", "-c", str(run / "ckpt.safetensors")] + args) == 0
    assert capsys.readouterr().out == from_folder and from_folder.startswith("To be")
    assert main(["export", str(run), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "config.json").is_file()
    (tmp_path / "empty").mkdir()
    assert main(["generate", "-c", str(tmp_path / "empty")]) == 2
    assert "training run" in _err_line(capsys)


def test_stop_text_cuts_the_output_where_it_first_appears(byte_ckpt, capsys):
    """--stop: the output is the unstopped output up to the first occurrence of the text (the
    text itself not shown), for a stop text that the unstopped output holds."""
    args = ["generate", "-c", str(byte_ckpt), "--prompt", "To be", "-n", "40", "--temperature",
            "0.8", "--seed", "4"]
    assert main(args) == 0
    full = capsys.readouterr().out.rstrip("\n")
    cont = full[len("To be"):]
    stop = next(cont[i:i + 2] for i in range(len(cont) - 1)
                if cont[i:i + 2].strip() and cont[i:i + 2] not in cont[:i])
    assert main(args + ["--stop", stop, "--stop", "\x00never"]) == 0
    want = "To be" + cont[:cont.index(stop)]
    assert capsys.readouterr().out.rstrip("\n") == want.rstrip("\n")


def test_the_speed_line_names_the_kv_cache_the_flags_choose(tmp_path, capsys):
    """``--kv-cache``: by default half precision on GGML block weights (float32 with ``--exact``)
    and float32 on float weights; either on request. The speed line gives the bytes per entry
    and the type, and the cache's size follows them."""
    pytest.importorskip("gguf")
    shipped = "minillama/weights/shakespeare.safetensors"
    q8 = tmp_path / "q8.gguf"
    assert main(["quantize", shipped, str(q8), "--type", "Q8_0"]) == 0
    capsys.readouterr()
    sizes = {}
    for ckpt, flags, want in [(q8, [], "2 B, f16"), (q8, ["--kv-cache", "f32"], "4 B, f32"),
                              (q8, ["--exact"], "4 B, f32"),
                              (q8, ["--exact", "--kv-cache", "f16"], "2 B, f16"),
                              (shipped, [], "4 B, f32"),
                              (shipped, ["--kv-cache", "f16"], "2 B, f16")]:
        assert main(["generate", "-c", str(ckpt), "--prompt", "To be", "-n", "4",
                     "--temperature", "0", *flags]) == 0
        err = capsys.readouterr().err
        assert want in err, (ckpt, flags, err)
        sizes[want[0]] = float(err.split("KV cache: ")[1].split(" KiB")[0])
    assert sizes["2"] * 2 == sizes["4"]
