"""What the commands share: argparse types, the ``--backend`` help and the sampling flags of
``generate``, ``chat`` and ``serve``."""

from __future__ import annotations

import argparse

from minillama.backends import backend_names
from minillama.core.errors import MinillamaError
from minillama.core.sampling import SamplingParams


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def backend_help() -> str:
    """The ``--backend`` help of the commands that run a model."""
    return (f"{', '.join(backend_names())} or auto (default: $MINILLAMA_BACKEND, else auto: the "
            f"fastest for the model's size, see README)")


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


def sampling_params(args) -> SamplingParams:
    """The :class:`~minillama.core.sampling.SamplingParams` of the shared flags, checked (a bad
    value is one error line naming its flag)."""
    try:
        return SamplingParams(
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
            repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
            frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty,
            seed=args.seed)
    except MinillamaError as e:
        name = str(e).split(" ", 1)[0]
        raise MinillamaError(f"--{name.replace('_', '-')}{str(e)[len(name):]}") from None
