r"""RoPE's frequencies and cos/sin tables (Su et al., 2021), with the context-extension scalings
of transformers' ``rope_type`` (linear, dynamic NTK, Llama 3.1's bands, YaRN) and llama.cpp's
frequency factors. The rotation itself, forward and backward, is in :mod:`minillama.core.ops`
(:func:`~minillama.core.ops.rope_forward`), which re-exports these two builders."""

from __future__ import annotations

import math

import numpy as np

from minillama.core.errors import MinillamaError


def rope_frequencies(head_dim: int, theta: float = 10000.0, scaling: dict | None = None,
                     seq_len: int | None = None):
    r"""RoPE's per-pair frequencies \theta_i (i < hd/2) and the attention factor \mathrm{mscale},
    in float64. The argument ``theta`` is the base (the config's ``rope_theta``), written
    \mathrm{base} here as in docs/MATH.md; \theta_i are the frequencies.

    Plain RoPE: \theta_i = \mathrm{base}^{-2i/hd}, \mathrm{mscale} = 1. The scalings of
    ``scaling["rope_type"]`` (transformers' names; s = ``factor``,
    L_0 = ``original_max_position_embeddings``; \theta'_i the scaled frequencies):

    * ``linear`` (position interpolation): \theta'_i = \theta_i / s.
    * ``dynamic`` (NTK-aware, for a sequence of S = \max(\mathrm{seq\_len}, L_0) positions): the
      base grows, \mathrm{base}' = \mathrm{base} (s S / L_0 - (s - 1))^{hd / (hd - 2)}, and
      \theta'_i = \mathrm{base}'^{-2i/hd}.
    * ``llama3`` (Llama 3.1's bands, with wavelength \Lambda_i = 2\pi / \theta_i and factors
      low < high): \theta_i if \Lambda_i < L_0 / high; \theta_i / s if \Lambda_i > L_0 / low;
      between them (1 - \gamma_i) \theta_i / s + \gamma_i \theta_i with
      \gamma_i = (L_0 / \Lambda_i - low) / (high - low).
    * ``yarn``: \theta'_i = (1 - \gamma_i) \theta_i / s + \gamma_i \theta_i with the ramp
      \gamma_i = 1 - \mathrm{clip}((i - i_{lo}) / (i_{hi} - i_{lo}), 0, 1) between the pair
      indices where the pair turns \beta_{fast} = 32 and \beta_{slow} = 1 times over L_0
      (\mathrm{pair}(n_{rot}) = hd \ln(L_0 / (2\pi n_{rot})) / (2 \ln \mathrm{base}),
      i_{lo} = \lfloor \mathrm{pair}(\beta_{fast}) \rfloor, i_{hi} = \lceil
      \mathrm{pair}(\beta_{slow}) \rceil);
      \mathrm{mscale} = 0.1 \ln s + 1 (or ``attention_factor``).
    * ``freq_factors`` (llama.cpp's ``rope_freqs`` tensor ff: (hd/2,)): \theta'_i = \theta_i / ff_i.

    Returns (\theta': (hd/2,) float64, \mathrm{mscale}: float). cos/sin tables are built from them
    by :func:`rope_tables` (multiplied by \mathrm{mscale}, so q \cdot k gains \mathrm{mscale}^2).
    """
    if head_dim % 2:
        raise MinillamaError(f"RoPE needs an even head dimension, got {head_dim}")
    expo = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim  # 2i / hd
    inv_freq = theta ** -expo
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "dynamic":
        s, L0 = scaling["factor"], scaling["original_max_position_embeddings"]
        L = max(seq_len or L0, L0)
        return (theta * (s * L / L0 - (s - 1.0)) ** (head_dim / (head_dim - 2))) ** -expo, 1.0
    if kind == "llama3":
        return _rope_llama3(inv_freq, scaling), 1.0
    if kind == "freq_factors":
        return inv_freq / np.asarray(scaling["factors"], dtype=np.float64), 1.0
    if kind == "yarn":
        return _rope_yarn(inv_freq, head_dim, theta, scaling)
    raise MinillamaError(f"rope scaling type {kind!r} is not supported")


def _rope_llama3(inv_freq, scaling):
    """Llama 3.1's frequency bands (see :func:`rope_frequencies`)."""
    s, L0 = scaling["factor"], scaling["original_max_position_embeddings"]
    lo, hi = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    gamma = (L0 / wavelen - lo) / (hi - lo)
    mid = (1 - gamma) * inv_freq / s + gamma * inv_freq
    out = np.where(wavelen > L0 / lo, inv_freq / s, mid)
    return np.where(wavelen < L0 / hi, inv_freq, out)


def _rope_yarn(inv_freq, hd: int, theta: float, scaling):
    r"""YaRN's ramp \gamma_i (``keep``) between interpolated and original frequencies, and its
    attention factor \mathrm{mscale} (``a``; see :func:`rope_frequencies`)."""
    s, L0 = scaling["factor"], scaling["original_max_position_embeddings"]

    def pair_index(n_rot):  # the pair that turns n_rot times over L0
        return hd * math.log(L0 / (n_rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = (pair_index(scaling.get("beta_fast") or 32),
                 pair_index(scaling.get("beta_slow") or 1))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, hd - 1)
    high = high + 0.001 if low == high else high
    keep = 1.0 - np.clip((np.arange(hd // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    a = scaling.get("attention_factor")
    if a is None:
        def mscale(m=1.0):
            return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        a = mscale(m) / mscale(m_all) if m and m_all else mscale()
    return inv_freq / s * (1 - keep) + inv_freq * keep, float(a)


def rope_tables(head_dim: int, max_seq_len: int, theta: float = 10000.0, dtype=np.float32, xp=np,
                scaling: dict | None = None, seq_len: int | None = None):
    r"""The cos/sin tables of RoPE: \varphi_{m,i} = m \theta_i with \theta_i from
    :func:`rope_frequencies` (plain: \theta_i = \mathrm{base}^{-2i/hd}, \mathrm{base} = ``theta``),
    each entry times the scaling's attention factor (1 unless yarn):
    \mathrm{mscale} \cos \varphi_{m,i}, \mathrm{mscale} \sin \varphi_{m,i}.

    Computed in float64 and cast to ``dtype``. ``seq_len`` is the sequence length a dynamic
    scaling adapts to. Returns (cos, sin), each (max_seq_len, hd/2).
    """
    inv_freq, a = rope_frequencies(head_dim, theta, scaling, seq_len)
    angles = np.outer(np.arange(max_seq_len, dtype=np.float64), inv_freq)
    return (xp.asarray(a * np.cos(angles), dtype=dtype),
            xp.asarray(a * np.sin(angles), dtype=dtype))
