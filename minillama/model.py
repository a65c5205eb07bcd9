r"""The LLaMA decoder: parameters, forward pass and the hand-written backward pass.

The model is a stack of pre-norm residual blocks (Touvron et al., 2023):

    h_0 = E[x]
    a_l = h_{l-1} + \mathrm{Attn}(\mathrm{RMSNorm}(h_{l-1}; g^{att}_l))
    h_l = a_l + W_2 (\mathrm{silu}(W_1 n) \odot W_3 n),  n = \mathrm{RMSNorm}(a_l; g^{ffn}_l)
    z = \mathrm{RMSNorm}(h_L; g) W_{out}^T          (W_{out} = E when the head is tied)

Every op is called through the backend (``self.backend.<op>_forward``), so one wiring serves NumPy,
Numba and CuPy. :meth:`Transformer.loss_and_grads` runs the forward keeping each op's ``ctx``, then
walks the layers in reverse calling the matching ``<op>_backward``.

The config's variants (docs/MATH.md part II) swap single pieces, defaults being LLaMA's:
``norm`` (RMSNorm | LayerNorm), ``norm_position`` (pre | post: a = Norm(x + Attn(x))),
``pos_encoding`` (RoPE | sinusoidal P added to \sqrt{D} E[x] | none), ``ffn`` (SwiGLU | GELU |
ReLU two-matrix) and ``logit_scale`` s (z = s Norm(h_L) W_out^T).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .backends import get_backend
from .config import ModelConfig
from .errors import MinillamaError
from .kvcache import KVCache
from . import ops
from .ops import rope_tables, sinusoidal_positions

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


class Transformer:
    """A LLaMA decoder bound to a backend.

    ``params`` maps names (see :func:`param_shapes`) to arrays; missing, extra or misshapen ones
    are a clear error. Without ``params`` the weights come from :func:`init_params` with ``seed``.
    ``dtype`` (default: that of the given params, else float32) is the compute precision.

    Reading order: :meth:`forward` / :meth:`loss_and_grads` call :meth:`_run`, which is
    :meth:`_embed`, one :meth:`_block_forward` per layer (:meth:`_norm`,
    :meth:`_attention_sublayer`, :meth:`_norm`, :meth:`_ffn_sublayer`, in the order of
    ``norm_position``) and :meth:`_head`. The backward visits the same pieces in reverse:
    :meth:`_head_backward`, :meth:`_block_backward` per layer from the last
    (:meth:`_ffn_sublayer_backward` then :meth:`_attention_sublayer_backward`, each with its
    :meth:`_norm_backward`) and :meth:`_embed_backward`.
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
        #: LoRA adapters (:class:`minillama.lora.LoRA`): when set, the targeted linears add their
        #: adapter and :meth:`loss_and_grads` returns the adapters' gradients only
        self.lora = None
        if cfg.pos_encoding == "rope":
            self.cos, self.sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta,
                                             self.dtype, xp, cfg.rope_scaling)
        if cfg.pos_encoding == "sinusoidal":
            self.pos_table = sinusoidal_positions(cfg.max_seq_len, cfg.dim, dtype=self.dtype, xp=xp)

    # ----------------------------------------------------------------------------------------
    # small helpers: the head matrix, caches, input checks, RoPE rows
    # ----------------------------------------------------------------------------------------
    @property
    def output_weight(self):
        """The classifier matrix (V, D): ``output.weight``, or the embedding when tied."""
        key = "tok_embeddings.weight" if self.cfg.tie_embeddings else "output.weight"
        return self.params[key]

    def new_cache(self, batch_size: int, max_seq_len: int | None = None) -> KVCache:
        """An empty KV cache for this model on its backend."""
        return KVCache(self.cfg, batch_size, max_seq_len, dtype=self.dtype, xp=self.backend.xp)

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
        start for the batch) or a (B, T) index array (one start per sequence)."""
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
        (None, None) when the model has no RoPE (the positions are checked all the same)."""
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

    # ----------------------------------------------------------------------------------------
    # forward, piece by piece
    # ----------------------------------------------------------------------------------------
    def _embed(self, tok, start_pos=0):
        r"""h_0 = E[x]: (B, T) ids -> (B, T, D). With sinusoidal positions, as in the vanilla
        transformer, h_0 = \sqrt{D}\, E[x] + P[positions] (P is fixed; without the \sqrt{D} the
        unit-amplitude P drowns embeddings of std 0.02). Returns (h_0, ctx)."""
        h, ctx = self.backend.embedding_forward(self.params["tok_embeddings.weight"],
                                                self.backend.asarray(tok))
        h = h.astype(self.dtype, copy=False)  # a quantized table's rows come as float32
        if self.cfg.pos_encoding == "sinusoidal":
            h = h * math.sqrt(self.cfg.dim) + self.pos_table[self._positions(start_pos,
                                                                               tok.shape[1])]
        return h, ctx

    def _norm(self, x, name: str):
        r"""RMSNorm(x; g) or LayerNorm(x; g, b) (``cfg.norm``) with the parameters ``name``.weight
        (and ``name``.bias). x: (..., D). Returns (y, ctx)."""
        be, p, eps = self.backend, self.params, self.cfg.norm_eps
        if self.cfg.norm == "layernorm":
            return be.layernorm_forward(x, p[name + ".weight"], p[name + ".bias"], eps)
        return be.rmsnorm_forward(x, p[name + ".weight"], eps)

    def _proj(self, pre: str, name: str, x):
        """One linear layer ``pre + name`` of the block: y = x W^T (+ b when the config has that
        bias). Returns (y, ctx)."""
        be, p, key = self.backend, self.params, pre + name + ".weight"
        if self.lora is not None and key in self.lora.targets:
            y, c_w = self.lora.forward(key, x, p[key])
        else:
            y, c_w = be.linear_forward(x, p[key])
        if pre + name + ".bias" in p:
            y, _ = be.bias_forward(y, p[pre + name + ".bias"])
        return y, c_w

    def _proj_backward(self, pre: str, name: str, dy, ctx, grads):
        """Gradient of :meth:`_proj`: dy (..., out) -> dx (..., in); fills its weight (and bias)
        gradients."""
        if pre + name + ".bias" in self.params:
            grads[pre + name + ".bias"] = self.backend.bias_backward(dy, None)
        key = pre + name + ".weight"
        if self.lora is not None:  # the base weights are frozen: no dW
            if key in self.lora.targets:
                return self.lora.backward(key, dy, ctx, grads)
            return self.backend.linear_backward_input(dy, ctx)
        dx, grads[key] = self.backend.linear_backward(dy, ctx)
        return dx

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
        window that hides some of them, the reference with the window (kernels lack it)."""
        W = self.cfg.sliding_window
        if W is None or S <= W:
            return self.backend.attention_forward, self.backend.attention_backward
        return (lambda q, k, v, start_pos: ops.attention_forward(q, k, v, start_pos, window=W),
                ops.attention_backward)

    def _attention_sublayer(self, layer: int, h, cos, sin, cache, start_pos):
        r"""\mathrm{Attn}(h) = W_o\, \mathrm{attn}(\mathrm{RoPE}(W_q h), \mathrm{RoPE}(W_k h), W_v h)
        (no RoPE when ``cos`` is None), h the block's (pre-norm: normalised) input.

        h: (B, T, D). With a ``cache`` the new K/V are written at ``start_pos`` and attention reads
        every cached position. Returns the branch output (B, T, D) (not yet added to x) and ctx.
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
        att_forward, att_backward = self._attention_ops(k.shape[1])
        a, c_att = att_forward(q, k, v, start_pos)
        o, c_o = self._proj(pre, "attention.wo", a.reshape(B, T, H * hd))
        return o, (c_q, c_k, c_v, c_rq, c_rk, (att_backward, c_att), c_o)

    def _ffn_sublayer(self, layer: int, n):
        r"""\mathrm{FFN}(n) = W_2(\mathrm{silu}(W_1 n) \odot W_3 n) (SwiGLU), or the two-matrix
        W_2\, \phi(W_1 n) with \phi = GELU or ReLU (``cfg.ffn``).

        n: (B, T, D). Returns the branch output (B, T, D) (not yet added to x) and ctx.
        """
        be, ffn = self.backend, self.cfg.ffn
        pre = f"layers.{layer}."
        a1, c_1 = self._proj(pre, "feed_forward.w1", n)  # (B, T, F)
        if ffn == "swiglu":
            b3, c_3 = self._proj(pre, "feed_forward.w3", n)  # (B, T, F)
            g, c_act = be.swiglu_forward(a1, b3)
        else:
            c_3 = None
            g, c_act = getattr(be, ffn + "_forward")(a1)
        f, c_2 = self._proj(pre, "feed_forward.w2", g)   # (B, T, D)
        return f, (c_1, c_3, c_act, c_2)

    def _block_forward(self, layer: int, x, cos, sin, cache, start_pos):
        """One residual block. Pre-norm (LLaMA): a = x + Attn(Norm(x)), x' = a + FFN(Norm(a)).
        Post-norm (the original transformer): a = Norm(x + Attn(x)), x' = Norm(a + FFN(a)).

        x: (B, T, D). Returns (x', ctx) with ctx = (norm 1, attention, norm 2, FFN ctx)."""
        pre = f"layers.{layer}."
        if self.cfg.norm_position == "pre":
            h, c_n1 = self._norm(x, pre + "attention_norm")
            o, c_attn = self._attention_sublayer(layer, h, cos, sin, cache, start_pos)
            x = x + o
            h, c_n2 = self._norm(x, pre + "ffn_norm")
            f, c_ffn = self._ffn_sublayer(layer, h)
            return x + f, (c_n1, c_attn, c_n2, c_ffn)
        o, c_attn = self._attention_sublayer(layer, x, cos, sin, cache, start_pos)
        x, c_n1 = self._norm(x + o, pre + "attention_norm")
        f, c_ffn = self._ffn_sublayer(layer, x)
        x, c_n2 = self._norm(x + f, pre + "ffn_norm")
        return x, (c_n1, c_attn, c_n2, c_ffn)

    def _pick_positions(self, x, output_index):
        """x[:, i] for one index i, or x[b, i_b] for (B,) indices: (B, T, D) -> (B, D)."""
        idx = np.asarray(output_index, dtype=np.int64).reshape(-1)
        if idx.size == 1:
            return x[:, int(idx[0])]
        be = self.backend
        return x[be.asarray(np.arange(x.shape[0])), be.asarray(idx)]

    def _head(self, x):
        r"""z = s\, \mathrm{Norm}(x; g) W_{out}^T (s = ``cfg.logit_scale``, skipped when 1):
        (..., D) -> (..., V). Returns (z, ctx)."""
        be = self.backend
        hn, c_n = self._norm(x, "norm")
        logits, c_out = be.linear_forward(hn, self.output_weight)
        c_s = None
        if self.cfg.logit_scale != 1.0:
            logits, c_s = be.logit_scale_forward(logits, self.cfg.logit_scale)
        return logits, (c_n, c_out, c_s)

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
            x, c_block = self._block_forward(layer, x, cos, sin, cache, start_pos)
            if train:
                tape.append(c_block)
        if output_index is not None:
            x = self._pick_positions(x, output_index)
        if not head:
            hn, c_n = self._norm(x, "norm")
            if train:
                tape.append(c_n)
            return hn, tape
        logits, c_head = self._head(x)
        if train:
            tape.append(c_head)
        return logits, tape

    def forward(self, tokens, start_pos=0, cache: KVCache | None = None, last_only: bool = False,
                output_index=None):
        r"""Logits z = f(x) for a (B, T) batch of token ids: (B, T, V).

        ``start_pos`` (int or (B,) ints) is the absolute position of the first token; with a
        ``cache`` the new K/V are written there and attention reads positions 0..start_pos+t.
        ``last_only`` returns only the last position's logits, (B, V), skipping the V x D head
        for the others; ``output_index`` ((B,) ints) picks one position per sequence likewise.
        A backend with ``decode_step(model, tok, start_pos, cache)`` may compute a one-token
        cached step in one fused call (same logits; None from it means the per-op path).
        """
        tok = self._tokens(tokens)
        if cache is not None and tok.shape[1] == 1 and hasattr(self.backend, "decode_step") \
                and self.lora is None:
            # a backend may run a whole one-token cached step in one fused call (numba does)
            logits = self.backend.decode_step(self, tok, start_pos, cache)
            if logits is not None:
                return logits if last_only or output_index is not None else logits[:, None]
        if last_only:
            output_index = tok.shape[1] - 1
        logits, _ = self._run(tok, start_pos, cache, train=False, output_index=output_index)
        return logits

    __call__ = forward

    # ----------------------------------------------------------------------------------------
    # backward, the same pieces in reverse
    # ----------------------------------------------------------------------------------------
    def _norm_backward(self, dy, ctx, name: str, grads):
        """Gradient of :meth:`_norm`: returns dx and fills the ``name`` gain (and bias) gradient."""
        be = self.backend
        if self.cfg.norm == "layernorm":
            dx, grads[name + ".weight"], grads[name + ".bias"] = be.layernorm_backward(dy, ctx)
        else:
            dx, grads[name + ".weight"] = be.rmsnorm_backward(dy, ctx)
        return dx

    def _head_backward(self, dlogits, ctx, grads):
        """dz (B, T, V) -> dx (B, T, D); sets the final norm's gradients, returns (dx, dW_out)."""
        c_n, c_out, c_s = ctx
        if c_s is not None:
            dlogits = self.backend.logit_scale_backward(dlogits, c_s)
        if self.lora is not None:  # a frozen head
            dhn, dw_out = self.backend.linear_backward_input(dlogits, c_out), None
        else:
            dhn, dw_out = self.backend.linear_backward(dlogits, c_out)
        return self._norm_backward(dhn, c_n, "norm", grads), dw_out

    def _ffn_sublayer_backward(self, layer: int, df, ctx, grads):
        """Gradient of the FFN branch: df (B, T, D) -> d(its input n) (B, T, D); fills the w1, w2
        (and w3) gradients of ``layer``."""
        be, pre = self.backend, f"layers.{layer}."
        c_1, c_3, c_act, c_2 = ctx
        dg = self._proj_backward(pre, "feed_forward.w2", df, c_2, grads)
        if c_3 is None:
            da1 = getattr(be, self.cfg.ffn + "_backward")(dg, c_act)
            return self._proj_backward(pre, "feed_forward.w1", da1, c_1, grads)
        da1, db3 = be.swiglu_backward(dg, c_act)
        dn = self._proj_backward(pre, "feed_forward.w1", da1, c_1, grads)
        dn3 = self._proj_backward(pre, "feed_forward.w3", db3, c_3, grads)
        dn += dn3  # fresh arrays: the gradient sums are accumulated in place
        return dn

    def _attention_sublayer_backward(self, layer: int, do, ctx, grads):
        """Gradient of the attention branch: do (B, T, D) -> d(its input h) (B, T, D); fills the
        wq, wk, wv and wo gradients of ``layer``."""
        be, cfg, pre = self.backend, self.cfg, f"layers.{layer}."
        B, T, _ = do.shape
        H, KVH, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        c_q, c_k, c_v, c_rq, c_rk, c_att, c_o = ctx
        da = self._proj_backward(pre, "attention.wo", do, c_o, grads)
        att_backward, c_att = c_att
        dq, dk, dv = att_backward(da.reshape(B, T, H, hd), c_att)
        if c_rq is not None:
            dq = be.rope_backward(dq, c_rq)
            dk = be.rope_backward(dk, c_rk)
        dh = self._proj_backward(pre, "attention.wq", dq.reshape(B, T, H * hd), c_q, grads)
        dhk = self._proj_backward(pre, "attention.wk", dk.reshape(B, T, KVH * hd), c_k, grads)
        dhv = self._proj_backward(pre, "attention.wv", dv.reshape(B, T, KVH * hd), c_v, grads)
        dh += dhk
        dh += dhv
        return dh

    def _block_backward(self, layer: int, dx, ctx, grads):
        """Gradient through one residual block, last sublayer first: dx (B, T, D) -> dx (B, T, D).
        Pre-norm: each residual adds its branch's gradient (through the norm) to the gradient that
        skips it. Post-norm: the gradient first passes the norm, then splits over the sum."""
        pre = f"layers.{layer}."
        c_n1, c_attn, c_n2, c_ffn = ctx
        if self.cfg.norm_position == "pre":
            dn = self._ffn_sublayer_backward(layer, dx, c_ffn, grads)
            dx += self._norm_backward(dn, c_n2, pre + "ffn_norm", grads)
            dh = self._attention_sublayer_backward(layer, dx, c_attn, grads)
            dx += self._norm_backward(dh, c_n1, pre + "attention_norm", grads)
            return dx
        ds = self._norm_backward(dx, c_n2, pre + "ffn_norm", grads)  # d(a + FFN(a))
        ds += self._ffn_sublayer_backward(layer, ds, c_ffn, grads)
        ds = self._norm_backward(ds, c_n1, pre + "attention_norm", grads)  # d(x + Attn(x))
        ds += self._attention_sublayer_backward(layer, ds, c_attn, grads)
        return ds

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

    def loss_and_grads(self, tokens, targets, ignore_index: int = -1):
        r"""Mean next-token cross-entropy L and \partial L / \partial \theta for every parameter.

        tokens, targets: (B, T) integers (targets equal to ``ignore_index`` do not count).
        Returns (loss as a Python float, grads: dict name -> array shaped like the parameter;
        quantized weights (:class:`~minillama.quant.QuantMatrix`) are frozen and have none).
        The backward visits the ops in exactly the reverse order of the forward. Without a logit
        scale the head projection and the loss run as one backend op,
        ``linear_cross_entropy_forward`` (CPU backends never hold the logits and their gradient
        as two (B T, V) arrays).
        """
        tok = self._tokens(tokens)
        tgt = self._targets(targets, tok.shape)
        be = self.backend
        B, T = tok.shape
        grads: dict[str, Any] = {}
        if self.lora is not None:
            self.lora.training = True  # adapter dropout (when configured) in this forward only
            try:
                loss, grads = self._loss_and_grads(tok, tgt, ignore_index, grads)
            finally:
                self.lora.training = False
            return loss, {k: grads[k] for k in self.lora.params}
        loss, grads = self._loss_and_grads(tok, tgt, ignore_index, grads)
        return loss, {k: grads[k] for k in self.params if grads.get(k) is not None}

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
        for layer in reversed(range(self.cfg.n_layers)):
            dx = self._block_backward(layer, dx, tape.pop(), grads)
        (c_emb,) = tape
        if self.lora is None:  # with adapters the embedding (and a tied head) stay frozen
            self._embed_backward(dx, c_emb, dw_out, grads)
        return float(be.to_numpy(loss)), grads

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


def check_params(cfg: ModelConfig, params: dict[str, Any]) -> None:
    """Raise :class:`MinillamaError` unless ``params`` has exactly the names and shapes of ``cfg``."""
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
