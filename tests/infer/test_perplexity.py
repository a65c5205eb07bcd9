"""`minillama perplexity`: llama.cpp's chunked method, held to a direct token-by-token
computation with the KV cache on the shipped model."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from minillama.cli.main import main
from minillama.core.errors import MinillamaError
from minillama.infer.perplexity import perplexity
from minillama.io.load import load_model
from minillama.io.tokenizer import ByteTokenizer

SHIPPED = "minillama/weights/shakespeare.safetensors"
TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"
        "\nFirst Citizen:\nYou are all resolved rather to die than to famish?\n") * 3


@pytest.fixture(scope="module")
def shipped():
    model, tok = load_model(SHIPPED, backend="numpy")
    return model, tok


def direct_nll(model, ids: list[int]) -> list[float]:
    """-ln p(ids[t+1] | ids[:t+1]) for every t, one token at a time through the KV cache."""
    cache = model.new_cache(1, len(ids))
    out = []
    for t, i in enumerate(ids[:-1]):
        z = np.asarray(model.forward(np.array([[i]]), start_pos=t, cache=cache), np.float64)[0, -1]
        out.append(float(np.log(np.exp(z - z.max()).sum()) + z.max() - z[ids[t + 1]]))
    return out


def test_matches_direct_computation(shipped):
    model, tok = shipped
    ids = tok.encode(TEXT, bos=True)
    n_ctx = 32
    r = perplexity(model, ids, n_ctx, bos_id=tok.bos_id, max_chunks=3, batch_size=2, tok=tok)
    nll = []
    for c in range(3):
        chunk = [tok.bos_id] + ids[c * n_ctx + 1:(c + 1) * n_ctx]  # BOS replaces the first
        nll += direct_nll(model, chunk)[n_ctx // 2:]  # positions n_ctx/2 .. n_ctx-2
    assert r.tokens_scored == len(nll) == 3 * (n_ctx - 1 - n_ctx // 2)
    assert r.nll == pytest.approx(np.mean(nll), rel=1e-5)
    assert r.ppl == pytest.approx(math.exp(np.mean(nll)), rel=1e-5)
    assert r.bits_per_byte == pytest.approx(np.mean(nll) / math.log(2), rel=1e-5)
    assert r.bos and r.chunks == 3


def test_chunking_and_bos(shipped):
    model, tok = shipped
    ids = tok.encode(TEXT, bos=True)
    n = len(ids) // 32
    full = perplexity(model, ids, 32, bos_id=tok.bos_id, batch_size=3, tok=tok)
    assert full.chunks == n and full.tokens_scored == n * 15  # the tail chunk is dropped
    one_batch = perplexity(model, ids, 32, bos_id=tok.bos_id, batch_size=64, tok=tok)
    assert one_batch.nll == full.nll  # each chunk is its own forward: bit for bit
    no_bos = perplexity(model, ids, 32, bos_id=None, batch_size=64, tok=tok)
    assert no_bos.nll != pytest.approx(full.nll, rel=1e-6)  # BOS changes every chunk's context
    longer = perplexity(model, ids, 64, bos_id=tok.bos_id, tok=tok)
    assert longer.chunks == len(ids) // 64 and longer.tokens_scored == longer.chunks * 31
    with pytest.raises(MinillamaError, match="fewer than one chunk"):
        perplexity(model, ids[:20], 32)
    with pytest.raises(MinillamaError, match="exceeds"):
        perplexity(model, ids, 512)


def test_bits_per_byte_counts_token_bytes(shipped):
    """Bits per byte divides by the bytes of the scored tokens (several per BPE token)."""
    model, tok = shipped

    class Pairs(ByteTokenizer):  # every token id decodes to two bytes
        def decode_bytes(self, ids):
            return b"".join(bytes([i % 256]) * 2 for i in ids)

    ids = tok.encode(TEXT, bos=True)
    a = perplexity(model, ids, 32, bos_id=tok.bos_id, tok=tok)
    b = perplexity(model, ids, 32, bos_id=tok.bos_id, tok=Pairs())
    assert b.bytes_scored == 2 * a.bytes_scored
    assert b.bits_per_byte == pytest.approx(a.bits_per_byte / 2)


def test_cli(tmp_path, capsys):
    data = tmp_path / "t.txt"
    data.write_text(TEXT, encoding="utf-8")
    assert main(["perplexity", "--data", str(data), "--ctx", "64", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ctx"] == 64 and out["bos"] is True
    model, tok = load_model(SHIPPED, backend="numpy")
    r = perplexity(model, tok.encode(TEXT, bos=True), 64, bos_id=tok.bos_id, tok=tok)
    assert out["ppl"] == round(r.ppl, 4) and out["tokens_scored"] == r.tokens_scored
    assert main(["perplexity", "--data", str(data), "--ctx", "64", "--bos", "no",
                 "--limit-chunks", "1"]) == 0
    line = capsys.readouterr().out
    assert "perplexity" in line and "31 tokens scored in 1 chunks of 64, BOS no" in line
    short = tmp_path / "short.txt"  # fewer tokens than the default --ctx of 512
    short.write_text(TEXT[:150], encoding="utf-8")
    n = len(tok.encode(TEXT[:150], bos=True))
    assert n < 256  # the shipped model holds 256 positions, the default would take them all
    assert main(["perplexity", "--data", str(short), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ctx"] == n // 2 * 2  # the text fills one window
    assert main(["perplexity", "--data", str(short), "--ctx", "200"]) == 2
    assert f"a --ctx of at most {n // 2 * 2}" in capsys.readouterr().err
    assert main(["perplexity", "--data", str(tmp_path / "none.txt")]) == 2
    assert capsys.readouterr().err.startswith("minillama: error: text file not found")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe abc")
    assert main(["perplexity", "--data", str(bad)]) == 2
    assert "not UTF-8" in capsys.readouterr().err


def test_quantized_gguf_costs_little(tmp_path):
    """The shipped model quantized to Q8_0 (a type the loader reads) scores close to the float
    model; Q4_0 costs more than Q8_0."""
    pytest.importorskip("gguf")
    model, tok = load_model(SHIPPED, backend="numpy")
    ids = tok.encode(TEXT * 2, bos=True)
    base = perplexity(model, ids, 64, bos_id=tok.bos_id, tok=tok)
    res = {}
    for qtype in ("Q8_0", "Q4_0"):
        path = tmp_path / f"{qtype}.gguf"
        assert main(["quantize", SHIPPED, str(path), "--type", qtype, "--output-type",
                     qtype]) == 0
        qmodel, _ = load_model(path, backend="numpy")
        res[qtype] = perplexity(qmodel, ids, 64, bos_id=tok.bos_id, tok=tok).nll
    assert abs(res["Q8_0"] - base.nll) < 0.01 * base.nll
    assert abs(res["Q4_0"] - base.nll) > abs(res["Q8_0"] - base.nll)
