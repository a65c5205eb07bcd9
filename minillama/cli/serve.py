"""``minillama serve``: the command that loads a checkpoint into a continuous-batching
:class:`~minillama.infer.engine.Engine` and serves it over the OpenAI-compatible HTTP API of
:mod:`minillama.infer.serve`.

Starlette and uvicorn are an optional extra (``pip install 'minillama[serve]'``), imported only
when the command runs: registering the command loads neither, nor asyncio.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

from minillama.cli.common import (
    add_backend_flag,
    add_model_flags,
    add_speculate_flag,
    apply_kv_cache,
    positive_int,
)
from minillama.core.errors import MinillamaError
from minillama.infer.engine import Engine
from minillama.infer.generate import warm_prefill, warm_up, warm_verify
from minillama.infer.serve import build_app
from minillama.io.load import DEFAULT_CHECKPOINT, detect_format, load_model, resolve_tokenizer
from minillama.io.tokenizer import TOKENIZER_KINDS


def non_negative_int(text: str) -> int:
    """An argparse type: an integer >= 0."""
    try:
        v = int(text)
    except ValueError:
        v = -1
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return v


def add_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="serve a checkpoint over an OpenAI-compatible HTTP API",
        description="Serve a checkpoint over HTTP with OpenAI's API (/v1/chat/completions, "
                    "/v1/completions, /v1/models, /health, and /metrics in Prometheus' text "
                    "format), concurrent requests sharing the model through continuous "
                    "batching; a prompt that starts as one before it (a system prompt, a "
                    "conversation's earlier turns) reuses the cached part. Needs pip install "
                    "'minillama[serve]'.")
    add_model_flags(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--api-key", default=os.environ.get("MINILLAMA_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every request but /health "
                        "(default: $MINILLAMA_API_KEY, which keeps the key out of `ps`)")
    p.add_argument("--model-name", default=None,
                   help="the model id clients send (default: the checkpoint's file or folder "
                        "name)")
    add_backend_flag(p, dtype=True)
    p.add_argument("--max-batch", type=positive_int, default=8,
                   help="most requests decoded together (KV-cache slots, default 8)")
    p.add_argument("--max-context", type=positive_int, default=2048,
                   help="positions per request, prompt included (default 2048, capped at the "
                        "model's context)")
    p.add_argument("--max-queue", type=non_negative_int, default=64,
                   help="most requests waiting for a slot; more get 503 with Retry-After "
                        "(default 64)")
    p.add_argument("--prefix-cache", type=non_negative_int, default=0,
                   help="KV-cache rows kept besides the --max-batch slots only to hold "
                        "finished requests' prompts for reuse; the free slots hold theirs too "
                        "(default 0: up to --max-batch prompts kept)")
    p.add_argument("--no-prefix-reuse", dest="prefix_reuse", action="store_false",
                   help="prefill every prompt whole, never from the cache")
    add_speculate_flag(p)
    p.set_defaults(func=run_cli)


def model_name_for(checkpoint: Path) -> str:
    """The default model id: the checkpoint's name without its extension."""
    name = checkpoint.name if checkpoint.is_dir() else checkpoint.stem
    return name or "minillama"


def load_engine(args):
    """(engine, tokenizer, model name) for the command's arguments."""
    checkpoint = Path(args.checkpoint) if args.checkpoint else DEFAULT_CHECKPOINT
    fmt = detect_format(checkpoint)
    model, model_tok = load_model(checkpoint, backend=args.backend, dtype=args.dtype)
    apply_kv_cache(args, model)
    tok = resolve_tokenizer(args.tokenizer, model_tok, model.cfg, checkpoint, fmt)
    if tok is None:
        raise MinillamaError(f"{checkpoint} has no tokenizer; pass --tokenizer ({TOKENIZER_KINDS})")
    engine = Engine(model, max_batch=args.max_batch, max_seq_len=args.max_context,
                    max_queue=args.max_queue, prefix_reuse=args.prefix_reuse,
                    prefix_rows=args.prefix_cache, speculate=args.speculate)
    # the first request should not wait for the compiler: compile (or load) the kernels now,
    # with those of long prompts, batches and drafts, saying so when it takes a while; all of
    # it on the engine's thread, the one that serves (Engine.run_in_thread says why)
    warm_up(model, [0], run=lambda: engine.generate([0], max_tokens=2),
            then=lambda m: engine.run_in_thread(_warm_serving, m))
    return engine, tok, args.model_name or model_name_for(checkpoint)


def _warm_serving(model) -> None:
    """The kernels of long prompts, batches and drafts' verification."""
    warm_prefill(model)
    warm_verify(model)


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` and listening (bound before the model loads, so that a
    busy port is refused at once)."""
    if not 0 <= port <= 65535:
        raise MinillamaError(f"--port must lie in [0, 65535], got {port}")
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
        sock.listen(128)
    except OSError as e:
        raise MinillamaError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def run_cli(args) -> int:
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError:
        raise MinillamaError("minillama serve needs the optional server packages: "
                             "pip install 'minillama[serve]'") from None
    sock = _listen(args.host, args.port)
    try:
        engine, tok, name = load_engine(args)
    except BaseException:
        sock.close()
        raise
    app = build_app(engine, tok, name, args.api_key)
    host, port = sock.getsockname()[:2]
    print(f"minillama: serving {name!r} on http://{host}:{port} (backend "
          f"{engine.model.backend.name}, {engine.max_batch} slots of {engine.S} positions, "
          f"queue {engine.max_queue}, KV cache {engine.cache.nbytes / 2**20:.1f} MiB "
          f"{engine.cache.k[0].dtype.name})",
          file=sys.stderr, flush=True)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
    draining_server(config, app.state.drain).run(sockets=[sock])
    return 0


def draining_server(config, drain):
    """uvicorn's server whose SIGTERM / SIGINT first cuts the generations in flight (each stream
    ends with a last chunk and ``[DONE]``; :class:`minillama.infer.serve.Drain`), then shuts
    down as uvicorn does (stops listening, waits for the open connections)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not drain.closing:
                n = drain.stop()
                print(f"minillama: shutting down: {n} generation{'s' * (n != 1)} cut short",
                      file=sys.stderr, flush=True)
            super().handle_exit(sig, frame)

    return DrainingServer(config)
