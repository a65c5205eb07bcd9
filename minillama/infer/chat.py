r"""Chat: a model's own chat template, its end-of-turn tokens, and ``minillama chat``.

* :func:`render_chat` renders the template the model ships (GGUF ``tokenizer.chat_template``,
  Hugging Face ``chat_template.jinja`` or ``tokenizer_config.json``'s ``chat_template``) with
  jinja2 in an immutable sandbox, configured as transformers' ``apply_chat_template`` does:
  ``trim_blocks``, ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that
  keeps non-ASCII text, the globals ``raise_exception`` and ``strftime_now``, and the special
  tokens (``bos_token``, ``eos_token``...) as variables.
* :func:`stop_ids` is the set of ids that end a reply: EOS, the source's end-of-turn ids, and
  ``<|im_end|>``, ``<|eot_id|>``, ``<|end_of_text|>``, ``<|endoftext|>``, ``<end_of_turn>`` where
  the vocabulary has them.
* :class:`ChatSession` keeps a conversation and the KV cache of its tokens. A turn renders the
  whole conversation again (templates are not prefix-stable in general: some rewrite earlier
  turns), keeps the cached positions of the longest common token prefix
  :math:`n = \max\{k : c_{<k} = t_{<k}\}` of the cached ids c and the new ids t (at most
  |t| - 1, so that one position is fed to get the next logits), and prefills only
  :math:`t_{n:}` at positions n, n+1, ... (rows past them still hold the old turn's K/V but
  are never read: attention reads positions below the one it feeds, and later writes overwrite
  them). When the conversation no longer fits the context, the oldest turns are dropped (a
  system message stays) and the command says so.
"""

from __future__ import annotations

import sys
from functools import lru_cache
from typing import Callable, Iterable

import numpy as np

from minillama.core.errors import MinillamaError
from minillama.core.sampling import add_sampling_flags, check_sampling, sample, sampling_kwargs

#: spellings of end-of-turn / end-of-text tokens of the LLaMA family and its relatives
STOP_NAMES = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "<end_of_turn>",
              "<|eom_id|>")


# ---------------------------------------------------------------------------------------------
# templates
# ---------------------------------------------------------------------------------------------
@lru_cache(maxsize=8)
def _compiled(template: str):
    try:
        import jinja2  # noqa: PLC0415
        from jinja2.ext import Extension, loopcontrols  # noqa: PLC0415
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415
    except ImportError:
        raise MinillamaError("chat templates need the optional `jinja2` package: "
                             "pip install 'minillama[hf]'") from None
    import json  # noqa: PLC0415

    class GenerationBlock(Extension):
        """``{% generation %}...{% endgeneration %}`` (marks assistant text for training
        masks in transformers): rendered as its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        import datetime  # noqa: PLC0415

        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template), jinja2
    except jinja2.TemplateError as e:
        raise MinillamaError(f"chat template does not parse: {e}") from None


def special_tokens(tok) -> dict[str, str]:
    """The special tokens a template sees (``bos_token``, ``eos_token``, and ``unk_token`` /
    ``pad_token`` where the source names them), spelled as in the vocabulary."""
    names = dict(getattr(tok, "special_names", {}) or {})
    text = getattr(tok, "token_text", None)
    for key, i in (("bos_token", tok.bos_id), ("eos_token", tok.eos_id)):
        if key not in names and i is not None and text is not None:
            names[key] = text(i)
    return names


def render_chat(tok, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The conversation ``messages`` (``[{"role": ..., "content": ...}]``) rendered with the
    chat template of ``tok``'s source, as transformers'
    ``apply_chat_template(messages, tokenize=False, add_generation_prompt=...)`` renders it.
    A source without a template, or a template that fails, is one clear error."""
    template = getattr(tok, "chat_template", None)
    if not template:
        raise MinillamaError("the model has no chat template (GGUF tokenizer.chat_template, "
                             "chat_template.jinja or tokenizer_config.json chat_template)")
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise MinillamaError("messages must be a list of {'role': str, 'content': ...} objects")
    compiled, jinja2 = _compiled(template)
    kwargs = special_tokens(tok)
    try:
        return compiled.render(messages=messages, tools=None, documents=None,
                               add_generation_prompt=add_generation_prompt, **kwargs)
    except jinja2.TemplateError as e:
        raise MinillamaError(f"chat template: {e}") from None
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise MinillamaError(f"chat template failed on these messages: "
                             f"{type(e).__name__}: {str(e)[:100]}") from None


def stop_ids(tok) -> set[int]:
    """The token ids that end a reply: EOS, the source's own end-of-turn ids (GGUF
    ``eot_token_id``, ``generation_config.json``'s ``eos_token_id`` list...) and the common
    end-of-turn tokens (:data:`STOP_NAMES`) where the vocabulary has them."""
    out = {tok.eos_id} | set(getattr(tok, "stop_ids", ()) or ())
    lookup = getattr(tok, "token_id", None)
    if lookup is not None:
        out |= {lookup(name) for name in STOP_NAMES}
    out.discard(None)
    return {int(i) for i in out}


def encode_rendered(tok, text: str) -> list[int]:
    """The ids of a rendered conversation: special tokens written in the text (``<s>``,
    ``<|im_start|>``...) become their ids, and nothing is added (the template wrote BOS where
    the model wants it), as transformers tokenizes a rendered template. Tokenizers that do not
    split special tokens out of text themselves (SentencePiece from tokenizer.bin or GGUF) get
    the control pieces cut out here; each piece between them is encoded on its own."""
    if not hasattr(tok, "pieces"):  # HF and byte-level BPE tokenizers split added tokens
        return tok.encode(text, bos=False, eos=False)
    specials = {}
    for i in {tok.bos_id, tok.eos_id, *stop_ids(tok)} - {None}:
        name = tok.token_text(i)
        if name:
            specials[name] = i
    from minillama.io.bpe import split_on

    ids: list[int] = []
    for part, special in split_on(text, specials):
        ids += [specials[part]] if special else tok.encode(part, bos=False, eos=False)
    return ids


# ---------------------------------------------------------------------------------------------
# a conversation with its KV cache
# ---------------------------------------------------------------------------------------------
def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two id lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ChatSession:
    """A conversation with a model: ``messages`` (a system message first if given) and the KV
    cache of ``cached`` (the ids whose K/V rows the cache holds, positions 0..len-1).

    :meth:`reply` adds a user turn and yields the reply's tokens as they are chosen; the reply
    joins the history when the generator finishes (or is closed, e.g. after Ctrl-C: the text
    so far is kept). ``sampling`` holds :func:`minillama.core.sampling.sample`'s keywords
    (temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n); ``seed`` seeds it."""

    def __init__(self, model, tok, system: str | None = None, max_new_tokens: int = 512,
                 context: int | None = None, seed: int | None = None, **sampling):
        cfg = model.cfg
        self.model, self.tok = model, tok
        self.context = int(min(context or cfg.max_seq_len, cfg.max_seq_len))
        if self.context < 2:
            raise MinillamaError(f"a chat needs a context of >= 2 positions, got {self.context}")
        if max_new_tokens < 1:
            raise MinillamaError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.max_new_tokens = int(max_new_tokens)
        check_sampling(sampling.get("temperature", 0.0), sampling.get("top_k"),
                       sampling.get("top_p"), sampling.get("min_p"),
                       sampling.get("repeat_penalty", 1.0), sampling.get("repeat_last_n", 64))
        self.sampling = sampling
        self.rng = np.random.default_rng(seed)
        self.system = system
        self.stop = stop_ids(tok)
        self.reset()
        # a template that refuses (e.g. no system role) fails now, not at the first turn
        render_chat(tok, self.messages + [{"role": "user", "content": "hi"}])
        self.cache = model.new_cache(1, self.context)
        #: called with a message when old turns are dropped to fit the context
        self.notice: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr)
        #: prompt tokens prefilled by the last turn (the part not already cached)
        self.last_prefill = 0

    def reset(self) -> None:
        """Forget the conversation (the system message stays)."""
        self.messages: list[dict] = ([{"role": "system", "content": self.system}]
                                     if self.system else [])
        self.cached: list[int] = []

    def _prompt(self) -> list[int]:
        """The ids of the whole conversation and the generation prompt; drops the oldest turns
        while it leaves less than a quarter of the context (or max_new_tokens) for the reply."""
        room = min(self.max_new_tokens, self.context // 4)
        dropped = 0
        first = 1 if self.messages and self.messages[0]["role"] == "system" else 0
        while True:
            ids = encode_rendered(self.tok, render_chat(self.tok, self.messages))
            if len(ids) + room <= self.context:
                break
            alone = self.messages[:first] + self.messages[-1:]
            n = len(encode_rendered(self.tok, render_chat(self.tok, alone))) if not dropped else 0
            if n >= self.context:  # refused before anything is dropped
                raise MinillamaError(f"the message makes a prompt of {n} tokens, longer than "
                                     f"the context of {self.context}")
            if len(self.messages) - first <= 1:  # only the new user message is left
                break
            # drop the oldest user turn and everything up to the next user turn
            del self.messages[first]
            while len(self.messages) > first + 1 and self.messages[first]["role"] != "user":
                del self.messages[first]
            dropped += 1
        if dropped:
            self.notice(f"[context full ({self.context} tokens): dropped the {dropped} oldest "
                        f"turn{'s' if dropped > 1 else ''}]")
        return ids

    def _logits(self, ids: list[int], start: int) -> np.ndarray:
        from minillama.core.decoding import finite_logits

        block = np.asarray([ids], dtype=np.int64)
        out = self.model.forward(block, start_pos=start, cache=self.cache, last_only=True)
        return finite_logits(self.model.backend.to_numpy(out)[0], f"position {start}")

    def reply(self, text: str):
        """Add the user message ``text`` and yield the reply's token ids (stop tokens are not
        yielded). Only the ids past the cached common prefix are prefilled."""
        self.messages.append({"role": "user", "content": text})
        try:
            ids = self._prompt()
        except MinillamaError:
            self.messages.pop()  # refused: the conversation stays as it was
            raise
        n = min(common_prefix(self.cached, ids), len(ids) - 1)
        self.last_prefill = len(ids) - n
        self.cached = self.cached[:n]  # positions n.. are rewritten now
        out: list[int] = []
        full = False
        try:  # an interrupted turn still gets its (maybe empty) reply: roles keep alternating
            z = self._logits(ids[n:], n)
            self.cached = list(ids)
            while len(out) < self.max_new_tokens:
                t = sample(z, self.rng, history=self.cached, **self.sampling)
                if t in self.stop:
                    break
                out.append(t)
                yield t
                if len(self.cached) >= self.context:
                    full = True
                    break
                z = self._logits([t], len(self.cached))
                self.cached.append(t)
        finally:
            self.messages.append({"role": "assistant", "content": self.tok.decode(out)})
        if full:
            self.notice(f"[context full ({self.context} tokens): the reply is cut; older turns "
                        f"are dropped next turn]")


# ---------------------------------------------------------------------------------------------
# the `minillama chat` command
# ---------------------------------------------------------------------------------------------
def add_cli(subparsers) -> None:
    from minillama.infer.generate import backend_help

    p = subparsers.add_parser(
        "chat", help="talk with a chat model (multi-turn, streams each reply)",
        description="An interactive conversation through the model's own chat template. Each "
                    "line you type is a user turn; the reply streams to stdout. The KV cache "
                    "is kept between turns, so a turn prefills only its new tokens. /reset "
                    "starts over, /exit (or Ctrl-D) quits, Ctrl-C stops a reply. Reads one "
                    "user turn per line from a pipe too. A turn that cannot be sent (longer "
                    "than the context, refused by the template) is one error line; the chat "
                    "goes on and exits with status 2 at the end.")
    p.add_argument("--checkpoint", "-c", required=True,
                   help="model file or folder with a chat template (GGUF or Hugging Face)")
    p.add_argument("--adapter", default=None,
                   help="a LoRA adapter folder (PEFT's adapter_config.json + "
                        "adapter_model.safetensors, e.g. `minillama finetune --out`)")
    p.add_argument("--tokenizer", "-t", default=None,
                   help="tokenizer folder or file (default: the checkpoint's own)")
    p.add_argument("--system", "-s", default=None, help="system message")
    p.add_argument("-n", "--max-new-tokens", type=int, default=512,
                   help="most tokens per reply (default 512)")
    p.add_argument("--context", type=int, default=4096,
                   help="KV cache positions for the conversation, capped at the model's "
                        "context (default 4096)")
    add_sampling_flags(p, temperature=0.8, top_p=0.95, min_p=0.05)
    p.add_argument("--backend", default=None, help=backend_help())
    p.add_argument("--dtype", default=None, choices=("float32", "float64"),
                   help="compute precision (default float32)")
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
    from minillama.infer.generate import open_model

    sampling = sampling_kwargs(args)
    if args.max_new_tokens < 1:
        raise MinillamaError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.context < 2:
        raise MinillamaError(f"--context must be >= 2, got {args.context}")
    from pathlib import Path  # noqa: PLC0415

    checkpoint = Path(args.checkpoint)
    model, tok, _ = open_model(checkpoint, args)
    if tok is None:
        raise MinillamaError(f"{checkpoint} has no tokenizer; pass --tokenizer")
    session = ChatSession(model, tok, system=args.system, max_new_tokens=args.max_new_tokens,
                          context=args.context, seed=args.seed, **sampling)
    return session, tok


def _stream_reply(session, tok, text: str, out) -> bool:
    """Write the reply to ``text`` as it is generated; False when the turn was refused (too long,
    the template objects: said on stderr). Ctrl-C stops the reply, keeping what was written."""
    from minillama.infer.generate import TextStreamer

    streamer = TextStreamer(tok)
    steps = session.reply(text)
    try:
        for t in steps:
            out.write(streamer.put(t))
            out.flush()
    except MinillamaError as e:  # this turn is refused (too long, the template objects)
        print(f"minillama: error: {e}", file=sys.stderr)
        return False
    except KeyboardInterrupt:
        steps.close()
        out.write(streamer.flush() + "\n")
        print("[reply stopped]", file=sys.stderr)
        return True
    out.write(streamer.flush() + "\n")
    out.flush()
    return True

