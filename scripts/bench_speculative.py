"""Speculative decoding against plain decoding and against llama.cpp's server, same file, same run.

For each prompt (copy-heavy: repeat, rewrite or extract from a given text or code; free: nothing to
copy) and each round, in turn: ``minillama`` plain greedy (``speculate=False``), ``minillama``
with prompt-lookup drafts (the default), and with ``--peer``, ``llama-server`` plain and with its
n-gram drafts (``--spec-type ngram-simple``, once with its default lookup of 12 tokens and once
with 3). Prints decode tokens/s (medians over the rounds), the drafted tokens taken, and the
ratios: speculative over plain, and over the better llama-server mode. With ``--batch``, also
the five prompts and three of them again sent at once (8 requests: minillama's engine, the
server's batching in-process, and llama-server with 8 slots): tokens/s over all of them. Checks
that minillama's speculative texts equal its plain texts, token for token. With ``--draft
FILE`` (a smaller model with the same tokenizer, a GGUF file), also minillama drafting from it
(``generate(..., draft=)``, ``--draft`` of the CLI) and, with ``--peer``, llama-server with it
(``-md FILE --spec-type draft-simple``); e.g. SmolLM2 in float32 (``minillama export ...
--format gguf --gguf-type F32``) drafted by its own Q4_1 file.

    python -m scripts.bench_speculative --checkpoint SmolLM2-135M-Instruct.Q4_1.gguf \\
        --tokens 128 --rounds 3 --threads 2 --batch [--peer /path/to/llama-server]
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


def minillama_runs(args, model, tok, call=lambda fn: fn()):
    """``run(name, speculate)``: one prompt's greedy generation, (its ids, (tok/s, drafted,
    taken, tokens)); ``call`` runs it (on the engine's thread when there is one)."""
    from minillama.infer.generate import GenerationStats, generate, warm_up
    from minillama.io.chat_template import encode_rendered, render_chat, stop_ids

    stop = stop_ids(tok)
    ids = {name: encode_rendered(tok, render_chat(tok, [{"role": "user", "content": text}]))
           for name, _, text in PROMPTS}
    call(lambda: warm_up(model, ids["poem"]))

    def run(name, speculate, draft=None):
        st = GenerationStats()
        out = call(lambda: generate(model, ids[name], args.tokens, stats=st, stop_ids=stop,
                                    speculate=speculate, draft=draft))
        return out, (st.decode_tokens_per_s, st.drafted, st.accepted, len(out))

    return run


def engine_runs(args, eng, tok):
    """``run(speculate)``: the 8 requests of :func:`batch_texts` at once through minillama's
    engine ``eng`` (the server's batching, in-process): (tokens/s over all of them, drafted,
    taken, tokens, the texts)."""
    from minillama.infer.generate import warm_prefill
    from minillama.io.chat_template import encode_rendered, render_chat, stop_ids

    stop = stop_ids(tok)
    ids = [encode_rendered(tok, render_chat(tok, [{"role": "user", "content": t}]))
           for t in batch_texts()]
    eng.run_in_thread(warm_prefill, eng.model)

    def run(speculate):
        eng.batch.speculate = speculate  # the engine is idle between runs
        d0, a0 = eng.batch.drafted, eng.batch.accepted
        t0 = time.perf_counter()
        reqs = [eng.submit(p, max_tokens=args.tokens, temperature=0, stop_ids=stop) for p in ids]
        for r in reqs:
            list(r.events())
        dt = time.perf_counter() - t0
        n = sum(len(r.tokens) for r in reqs)
        return (n / dt, eng.batch.drafted - d0, eng.batch.accepted - a0, n,
                [r.tokens for r in reqs])

    return run


def batch_texts():
    """8 requests: the prompts in turn."""
    return [PROMPTS[i % len(PROMPTS)][2] for i in range(8)]


def peer_batch(url, tokens):
    """(tokens/s over all, drafted, taken, tokens) of :func:`batch_texts` sent at once."""
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda t: peer_run(url, t, tokens), batch_texts()))
    dt = time.perf_counter() - t0
    n = sum(g[3] for g in got)
    return n / dt, sum(g[1] for g in got), sum(g[2] for g in got), n


def start_peer(args, extra, slots=1):
    """llama-server on the file with ``slots`` slots, ``extra`` flags: (process, url)."""
    from scripts.bench_serve import free_port, wait_ready

    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log", delete=False)
    cmd = [args.peer, "-m", args.checkpoint, "-np", str(slots), "-t", str(args.threads),
           "-c", str(2048 * slots), "--host", "127.0.0.1", "--port", str(port), *extra]
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
    ap.add_argument("--draft", default=None, help="a draft model's GGUF file (same tokenizer)")
    ap.add_argument("--batch", action="store_true",
                    help="also 8 requests at once: minillama's engine and llama-server -np 8")
    args = ap.parse_args()
    pin_threads(args.threads)
    from minillama.infer.engine import Engine
    from minillama.io.load import load_model

    model, tok = load_model(args.checkpoint)
    draft = load_model(args.draft, backend=model.backend)[0] if args.draft else None
    # with --batch every kernel call runs on the engine's thread, the generations alone too
    # (Numba's OpenMP regions run slower on a second thread: minillama/infer/engine.py)
    eng = Engine(model, max_batch=8, max_seq_len=1024, prefix_reuse=False) if args.batch else None
    run = minillama_runs(args, model, tok, (lambda fn: eng.run_in_thread(fn)) if eng else
                         (lambda fn: fn()))
    erun = engine_runs(args, eng, tok) if eng else None
    flags = {"server plain": [], "server ngram-12": ["--spec-type", "ngram-simple"],
             "server ngram-3": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3"]}
    if args.draft:
        flags["server draft"] = ["-md", args.draft, "--spec-type", "draft-simple"]
    peers = {m: start_peer(args, f) for m, f in flags.items()} if args.peer else {}
    peers8 = ({m: start_peer(args, f, 8) for m, f in flags.items()}
              if args.peer and args.batch else {})
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
                if draft is not None:
                    by_draft, c = run(name, True, draft)
                    same[name] = same[name] and plain == by_draft
                    res.setdefault((name, "draft"), []).append(c)
                for mode, (_, url) in peers.items():
                    res.setdefault((name, mode), []).append(peer_run(url, text, args.tokens))
            if erun is not None:
                a, b = erun(False), erun(True)
                same["batch of 8"] = same.get("batch of 8", True) and a[4] == b[4]
                res.setdefault(("batch of 8", "plain"), []).append(a[:4])
                res.setdefault(("batch of 8", "spec"), []).append(b[:4])
                for mode, (_, url) in peers8.items():
                    res.setdefault(("batch of 8", mode), []).append(peer_batch(url, args.tokens))
    finally:
        for proc, _ in [*peers.values(), *peers8.values()]:
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
    drafts = any(key[1] == "draft" for key in res)
    head = "| prompt | kind | tokens | plain | speculative (taken) | spec/plain |"
    head += " draft model (taken) | draft/plain |" if drafts else ""
    head += "".join(f" {m} (taken) |" for m in modes) + (" spec / best server |" if modes else "")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    rows = [(name, kind) for name, kind, _ in PROMPTS]
    if ("batch of 8", "plain") in res:
        rows.append(("batch of 8", "all 8"))
    for name, kind in rows:
        p, s = med((name, "plain")), med((name, "spec"))
        row = (f"| {name} | {kind} | {res[(name, 'spec')][-1][3]} | {p:.1f} | {s:.1f} "
               f"({taken((name, 'spec'))}) | {s / p:.2f} |")
        if drafts:
            dm = med((name, "draft")) if (name, "draft") in res else float("nan")
            row += (f" {dm:.1f} ({taken((name, 'draft')) if (name, 'draft') in res else '-'}) |"
                    f" {dm / p:.2f} |")
        for m in modes:
            row += f" {med((name, m)):.1f} ({taken((name, m))}) |"
        if modes:
            row += f" {s / max(med((name, m)) for m in modes):.2f} |"
        print(row + ("" if same[name] else "  TEXTS DIFFER"))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
