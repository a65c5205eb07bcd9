r"""The LLaMA decoder: parameters, forward pass and the hand-written backward pass.

The model is a stack of pre-norm residual blocks (Touvron et al., 2023):

    h_0 = E_{\mathrm{tok}}
    h'_l = h_{l-1} + \mathrm{Attn}(\mathrm{RMSNorm}(h_{l-1}; g^{att}_l))
    h_l = h'_l + (\mathrm{silu}(\hat{h} W_1^T) \odot \hat{h} W_3^T) W_2^T,  \hat{h} =
    \mathrm{RMSNorm}(h'_l; g^{ffn}_l)
    z = \mathrm{RMSNorm}(h_L; g) W_{out}^T          (W_{out} = E when the head is tied)

(rows: every vector is a row and a linear layer is x W^T, as in docs/MATH.md).

This module holds the parameters (names, shapes, initialisation, checks) and the
:class:`Transformer` with its two drivers, the forward (:meth:`Transformer._run`) and the backward
(:meth:`Transformer.loss_and_grads`); the pieces they call are mixins in ``model/ends.py``,
``model/block.py``, ``model/variants.py`` and ``model/inputs.py``.

Every op is called through the backend (``self.backend.<op>_forward``), so one wiring serves NumPy,
Numba and CuPy. :meth:`Transformer.loss_and_grads` runs the forward keeping each op's ``ctx``, then
walks the layers in reverse calling the matching ``<op>_backward``.

The config's variants (docs/MATH.md part II) swap single pieces, defaults being LLaMA's:
``norm`` (RMSNorm | LayerNorm), ``norm_position`` (pre | post: h' = Norm(h + Attn(h))),
``pos_encoding`` (RoPE | sinusoidal E^{pos} added to \sqrt{D} E_{tok} | none), ``ffn`` (SwiGLU |
GELU |
ReLU two-matrix) and ``logit_scale`` s (z = s Norm(h_L) W_out^T).
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from minillama.backends import get_backend
from minillama.core.config import ModelConfig, param_shapes
from minillama.core.errors import MinillamaError
from minillama.core.ops import rope_tables, sinusoidal_positions
from minillama.model import packing, recompute
from minillama.model.block import BlockWiring
from minillama.model.ends import EndsWiring
from minillama.model.inputs import ModelInputs
from minillama.model.kvcache import KVCache
from minillama.model.variants import VariantPieces


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


class Transformer(ModelInputs, EndsWiring, VariantPieces, BlockWiring):
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

    The pieces live in mixins, one job each, every one forward first then backward:
    :class:`~minillama.model.ends.EndsWiring` (embedding and head),
    :class:`~minillama.model.block.BlockWiring` (a block and its two sublayers),
    :class:`~minillama.model.variants.VariantPieces` (norm, linear with bias and LoRA, attention
    pair with a sliding window) and :class:`~minillama.model.inputs.ModelInputs` (token checks,
    positions, RoPE rows).
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
        #: gradient checkpointing; the packed rows of a call given ``segments`` (while it runs)
        self.recompute, self.segments = False, None
        if cfg.pos_encoding == "rope":
            self.cos, self.sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta,
                                             self.dtype, xp, cfg.rope_scaling)
        if cfg.pos_encoding == "sinusoidal":
            self.pos_table = sinusoidal_positions(cfg.max_seq_len, cfg.dim, dtype=self.dtype, xp=xp)

    # ----------------------------------------------------------------------------------------
    # small helpers: the head matrix, caches (input checks and RoPE rows: ModelInputs)
    # ----------------------------------------------------------------------------------------
    @property
    def output_weight(self):
        """The classifier matrix (V, D): ``output.weight``, or the embedding when tied."""
        key = "tok_embeddings.weight" if self.cfg.tie_embeddings else "output.weight"
        return self.params[key]

    def new_cache(self, batch_size: int, max_seq_len: int | None = None) -> KVCache:
        """An empty KV cache for this model on its backend."""
        return KVCache(self.cfg, batch_size, max_seq_len, dtype=self.dtype, xp=self.backend.xp)

    # ----------------------------------------------------------------------------------------
    # forward, piece by piece
    # ----------------------------------------------------------------------------------------
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
        if step and hasattr(self.backend, "decode_step") and self.lora is None:
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
        threads = getattr(self.backend, "decode_threads", None) if step else None
        with threads(tok.shape[0]) if threads else contextlib.nullcontext():
            return self._run(tok, start_pos, cache, train=False, output_index=output_index)[0]

    __call__ = forward

    # ----------------------------------------------------------------------------------------
    # backward, the same pieces in reverse
    # ----------------------------------------------------------------------------------------
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
        with getattr(self.backend, "exact_products", contextlib.nullcontext)():
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


def _pick_positions(be, x, output_index):
    """x[:, i] for one index i, or x[b, i_b] for (B,) indices: (B, T, D) -> (B, D)."""
    idx = np.asarray(output_index, dtype=np.int64).reshape(-1)
    if idx.size == 1:
        return x[:, int(idx[0])]
    return x[be.asarray(np.arange(x.shape[0])), be.asarray(idx)]


def _rows_alike(model) -> bool:
    """Whether ``model``'s backend computes a prompt's rows alike whatever their count
    (``prompt_rows``) and its one-token steps by ``decode_step``."""
    alike = getattr(model.backend, "prompt_rows_invariant", None)
    return alike is not None and alike(model)


def _prompt_then_step(model, tok, start_pos, cache, output_index):
    """A cached prompt as the backend's row-alike prefill of all but each sequence's last token,
    then that token by ``decode_step``: the logits (B, V) at ``output_index`` (default the last
    column), or None when the step declines. A cold prompt, one whose prefix came from a cache
    and one prefilled beside others then end in the same computations, so their logits and K/V
    agree bit for bit."""
    B, T = tok.shape
    idx = np.broadcast_to(np.asarray(T - 1 if output_index is None else output_index,
                                     dtype=np.int64).reshape(-1), (B,))
    with model.backend.prompt_rows():
        model._run(tok[:, :-1], start_pos, cache, train=False, head=False)
    starts = np.broadcast_to(np.asarray(start_pos, dtype=np.int64).reshape(-1), (B,))
    return model.backend.decode_step(model, tok[np.arange(B), idx][:, None], starts + idx, cache)
