"""``minillama generate``: text from a checkpoint (the shipped Shakespeare model by default),
streamed to stdout, with the prefill and decode speeds and the KV cache's size on stderr.

The generation itself is :mod:`minillama.infer.generate`; this module is the command's flags,
their checks and its output.
"""

from __future__ import annotations

import sys
from pathlib import Path

from minillama.backends import resolve_name
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
from minillama.cli.main import main
from minillama.core.decoding import stream_greedy
from minillama.core.errors import MinillamaError
from minillama.core.sampling import StopText
from minillama.infer.generate import (
    GenerationStats,
    TextStreamer,
    generate_steps,
    graph_decoder_for,
    warm_up,
)
from minillama.io.chat_template import encode_rendered, render_chat, stop_ids
from minillama.io.load import DEFAULT_CHECKPOINT, open_model
from minillama.io.tokenizer import TOKENIZER_KINDS, ByteTokenizer

#: the values of --cuda-graph
CUDA_GRAPH_CHOICES = ("auto", "on", "off")


def add_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "generate", help="generate text from a checkpoint (streams to stdout)",
        description="Generate text with a KV cache from a llama2.c .bin, a Hugging Face LLaMA "
                    "directory or a minillama .safetensors checkpoint. Text streams to stdout; "
                    "prefill/decode speed and KV-cache memory go to stderr.")
    add_model_flags(p, adapter=True)
    p.add_argument("--prompt", "-p", default="",
                   help="prompt text, with BOS in front where the tokenizer says so (default: "
                        "empty: start at BOS; byte-level models start at BOS and a newline)")
    p.add_argument("--chat", action="store_true",
                   help="send --prompt as a user message through the model's chat template "
                        "(GGUF tokenizer.chat_template, tokenizer_config.json or "
                        "chat_template.jinja; rendered with jinja2)")
    p.add_argument("-n", "--max-new-tokens", type=int, default=256,
                   help="most tokens to generate (default 256; the model's context may cut it, "
                        "which is noted on stderr)")
    add_sampling_flags(p, temperature=1.0, top_p=0.9, min_p=None)
    add_backend_flag(p, dtype=True)
    add_speculate_flag(p)
    add_draft_flag(p)
    p.add_argument("--cuda-graph", default="auto", choices=CUDA_GRAPH_CHOICES,
                   help="greedy decoding on the cupy backend with each decode step captured as "
                        "one CUDA graph: auto (default: when --temperature 0, float32 and a plain "
                        "LLaMA model), on (an error where it cannot), off (the eager loop)")
    p.set_defaults(func=run_cli)


def check_cuda_graph_flag(mode: str, backend_name: str, temperature: float) -> None:
    """``--cuda-graph on`` needs what it cannot do without (checked before the model loads): the
    cupy backend and greedy decoding (sampling with a temperature stays on the eager loop)."""
    if mode not in CUDA_GRAPH_CHOICES:
        raise MinillamaError(f"--cuda-graph must be one of {', '.join(CUDA_GRAPH_CHOICES)}, "
                             f"got {mode!r}")
    if mode != "on":
        return
    if backend_name != "cupy":
        raise MinillamaError(f"--cuda-graph on needs --backend cupy (the backend is "
                             f"{backend_name})")
    if temperature != 0.0:
        raise MinillamaError(f"--cuda-graph on decodes greedily; use --temperature 0 (got "
                             f"{temperature}) or --cuda-graph off/auto to sample")


def run_cli(args) -> int:
    params = sampling_params(args)
    model, tok, checkpoint, fmt, graph_mode = _load_for_cli(args)
    draft = load_draft(args, model, tok, params)
    cfg = model.cfg
    prompt_ids, stop = _cli_prompt(args, tok, cfg, checkpoint, fmt)
    if params.stop and tok is None:
        raise MinillamaError("--stop needs a tokenizer (the output is token ids)")
    if len(prompt_ids) > cfg.max_seq_len:
        raise MinillamaError(f"prompt of {len(prompt_ids)} tokens is longer than the model "
                             f"context of {cfg.max_seq_len}")
    room = cfg.max_seq_len - len(prompt_ids) + 1  # the last token needs no slot of its own
    if args.max_new_tokens > room:
        print(f"minillama: note: -n {args.max_new_tokens} is cut to {room} new tokens: the "
              f"model's context is {cfg.max_seq_len} tokens and the prompt takes "
              f"{len(prompt_ids)}", file=sys.stderr)
    out = sys.stdout
    stats = GenerationStats()
    if tok is not None:
        streamer = TextStreamer(tok, prompt_ids)
        head = streamer.start()
        if not getattr(args, "chat", False):  # a chat turn prints the reply only
            out.write(head)
            out.flush()
    cache_len = int(min(cfg.max_seq_len, len(prompt_ids) + args.max_new_tokens))
    decoder = graph_decoder_for(model, graph_mode, params.temperature, cache_len) \
        if args.max_new_tokens > 0 and not params.penalised else None
    if decoder is not None:
        stats.cache_bytes = decoder.cache.nbytes
        stats.cache_shape = (2, cfg.n_layers, 1, decoder.S, cfg.n_kv_heads, cfg.head_dim)
        steps = stream_greedy(decoder, prompt_ids, args.max_new_tokens, cfg.max_seq_len, stop,
                              stats)
    else:
        warm_up(model, prompt_ids, params)
        steps = generate_steps(model, [prompt_ids], args.max_new_tokens, params, stop_ids=stop,
                               stats=stats, speculate=args.speculate, draft=draft)
    stopper = StopText(params.stop)
    for step in steps:
        for _, t in step:
            out.write(stopper.push(streamer.put(t)) if tok is not None else f"{t} ")
        out.flush()
        if stopper.hit:
            steps.close()  # a stop text appeared: no more tokens
            break
    tail = stopper.push(streamer.flush()) + stopper.flush() if tok is not None else ""
    out.write(tail + "\n")
    out.flush()
    _print_stats(stats, model, decoder is not None)
    return 0


def _load_for_cli(args):
    """The command's checks, then (model, tokenizer or None, checkpoint path, its format, CUDA
    graph mode): the checkpoint (or the shipped default) loaded with its adapter."""
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise MinillamaError("--prompt is not valid UTF-8 text") from None
    if args.max_new_tokens < 1:
        raise MinillamaError(f"-n/--max-new-tokens must be at least 1, got "
                             f"{args.max_new_tokens}")
    graph_mode = getattr(args, "cuda_graph", "off")
    check_cuda_graph_flag(graph_mode, resolve_name(args.backend), args.temperature)
    if args.checkpoint is None:
        if not DEFAULT_CHECKPOINT.is_file():
            raise MinillamaError(
                "no default checkpoint ships yet (minillama/weights/shakespeare.safetensors is "
                "missing); pass --checkpoint PATH")
        checkpoint = DEFAULT_CHECKPOINT
    else:
        checkpoint = Path(args.checkpoint)
    model, tok, fmt = open_model(checkpoint, args.backend, args.dtype,
                                 getattr(args, "adapter", None), args.tokenizer)
    apply_kv_cache(args, model)
    return model, tok, checkpoint, fmt, graph_mode


def _cli_prompt(args, tok, cfg, checkpoint, fmt) -> tuple[list[int], set[int]]:
    """(prompt ids, stop ids) of ``--prompt`` (rendered as one user turn with ``--chat``); without
    a tokenizer only an empty prompt works: BOS alone."""
    if tok is None:
        if args.prompt:
            hint = ("--tokenizer byte (its vocabulary of 258 is minillama's byte tokenizer)"
                    if cfg.vocab_size == ByteTokenizer.vocab_size else
                    f"--tokenizer ({TOKENIZER_KINDS})")
            raise MinillamaError(f"{checkpoint} has no tokenizer; pass {hint} to use a text "
                                 f"prompt")
        bos, stop = 1, ({1, 2} if fmt == "llama2c" else set())
        return [bos if bos < cfg.vocab_size else 0], stop
    text = args.prompt
    if not text and isinstance(tok, ByteTokenizer):
        # Byte models are trained on windows at random offsets, so they almost never see a
        # token right after BOS and sample noise there; start at the beginning of a line.
        text = "\n"
    if getattr(args, "chat", False):
        # the template writes BOS itself (as bos_token) when the model wants it
        prompt_ids = encode_rendered(tok, render_chat(
            tok, [{"role": "user", "content": args.prompt}]))
        stop = stop_ids(tok)
    else:
        # BOS as the tokenizer's source says (add_bos)
        prompt_ids = tok.encode(text, eos=False)  # a text to continue never ends in EOS
        if not prompt_ids:  # an empty prompt of a model that wants no BOS
            prompt_ids = [tok.bos_id if tok.bos_id is not None else tok.eos_id]
        stop = {tok.eos_id} | set(getattr(tok, "stop_ids", ()))
        if tok.bos_id is not None and tok.add_bos:
            stop.add(tok.bos_id)  # a new document starts: the text is over (llama2.c)
    stop.discard(None)
    return prompt_ids, stop


#: the speed line's names of the KV cache's storage
_KV_NAMES = {"float16": "f16", "float32": "f32", "float64": "f64"}


def _print_stats(stats: GenerationStats, model, graphed: bool) -> None:
    """The prefill and decode speeds and the KV cache's size, on stderr."""
    kib = stats.cache_bytes / 1024
    L, B, S, KVH, hd = stats.cache_shape[1:] if stats.cache_shape else (0,) * 5
    print(f"prefill: {stats.prompt_tokens} tokens in {stats.prefill_s * 1e3:.1f} ms "
          f"({stats.prefill_tokens_per_s:.1f} tok/s); decode: {max(stats.new_tokens - 1, 0)} "
          f"tokens in {stats.decode_s * 1e3:.1f} ms ({stats.decode_tokens_per_s:.1f} tok/s); "
          f"KV cache: {kib:.1f} KiB (2 x L={L} x B={B} x S={S} x KVH={KVH} x hd={hd} x "
          f"{model.kv_dtype.itemsize} B, {_KV_NAMES[model.kv_dtype.name]}); "
          f"{backend_line(model.backend)}"
          f"{'; ' + stats.drafts_taken if stats.drafted else ''}"
          f"{', one CUDA graph per decode step' if graphed else ''}", file=sys.stderr)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main(["generate", *sys.argv[1:]]))
