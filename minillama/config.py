"""Model hyper-parameters, with Meta's field names and the checks that keep them consistent."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from .errors import MinillamaError


def llama_hidden_dim(dim: int, multiple_of: int = 256, ffn_dim_multiplier: float | None = None) -> int:
    r"""LLaMA's rule for the SwiGLU hidden size F.

    F = multiple\_of \cdot \lceil (m \cdot \lfloor 2 \cdot 4D / 3 \rfloor) / multiple\_of \rceil,
    with m = ffn\_dim\_multiplier (1 when unset). The 2/3 keeps the parameter count of the three
    SwiGLU matrices equal to that of a 4D two-matrix MLP.
    """
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


@dataclass
class ModelConfig:
    """Shape of a LLaMA-family decoder.

    Sizes: D = ``dim``, L = ``n_layers``, H = ``n_heads``, KVH = ``n_kv_heads``,
    hd = D / H, F = ``hidden_dim``, V = ``vocab_size``, ``max_seq_len`` the context.
    ``n_kv_heads`` defaults to ``n_heads`` (MHA); KVH = 1 is MQA, anything between is GQA.
    ``hidden_dim`` defaults to :func:`llama_hidden_dim` of ``dim``, ``multiple_of`` and
    ``ffn_dim_multiplier``.
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

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.hidden_dim is None:
            self.validate_positive("dim", "multiple_of")
            self.hidden_dim = llama_hidden_dim(self.dim, self.multiple_of, self.ffn_dim_multiplier)
        self.validate()

    # --- derived sizes ---------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        """hd = D / H."""
        return self.dim // self.n_heads

    @property
    def n_rep(self) -> int:
        """Query heads per KV head, H / KVH."""
        return self.n_heads // self.n_kv_heads

    # --- checks ----------------------------------------------------------------------------
    def validate_positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise MinillamaError(f"ModelConfig.{name} must be a positive integer, got {value!r}")

    def validate(self) -> None:
        """Raise :class:`MinillamaError` naming the fields of the first broken invariant."""
        self.validate_positive("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size",
                               "hidden_dim", "max_seq_len")
        if self.dim % self.n_heads:
            raise MinillamaError(
                f"dim % n_heads must be 0 (dim={self.dim}, n_heads={self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise MinillamaError(
                f"n_heads % n_kv_heads must be 0 (n_heads={self.n_heads}, "
                f"n_kv_heads={self.n_kv_heads})")
        if self.head_dim % 2:
            raise MinillamaError(
                f"RoPE needs an even head dimension dim / n_heads, got {self.head_dim} "
                f"(dim={self.dim}, n_heads={self.n_heads})")
        if not (self.norm_eps > 0):
            raise MinillamaError(f"norm_eps must be > 0, got {self.norm_eps!r}")
        if not (self.rope_theta > 0):
            raise MinillamaError(f"rope_theta must be > 0, got {self.rope_theta!r}")

    # --- (de)serialisation -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
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
        kv = self.n_kv_heads * self.head_dim
        per_layer = D * D * 2 + 2 * D * kv + 3 * D * F + 2 * D
        return V * D * (1 if self.tie_embeddings else 2) + L * per_layer + D
