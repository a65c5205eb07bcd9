r"""LoRA adapters on disk as PEFT writes them: ``adapter_config.json`` and
``adapter_model.safetensors``.

Tensor names are PEFT's (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), so
``peft.PeftModel.from_pretrained`` loads an adapter :func:`save_peft` wrote on the Hugging Face
base, and :func:`load_peft` reads the adapters PEFT trained. The rows of B for W_q and W_k follow
the base weights through the HF-to-interleaved RoPE permutation (docs/MATH.md 4).
:func:`apply_adapter` is what ``--adapter`` does: the adapter merged into the weights, or kept
attached over a quantized base. The adapters themselves are :class:`minillama.model.lora.LoRA`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from minillama.core.errors import MinillamaError
from minillama.core.quant import QuantMatrix
from minillama.io.checkpoint import atomic_write, check_output_dir, read_safetensors
from minillama.io.hf import hf_to_interleaved, interleaved_to_hf
from minillama.model.lora import TARGETS, LoRA, LoRAConfig

#: PEFT / transformers module name (``q_proj``) -> short target name (``q``)
_BY_PEFT = {peft.split(".")[-1]: short for short, (_, peft) in TARGETS.items()}
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model.model.layers."


def peft_tensors(lora: LoRA) -> dict[str, np.ndarray]:
    """The adapters of ``lora`` under PEFT's names, B of q/k rows in the HF (half-split RoPE)
    order."""
    out = {}
    for key, (a, b) in lora.targets.items():
        _, layer, sub = key.split(".", 2)
        short = next(t for t, (w, _) in TARGETS.items() if w + ".weight" == sub)
        A = np.ascontiguousarray(lora.backend.to_numpy(lora.params[a]), dtype=np.float32)
        B = np.ascontiguousarray(lora.backend.to_numpy(lora.params[b]), dtype=np.float32)
        if short in ("q", "k"):
            B = interleaved_to_hf(B, lora.cfg.n_heads if short == "q" else lora.cfg.n_kv_heads)
        base = f"{PEFT_PREFIX}{layer}.{TARGETS[short][1]}"
        out[base + ".lora_A.weight"], out[base + ".lora_B.weight"] = A, B
    return out


def save_peft(lora: LoRA, folder, base_model: str | None = None) -> Path:
    """Write the adapters of ``lora`` into ``folder`` as ``adapter_config.json`` and
    ``adapter_model.safetensors`` (atomically each)."""
    d = check_output_dir(folder, "adapter folder")
    d.mkdir(parents=True, exist_ok=True)
    lc = lora.lc
    conf = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lc.rank,
            "lora_alpha": lc.alpha, "lora_dropout": lc.dropout, "use_rslora": lc.rslora,
            "target_modules": sorted(TARGETS[t][1].split(".")[-1] for t in lc.targets),
            "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
            "modules_to_save": None, "init_lora_weights": True,
            "base_model_name_or_path": base_model}
    tensors = peft_tensors(lora)
    atomic_write(d / ADAPTER_WEIGHTS, lambda t: save_file(tensors, t, metadata={"format": "pt"}),
                 "adapter weights")
    atomic_write(d / ADAPTER_CONFIG, lambda t: Path(t).write_text(json.dumps(conf, indent=2)),
                 "adapter config")
    return d


def read_peft_config(folder) -> LoRAConfig:
    """The :class:`~minillama.model.lora.LoRAConfig` of a PEFT adapter folder (LoRA adapters of a
    llama-like model)."""
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
    """The adapters of a PEFT folder as a :class:`~minillama.model.lora.LoRA` for ``model`` (not
    yet attached)."""
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
    lora = load_peft(model, folder)
    if any(isinstance(model.params[k], QuantMatrix) for k in lora.targets):
        return lora.attach(model)
    for key, w in lora.merged(model.params).items():
        if key in lora.targets:
            model.params[key] = model.backend.asarray(w, dtype=model.dtype)
    return lora
