#!/usr/bin/env python
"""Time to first token of ``minillama generate``, ``chat`` and ``serve`` on a cold kernel cache,
after ``minillama compile`` (what an editable install leaves) and on a warm cache, beside
llama.cpp's: seconds from starting the command to the first byte of the reply, each in a fresh
process.

    python -m scripts.bench_first_token --checkpoint SmolLM2-135M-Instruct.Q4_1.gguf \\
        [--peer-bin BIN]

Cold: a fresh, empty ``NUMBA_CACHE_DIR`` for each command, so every kernel it needs compiles;
compiled: another empty folder filled by ``minillama compile`` (timed) and then the command's
first run; warm: the same command again. ``generate --chat`` and ``chat``: the first byte on
stdout; ``serve``: the server started, then one streaming chat request sent as soon as it
listens, to the first content chunk. Greedy (``--temperature 0``): the script compares the
replies of the three states. With ``--peer-bin`` (the folder of llama.cpp's ``llama-cli`` and
``llama-server``): ``llama-cli -st`` to its exit (it prints a banner before the reply, so the
exit is what is timed) and ``llama-server`` to the first content chunk, on the same file.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time


def first_token(argv: list[str], env: dict, stdin: str) -> tuple[float, float, str, str]:
    """(seconds to the first stdout byte, seconds to exit, stdout, stderr) of ``argv``."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as errfile:  # stderr to a file: no pipe to fill and block
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=errfile, env=env)
        proc.stdin.write(stdin.encode())
        proc.stdin.close()
        head = proc.stdout.read(1)
        t1 = time.perf_counter()
        rest = proc.stdout.read()
        code = proc.wait()
        errfile.seek(0)
        err = errfile.read().decode(errors="replace")
    if code != 0:
        sys.exit(f"{' '.join(argv)} failed:\n{err}")
    return t1 - t0, time.perf_counter() - t0, (head + rest).decode(errors="replace"), err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served_first_token(argv: list[str], port: int, env: dict, prompt: str,
                       tokens: int) -> tuple[float, str, str]:
    """(seconds from starting server ``argv`` to the first content chunk of one streaming chat
    request, the reply, the server's stderr)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as errfile:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=errfile, env=env)
        try:
            ttft, reply = _ask(port, prompt, tokens, proc, t0)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        errfile.seek(0)
        return ttft, reply, errfile.read().decode(errors="replace")


def _ask(port: int, prompt: str, tokens: int, proc, t0: float) -> tuple[float, str]:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": tokens, "temperature": 0, "stream": True})
    while True:  # until the server answers (it listens before or after loading)
        if proc.poll() is not None:
            sys.exit(f"the server exited with status {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
            conn.request("POST", "/v1/chat/completions", body,
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
        except OSError:
            time.sleep(0.05)
            continue
        if resp.status == 503:  # llama-server: still loading
            resp.read()
            time.sleep(0.05)
            continue
        break
    if resp.status != 200:
        sys.exit(f"the server answered {resp.status}: {resp.read()[:300]!r}")
    ttft, parts = None, []
    for line in resp:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        delta = json.loads(line[6:])["choices"][0].get("delta", {}).get("content") or ""
        if delta and ttft is None:
            ttft = time.perf_counter() - t0
        parts.append(delta)
    return (ttft if ttft is not None else time.perf_counter() - t0), "".join(parts)


def _minillama(command: str, args) -> tuple[list[str], str]:
    if command == "generate":
        return ["generate", "-c", args.checkpoint, "--chat", "--prompt", args.prompt, "-n",
                str(args.tokens), "--temperature", "0"], ""
    if command == "chat":
        return (["chat", "-c", args.checkpoint, "-n", str(args.tokens), "--temperature", "0"],
                args.prompt + "\n")
    sys.exit(f"unknown command {command!r}: generate, chat or serve")


def run_state(command: str, args, cache: str) -> tuple[float, str, str]:
    """(time to first token, reply, the warm-up notice) of ``command`` on kernel cache ``cache``."""
    env = {**os.environ, "NUMBA_CACHE_DIR": cache}
    if command == "serve":
        port = _free_port()
        argv = [sys.executable, "-m", "minillama", "serve", "-c", args.checkpoint, "--port",
                str(port), "--model-name", "m"]
        ttft, reply, err = served_first_token(argv, port, env, args.prompt, args.tokens)
    else:
        argv, stdin = _minillama(command, args)
        ttft, _, reply, err = first_token([sys.executable, "-m", "minillama", *argv], env, stdin)
    notice = [line for line in err.splitlines() if "kernels" in line]
    return ttft, reply.strip(), notice[0].strip() if notice else "(no notice)"


def peers(args) -> None:
    cli = [os.path.join(args.peer_bin, "llama-cli"), "-m", args.checkpoint, "-p", args.prompt,
           "-n", str(args.tokens), "-st", "--simple-io", "-t", "2", "--temp", "0"]
    _, total, _, _ = first_token(cli, dict(os.environ), "")
    print(f"llama-cli -st: exit {total:6.2f} s (its reply follows a banner on stdout)")
    port = _free_port()
    server = [os.path.join(args.peer_bin, "llama-server"), "-m", args.checkpoint, "--port",
              str(port), "-t", "2"]
    ttft, reply, _ = served_first_token(server, port, dict(os.environ), args.prompt,
                                        args.tokens)
    print(f"llama-server: first token {ttft:6.2f} s ({reply!r})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="a chat model (GGUF file or folder)")
    ap.add_argument("--prompt", default="hi")
    ap.add_argument("-n", "--tokens", type=int, default=8, help="tokens of each reply")
    ap.add_argument("--commands", default="generate,chat,serve", help="comma-separated")
    ap.add_argument("--peer-bin", help="folder of llama.cpp's llama-cli and llama-server")
    args = ap.parse_args()
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load "
          f"{os.getloadavg()[0]:.2f}, {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory(prefix="numba-compiled-") as compiled:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "minillama", "compile"], check=True,
                       stdout=subprocess.DEVNULL, env={**os.environ, "NUMBA_CACHE_DIR": compiled})
        print(f"minillama compile: {time.perf_counter() - t0:.1f} s", flush=True)
        for command in args.commands.split(","):
            with tempfile.TemporaryDirectory(prefix="numba-cold-") as cold:
                rows = [("cold", *run_state(command, args, cold)),
                        ("compiled", *run_state(command, args, compiled)),
                        ("warm", *run_state(command, args, compiled))]
            for state, ttft, _, notice in rows:
                print(f"{command:8s} {state:8s}: first token {ttft:6.2f} s; {notice}", flush=True)
            replies = {reply for _, _, reply, _ in rows}
            print(f"{command:8s} replies {'the same' if len(replies) == 1 else 'DIFFER'}: "
                  + " / ".join(repr(r) for r in replies))
    if args.peer_bin:
        peers(args)


if __name__ == "__main__":
    main()
