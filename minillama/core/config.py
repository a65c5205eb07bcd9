"""Model hyper-parameters, with Meta's field names and the checks that keep them consistent."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from minillama.core.errors import MinillamaError

#: the compute dtypes a model runs in; the first is the default
COMPUTE_DTYPES = ("float32", "float64")
#: the help of ``--dtype`` (the caller states the default)
DTYPE_HELP = f"compute precision, {' or '.join(COMPUTE_DTYPES)}"


def llama_hidden_dim(dim: int, multiple_of: int = 256,
                     ffn_dim_multiplier: float | None = None) -> int:
    r"""LLaMA's rule for the SwiGLU hidden size F.

    F = multiple\_of \cdot
        \lceil \lfloor m \cdot \lfloor 2 \cdot 4D / 3 \rfloor \rfloor / multiple\_of \rceil,

    with m = ffn\_dim\_multiplier (1 when unset). The floor after m is Meta's rounding (D = 48,
    m = 1.004, multiple\_of = 32 give 128; without it 160). The 2/3 keeps the parameter count of
    the three SwiGLU matrices equal to that of a 4D two-matrix MLP.
    """
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


#: the architecture variants a config may name (the first of each is LLaMA's choice)
VARIANTS = {"norm": ("rmsnorm", "layernorm"), "norm_position": ("pre", "post"),
            "pos_encoding": ("rope", "sinusoidal", "none"), "ffn": ("swiglu", "gelu", "relu")}


@dataclass
class ModelConfig:
    """Shape of a LLaMA-family decoder.

    Sizes: D = ``dim``, L = ``n_layers``, H = ``n_heads``, KVH = ``n_kv_heads``,
    hd = ``head_dim``, F = ``hidden_dim``, V = ``vocab_size``, ``max_seq_len`` the context.
    ``n_kv_heads`` defaults to ``n_heads`` (MHA); KVH = 1 is MQA, anything between is GQA.
    ``hidden_dim`` defaults to :func:`llama_hidden_dim` of ``dim``, ``multiple_of`` and
    ``ffn_dim_multiplier``; ``head_dim`` defaults to D / H but may be anything even (Mistral
    Nemo, Qwen3: H hd != D).

    Family options (all off for LLaMA 1/2): ``qkv_bias`` adds biases to W_q, W_k, W_v (Qwen2);
    ``attn_out_bias`` to W_o and ``mlp_bias`` to W_1, W_2, W_3 (HF ``attention_bias`` sets both
    attention flags); ``sliding_window`` W lets query t read keys t-W+1..t only (Mistral);
    ``rope_scaling`` is a transformers-style dict ``{"rope_type": "linear" | "dynamic" |
    "llama3" | "yarn", "factor": ..., ...}`` (see :func:`minillama.core.ops.rope_frequencies`).
    For a two-matrix FFN (``gelu``/``relu``) the default F is 3/2 of LLaMA's, so the FFN has as
    many parameters as SwiGLU's three matrices.

    Variants (defaults = LLaMA, see :data:`VARIANTS` and docs/MATH.md part II): ``norm``,
    ``norm_position``, ``pos_encoding``, ``ffn``, and ``logit_scale`` s (logits = s z).
    """

    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    vocab_size: int = 256
    hidden_dim: int | None = None
    multiple_of: int = 32
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 256
    tie_embeddings: bool = True
    head_dim: int | None = None
    qkv_bias: bool = False
    attn_out_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    rope_scaling: dict | None = None
    norm: str = "rmsnorm"
    norm_position: str = "pre"
    pos_encoding: str = "rope"
    ffn: str = "swiglu"
    logit_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.hidden_dim is None:
            self.validate_fields("dim", "multiple_of", "ffn_dim_multiplier")
            self.hidden_dim = llama_hidden_dim(self.dim, self.multiple_of, self.ffn_dim_multiplier)
            if self.ffn in ("gelu", "relu"):
                self.hidden_dim = self.hidden_dim * 3 // 2
        if self.head_dim is None:
            self.validate_fields("dim", "n_heads")
            if self.dim % self.n_heads:
                raise MinillamaError(
                    f"dim % n_heads must be 0 when head_dim is not given (dim={self.dim}, "
                    f"n_heads={self.n_heads})")
            self.head_dim = self.dim // self.n_heads
        self.validate()

    @property
    def is_llama(self) -> bool:
        """True when every variant is LLaMA's (what llama2.c and HF llama files can express)."""
        return (all(getattr(self, k) == v[0] for k, v in VARIANTS.items())
                and self.logit_scale == 1.0)

    def require_llama(self, fmt: str) -> None:
        """Raise :class:`MinillamaError` naming the variants that the format ``fmt`` cannot hold."""
        if not self.is_llama:
            odd = [f"{k}={getattr(self, k)}" for k, v in VARIANTS.items()
                   if getattr(self, k) != v[0]]
            odd += [f"logit_scale={self.logit_scale}"] if self.logit_scale != 1.0 else []
            raise MinillamaError(f"the {fmt} format holds only LLaMA's architecture; this model "
                                 f"has {', '.join(odd)} (keep the minillama .safetensors format)")

    # --- derived sizes ---------------------------------------------------------------------

    @property
    def n_rep(self) -> int:
        """Query heads per KV head, H / KVH."""
        return self.n_heads // self.n_kv_heads

    # --- checks ----------------------------------------------------------------------------
    def validate_fields(self, *names: str) -> None:
        """Check the type and range of the named fields (all of them when none is named).

        The rule of a field is its entry in :data:`FIELD_RULES`; a field without one (added by a
        later model variant) is checked by its annotation: ``int`` fields are integers in
        [0, :data:`MAX_SIZE`], ``float`` fields finite numbers, ``bool`` fields booleans,
        ``str`` fields strings, and ``X | None`` allows None.
        """
        for f in dataclasses.fields(self):
            if names and f.name not in names:
                continue
            value = _check_field(f.name, getattr(self, f.name), str(f.type))
            object.__setattr__(self, f.name, value)  # NumPy scalars become plain Python

    def validate_positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise MinillamaError(f"ModelConfig.{name} must be a positive integer, "
                                     f"got {value!r}")

    def validate(self) -> None:
        """Raise :class:`MinillamaError` naming the fields of the first broken rule: every
        field's type and range (sizes bounded, so a lying config is refused before anything is
        allocated), then the cross-field invariants."""
        self.validate_fields()
        if self.n_kv_heads > self.n_heads or self.n_heads % self.n_kv_heads:
            raise MinillamaError(
                f"n_heads % n_kv_heads must be 0 (n_heads={self.n_heads}, "
                f"n_kv_heads={self.n_kv_heads})")
        if self.head_dim % 2:
            raise MinillamaError(
                f"RoPE needs an even head dimension, got head_dim={self.head_dim} "
                f"(dim={self.dim}, n_heads={self.n_heads})")
        if self.max_seq_len * self.head_dim > MAX_ROPE_TABLE:
            raise MinillamaError(
                f"max_seq_len * head_dim = {self.max_seq_len} * {self.head_dim} is more than "
                f"{MAX_ROPE_TABLE} (the RoPE tables alone would take "
                f"{self.max_seq_len * self.head_dim * 4 / 2**30:.1f} GiB)")
        self.rope_scaling = check_rope_scaling(self.rope_scaling, self.head_dim)
        for name, known in VARIANTS.items():
            if getattr(self, name) not in known:
                raise MinillamaError(f"unknown {name} {getattr(self, name)!r}; this version knows "
                                     f"{', '.join(known)}")
        if self.pos_encoding == "sinusoidal" and self.dim % 2:
            raise MinillamaError(f"sinusoidal positions need an even dim, got {self.dim}")

    # --- (de)serialisation -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(d, dict):
            raise MinillamaError(f"a model config must be a mapping, got {type(d).__name__}")
        unknown = sorted(str(k) for k in set(d) - known)
        if unknown:
            raise MinillamaError(f"unknown ModelConfig field(s): {', '.join(unknown)}")
        try:
            return cls(**d)
        except TypeError as e:  # pragma: no cover - defensive
            raise MinillamaError(f"bad ModelConfig: {e}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def n_params(self) -> int:
        """Number of parameters (the tied head counted once)."""
        D, F, V, L = self.dim, self.hidden_dim, self.vocab_size, self.n_layers
        qd, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        n_mats, n_vecs = (3 if self.ffn == "swiglu" else 2), (2 if self.norm == "layernorm" else 1)
        per_layer = 2 * D * qd + 2 * D * kv + n_mats * D * F + 2 * D * n_vecs
        per_layer += (qd + 2 * kv) * self.qkv_bias + D * self.attn_out_bias
        per_layer += ((n_mats - 1) * F + D) * self.mlp_bias
        return V * D * (1 if self.tie_embeddings else 2) + L * per_layer + D * n_vecs


#: model shapes used by the benchmarks (size letters as in the docs): ``minillama bench --shape``
#: and the scripts under scripts/, as :class:`ModelConfig` keyword arguments
SHAPES = {
    "tiny": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=384, vocab_size=128,
                 max_seq_len=256),
    "s15": dict(dim=288, n_layers=6, n_heads=6, n_kv_heads=6, hidden_dim=768, vocab_size=32000,
                max_seq_len=256),
    "s110": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, hidden_dim=2048,
                 vocab_size=32000, max_seq_len=1024),
}


# ---------------------------------------------------------------------------------------------
# field rules: the one place that says what a valid config holds
# ---------------------------------------------------------------------------------------------
#: the largest size any integer field may take unless its rule says otherwise; a config asking
#: for more is refused before anything is allocated (a lying header cannot exhaust memory)
MAX_SIZE = 1 << 24

#: the most entries the RoPE tables (cos and sin, S x hd/2 each) may have in all: a 1M-token
#: context at hd = 128 fits; a small file whose config claims 2M positions at hd = 4096 (32 GiB of
#: tables) does not
MAX_ROPE_TABLE = 1 << 27

#: field -> (kind, low, high); kind "int" (bool refused), "float" (finite; ints accepted),
#: "bool"; bounds inclusive. Generous for real models (Llama 3 405B: D 16384, L 126, H 128,
#: F 53248, V 128256) and small enough that nothing absurd gets allocated.
FIELD_RULES: dict[str, tuple[str, float, float]] = {
    "dim": ("int", 1, 1 << 16),
    "n_layers": ("int", 1, 1 << 10),
    "n_heads": ("int", 1, 1 << 10),
    "n_kv_heads": ("int", 1, 1 << 10),
    "vocab_size": ("int", 1, 1 << 22),
    "hidden_dim": ("int", 1, 1 << 18),
    "multiple_of": ("int", 1, 1 << 16),
    "ffn_dim_multiplier": ("float", 1e-3, 1e3),
    "norm_eps": ("float", 1e-12, 1.0),
    "rope_theta": ("float", 1.0, 1e12),
    "max_seq_len": ("int", 1, 1 << 21),
    "tie_embeddings": ("bool", 0, 1),
    "head_dim": ("int", 2, 1 << 12),
    "sliding_window": ("int", 1, 1 << 21),
    "logit_scale": ("float", 1e-6, 1e6),
}

#: the RoPE scalings implemented (transformers' ``rope_type`` names) and the numeric parameters
#: each one needs; "default" is plain RoPE
ROPE_SCALING_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "freq_factors": (),  # llama.cpp's rope_freqs tensor: theta_i / f_i, "factors" (hd/2,)
}
#: optional numeric parameters (yarn's)
_ROPE_OPTIONAL = ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def check_rope_scaling(scaling: Any, head_dim: int) -> dict | None:
    """``scaling`` as a clean dict (``rope_type`` plus its finite positive numbers), None for
    plain RoPE; an unknown type or a missing/bad parameter is one clear error."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise MinillamaError(f"ModelConfig.rope_scaling must be an object or null, got "
                             f"{type(scaling).__name__}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if not isinstance(kind, str) or kind not in ROPE_SCALING_KEYS:
        raise MinillamaError(f"rope scaling type {_show(kind)} is not supported (supported: "
                             f"{', '.join(ROPE_SCALING_KEYS)})")
    if kind == "default":
        return None
    out: dict[str, Any] = {"rope_type": kind}
    for key in ROPE_SCALING_KEYS[kind] + _ROPE_OPTIONAL:
        value = scaling.get(key)
        if value is None and key not in ROPE_SCALING_KEYS[kind]:
            continue
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value) or value <= 0):
            raise MinillamaError(f"rope_scaling ({kind}): {key} must be a positive number, "
                                 f"got {_show(value)}")
        out[key] = value
    if kind in ("llama3",) and out["high_freq_factor"] <= out["low_freq_factor"]:
        raise MinillamaError("rope_scaling (llama3): high_freq_factor must exceed low_freq_factor")
    if kind == "dynamic" and head_dim <= 2:
        raise MinillamaError("rope_scaling (dynamic) needs head_dim > 2")
    if "truncate" in scaling:
        out["truncate"] = bool(scaling["truncate"])
    if kind == "freq_factors":
        f = scaling.get("factors")
        if (not isinstance(f, list) or len(f) != head_dim // 2
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                           and math.isfinite(x) and x > 0 for x in f)):
            raise MinillamaError(f"rope_scaling (freq_factors): factors must be head_dim / 2 = "
                                 f"{head_dim // 2} positive numbers")
        out["factors"] = [float(x) for x in f]
    return out


def _check_field(name: str, value: Any, annotation: str) -> Any:
    """``value`` as a plain Python value if it fits field ``name``, else a one-line
    :class:`MinillamaError`."""
    optional = "None" in annotation or "Optional" in annotation
    if value is None:
        if optional:
            return None
        raise MinillamaError(f"ModelConfig.{name} must be set, got None")
    kind, lo, hi = FIELD_RULES.get(name, (None, None, None))
    if kind is None:
        base = annotation.replace("| None", "").replace("Optional[", "").strip(" ]")
        kind = {"int": "int", "float": "float", "bool": "bool", "str": "str"}.get(base)
        lo, hi = (0, MAX_SIZE) if kind == "int" else (-math.inf, math.inf)
    if kind == "bool":
        if not isinstance(value, (bool, np.bool_)):
            raise MinillamaError(f"ModelConfig.{name} must be true or false, got {_show(value)}")
        return bool(value)
    if kind == "str":
        if not isinstance(value, str):
            raise MinillamaError(f"ModelConfig.{name} must be a string, got {_show(value)}")
        return value
    if kind == "int":
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise MinillamaError(f"ModelConfig.{name} must be an integer, got {_show(value)}")
        if not lo <= value <= hi:
            raise MinillamaError(f"ModelConfig.{name} must be in [{lo}, {hi}], got "
                                 f"{_show(value)}")
        return int(value)
    if kind == "float":
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
            raise MinillamaError(f"ModelConfig.{name} must be a number, got {_show(value)}")
        if not (math.isfinite(value) and lo <= value <= hi):
            raise MinillamaError(f"ModelConfig.{name} must be a finite number in [{lo:g}, "
                                 f"{hi:g}], got {value!r}")
        return float(value)
    return value


def _show(value: Any) -> str:
    """A short repr (a huge string or list in a config must not flood the error line)."""
    r = repr(value)
    return r if len(r) <= 60 else r[:57] + "..."


#: the names of one block's parameters (prefix ``layers.{l}.``), Meta / llama2.c naming
LAYER_PARAMS = (
    "attention_norm.weight",
    "attention.wq.weight",
    "attention.wk.weight",
    "attention.wv.weight",
    "attention.wo.weight",
    "ffn_norm.weight",
    "feed_forward.w1.weight",
    "feed_forward.w2.weight",
    "feed_forward.w3.weight",
)


def layer_biases(cfg: ModelConfig) -> tuple[str, ...]:
    """The bias parameters of one block that ``cfg`` asks for (``qkv_bias``: wq, wk, wv;
    ``attn_out_bias``: wo; ``mlp_bias``: w1, w2, w3), each ``<linear>.bias``."""
    names: list[str] = []
    if cfg.qkv_bias:
        names += ["attention.wq.bias", "attention.wk.bias", "attention.wv.bias"]
    if cfg.attn_out_bias:
        names.append("attention.wo.bias")
    if cfg.mlp_bias:
        names += ["feed_forward.w1.bias", "feed_forward.w2.bias"]
        names += ["feed_forward.w3.bias"] if cfg.ffn == "swiglu" else []
    return tuple(names)


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape, in a fixed order (embedding, layers, norm, head).

    Linear weights are (out, in): wq (H*hd, D), wk/wv (KVH*hd, D), wo (D, H*hd), w1/w3 (F, D),
    w2 (D, F); biases (out,) when the config has them (:func:`layer_biases`); norm gains (D,);
    tok_embeddings and output (V, D). ``output.weight`` exists only when the head is not tied
    to the embedding. Variants: a two-matrix FFN (``ffn`` gelu/relu) has no w3; LayerNorm adds a
    bias (D,) next to each norm gain (``*_norm.bias``, ``norm.bias``).
    """
    D, F, V = cfg.dim, cfg.hidden_dim, cfg.vocab_size
    qd, kvd = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    per_layer = {
        "attention_norm.weight": (D,),
        "attention.wq.weight": (qd, D),
        "attention.wk.weight": (kvd, D),
        "attention.wv.weight": (kvd, D),
        "attention.wo.weight": (D, qd),
        "ffn_norm.weight": (D,),
        "feed_forward.w1.weight": (F, D),
        "feed_forward.w2.weight": (D, F),
        "feed_forward.w3.weight": (F, D),
    }
    biases = layer_biases(cfg)
    for name in biases:
        per_layer[name] = per_layer[name.replace(".bias", ".weight")][:1]
    names = [n for n in LAYER_PARAMS if cfg.ffn == "swiglu" or n != "feed_forward.w3.weight"]
    if cfg.norm == "layernorm":
        per_layer["attention_norm.bias"] = per_layer["ffn_norm.bias"] = (D,)
        names += ["attention_norm.bias", "ffn_norm.bias"]
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (V, D)}
    for layer in range(cfg.n_layers):
        for name in names + list(biases):
            shapes[f"layers.{layer}.{name}"] = per_layer[name]
    shapes["norm.weight"] = (D,)
    if cfg.norm == "layernorm":
        shapes["norm.bias"] = (D,)
    if not cfg.tie_embeddings:
        shapes["output.weight"] = (V, D)
    return shapes
