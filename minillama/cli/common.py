"""What the commands share: argparse types, the model flags (``--checkpoint``, ``--tokenizer``,
``--adapter``), ``--backend`` and ``--dtype``, and the sampling flags of ``generate`` and
``chat``: each flag declared once here, each command choosing the ones it takes."""

from __future__ import annotations

import argparse
import contextlib
import os

from minillama.backends import backend_help, backend_names, threads_in_use
from minillama.core.config import COMPUTE_DTYPES, DTYPE_HELP
from minillama.core.errors import MinillamaError
from minillama.core.sampling import SamplingParams
from minillama.infer.generate import draft_decoder, warm_up
from minillama.io.load import DEFAULT_CHECKPOINT, open_model
from minillama.io.tokenizer import TOKENIZER_KINDS
from minillama.model.kvcache import KV_CACHE_TYPES


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


# ---------------------------------------------------------------------------------------------
# the model a command loads and where it computes
# ---------------------------------------------------------------------------------------------
def add_model_flags(p, *, checkpoint_required: bool = False, checkpoint_help: str | None = None,
                    tokenizer: bool = True, adapter: bool = False) -> None:
    """``--checkpoint/-c`` (default: the shipped model, unless ``checkpoint_required`` or a
    ``checkpoint_help`` that says otherwise), then ``--tokenizer/-t`` and ``--adapter`` where the
    command takes them."""
    p.add_argument("--checkpoint", "-c", default=None, required=checkpoint_required,
                   help=checkpoint_help or f"model file or folder (default: "
                                           f"{DEFAULT_CHECKPOINT.name}, the Shakespeare model "
                                           f"shipped with the package)")
    if tokenizer:
        p.add_argument("--tokenizer", "-t", default=None,
                       help=f"tokenizer: {TOKENIZER_KINDS} (default: the one stored with the "
                            f"checkpoint)")
    if adapter:
        p.add_argument("--adapter", default=None,
                       help="a LoRA adapter folder (PEFT's adapter_config.json + "
                            "adapter_model.safetensors, e.g. `minillama finetune --out`), merged "
                            "into the weights on loading")


def add_backend_flag(p, *, dtype: bool = False, task: str = "decode", cache: bool = True) -> None:
    """``--backend`` (one backend name or auto; ``task``: what auto is chosen for, see
    :func:`~minillama.backends.backend_help`), with ``--exact`` and (``cache``: a command that
    decodes on a KV cache) ``--kv-cache`` for decoding, and ``--dtype`` with ``dtype``."""
    p.add_argument("--backend", default=None, help=backend_help(task))
    if task == "decode":
        p.add_argument("--exact", action="store_true",
                       help="float32 products with quantized weights (numba): activations stay "
                            "float32 instead of being rounded to 8-bit blocks as llama.cpp does; "
                            "slower, and on near-ties other tokens (the same as "
                            "MINILLAMA_QUANT_DOTS=float)"
                            + ("; the KV cache float32 too unless --kv-cache says otherwise"
                               if cache else ""))
    if task == "decode" and cache:
        p.add_argument("--kv-cache", default="auto", choices=KV_CACHE_TYPES,
                       help="the KV cache's storage: f16 halves its memory and the bytes a decode "
                            "step reads at long contexts, f32 keeps the compute precision; auto "
                            "(default): f16 for GGML block weights (whose 8-bit activations "
                            "already round far coarser), f32 for float weights and with --exact")
    if dtype:
        p.add_argument("--dtype", default=None, choices=COMPUTE_DTYPES,
                       help=f"{DTYPE_HELP} (default {COMPUTE_DTYPES[0]})")


def apply_kv_cache(args, model) -> None:
    """``--kv-cache`` on ``model`` (its caches' storage, :attr:`Transformer.kv_dtype`; "auto"
    with ``--exact`` is float32, the float model's math), refused in one line where the backend
    or the dtype cannot keep it."""
    kind = getattr(args, "kv_cache", "auto")
    model.kv_cache = "f32" if kind == "auto" and getattr(args, "exact", False) else kind
    model.kv_dtype  # noqa: B018  (checked now: a clear error before any work)


def add_speculate_flag(p) -> None:
    """``--no-speculate`` (``args.speculate`` False): greedy decoding of one sequence without
    prompt-lookup drafts (:mod:`minillama.core.speculative`)."""
    p.add_argument("--no-speculate", dest="speculate", action="store_false",
                   help="greedy decoding without prompt-lookup drafts (by default drafts are "
                        "verified several tokens per step where the backend computes them "
                        "exactly as single steps: the same tokens, faster on text that repeats "
                        "its context)")


def add_draft_flag(p) -> None:
    """``--draft CHECKPOINT``: drafts from a smaller model with the same tokenizer."""
    p.add_argument("--draft", metavar="CHECKPOINT",
                   help="draft from this smaller model (same tokenizer) instead of looking the "
                        "next tokens up in the context: it proposes its greedy continuation, the "
                        "model checks several tokens per step; greedy only (--temperature 0), "
                        "the same tokens as without it (default: prompt lookup)")


def load_draft(args, model, tok, params: SamplingParams):
    """The draft model of ``--draft`` on ``model``'s backend, or None; refused in one line where
    it cannot draft for ``model`` (sampling, --no-speculate, another tokenizer or a shorter
    context)."""
    path = getattr(args, "draft", None)
    if not path:
        return None
    if params.temperature != 0 or params.penalised:
        raise MinillamaError("--draft: drafts are verified for greedy decoding only (--temperature "
                             "0, no penalties)")
    if not args.speculate:
        raise MinillamaError("--draft and --no-speculate contradict each other")
    if not model.backend.speculation_exact(model):
        raise MinillamaError(f"--draft: the {model.backend.name} backend does not verify drafts "
                             "for this model (numba does, on float weights and on GGML blocks "
                             "with 8-bit products, so not with --exact)")
    draft, dtok, _ = open_model(path, model.backend, args.dtype)
    apply_kv_cache(args, draft)
    same = draft.cfg.vocab_size == model.cfg.vocab_size
    if same and tok is not None and dtok is not None:
        same = (getattr(tok, "bos_id", None), getattr(tok, "eos_id", None)) == \
            (getattr(dtok, "bos_id", None), getattr(dtok, "eos_id", None)) and all(
                _piece(tok, i) == _piece(dtok, i) for i in range(model.cfg.vocab_size))
    if not same:
        raise MinillamaError(f"--draft {path}: its vocabulary differs from the model's (a draft "
                             "model needs the same tokenizer)")
    if draft.cfg.max_seq_len < model.cfg.max_seq_len:
        raise MinillamaError(f"--draft {path}: its context ({draft.cfg.max_seq_len}) is shorter "
                             f"than the model's ({model.cfg.max_seq_len})")
    draft_decoder(draft, 2)  # one-line error where it has no decoder of its own
    warm_up(draft, [1, 2, 3])  # its kernels compiled (or loaded) now, not in the first reply
    return draft


def _piece(tok, i: int):
    """Token ``i``'s text, or None where the tokenizer has none (a padded vocabulary)."""
    try:
        return tok.token_text(i)
    except (IndexError, KeyError, ValueError):
        return None


@contextlib.contextmanager
def apply_exact(args):
    """``--exact``: within it, the switch the numba kernels read at each product, in every thread
    (``MINILLAMA_QUANT_DOTS=float``, :func:`minillama.backends.numba.quant.int8_dots.int8_enabled`);
    the environment as it was after it (a command run in-process leaves no trace)."""
    if not getattr(args, "exact", False):
        yield
        return
    before = os.environ.get("MINILLAMA_QUANT_DOTS")
    os.environ["MINILLAMA_QUANT_DOTS"] = "float"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("MINILLAMA_QUANT_DOTS", None)
        else:
            os.environ["MINILLAMA_QUANT_DOTS"] = before


def add_backend_list_flag(p) -> None:
    """``--backend`` of a command that runs on several backends (``bench``): a comma-separated
    list, or all those that can run here."""
    p.add_argument("--backend", default="all",
                   help=f"comma-separated backend names ({', '.join(backend_names())}), or 'all' "
                        f"(those that can run here)")


def add_max_memory_flag(p) -> None:
    """``--max-memory SIZE`` of ``train`` and ``finetune``: a limit on the memory plan of a step
    (:func:`minillama.train.memplan.settle`)."""
    p.add_argument("--max-memory", default=None, metavar="SIZE",
                   help="the most memory the run may take at a step's peak (e.g. 8G, 512M; the "
                        "whole process, as the memory plan counts it): a plan over it turns on "
                        "--recompute if that fits (and says so), else the run stops at once "
                        "naming the --batch-size / --context that fit; default: no limit, a "
                        "warning when the step needs more than is free")


# ---------------------------------------------------------------------------------------------
# the command-line flags `generate` and `chat` share
# ---------------------------------------------------------------------------------------------
def add_sampling_flags(p, temperature: float, top_p: float | None, min_p: float | None) -> None:
    """The sampling flags ``generate`` and ``chat`` share."""
    p.add_argument("--temperature", type=float, default=temperature,
                   help=f"sampling temperature, 0 = greedy (default {temperature})")
    p.add_argument("--top-k", type=int, default=None, help="keep only the k most likely tokens")
    p.add_argument("--top-p", type=float, default=top_p,
                   help=f"nucleus sampling mass, 1 disables it (default {top_p})")
    p.add_argument("--min-p", type=float, default=min_p,
                   help="keep tokens at least min-p times as likely as the most likely one, "
                        f"0 disables it (default {min_p or 0})")
    p.add_argument("--repeat-penalty", type=float, default=1.0,
                   help="divide positive (multiply negative) logits of the last "
                        "--repeat-last-n tokens by this, 1 disables it (default 1)")
    p.add_argument("--repeat-last-n", type=int, default=64,
                   help="how many recent tokens the penalties look at, prompt included; "
                        "-1 = all (default 64)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract this times a token's count among the last --repeat-last-n "
                        "tokens from its logit, in [-2, 2] (default 0)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract this from the logit of every token among the last "
                        "--repeat-last-n tokens, in [-2, 2] (default 0)")
    p.add_argument("--seed", type=int, default=None, help="random seed (reproducible sampling)")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="end the output where this text appears (not shown); repeat for several")


def sampling_params(args) -> SamplingParams:
    """The :class:`~minillama.core.sampling.SamplingParams` of the shared flags, checked (a bad
    value is one error line naming the setting)."""
    if args.seed is not None and args.seed < 0:
        raise MinillamaError(f"--seed must be a non-negative integer, got {args.seed}")
    return SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
        frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty,
        seed=args.seed, stop=tuple(getattr(args, "stop", None) or ()))


def add_threads_flag(p) -> None:
    """``--threads N``, which every command takes (:func:`minillama.backends.set_threads`)."""
    p.add_argument("--threads", type=positive_int, default=None,
                   help="CPU threads of every pool: the backend's kernels, BLAS, the row "
                        "threads (default: $MINILLAMA_NUM_THREADS, else every core)")


def backend_line(backend) -> str:
    """``backend numba, 2 threads`` (the threads left out on a GPU backend): what speed lines
    name, so a figure says what produced it."""
    n = threads_in_use(backend)
    return f"backend {backend.name}" + ("" if n is None else f", {n} thread{'s' * (n != 1)}")
