#!/usr/bin/env python
"""Time to first token of ``minillama generate`` and ``minillama chat`` on a cold and a warm
kernel cache: seconds from starting the command to the first byte of the reply on stdout (and
to its exit), each in a fresh process.

    python -m scripts.bench_first_token --checkpoint SmolLM2-135M-Instruct.Q4_1.gguf

Cold: a fresh, empty ``NUMBA_CACHE_DIR`` (a temporary folder), so every kernel compiles; warm:
the same folder again. Greedy (``--temperature 0``) so that the cold and the warm reply can be
compared: the script prints both replies and whether they are the same, and each run's warm-up
notice from stderr ("compiling kernels" / "loading compiled kernels", with its time; none when
the warm-up took under a second).
"""

from __future__ import annotations

import argparse
import os
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="a chat model (GGUF file or folder)")
    ap.add_argument("--prompt", default="hi")
    ap.add_argument("-n", "--tokens", type=int, default=8, help="tokens of each reply")
    ap.add_argument("--commands", default="generate,chat", help="comma-separated")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {load:.2f}, "
          f"{os.cpu_count()} cores")
    for command in args.commands.split(","):
        if command == "generate":
            argv = ["generate", "-c", args.checkpoint, "--chat", "--prompt", args.prompt]
            stdin = ""
        elif command == "chat":
            argv, stdin = ["chat", "-c", args.checkpoint], args.prompt + "\n"
        else:
            sys.exit(f"unknown command {command!r}: generate or chat")
        argv = [sys.executable, "-m", "minillama", *argv, "-n", str(args.tokens),
                "--temperature", "0"]
        with tempfile.TemporaryDirectory(prefix="numba-cache-") as cache:
            env = {**os.environ, "NUMBA_CACHE_DIR": cache}
            replies = []
            for state in ("cold", "warm"):
                ttft, total, out, err = first_token(argv, env, stdin)
                notice = [line for line in err.splitlines() if "kernels" in line]
                replies.append(out.strip())
                print(f"{command:8s} {state}: first token {ttft:6.1f} s, exit {total:6.1f} s;"
                      f" {notice[0] if notice else '(no notice)'}")
            print(f"{command:8s} replies {'the same' if replies[0] == replies[1] else 'DIFFER'}:"
                  f" {replies[0]!r}" + ("" if replies[0] == replies[1] else f" / {replies[1]!r}"))


if __name__ == "__main__":
    main()
