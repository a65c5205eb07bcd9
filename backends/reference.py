"""The ``reference`` backend: NumPy arrays and the plain ops of :mod:`minillama.core.ops`,
nothing else.

No threads, no BLAS or allocator tuning: ``minillama generate --backend reference`` runs the math
exactly as ``minillama/core/ops.py`` writes it. The other backends derive from this class and
override only the op pairs they make faster (``numpy`` and ``numba`` on the CPU, ``cupy`` on a GPU).

The class also declares, once, every optional ability a faster backend may add (a fused decode
step, fused AdamW, exact products, ...; :data:`ABILITIES`), with the answer of a backend without
it, so the layers above use each one as a plain attribute.
"""

from __future__ import annotations

import contextlib

import numpy as np

from minillama.core import notes_ops, ops
from minillama.core.quant import QuantMatrix

#: the optional abilities :class:`ReferenceBackend` declares below its ops, by name: what an object
#: standing in for a backend takes from the reference where it lacks them
#: (:func:`minillama.backends.complete`, which :func:`~minillama.backends.get_backend` applies)
ABILITIES = ("supports_float64", "attention_precision", "num_threads", "adamw_update",
             "exact_products", "decode_threads", "decode_step", "prompt_rows_invariant",
             "prefill_decode_invariant",
             "greedy_steps", "greedy_decoder", "decode_rows", "speculation_exact",
             "verification_ready",
             "watch_compiles", "invariance", "threads", "half_kv_cache",
             "attention_forward_packed", "attention_backward_packed")


class ReferenceBackend:
    """NumPy on the CPU, every op straight from :mod:`minillama.core.ops`."""

    name = "reference"
    device = "cpu"

    def __init__(self) -> None:
        self.xp = np

    # the named ops (forward and backward side by side, as in minillama.core.ops)
    embedding_forward = staticmethod(ops.embedding_forward)
    embedding_backward = staticmethod(ops.embedding_backward)
    linear_forward = staticmethod(ops.linear_forward)
    linear_backward = staticmethod(ops.linear_backward)
    lora_forward = staticmethod(ops.lora_forward)
    lora_backward = staticmethod(ops.lora_backward)
    bias_forward = staticmethod(ops.bias_forward)
    bias_backward = staticmethod(ops.bias_backward)
    rmsnorm_forward = staticmethod(ops.rmsnorm_forward)
    rmsnorm_backward = staticmethod(ops.rmsnorm_backward)
    rope_forward = staticmethod(ops.rope_forward)
    rope_backward = staticmethod(ops.rope_backward)
    attention_forward = staticmethod(ops.attention_forward)
    attention_backward = staticmethod(ops.attention_backward)
    swiglu_forward = staticmethod(ops.swiglu_forward)
    swiglu_backward = staticmethod(ops.swiglu_backward)
    cross_entropy_forward = staticmethod(ops.cross_entropy_forward)
    cross_entropy_backward = staticmethod(ops.cross_entropy_backward)
    linear_cross_entropy_forward = staticmethod(ops.linear_cross_entropy_forward)
    linear_cross_entropy_backward = staticmethod(ops.linear_cross_entropy_backward)
    # the notes' other pieces (model variants, cross/latent attention): reference code everywhere
    layernorm_forward = staticmethod(notes_ops.layernorm_forward)
    layernorm_backward = staticmethod(notes_ops.layernorm_backward)
    gelu_forward = staticmethod(notes_ops.gelu_forward)
    gelu_backward = staticmethod(notes_ops.gelu_backward)
    relu_forward = staticmethod(notes_ops.relu_forward)
    relu_backward = staticmethod(notes_ops.relu_backward)
    cross_attention_forward = staticmethod(notes_ops.cross_attention_forward)
    cross_attention_backward = staticmethod(notes_ops.cross_attention_backward)
    logit_scale_forward = staticmethod(notes_ops.logit_scale_forward)
    logit_scale_backward = staticmethod(notes_ops.logit_scale_backward)

    # a LoRA step's frozen weights: only the input gradient (a fast backend skips dW)
    def linear_backward_input(self, dy, ctx):
        r"""dx = dy W of :meth:`linear_backward` alone, W frozen (ctx from :meth:`linear_forward`;
        only its W is read). dy: (..., out). Returns dx (..., in)."""
        w = ctx[1]
        if isinstance(w, QuantMatrix):
            return self.linear_backward(dy, ctx)[0]  # a quantized W has no dW anyway
        return (dy.reshape(-1, dy.shape[-1]) @ w).reshape(*dy.shape[:-1], w.shape[1])

    def linear_cross_entropy_backward_input(self, dloss, ctx):
        r"""dx of :meth:`linear_cross_entropy_backward` alone, the head W frozen. Returns
        dx (N, D)."""
        return self.linear_cross_entropy_backward(dloss, ctx)[0]

    # helpers
    def asarray(self, a, dtype=None):
        """Move/convert ``a`` to this backend's array type (a :class:`QuantMatrix` stays as it
        is: its blocks are the weight)."""
        if isinstance(a, QuantMatrix):
            return a
        return self.xp.asarray(a, dtype=dtype)

    def to_numpy(self, a) -> np.ndarray:
        """A NumPy copy/view of ``a`` on the host."""
        return np.asarray(a)

    def synchronize(self) -> None:
        """Wait for queued device work (a no-op on the CPU)."""

    # -----------------------------------------------------------------------------------------
    # optional abilities: what a faster backend may add beside the ops. Each is declared here,
    # once, with the answer of a backend that lacks it, so the layers above use it plainly
    # (``backend.decode_step(...)``, never a hasattr); a backend that has one overrides it.
    # -----------------------------------------------------------------------------------------
    #: whether float64 arrays are computed in float64 (False: the identities and the gradient
    #: checks run the backend in float32)
    supports_float64 = True
    #: the precision of a GPU's attention products ("fp32", "tf32": cupy); None where it is no
    #: setting (the CPU backends compute in the arrays' dtype)
    attention_precision: str | None = None
    #: the size of the backend's own CPU thread team (numba's); None: it has none, its ops run on
    #: the shared pools of :mod:`minillama.backends.numpy.threads`
    num_threads: int | None = None
    #: ``adamw_update(param, grad, m, v, lr, beta1, beta2, eps, wd, step)``: one AdamW step of
    #: one parameter in place, fused (numba, cupy); None: :class:`minillama.train.optim.AdamW`
    #: runs its own array expressions
    adamw_update = None
    #: ``attention_forward_packed(q, k, v, start_pos, segments=...)`` and its backward: attention
    #: over rows packed from several examples (numpy's); None: the model takes
    #: :func:`minillama.core.ops.attention_forward` with the segments
    attention_forward_packed = None
    attention_backward_packed = None

    def exact_products(self):
        """A context in which the products are exact where the backend has a faster approximate
        path (numba: GGML block weights times activations rounded to 8 bits); the training
        forward and the identities run in it. The reference's products are exact: a no-op."""
        return contextlib.nullcontext()

    #: whether a model's KV cache may store float16 (``--kv-cache f16``): the model widens what
    #: the cache returns before attention, so every op here sees float32
    half_kv_cache = True

    #: the bitwise identities of :mod:`minillama.identities.invariance` this backend keeps
    #: ("batch", "prefix_cache", "threads", "prefill_decode"): none here, whose NumPy products
    #: follow the BLAS library's blocking for the shapes at hand
    invariance: frozenset[str] = frozenset()

    def threads(self, n: int):
        """A context manager running this backend's ops on ``n`` threads in its ``with`` block
        (the reference has no pools of its own: nothing changes)."""
        return contextlib.nullcontext()

    def decode_threads(self, B: int):
        """A context manager around one cached decode step of B sequences (the model's per-op
        path at T = 1): a backend with thread pools picks their size for the step there. The
        reference has none."""
        return contextlib.nullcontext()

    def decode_step(self, model, tok, start_pos, cache):
        """One KV-cached decode step of ``model`` (tok (B, 1) ids at ``start_pos``) in one fused
        call: its logits (B, V), or None to decline, the model then running its per-op path.
        The reference declines."""
        return None

    def prompt_rows_invariant(self, model) -> bool:
        """Whether this backend computes ``model``'s prompt rows alike whatever their count (in
        its ``prompt_rows()`` context) and their last token by :meth:`decode_step` (numba on
        GGML block weights). The reference does not say so: False."""
        return False

    def prefill_decode_invariant(self, model) -> bool:
        """Whether this backend's decode steps compute a position of ``model`` bit for bit as
        its prefill does (numba on GGML blocks of 32). The reference does not say so: False."""
        return False

    def greedy_steps(self, model, tok, start_pos, cache, k: int):
        """Up to ``k`` greedy decode steps of B > 1 sequences in one call: their ids (B, k'),
        or None to decline (the caller steps one token at a time). The reference declines."""
        return None

    def decode_rows(self, model, tok, pos, seq, cache):
        """One step over R rows that need not be one per sequence: row r feeds tok[r] at
        position pos[r] of cache row seq[r] (a sequence's drafted tokens are several rows at
        consecutive positions), each row computed exactly as a one-row decode step computes it;
        the logits (R, V), or None where the backend cannot promise that (the reference)."""
        return None

    def speculation_exact(self, model) -> bool:
        """Whether a step of several rows computes each row bit for bit as a one-row step
        (so verified drafts keep the greedy tokens); the reference does not say so: False."""
        return False

    def verification_ready(self, model) -> bool:
        """Whether :meth:`decode_rows` verifies drafts for ``model`` now (compiled, exact); the
        reference has no such step: False."""
        return False

    def greedy_decoder(self, model, max_seq_len: int, stop_ids=(), speculate: bool = False,
                       cache=None, cached: int = 0):
        """A decoder running greedy steps of one sequence several per call
        (:class:`minillama.core.decoding.ChunkDecoder`), or None where the backend has none (the
        caller steps the model); ``speculate``: one verifying prompt-lookup drafts
        (:mod:`minillama.core.speculative`) where that gives the same ids; ``cache``, ``cached``:
        a one-sequence cache holding the prompt's first ``cached`` positions to write into. The
        reference has none."""
        return None

    def watch_compiles(self):
        """A context around work that may compile kernels, yielding what it saw (numba: a
        ``CompileWatch``) or None where the backend compiles nothing or cannot tell."""
        return contextlib.nullcontext()

    def __repr__(self) -> str:
        return f"<minillama backend {self.name}>"


# the loss head composed of a backend's own linear and cross-entropy ops (bound as methods by the
# backends that have fast versions of those two but no fused head: cupy, mixed precision)
def composed_linear_cross_entropy_forward(self, x, w, targets, ignore_index: int = -1):
    r"""z = x W^T, L = CE(z, y) (:func:`minillama.core.ops.linear_cross_entropy_forward`) through
    ``self.linear_forward`` and ``self.cross_entropy_forward``. x: (N, D); w: (V, D);
    targets: (N,). Returns (0-d loss, ctx)."""
    z, c_lin = self.linear_forward(x, w)
    loss, c_ce = self.cross_entropy_forward(z, targets, ignore_index)
    return loss, (c_lin, c_ce)


def composed_linear_cross_entropy_backward(self, dloss, ctx):
    r"""dx = \bar{z} W, dW = \bar{z}^T x with \bar{z} from ``self.cross_entropy_backward``.
    Returns (dx (N, D), dW (V, D))."""
    c_lin, c_ce = ctx
    return self.linear_backward(self.cross_entropy_backward(dloss, c_ce), c_lin)
