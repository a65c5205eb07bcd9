"""Speculative decoding against plain decoding and against llama.cpp's server, same file, same run.

For each prompt (copy-heavy: repeat, rewrite or extract from a given text or code; free: nothing to
copy) and each round, in turn: ``minillama`` plain greedy (``speculate=False``), ``minillama``
with prompt-lookup drafts (the default), and with ``--peer``, ``llama-server`` plain and with its
n-gram drafts (``--spec-type ngram-simple``, once with its default lookup of 12 tokens and once
with 3). Prints decode tokens/s (medians over the rounds), the drafted tokens taken, and the
ratios: speculative over plain, and over the better llama-server mode. Checks that minillama's
speculative text equals its plain text, token for token.

    python -m scripts.bench_speculative --checkpoint SmolLM2-135M-Instruct.Q4_1.gguf \\
        --tokens 128 --rounds 3 --threads 2 [--peer /path/to/llama-server]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

from scripts._measure import pin_threads

PARAGRAPH = (
    "The violin, sometimes known as a fiddle, is a wooden chordophone, and is the smallest, and "
    "thus highest-pitched instrument in regular use in the violin family. Smaller violin-type "
    "instruments exist, including the violino piccolo and the pochette, but these are virtually "
    "unused. Most violins have a hollow wooden body, and commonly have four strings, usually "
    "tuned in perfect fifths with notes G3, D4, A4, E5, and are most commonly played by drawing a "
    "bow across the strings.")
CODE = '''def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)


def variance(values):
    m = mean(values)
    total = 0
    for v in values:
        total += (v - m) ** 2
    return total / len(values)
'''
#: (name, kind, user message)
PROMPTS = [
    ("repeat", "copy", "Repeat this paragraph exactly, word for word:\n\n" + PARAGRAPH),
    ("code edit", "copy", "Rename the function mean to average everywhere in this code and "
                          "print the whole code:\n\n" + CODE),
    ("extract", "copy", "List every sentence of this text that mentions strings, quoting each "
                        "sentence exactly:\n\n" + PARAGRAPH),
    ("poem", "free", "Write a short poem about the sea."),
    ("explain", "free", "Explain how a violin makes sound."),
]


def minillama_runs(args):
    """(name -> list of (tok/s, drafted, taken)) per mode, and whether the texts agreed."""
    from minillama.infer.generate import GenerationStats, generate, warm_up
    from minillama.io.chat_template import encode_rendered, render_chat, stop_ids
    from minillama.io.load import load_model

    model, tok = load_model(args.checkpoint)
    stop = stop_ids(tok)
    ids = {name: encode_rendered(tok, render_chat(tok, [{"role": "user", "content": text}]))
           for name, _, text in PROMPTS}
    warm_up(model, ids["poem"])

    def run(name, speculate):
        st = GenerationStats()
        out = generate(model, ids[name], args.tokens, stats=st, stop_ids=stop,
                       speculate=speculate)
        return out, (st.decode_tokens_per_s, st.drafted, st.accepted, len(out))

    return run


def start_peer(args, extra):
    """llama-server on the file with one slot, ``extra`` flags: (process, url)."""
    from scripts.bench_serve import free_port, wait_ready

    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log", delete=False)
    cmd = [args.peer, "-m", args.checkpoint, "-np", "1", "-t", str(args.threads), "-c", "2048",
           "--host", "127.0.0.1", "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc)
    return proc, url


def peer_run(url, text, tokens):
    """(tok/s, drafted, taken, n) of one greedy chat request, from the server's own timings."""
    import httpx

    r = httpx.post(url + "/v1/chat/completions", timeout=600, json={
        "messages": [{"role": "user", "content": text}], "temperature": 0,
        "max_tokens": tokens, "cache_prompt": False})
    t = r.json()["timings"]
    return (t["predicted_per_second"], t.get("draft_n", 0), t.get("draft_n_accepted", 0),
            t["predicted_n"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peer", default=None, help="llama-server to compare with")
    args = ap.parse_args()
    pin_threads(args.threads)
    run = minillama_runs(args)
    peers = {}
    if args.peer:
        peers = {"server plain": start_peer(args, []),
                 "server ngram-12": start_peer(args, ["--spec-type", "ngram-simple"]),
                 "server ngram-3": start_peer(args, ["--spec-type", "ngram-simple",
                                                     "--spec-ngram-simple-size-n", "3"])}
    res: dict = {}
    same = {}
    try:
        for _ in range(args.rounds):
            for name, _, text in PROMPTS:
                plain, a = run(name, False)
                fast, b = run(name, True)
                same[name] = same.get(name, True) and plain == fast
                res.setdefault((name, "plain"), []).append(a)
                res.setdefault((name, "spec"), []).append(b)
                for mode, (_, url) in peers.items():
                    res.setdefault((name, mode), []).append(peer_run(url, text, args.tokens))
    finally:
        for proc, _ in peers.values():
            proc.kill()
    report(args, res, same, list(peers))


def report(args, res, same, modes) -> None:
    def med(key):
        return statistics.median(r[0] for r in res[key])

    def taken(key):
        r = res[key][-1]
        return f"{r[2]}/{r[1]}" if r[1] else "-"

    print(f"# {time.strftime('%Y-%m-%d %H:%M')} {args.checkpoint}, {args.tokens} tokens, "
          f"{args.threads} threads, median of {args.rounds} rounds")
    head = "| prompt | kind | tokens | plain | speculative (taken) | spec/plain |"
    head += "".join(f" {m} (taken) |" for m in modes) + (" spec / best server |" if modes else "")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for name, kind, _ in PROMPTS:
        p, s = med((name, "plain")), med((name, "spec"))
        row = (f"| {name} | {kind} | {res[(name, 'spec')][-1][3]} | {p:.1f} | {s:.1f} "
               f"({taken((name, 'spec'))}) | {s / p:.2f} |")
        for m in modes:
            row += f" {med((name, m)):.1f} ({taken((name, m))}) |"
        if modes:
            row += f" {s / max(med((name, m)) for m in modes):.2f} |"
        print(row + ("" if same[name] else "  TEXTS DIFFER"))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
