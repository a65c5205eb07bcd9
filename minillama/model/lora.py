r"""LoRA adapters on a :class:`~minillama.model.transformer.Transformer`, and their PEFT files.

A :class:`LoRA` holds one pair (A (r, in), B (out, r)) per targeted linear weight W (out, in) of
every block; attached to a model (``model.lora = lora``) each targeted layer computes
y = x W^T + s (x A^T) B^T (:func:`minillama.core.ops.lora_forward`, s = alpha / r, or alpha / \sqrt{r}
with rsLoRA) and the backward fills only the adapters' gradients: W, the norms, the embedding and
the head stay frozen and get neither gradients nor optimizer state.

Adapter names: ``layers.{l}.{weight}.lora_A`` / ``.lora_B`` with ``{weight}`` the base weight's
name without ``.weight`` (``layers.0.attention.wq.lora_A``). On disk they are written as PEFT
writes them (``adapter_config.json`` + ``adapter_model.safetensors``, keys
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), so
``peft.PeftModel.from_pretrained`` loads them on the Hugging Face base. The rows of B for W_q and
W_k follow the base weights through the HF-to-interleaved RoPE permutation (docs/MATH.md 4).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from minillama.core.errors import MinillamaError

#: short target name -> (minillama weight inside a block, PEFT / transformers module name)
TARGETS = {
    "q": ("attention.wq", "self_attn.q_proj"),
    "k": ("attention.wk", "self_attn.k_proj"),
    "v": ("attention.wv", "self_attn.v_proj"),
    "o": ("attention.wo", "self_attn.o_proj"),
    "gate": ("feed_forward.w1", "mlp.gate_proj"),
    "up": ("feed_forward.w3", "mlp.up_proj"),
    "down": ("feed_forward.w2", "mlp.down_proj"),
}
_BY_PEFT = {peft.split(".")[-1]: short for short, (_, peft) in TARGETS.items()}
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model.model.layers."


@dataclass
class LoRAConfig:
    """Rank r, alpha, the targeted linears (short names of :data:`TARGETS`), adapter-input
    dropout and rsLoRA's scale."""

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = tuple(TARGETS)
    dropout: float = 0.0
    rslora: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def scale(self) -> float:
        """s = alpha / r, or alpha / \\sqrt{r} (rsLoRA)."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def validate(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise MinillamaError(f"LoRA rank must be a positive integer, got {self.rank!r}")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha)
                and self.alpha > 0):
            raise MinillamaError(f"LoRA alpha must be a positive number, got {self.alpha!r}")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise MinillamaError(f"LoRA dropout must lie in [0, 1), got {self.dropout!r}")
        bad = [t for t in self.targets if t not in TARGETS]
        if bad or not self.targets:
            raise MinillamaError(f"LoRA targets must be among {', '.join(TARGETS)}; got "
                                 f"{', '.join(bad) or 'none'}")


def parse_targets(text: str) -> tuple[str, ...]:
    """``"q,k,v"`` -> ("q", "k", "v"); ``all`` is every target."""
    if text.strip() == "all":
        return tuple(TARGETS)
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [t for t in names if t not in TARGETS]
    if bad or not names:
        raise MinillamaError(f"--lora-targets: {', '.join(bad) or 'nothing'} is not among "
                             f"{', '.join(TARGETS)} (or all)")
    return tuple(dict.fromkeys(names))


class LoRA:
    """The adapters of one model: ``params`` {adapter name: array} on the model's backend, and
    ``targets`` {base weight name: (A name, B name)}.

    New adapters are initialised as PEFT does: A ~ U(-1/\\sqrt{in}, 1/\\sqrt{in}) (Kaiming-uniform
    with a = \\sqrt{5}), B = 0, so the adapted model starts equal to the base.
    """

    def __init__(self, model, lc: LoRAConfig, params: dict[str, Any] | None = None,
                 seed: int = 0):
        lc.validate()
        self.lc = lc
        self.cfg = model.cfg
        self.backend = model.backend
        self.training = False
        self.rng = np.random.default_rng([seed, 1])  # the dropout masks
        self.targets: dict[str, tuple[str, str]] = {}
        shapes = {}
        for layer in range(self.cfg.n_layers):
            for t in lc.targets:
                w = f"layers.{layer}.{TARGETS[t][0]}"
                out, inp = model.params[w + ".weight"].shape
                self.targets[w + ".weight"] = (w + ".lora_A", w + ".lora_B")
                shapes[w + ".lora_A"], shapes[w + ".lora_B"] = (lc.rank, inp), (out, lc.rank)
        if params is None:
            rng = np.random.default_rng(seed)
            params = {}
            for name, shape in shapes.items():
                bound = 1.0 / math.sqrt(shape[1])
                params[name] = (rng.uniform(-bound, bound, size=shape) if name.endswith("_A")
                                else np.zeros(shape))
        missing = [k for k in shapes if k not in params]
        extra = [k for k in params if k not in shapes]
        if missing or extra:
            raise MinillamaError(f"adapter tensors do not fit the model: "
                                 f"{'missing ' + missing[0] if missing else 'unexpected ' + extra[0]}")
        for k, shape in shapes.items():
            if tuple(params[k].shape) != shape:
                raise MinillamaError(f"adapter {k} has shape {tuple(params[k].shape)}, the model "
                                     f"needs {shape}")
        self.params = {k: self.backend.asarray(params[k], dtype=model.dtype) for k in shapes}

    def attach(self, model) -> "LoRA":
        """Make ``model`` run with these adapters (and train only them)."""
        model.lora = self
        return self

    # --- the model's hooks -------------------------------------------------------------------
    def forward(self, key: str, x, w):
        """The targeted linear ``key`` (its base weight ``w``) on x (..., in): (y, ctx)."""
        a, b = self.targets[key]
        drop = None
        p = float(self.lc.dropout)
        if self.training and p > 0:
            keep = self.rng.random(x.shape) >= p
            drop = self.backend.asarray(keep / (1.0 - p), dtype=x.dtype)
        return self.backend.lora_forward(x, w, self.params[a], self.params[b], self.lc.scale,
                                         drop)

    def backward(self, key: str, dy, ctx, grads):
        """dy (..., out) -> dx (..., in); sets the gradients of ``key``'s A and B in ``grads``."""
        a, b = self.targets[key]
        dx, grads[a], grads[b] = self.backend.lora_backward(dy, ctx)
        return dx

    # --- merging -----------------------------------------------------------------------------
    def merged(self, params: dict[str, Any]) -> dict[str, np.ndarray]:
        """Host copies of ``params`` with every targeted W replaced by W + s B A."""
        out = {k: np.array(self.backend.to_numpy(v)) for k, v in params.items()}
        for key, (a, b) in self.targets.items():
            A = self.backend.to_numpy(self.params[a]).astype(np.float64)
            B = self.backend.to_numpy(self.params[b]).astype(np.float64)
            out[key] = (out[key] + self.lc.scale * (B @ A)).astype(out[key].dtype)
        return out

    # --- PEFT files --------------------------------------------------------------------------
    def peft_tensors(self) -> dict[str, np.ndarray]:
        """The adapters under PEFT's names, B of q/k rows in the HF (half-split RoPE) order."""
        from minillama.io.hf import interleaved_to_hf

        out = {}
        for key, (a, b) in self.targets.items():
            _, layer, sub = key.split(".", 2)
            short = next(t for t, (w, _) in TARGETS.items() if w + ".weight" == sub)
            A = np.ascontiguousarray(self.backend.to_numpy(self.params[a]), dtype=np.float32)
            B = np.ascontiguousarray(self.backend.to_numpy(self.params[b]), dtype=np.float32)
            if short in ("q", "k"):
                B = interleaved_to_hf(B, self.cfg.n_heads if short == "q" else self.cfg.n_kv_heads)
            base = f"{PEFT_PREFIX}{layer}.{TARGETS[short][1]}"
            out[base + ".lora_A.weight"], out[base + ".lora_B.weight"] = A, B
        return out

    def save_peft(self, folder, base_model: str | None = None) -> Path:
        """Write ``adapter_config.json`` and ``adapter_model.safetensors`` into ``folder``
        (atomically each)."""
        from safetensors.numpy import save_file  # noqa: PLC0415

        from minillama.io.checkpoint import atomic_write, check_output_dir

        d = check_output_dir(folder, "adapter folder")
        d.mkdir(parents=True, exist_ok=True)
        lc = self.lc
        conf = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lc.rank,
                "lora_alpha": lc.alpha, "lora_dropout": lc.dropout, "use_rslora": lc.rslora,
                "target_modules": sorted(TARGETS[t][1].split(".")[-1] for t in lc.targets),
                "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
                "modules_to_save": None, "init_lora_weights": True,
                "base_model_name_or_path": base_model}
        tensors = self.peft_tensors()
        atomic_write(d / ADAPTER_WEIGHTS, lambda t: save_file(tensors, t, metadata={"format": "pt"}),
                     "adapter weights")
        atomic_write(d / ADAPTER_CONFIG, lambda t: Path(t).write_text(json.dumps(conf, indent=2)),
                     "adapter config")
        return d


def read_peft_config(folder) -> LoRAConfig:
    """The :class:`LoRAConfig` of a PEFT adapter folder (LoRA adapters of a llama-like model)."""
    d = Path(folder)
    path = d / ADAPTER_CONFIG
    if not path.is_file():
        raise MinillamaError(f"{d} is not an adapter folder (no {ADAPTER_CONFIG})")
    try:
        c = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise MinillamaError(f"corrupt {path}: {str(e).splitlines()[0][:100]}") from None
    if not isinstance(c, dict) or c.get("peft_type", "LORA") != "LORA":
        raise MinillamaError(f"{path}: only LoRA adapters are read (peft_type "
                             f"{c.get('peft_type') if isinstance(c, dict) else None!r})")
    mods = c.get("target_modules")
    if isinstance(mods, str) or not isinstance(mods, list):
        raise MinillamaError(f"{path}: target_modules must be a list of module names")
    unknown = [m for m in mods if m not in _BY_PEFT]
    if unknown:
        raise MinillamaError(f"{path}: target module {unknown[0]!r} is not a llama linear "
                             f"({', '.join(_BY_PEFT)})")
    for key in ("modules_to_save",):
        if c.get(key):
            raise MinillamaError(f"{path}: {key} is not supported")
    if c.get("bias", "none") != "none" or c.get("fan_in_fan_out"):
        raise MinillamaError(f"{path}: bias={c.get('bias')!r} / fan_in_fan_out adapters are not "
                             f"supported")
    if c.get("rank_pattern") or c.get("alpha_pattern") or c.get("use_dora"):
        raise MinillamaError(f"{path}: rank/alpha patterns and DoRA are not supported")
    lc = LoRAConfig(rank=c.get("r"), alpha=c.get("lora_alpha"),
                    targets=tuple(t for t in TARGETS if TARGETS[t][1].split(".")[-1] in mods),
                    dropout=float(c.get("lora_dropout") or 0.0), rslora=bool(c.get("use_rslora")))
    lc.validate()
    return lc


def load_peft(model, folder) -> LoRA:
    """The adapters of a PEFT folder as a :class:`LoRA` for ``model`` (not yet attached)."""
    from minillama.io.checkpoint import read_safetensors
    from minillama.io.hf import hf_to_interleaved

    d = Path(folder)
    lc = read_peft_config(d)
    if not (d / ADAPTER_WEIGHTS).is_file():
        raise MinillamaError(f"{d} has no {ADAPTER_WEIGHTS}")
    tensors, _ = read_safetensors(d / ADAPTER_WEIGHTS)
    params = {}
    for name, arr in tensors.items():
        rest = name.removeprefix(PEFT_PREFIX)
        parts = rest.split(".")
        if rest == name or len(parts) != 5 or not parts[0].isdigit() \
                or parts[2] not in _BY_PEFT or parts[3] not in ("lora_A", "lora_B") \
                or parts[4] != "weight":
            raise MinillamaError(f"unexpected tensor {name[:100]} in {d / ADAPTER_WEIGHTS}")
        short = _BY_PEFT[parts[2]]
        if parts[3] == "lora_B" and short in ("q", "k") and arr.ndim == 2:
            heads = model.cfg.n_heads if short == "q" else model.cfg.n_kv_heads
            if arr.shape[0] % heads == 0:
                arr = hf_to_interleaved(arr, heads)
        params[f"layers.{int(parts[0])}.{TARGETS[short][0]}.{parts[3]}"] = arr
    if not all(np.isfinite(v).all() for v in params.values()):
        raise MinillamaError(f"{d / ADAPTER_WEIGHTS} holds NaN/inf values")
    return LoRA(model, lc, params=params)


def apply_adapter(model, folder) -> LoRA:
    """Merge the PEFT adapter in ``folder`` into ``model``'s weights in place (W <- W + s B A):
    the model then runs every backend's fast paths with the adapter's outputs. Over weights kept
    in GGML blocks (a quantized GGUF base) the adapter stays attached instead, so the base stays
    quantized: each targeted layer adds s (x A^T) B^T to its quantized product."""
    from minillama.core.quant import QuantMatrix

    lora = load_peft(model, folder)
    if any(isinstance(model.params[k], QuantMatrix) for k in lora.targets):
        return lora.attach(model)
    for key, w in lora.merged(model.params).items():
        if key in lora.targets:
            model.params[key] = model.backend.asarray(w, dtype=model.dtype)
    return lora
