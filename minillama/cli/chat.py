"""``minillama chat``: an interactive conversation with a chat model through its own chat
template, each reply streamed to stdout as it is generated; one user turn per line, from a
terminal or a pipe.

The conversation and its KV cache are :class:`minillama.infer.chat.ChatSession`; this module is
the command's flags, the input loop and the streamed output.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from minillama.cli.common import (
    add_backend_flag,
    add_draft_flag,
    add_model_flags,
    add_sampling_flags,
    add_speculate_flag,
    apply_kv_cache,
    backend_line,
    load_draft,
    sampling_params,
)
from minillama.core.errors import MinillamaError
from minillama.core.sampling import StopText
from minillama.infer.chat import ChatSession
from minillama.infer.generate import TextStreamer, warm_up, warm_verify
from minillama.io.load import open_model
from minillama.io.tokenizer import TOKENIZER_KINDS


def add_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "chat", help="talk with a chat model (multi-turn, streams each reply)",
        description="An interactive conversation through the model's own chat template. Each "
                    "line you type is a user turn; the reply streams to stdout. The KV cache "
                    "is kept between turns, so a turn prefills only its new tokens. /reset "
                    "starts over, /exit (or Ctrl-D) quits, Ctrl-C stops a reply. Reads one "
                    "user turn per line from a pipe too. A turn that cannot be sent (longer "
                    "than the context, refused by the template) is one error line; the chat "
                    "goes on and exits with status 2 at the end.")
    add_model_flags(p, checkpoint_required=True, adapter=True,
                    checkpoint_help="model file or folder with a chat template (GGUF or Hugging "
                                    "Face)")
    p.add_argument("--system", "-s", default=None, help="system message")
    p.add_argument("-n", "--max-new-tokens", type=int, default=512,
                   help="most tokens per reply (default 512)")
    p.add_argument("--context", type=int, default=4096,
                   help="KV cache positions for the conversation, capped at the model's "
                        "context (default 4096)")
    add_sampling_flags(p, temperature=0.8, top_p=0.95, min_p=0.05)
    add_backend_flag(p, dtype=True)
    add_speculate_flag(p)
    add_draft_flag(p)
    p.set_defaults(func=run_cli)


def run_cli(args, stdin=None, stdout=None) -> int:
    stdin = stdin if stdin is not None else sys.stdin
    out = stdout if stdout is not None else sys.stdout
    session, tok = _open_session(args)
    interactive = stdin.isatty() if hasattr(stdin, "isatty") else False
    if interactive:
        print("chat: /reset starts over, /exit or Ctrl-D quits, Ctrl-C stops a reply",
              file=sys.stderr)
    failed = False
    while True:
        if interactive:
            out.write("> ")
            out.flush()
        try:
            line = stdin.readline()
        except KeyboardInterrupt:
            out.write("\n")
            continue
        if not line:
            break
        text = line.rstrip("\r\n")
        if text.strip() == "/exit":
            break
        if text.strip() == "/reset":
            session.reset()
            print("[conversation reset]", file=sys.stderr)
            continue
        if not text.strip():
            continue
        failed = not _stream_reply(session, tok, text, out) or failed
    return 2 if failed else 0  # a refused turn: the chat went on, the exit status tells


def _open_session(args):
    """(ChatSession, tokenizer) of the command's checkpoint, adapter, tokenizer and settings."""
    params = sampling_params(args)
    if args.max_new_tokens < 1:
        raise MinillamaError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.context < 2:
        raise MinillamaError(f"--context must be >= 2, got {args.context}")
    checkpoint = Path(args.checkpoint)
    model, tok, _ = open_model(checkpoint, args.backend, args.dtype,
                               getattr(args, "adapter", None), args.tokenizer)
    if tok is None:
        raise MinillamaError(f"{checkpoint} has no tokenizer; pass --tokenizer ({TOKENIZER_KINDS})")
    apply_kv_cache(args, model)
    session = ChatSession(model, tok, system=args.system, max_new_tokens=args.max_new_tokens,
                          context=args.context, params=params)
    session.speculate = args.speculate
    session.draft = load_draft(args, model, tok, params)
    # a throwaway turn compiles (or loads) the kernels before the first prompt, saying so when
    # it takes a while
    def dry_turn() -> None:
        try:
            dry = ChatSession(model, tok, system=args.system, max_new_tokens=2,
                              context=min(args.context, 256), params=params)
            list(dry.reply("hi"))
            warm_verify(model)
        except MinillamaError:  # a template or context that refuses it: the first turn says so
            pass

    warm_up(model, [0], run=dry_turn)
    print(f"chat: {backend_line(model.backend)}, {model.dtype}; /reset starts over, /exit ends",
          file=sys.stderr)
    return session, tok


def _stream_reply(session, tok, text: str, out) -> bool:
    """Write the reply to ``text`` as it is generated; False when the turn was refused (too long,
    the template objects: said on stderr). Ctrl-C stops the reply, keeping what was written."""
    streamer = TextStreamer(tok)
    stopper = StopText(session.params.stop)
    steps = session.reply(text)
    t0, n, shown = time.perf_counter(), 0, []
    try:
        for t in steps:
            piece = stopper.push(streamer.put(t))
            shown.append(piece)
            out.write(piece)
            out.flush()
            n += 1
            if stopper.hit:  # a stop text appeared: the reply ends before it
                steps.close()
                session.cut_reply("".join(shown))
                break
    except MinillamaError as e:  # this turn is refused (too long, the template objects)
        print(f"minillama: error: {e}", file=sys.stderr)
        return False
    except KeyboardInterrupt:
        steps.close()
        tail = "" if stopper.hit else stopper.push(streamer.flush()) + stopper.flush()
        out.write(tail + "\n")
        if stopper.hit:
            session.cut_reply("".join(shown) + tail)
        print("[reply stopped]", file=sys.stderr)
        return True
    if not stopper.hit:
        tail = stopper.push(streamer.flush()) + stopper.flush()
        out.write(tail)
        if stopper.hit:
            session.cut_reply("".join(shown) + tail)
    out.write("\n")
    out.flush()
    dt = time.perf_counter() - t0
    st = session.last_stats
    drafts = f"; {st.drafts_taken}" if st and st.drafted else ""
    print(f"[{n} tokens in {dt:.2f} s, {n / dt if dt > 0 else 0.0:.1f} tok/s; "
          f"prefilled {session.last_prefill}{drafts}]", file=sys.stderr)
    return True

