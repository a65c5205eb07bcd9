r"""The LLaMA decoder: parameters, forward pass and the hand-written backward pass, in one module.

The model is a stack of pre-norm residual blocks (Touvron et al., 2023):

    h_0 = E_{\mathrm{tok}}
    h'_l = h_{l-1} + \mathrm{Attn}(\mathrm{RMSNorm}(h_{l-1}; g^{att}_l))
    h_l = h'_l + (\mathrm{silu}(\hat{h} W_1^T) \odot \hat{h} W_3^T) W_2^T,  \hat{h} =
    \mathrm{RMSNorm}(h'_l; g^{ffn}_l)
    z = \mathrm{RMSNorm}(h_L; g) W_{out}^T          (W_{out} = E when the head is tied)

(rows: every vector is a row and a linear layer is x W^T, as in docs/MATH.md).

The module reads top to bottom as docs/MATH.md part I does: the parameters (names, shapes,
initialisation, checks), the values each piece's forward keeps for its backward (named tuples:
:class:`AttentionState`, :class:`FFNState`, :class:`BlockState`, :class:`HeadState`), then
:class:`Transformer`: its inputs (token checks, positions, RoPE rows), the forward in the order
of the math (embedding; per block norm, attention with RoPE, grouped KV heads and the KV cache,
residual, norm, SwiGLU FFN, residual; final norm and head), then the backward, the same pieces
in reverse, and last the notes' variants (docs/MATH.md part II), each reached from one dispatch
in the LLaMA piece it replaces.

Every op is called through the backend (``self.backend.<op>_forward``), so one wiring serves NumPy,
Numba and CuPy. :meth:`Transformer.loss_and_grads` runs the forward keeping each op's ``ctx``, then
walks the layers in reverse calling the matching ``<op>_backward``.

The config's variants (docs/MATH.md part II) swap single pieces, defaults being LLaMA's:
``norm`` (RMSNorm | LayerNorm), ``norm_position`` (pre | post: h' = Norm(h + Attn(h))),
``pos_encoding`` (RoPE | sinusoidal E^{pos} added to \sqrt{D} E_{tok} | none), ``ffn`` (SwiGLU |
GELU | ReLU two-matrix) and ``logit_scale`` s (z = s Norm(h_L) W_out^T).

LoRA adapters (:mod:`minillama.model.lora`) enter at the linear layers (:meth:`Transformer._proj`)
and freeze the rest; gradient checkpointing (:mod:`minillama.model.recompute`) and packed rows
(:mod:`minillama.model.packing`) keep their own modules, which the forward calls.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from minillama.backends import get_backend
from minillama.core import ops
from minillama.core.config import ModelConfig, param_shapes
from minillama.core.errors import MinillamaError
from minillama.core.notes_ops import sinusoidal_positions
from minillama.core.ops import rope_tables
from minillama.core.quant import QuantMatrix
from minillama.model import packing, recompute
from minillama.model.kvcache import KVCache, kv_storage_dtype


# ---------------------------------------------------------------------------------------------
# the parameters
# ---------------------------------------------------------------------------------------------
def init_params(cfg: ModelConfig, seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    r"""Random initial parameters (NumPy, host memory).

    Matrices ~ N(0, 0.02^2); the residual output projections wo and w2 ~ N(0, (0.02/\sqrt{2L})^2)
    so that the residual stream's variance does not grow with depth (GPT-2's scaled init, also used
    by llama2.c's training code); norm gains are ones; biases zeros.
    """
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith("norm.weight"):
            params[name] = np.ones(shape, dtype=dtype)
            continue
        if name.endswith(".bias"):
            params[name] = np.zeros(shape, dtype=dtype)
            continue
        std = 0.02
        if name.endswith(("wo.weight", "w2.weight")):
            std = 0.02 / np.sqrt(2 * cfg.n_layers)
        params[name] = rng.normal(0.0, std, size=shape).astype(dtype)
    return params


def check_params(cfg: ModelConfig, params: dict[str, Any]) -> None:
    """Raise :class:`MinillamaError` unless ``params`` has exactly the names and shapes of
    ``cfg``."""
    shapes = param_shapes(cfg)
    missing = [k for k in shapes if k not in params]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise MinillamaError(f"missing parameter(s): {', '.join(missing[:3])}{more}")
    extra = [k for k in params if k not in shapes]
    if extra:
        raise MinillamaError(f"unexpected parameter(s) for this config: {', '.join(extra[:3])}")
    for k, shape in shapes.items():
        got = tuple(params[k].shape)
        if got != shape:
            raise MinillamaError(f"parameter {k} has shape {got}, expected {shape} for this config")


# ---------------------------------------------------------------------------------------------
# what a forward keeps for its backward (each field the ctx of one op, opaque to the model)
# ---------------------------------------------------------------------------------------------
class AttentionState(NamedTuple):
    """The attention sublayer's saved values: the q, k, v projections', RoPE's on q and k (None
    without RoPE), the attention pair's backward with its ctx, and the output projection's."""

    wq: Any
    wk: Any
    wv: Any
    rope_q: Any
    rope_k: Any
    attention_backward: Callable
    attention: Any
    wo: Any


class FFNState(NamedTuple):
    """The FFN sublayer's saved values: W_1's, W_3's (None for a two-matrix FFN), the gate's
    (SwiGLU, or the GELU / ReLU activation) and W_2's."""

    w1: Any
    w3: Any
    gate: Any
    w2: Any


class BlockState(NamedTuple):
    """One residual block's saved values: its two norms' and its two sublayers'."""

    attention_norm: Any
    attention: AttentionState
    ffn_norm: Any
    ffn: FFNState


class HeadState(NamedTuple):
    """The head's saved values: the final norm's, the output projection's and the logit
    scale's (None when the scale is 1)."""

    norm: Any
    output: Any
    logit_scale: Any


class Transformer:
    """A LLaMA decoder bound to a backend.

    ``params`` maps names (see :func:`param_shapes`) to arrays; missing, extra or misshapen ones
    are a clear error. Without ``params`` the weights come from :func:`init_params` with ``seed``.
    ``dtype`` (default: that of the given params, else float32) is the compute precision.

    Reading order: :meth:`forward` / :meth:`loss_and_grads` call :meth:`_run`, which is
    :meth:`_embed`, one :meth:`_block_forward` per layer (:meth:`_norm`,
    :meth:`_attention_sublayer`, :meth:`_norm`, :meth:`_ffn_sublayer`) and :meth:`_head`. The
    backward visits the same pieces in reverse: :meth:`_head_backward`, :meth:`_block_backward`
    per layer from the last (:meth:`_ffn_sublayer_backward` then
    :meth:`_attention_sublayer_backward`, each with its :meth:`_norm_backward`) and
    :meth:`_embed_backward`. The notes' variants come last: :meth:`_postnorm_block_forward` and
    :meth:`_mlp_sublayer` with their backwards; LayerNorm, sinusoidal positions and the logit
    scale are one dispatch each in :meth:`_norm`, :meth:`_embed` and :meth:`_head`.
    """

    def __init__(self, cfg: ModelConfig, params: dict[str, Any] | None = None, backend=None,
                 dtype=None, seed: int = 0):
        cfg.validate()
        self.cfg = cfg
        self.backend = get_backend(backend)
        xp = self.backend.xp
        if params is None:
            params = init_params(cfg, seed=seed, dtype=np.dtype(dtype or np.float32))
        check_params(cfg, params)
        if dtype is None:  # that of the embedding; float32 for a quantized one (a QuantMatrix)
            dtype = getattr(params["tok_embeddings.weight"], "dtype", np.float32)
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.float32, np.float64):
            raise MinillamaError(f"compute dtype must be float32 or float64, got {self.dtype}")
        self.params = {k: self.backend.asarray(v, dtype=self.dtype) for k, v in params.items()}
        #: LoRA adapters (:class:`minillama.model.lora.LoRA`): when set, the targeted linears add
        #: their adapter and :meth:`loss_and_grads` returns the adapters' gradients only
        self.lora = None
        #: the KV caches' storage: "auto", "f32" or "f16" (:attr:`kv_dtype`)
        self.kv_cache = "auto"
        #: gradient checkpointing; the packed rows of a call given ``segments`` (while it runs)
        self.recompute, self.segments = False, None
        if cfg.pos_encoding == "rope":
            self.cos, self.sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta,
                                             self.dtype, xp, cfg.rope_scaling)
        if cfg.pos_encoding == "sinusoidal":
            self.pos_table = sinusoidal_positions(cfg.max_seq_len, cfg.dim, dtype=self.dtype, xp=xp)

    @property
    def output_weight(self):
        """The classifier matrix (V, D): ``output.weight``, or the embedding when tied."""
        key = "tok_embeddings.weight" if self.cfg.tie_embeddings else "output.weight"
        return self.params[key]

    @property
    def kv_dtype(self) -> np.dtype:
        """The dtype its KV caches store K and V in, by :attr:`kv_cache` ("auto", "f32" or
        "f16"; :func:`~minillama.model.kvcache.kv_storage_dtype`)."""
        blocks = any(isinstance(v, QuantMatrix) for k, v in self.params.items()
                     if k.startswith("layers."))
        return kv_storage_dtype(self.kv_cache, self.dtype, blocks, self.backend)

    def new_cache(self, batch_size: int, max_seq_len: int | None = None) -> KVCache:
        """An empty KV cache for this model on its backend, of :attr:`kv_dtype`."""
        return KVCache(self.cfg, batch_size, max_seq_len, dtype=self.kv_dtype,
                       xp=self.backend.xp)

    def reusable_rows(self, prompt_len: int, positions: int) -> int:
        """How many leading K/V rows of a cache row that holds a prompt of ``prompt_len`` tokens
        (prefilled) and then tokens fed by decode steps up to ``positions`` a later prompt with
        the same first ids may keep as its prefix.

        Where the backend computes prompt rows alike whatever their count but decode steps in
        another order (numba on GGML blocks: :func:`_rows_alike`), only the rows the prompt's
        prefill wrote (:func:`_prompt_then_step`): a kept row computed by a decode step would
        give the later prompt other logits than a cold prefill of it. Elsewhere every
        position."""
        if self.decode_rows_differ:
            # a one-token prompt is a decode step: its row is no prefill's
            return min(int(positions), int(prompt_len)) if prompt_len >= 2 else 0
        return int(positions)

    def prefill_start(self, common: int, prompt_len: int, keep_last: bool = False) -> int:
        """Where the prefill of a prompt of ``prompt_len`` tokens starts when its first
        ``common`` ids' K/V rows are cached (:meth:`reusable_rows`): at most one token before its
        end, so that its last logits are computed. Where :attr:`decode_rows_differ`, at most two
        (a call of one token with a cache is a decode step, whose row is no prefill's), except
        with ``keep_last`` when the cache holds every row of the prompt: then one, the caller
        keeping that last row (:meth:`~minillama.model.kvcache.KVCache.kept`) while the decode
        step gives its logits, as a cold prefill does."""
        if not self.decode_rows_differ:
            return max(0, min(int(common), int(prompt_len) - 1))
        if keep_last and common >= prompt_len:
            return int(prompt_len) - 1
        return max(0, min(int(common), int(prompt_len) - 2))

    @property
    def decode_rows_differ(self) -> bool:
        """Whether the backend computes a prompt's rows alike whatever their count, in another
        order than its decode steps (:func:`_rows_alike` and not the backend's
        ``prefill_decode_invariant``; numba on a model with a layer of a type without an integer
        kernel): then a cache row a decode step wrote is no prefill's. On the types of numba's
        integer GEMM the two agree bit for bit and every row may be kept."""
        return _rows_alike(self) and not self.backend.prefill_decode_invariant(self)

    # ========================================================================================
    # the inputs: token and target arrays, positions in the context and the RoPE rows at them
    # ========================================================================================
    def _tokens(self, tokens):
        """``tokens`` as a checked (B, T) NumPy integer array with ids in [0, V)."""
        tok = np.asarray(self.backend.to_numpy(tokens) if not isinstance(tokens, (list, tuple))
                         else tokens)
        if tok.ndim == 1:
            tok = tok[None, :]
        if tok.ndim != 2 or tok.shape[1] == 0:
            raise MinillamaError(f"tokens must be a non-empty (B, T) integer array, got shape "
                                 f"{tok.shape}")
        if not np.issubdtype(tok.dtype, np.integer):
            raise MinillamaError(f"tokens must be integers, got dtype {tok.dtype}")
        if tok.size and (tok.min() < 0 or tok.max() >= self.cfg.vocab_size):
            raise MinillamaError(
                f"token ids must lie in [0, {self.cfg.vocab_size}), got min {tok.min()} "
                f"max {tok.max()}")
        return tok

    def _targets(self, targets, shape):
        """``targets`` as a (B, T) NumPy array shaped like the tokens."""
        tgt = np.asarray(self.backend.to_numpy(targets) if not isinstance(targets, (list, tuple))
                         else targets)
        if tgt.ndim == 1:
            tgt = tgt[None, :]
        if tgt.shape != shape:
            raise MinillamaError(f"targets shape {tgt.shape} != tokens shape {shape}")
        return tgt

    def _rope_table(self, end: int):
        """The (cos, sin) tables for a forward whose furthest position is end - 1: the fixed ones,
        or for a ``dynamic`` RoPE scaling past its original length, ones rebuilt for ``end``
        positions (as transformers does for the longest position of the batch)."""
        sc = self.cfg.rope_scaling
        if not sc or sc["rope_type"] != "dynamic" or end <= sc["original_max_position_embeddings"]:
            return self.cos, self.sin
        return rope_tables(self.cfg.head_dim, end, self.cfg.rope_theta, self.dtype,
                           self.backend.xp, sc, seq_len=end)

    def _positions(self, start_pos, T: int):
        """Positions start_pos .. start_pos + T - 1, checked against the context: a slice (one
        start for the batch) or a (B, T) index array (one start per sequence; for packed rows,
        restarting per example: :mod:`minillama.model.packing`)."""
        if self.segments is not None:
            return packing.positions(self)
        if np.ndim(start_pos) == 0:
            s = int(start_pos)
            if s < 0 or s + T > self.cfg.max_seq_len:
                raise MinillamaError(f"positions {s}..{s + T - 1} exceed the model context of "
                                     f"{self.cfg.max_seq_len}")
            return slice(s, s + T)
        starts = np.asarray(start_pos, dtype=np.int64).reshape(-1)
        if starts.min() < 0 or starts.max() + T > self.cfg.max_seq_len:
            raise MinillamaError(
                f"positions up to {starts.max() + T - 1} exceed the model context of "
                f"{self.cfg.max_seq_len}")
        return self.backend.asarray(starts[:, None] + np.arange(T)[None, :])

    def _rope_at(self, start_pos, T: int):
        """cos/sin gathered at positions start_pos .. start_pos + T - 1: (T, hd/2) or (B, T, hd/2);
        (None, None) when the model has no RoPE (the positions are checked all the same).
        Packed rows take the rows of their restarting positions (:mod:`minillama.model.packing`)."""
        if self.segments is not None:
            return packing.rope_rows(self, T)
        if self.cfg.pos_encoding != "rope":
            self._positions(start_pos, T)
            return None, None
        if np.ndim(start_pos) == 0:
            s = int(start_pos)
            end = s + T
            if s < 0 or end > self.cfg.max_seq_len:
                raise MinillamaError(
                    f"positions {s}..{end - 1} exceed the model context of {self.cfg.max_seq_len}")
            cos, sin = self._rope_table(end)
            return cos[s:end], sin[s:end]
        starts = np.asarray(start_pos, dtype=np.int64).reshape(-1)
        if starts.min() < 0 or starts.max() + T > self.cfg.max_seq_len:
            raise MinillamaError(
                f"positions up to {starts.max() + T - 1} exceed the model context of "
                f"{self.cfg.max_seq_len}")
        cos, sin = self._rope_table(int(starts.max()) + T)
        pos = self.backend.asarray(starts[:, None] + np.arange(T)[None, :])
        return cos[pos], sin[pos]

    # ========================================================================================
    # forward, in the order of docs/MATH.md
    # ========================================================================================
    @packing.takes_segments
    def forward(self, tokens, start_pos=0, cache: KVCache | None = None, last_only: bool = False,
                output_index=None):
        r"""Logits z = f(x) for a (B, T) batch of token ids: (B, T, V).

        ``start_pos`` (int or (B,) ints) is the absolute position of the first token; with a
        ``cache`` the new K/V are written there and attention reads positions 0..start_pos+t.
        ``last_only`` returns only the last position's logits, (B, V), skipping the V x D head
        for the others; ``output_index`` ((B,) ints) picks one position per sequence likewise.
        A backend with ``decode_step(model, tok, start_pos, cache)`` may compute a one-token
        cached step in one fused call (same logits; None from it means the per-op path); its
        ``decode_threads(B)`` picks the threads of a per-op one. ``segments`` ((B, T) example
        ids, no cache) runs packed rows (:mod:`minillama.model.packing`).
        """
        tok = self._tokens(tokens)
        step = cache is not None and tok.shape[1] == 1
        if step and self.lora is None:
            logits = self.backend.decode_step(self, tok, start_pos, cache)
            if logits is not None:
                return logits if last_only or output_index is not None else logits[:, None]
        if cache is not None and not step and self.lora is None and (
                last_only or output_index is not None) and _rows_alike(self):
            logits = _prompt_then_step(self, tok, start_pos, cache, None if last_only
                                       else output_index)
            if logits is not None:
                return logits
        if last_only:
            output_index = tok.shape[1] - 1
        with self.backend.decode_threads(tok.shape[0]) if step else contextlib.nullcontext():
            return self._run(tok, start_pos, cache, train=False, output_index=output_index)[0]

    __call__ = forward

    @packing.takes_segments
    def loss(self, tokens, targets, ignore_index: int = -1) -> float:
        """Mean next-token cross-entropy without gradients (no tape kept)."""
        tok = self._tokens(tokens)
        tgt = np.asarray(targets).reshape(tok.shape)
        be = self.backend
        logits, _ = self._run(tok, 0, None, train=False)
        B, T = tok.shape
        loss, _ = be.cross_entropy_forward(logits.reshape(B * T, -1), be.asarray(tgt.reshape(-1)),
                                           ignore_index)
        return float(be.to_numpy(loss))

    def _run(self, tok, start_pos, cache: KVCache | None, train: bool, output_index=None,
             head: bool = True):
        """The forward pass. Returns (logits, tape) where tape holds each piece's ctx when training:
        [embedding ctx, block 0 ctx, ..., block L-1 ctx, head ctx]. ``head=False`` stops after the
        final norm: returns the normalised (B, T, D) and that norm's ctx as the last entry."""
        B, T = tok.shape
        if cache is not None and cache.batch_size != B:
            raise MinillamaError(f"KV cache batch {cache.batch_size} != token batch {B}")
        cos, sin = self._rope_at(start_pos, T)
        x, c_emb = self._embed(tok, start_pos)
        tape: list[Any] = [c_emb]
        for layer in range(self.cfg.n_layers):
            kept = recompute.keep(self, x) if train and self.recompute else None
            x, c_block = self._block_forward(layer, x, cos, sin, cache, start_pos)
            if train:
                tape.append(c_block if kept is None else kept)
        if output_index is not None:
            x = _pick_positions(self.backend, x, output_index)
        if not head:
            hn, c_n = self._norm(x, "norm")
            if train:
                tape.append(c_n)
            return hn, tape
        logits, c_head = self._head(x)
        if train:
            tape.append(c_head)
        return logits, tape

    def _embed(self, tok, start_pos=0):
        r"""h_0 = E_{\mathrm{tok}}: (B, T) ids -> (B, T, D). With sinusoidal positions, as in the
        vanilla transformer, h_0 = \sqrt{D}\, E_{\mathrm{tok}} + E^{pos}_m at the positions m
        (E^{pos} is fixed; without the \sqrt{D} the unit-amplitude E^{pos} drowns embeddings of
        std 0.02). Returns (h_0, ctx)."""
        h, ctx = self.backend.embedding_forward(self.params["tok_embeddings.weight"],
                                                self.backend.asarray(tok))
        h = h.astype(self.dtype, copy=False)  # a quantized table's rows come as float32
        if self.cfg.pos_encoding == "sinusoidal":
            h = h * math.sqrt(self.cfg.dim) + self.pos_table[self._positions(start_pos,
                                                                               tok.shape[1])]
        return h, ctx

    def _block_forward(self, layer: int, x, cos, sin, cache, start_pos):
        """One residual block. Pre-norm (LLaMA): a = x + Attn(Norm(x)), x' = a + FFN(Norm(a)).
        Post-norm (the original transformer): :meth:`_postnorm_block_forward`.

        x: (B, T, D). Returns (x', :class:`BlockState`)."""
        if self.cfg.norm_position == "post":
            return self._postnorm_block_forward(layer, x, cos, sin, cache, start_pos)
        pre = f"layers.{layer}."
        h, c_n1 = self._norm(x, pre + "attention_norm")
        o, c_attn = self._attention_sublayer(layer, h, cos, sin, cache, start_pos)
        x = x + o
        h, c_n2 = self._norm(x, pre + "ffn_norm")
        f, c_ffn = self._ffn_sublayer(layer, h)
        return x + f, BlockState(c_n1, c_attn, c_n2, c_ffn)

    def _norm(self, x, name: str):
        r"""RMSNorm(x; g) or LayerNorm(x; g, b) (``cfg.norm``) with the parameters ``name``.weight
        (and ``name``.bias). x: (..., D). Returns (y, ctx)."""
        be, p, eps = self.backend, self.params, self.cfg.norm_eps
        if self.cfg.norm == "layernorm":
            return be.layernorm_forward(x, p[name + ".weight"], p[name + ".bias"], eps)
        return be.rmsnorm_forward(x, p[name + ".weight"], eps)

    def _attention_sublayer(self, layer: int, h, cos, sin, cache, start_pos):
        r"""\mathrm{Attn}(h) = \mathrm{attn}(\mathrm{RoPE}(h W_q^T), \mathrm{RoPE}(h W_k^T),
        h W_v^T)\, W_o^T (rows; no RoPE when ``cos`` is None), h the block's (pre-norm:
        normalised, \hat{h} in docs/MATH.md) input.

        h: (B, T, D). With a ``cache`` the new K/V are written at ``start_pos`` and attention reads
        every cached position. Returns the branch output (B, T, D) (not yet added to x) and its
        :class:`AttentionState`.
        """
        be, cfg = self.backend, self.cfg
        pre = f"layers.{layer}."
        B, T, _ = h.shape
        H, KVH, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q, c_q = self._proj(pre, "attention.wq", h)
        k, c_k = self._proj(pre, "attention.wk", h)
        v, c_v = self._proj(pre, "attention.wv", h)
        q, k = q.reshape(B, T, H, hd), k.reshape(B, T, KVH, hd)
        c_rq = c_rk = None
        if cos is not None:
            q, c_rq = be.rope_forward(q, cos, sin)  # (B, T, H, hd)
            k, c_rk = be.rope_forward(k, cos, sin)  # (B, T, KVH, hd)
        v = v.reshape(B, T, KVH, hd)
        if cache is not None:
            k, v = cache.update(layer, k, v, start_pos)  # (B, S, KVH, hd)
            k, v, start_pos = self._window_keys(k, v, start_pos)
            if k.dtype != q.dtype:  # a half cache: K, V widened back (exact)
                k, v = k.astype(q.dtype), v.astype(q.dtype)
        att_forward, att_backward = self._attention_ops(k.shape[1])
        a, c_att = att_forward(q, k, v, start_pos)
        o, c_o = self._proj(pre, "attention.wo", a.reshape(B, T, H * hd))
        return o, AttentionState(c_q, c_k, c_v, c_rq, c_rk, att_backward, c_att, c_o)

    def _proj(self, pre: str, name: str, x):
        """One linear layer ``pre + name`` of the block: y = x W^T (+ b when the config has that
        bias); a LoRA adapter on it adds its term. Returns (y, ctx)."""
        be, p, key = self.backend, self.params, pre + name + ".weight"
        if self.lora is not None and key in self.lora.targets:
            y, c_w = self.lora.forward(key, x, p[key])
        else:
            y, c_w = be.linear_forward(x, p[key])
        if pre + name + ".bias" in p:
            y, _ = be.bias_forward(y, p[pre + name + ".bias"])
        return y, c_w

    def _window_keys(self, k, v, start_pos):
        """With a sliding window W and one start position p, only cached keys p - W + 1 onwards
        can be read: drop the older ones (positions shift by the same amount for queries and
        keys, so the mask is unchanged). A decode step then reads W keys, not p + 1."""
        W = self.cfg.sliding_window
        if W is None or np.ndim(start_pos) != 0 or int(start_pos) - W + 1 <= 0:
            return k, v, start_pos
        lo = int(start_pos) - W + 1
        return k[:, lo:], v[:, lo:], int(start_pos) - lo

    def _attention_ops(self, S: int):
        """The attention (forward, backward) pair for S keys: the backend's, or with a sliding
        window that hides some of them, the reference with the window (kernels lack it); packed
        rows the pair with their segment mask (:func:`minillama.model.packing.attention_ops`)."""
        W = self.cfg.sliding_window
        if self.segments is not None:
            return packing.attention_ops(self, S, W if W is not None and S > W else None)
        if W is None or S <= W:
            return self.backend.attention_forward, self.backend.attention_backward
        return (lambda q, k, v, start_pos: ops.attention_forward(q, k, v, start_pos, window=W),
                ops.attention_backward)

    def _ffn_sublayer(self, layer: int, n):
        r"""\mathrm{FFN}(\hat{h}) = (\mathrm{silu}(\hat{h} W_1^T) \odot \hat{h} W_3^T) W_2^T
        (SwiGLU); rows, \hat{h} the normalised input (the argument ``n``). The two-matrix GELU /
        ReLU FFN of ``cfg.ffn``: :meth:`_mlp_sublayer`.

        n: (B, T, D). Returns the branch output (B, T, D) (not yet added to x) and its
        :class:`FFNState`.
        """
        if self.cfg.ffn != "swiglu":
            return self._mlp_sublayer(layer, n)
        be, pre = self.backend, f"layers.{layer}."
        a1, c_1 = self._proj(pre, "feed_forward.w1", n)  # (B, T, F)
        b3, c_3 = self._proj(pre, "feed_forward.w3", n)  # (B, T, F)
        g, c_act = be.swiglu_forward(a1, b3)
        f, c_2 = self._proj(pre, "feed_forward.w2", g)   # (B, T, D)
        return f, FFNState(c_1, c_3, c_act, c_2)

    def _head(self, x):
        r"""z = s\, \mathrm{Norm}(x; g) W_{out}^T (s = ``cfg.logit_scale``, skipped when 1):
        (..., D) -> (..., V). Returns (z, :class:`HeadState`)."""
        be = self.backend
        hn, c_n = self._norm(x, "norm")
        logits, c_out = be.linear_forward(hn, self.output_weight)
        c_s = None
        if self.cfg.logit_scale != 1.0:
            logits, c_s = be.logit_scale_forward(logits, self.cfg.logit_scale)
        return logits, HeadState(c_n, c_out, c_s)

    # ========================================================================================
    # backward, the same pieces in reverse
    # ========================================================================================
    @packing.takes_segments
    def loss_and_grads(self, tokens, targets, ignore_index: int = -1):
        r"""Mean next-token cross-entropy L and \partial L / \partial \theta for every parameter.

        tokens, targets: (B, T) integers (targets equal to ``ignore_index`` do not count).
        Returns (loss as a Python float, grads: dict name -> array shaped like the parameter;
        quantized weights (:class:`~minillama.core.quant.QuantMatrix`) are frozen and have none).
        The backward visits the ops in exactly the reverse order of the forward. Without a logit
        scale the head projection and the loss run as one backend op,
        ``linear_cross_entropy_forward`` (CPU backends never hold the logits and their gradient
        as two (B T, V) arrays). ``segments``: packed rows (:mod:`minillama.model.packing`); with
        ``recompute`` set the forward keeps only block inputs (:mod:`minillama.model.recompute`).
        """
        tok = self._tokens(tokens)
        tgt = self._targets(targets, tok.shape)
        grads: dict[str, Any] = {}
        # numba rounds activations to 8 bits in quantized products, for inference only
        with self.backend.exact_products():
            if self.lora is None:
                loss, grads = self._loss_and_grads(tok, tgt, ignore_index, grads)
                return loss, {k: grads[k] for k in self.params if grads.get(k) is not None}
            self.lora.training = True  # adapter dropout (when configured) in this forward only
            try:
                loss, grads = self._loss_and_grads(tok, tgt, ignore_index, grads)
            finally:
                self.lora.training = False
            return loss, {k: grads[k] for k in self.lora.params}

    def _loss_and_grads(self, tok, tgt, ignore_index, grads):
        """The forward and backward of :meth:`loss_and_grads`: (loss, every gradient formed)."""
        be = self.backend
        B, T = tok.shape
        if self.cfg.logit_scale == 1.0:
            hn, tape = self._run(tok, 0, None, train=True, head=False)
            loss, c_lce = be.linear_cross_entropy_forward(
                hn.reshape(B * T, -1), self.output_weight, be.asarray(tgt.reshape(-1)),
                ignore_index)
            if self.lora is not None:  # the head is frozen: no dW_out
                dhn, dw_out = be.linear_cross_entropy_backward_input(1.0, c_lce), None
            else:
                dhn, dw_out = be.linear_cross_entropy_backward(1.0, c_lce)
            dx = self._norm_backward(dhn.reshape(B, T, -1), tape.pop(), "norm", grads)
        else:
            logits, tape = self._run(tok, 0, None, train=True)
            loss, c_ce = be.cross_entropy_forward(logits.reshape(B * T, -1),
                                                  be.asarray(tgt.reshape(-1)), ignore_index)
            dlogits = be.cross_entropy_backward(1.0, c_ce).reshape(B, T, -1)
            dx, dw_out = self._head_backward(dlogits, tape.pop(), grads)
        cos, sin = self._rope_at(0, T) if self.recompute else (None, None)
        for layer in reversed(range(self.cfg.n_layers)):  # with recompute: rebuild each ctx
            dx = self._block_backward(layer, dx, recompute.rebuild(self, layer, tape.pop(), cos,
                                                                   sin), grads)
        (c_emb,) = tape
        if self.lora is None:  # with adapters the embedding (and a tied head) stay frozen
            self._embed_backward(dx, c_emb, dw_out, grads)
        return float(be.to_numpy(loss)), grads

    def _head_backward(self, dlogits, ctx: HeadState, grads):
        """dz (B, T, V) -> dx (B, T, D); sets the final norm's gradients, returns (dx, dW_out)."""
        if ctx.logit_scale is not None:
            dlogits = self.backend.logit_scale_backward(dlogits, ctx.logit_scale)
        if self.lora is not None:  # a frozen head
            dhn, dw_out = self.backend.linear_backward_input(dlogits, ctx.output), None
        else:
            dhn, dw_out = self.backend.linear_backward(dlogits, ctx.output)
        return self._norm_backward(dhn, ctx.norm, "norm", grads), dw_out

    def _block_backward(self, layer: int, dx, ctx: BlockState, grads):
        """Gradient through one residual block, last sublayer first: dx (B, T, D) -> dx (B, T, D).
        Pre-norm: each residual adds its branch's gradient (through the norm) to the gradient that
        skips it. Post-norm: :meth:`_postnorm_block_backward`."""
        if self.cfg.norm_position == "post":
            return self._postnorm_block_backward(layer, dx, ctx, grads)
        pre = f"layers.{layer}."
        dn = self._ffn_sublayer_backward(layer, dx, ctx.ffn, grads)
        dx += self._norm_backward(dn, ctx.ffn_norm, pre + "ffn_norm", grads)
        dh = self._attention_sublayer_backward(layer, dx, ctx.attention, grads)
        dx += self._norm_backward(dh, ctx.attention_norm, pre + "attention_norm", grads)
        return dx

    def _ffn_sublayer_backward(self, layer: int, df, ctx: FFNState, grads):
        """Gradient of the FFN branch: df (B, T, D) -> d(its input n) (B, T, D); fills the w1, w2
        and w3 gradients of ``layer`` (a two-matrix FFN: :meth:`_mlp_sublayer_backward`)."""
        if self.cfg.ffn != "swiglu":
            return self._mlp_sublayer_backward(layer, df, ctx, grads)
        be, pre = self.backend, f"layers.{layer}."
        dg = self._proj_backward(pre, "feed_forward.w2", df, ctx.w2, grads)
        da1, db3 = be.swiglu_backward(dg, ctx.gate)
        dn = self._proj_backward(pre, "feed_forward.w1", da1, ctx.w1, grads)
        dn3 = self._proj_backward(pre, "feed_forward.w3", db3, ctx.w3, grads)
        dn += dn3  # fresh arrays: the gradient sums are accumulated in place
        return dn

    def _attention_sublayer_backward(self, layer: int, do, ctx: AttentionState, grads):
        """Gradient of the attention branch: do (B, T, D) -> d(its input h) (B, T, D); fills the
        wq, wk, wv and wo gradients of ``layer``."""
        be, cfg, pre = self.backend, self.cfg, f"layers.{layer}."
        B, T, _ = do.shape
        H, KVH, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        da = self._proj_backward(pre, "attention.wo", do, ctx.wo, grads)
        dq, dk, dv = ctx.attention_backward(da.reshape(B, T, H, hd), ctx.attention)
        if ctx.rope_q is not None:
            dq = be.rope_backward(dq, ctx.rope_q)
            dk = be.rope_backward(dk, ctx.rope_k)
        dh = self._proj_backward(pre, "attention.wq", dq.reshape(B, T, H * hd), ctx.wq, grads)
        dhk = self._proj_backward(pre, "attention.wk", dk.reshape(B, T, KVH * hd), ctx.wk, grads)
        dhv = self._proj_backward(pre, "attention.wv", dv.reshape(B, T, KVH * hd), ctx.wv, grads)
        dh += dhk
        dh += dhv
        return dh

    def _proj_backward(self, pre: str, name: str, dy, ctx, grads):
        """Gradient of :meth:`_proj`: dy (..., out) -> dx (..., in); fills its weight (and bias)
        gradients, or with LoRA its adapter's (the base weights are frozen)."""
        if pre + name + ".bias" in self.params:
            grads[pre + name + ".bias"] = self.backend.bias_backward(dy, None)
        key = pre + name + ".weight"
        if self.lora is not None:  # the base weights are frozen: no dW
            if key in self.lora.targets:
                return self.lora.backward(key, dy, ctx, grads)
            return self.backend.linear_backward_input(dy, ctx)
        dx, grads[key] = self.backend.linear_backward(dy, ctx)
        return dx

    def _norm_backward(self, dy, ctx, name: str, grads):
        """Gradient of :meth:`_norm`: returns dx and fills the ``name`` gain (and bias) gradient."""
        be = self.backend
        if self.cfg.norm == "layernorm":
            dx, grads[name + ".weight"], grads[name + ".bias"] = be.layernorm_backward(dy, ctx)
        else:
            dx, grads[name + ".weight"] = be.rmsnorm_backward(dy, ctx)
        return dx

    def _embed_backward(self, dx, ctx, dw_out, grads) -> None:
        r"""Scatter dx (B, T, D) into dE (V, D) (times \sqrt{D} with sinusoidal positions); a tied
        head adds its dW_out to the same matrix."""
        if self.cfg.pos_encoding == "sinusoidal":
            dx = dx * math.sqrt(self.cfg.dim)
        d_emb = self.backend.embedding_backward(dx, ctx)  # None for a quantized (frozen) table
        if self.cfg.tie_embeddings:
            if d_emb is not None:
                d_emb += dw_out  # the tied matrix collects both gradients
        else:
            grads["output.weight"] = dw_out
        grads["tok_embeddings.weight"] = d_emb

    # ========================================================================================
    # the notes' variants (docs/MATH.md part II), each reached from one dispatch above
    # ========================================================================================
    def _postnorm_block_forward(self, layer: int, x, cos, sin, cache, start_pos):
        """The post-norm block (the original transformer): a = Norm(x + Attn(x)),
        x' = Norm(a + FFN(a)). x: (B, T, D). Returns (x', :class:`BlockState`)."""
        pre = f"layers.{layer}."
        o, c_attn = self._attention_sublayer(layer, x, cos, sin, cache, start_pos)
        x, c_n1 = self._norm(x + o, pre + "attention_norm")
        f, c_ffn = self._ffn_sublayer(layer, x)
        x, c_n2 = self._norm(x + f, pre + "ffn_norm")
        return x, BlockState(c_n1, c_attn, c_n2, c_ffn)

    def _postnorm_block_backward(self, layer: int, dx, ctx: BlockState, grads):
        """Gradient through a post-norm block: the gradient first passes the norm, then splits
        over the sum. dx (B, T, D) -> dx (B, T, D)."""
        pre = f"layers.{layer}."
        ds = self._norm_backward(dx, ctx.ffn_norm, pre + "ffn_norm", grads)  # d(a + FFN(a))
        ds += self._ffn_sublayer_backward(layer, ds, ctx.ffn, grads)
        # d(x + Attn(x))
        ds = self._norm_backward(ds, ctx.attention_norm, pre + "attention_norm", grads)
        ds += self._attention_sublayer_backward(layer, ds, ctx.attention, grads)
        return ds

    def _mlp_sublayer(self, layer: int, n):
        r"""The two-matrix FFN \mathrm{act}(\hat{h} W_1^T) W_2^T with \mathrm{act} = GELU or ReLU
        (``cfg.ffn``); rows, \hat{h} the normalised input (the argument ``n``).

        n: (B, T, D). Returns the branch output (B, T, D) and its :class:`FFNState` (no W_3).
        """
        be, pre = self.backend, f"layers.{layer}."
        a1, c_1 = self._proj(pre, "feed_forward.w1", n)  # (B, T, F)
        g, c_act = getattr(be, self.cfg.ffn + "_forward")(a1)
        f, c_2 = self._proj(pre, "feed_forward.w2", g)   # (B, T, D)
        return f, FFNState(c_1, None, c_act, c_2)

    def _mlp_sublayer_backward(self, layer: int, df, ctx: FFNState, grads):
        """Gradient of the two-matrix FFN: df (B, T, D) -> dn (B, T, D); fills the w1 and w2
        gradients of ``layer``."""
        pre = f"layers.{layer}."
        dg = self._proj_backward(pre, "feed_forward.w2", df, ctx.w2, grads)
        da1 = getattr(self.backend, self.cfg.ffn + "_backward")(dg, ctx.gate)
        return self._proj_backward(pre, "feed_forward.w1", da1, ctx.w1, grads)


# ---------------------------------------------------------------------------------------------
# the last position's logits of a cached prompt (Transformer.forward)
# ---------------------------------------------------------------------------------------------
def _pick_positions(be, x, output_index):
    """x[:, i] for one index i, or x[b, i_b] for (B,) indices: (B, T, D) -> (B, D)."""
    idx = np.asarray(output_index, dtype=np.int64).reshape(-1)
    if idx.size == 1:
        return x[:, int(idx[0])]
    return x[be.asarray(np.arange(x.shape[0])), be.asarray(idx)]


def _rows_alike(model) -> bool:
    """Whether ``model``'s backend computes a prompt's rows alike whatever their count
    (``prompt_rows``) and its one-token steps by ``decode_step``."""
    return model.backend.prompt_rows_invariant(model)


def _prompt_then_step(model, tok, start_pos, cache, output_index):
    """A cached prompt as the backend's row-alike prefill of every token (K/V rows only), then
    each sequence's last token by ``decode_step`` for its logits, after which that token's K/V
    rows are put back as the prefill wrote them (where the sequence has two tokens or more
    here: a single one is a decode step's, as alone): the logits (B, V) at ``output_index``
    (default the last column), or None when the step declines. Every cache row a prompt of two
    tokens or more leaves is then a prefill's row, so a cold prompt, one whose prefix came from
    a cache, one prefilled beside others and one cut into chunks end in the same computations:
    their logits and K/V agree bit for bit (the decode step sums in another order than the
    prefill on GGML blocks)."""
    B, T = tok.shape
    idx = np.broadcast_to(np.asarray(T - 1 if output_index is None else output_index,
                                     dtype=np.int64).reshape(-1), (B,))
    with model.backend.prompt_rows():
        model._run(tok, start_pos, cache, train=False, head=False)
    starts = np.broadcast_to(np.asarray(start_pos, dtype=np.int64).reshape(-1), (B,))
    # the last tokens' rows as prefilled, of the sequences given two tokens or more (one token
    # is a decode step, as it is alone)
    b = np.flatnonzero(idx >= 1)
    with cache.kept(b, (starts + idx)[b]):
        return model.backend.decode_step(model, tok[np.arange(B), idx][:, None], starts + idx,
                                         cache)
