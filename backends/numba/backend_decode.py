"""The fused decode step of the ``numba`` backend, a mixin of
:class:`~minillama.backends.numba.backend.NumbaBackend`: a whole KV-cached step (one new token per
sequence) in one compiled call (:mod:`.decode.float_step`, :mod:`.decode.quant_step` for GGML block
weights), and greedy decoding of many steps per call (:class:`GreedyDecoder`,
:meth:`FusedDecode.greedy_steps`). :class:`DecodePlans` turns a model and a cache into the typed
lists those kernels take."""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import threading

import numpy as np

from minillama.core.config import param_shapes
from minillama.core.decoding import ChunkDecoder, nonfinite_error
from minillama.core.decoding import finite_logits as _finite
from minillama.core.errors import MinillamaError
from minillama.core.quant import QuantMatrix
from minillama.core.speculative import Speculation

from ..tuner import ThreadTuner

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))

#: config fields the fused decode step understands; any other field must keep its default
#: (a model variant with, e.g., biases or another norm falls back to the per-op path)
FUSED_DECODE_FIELDS = frozenset({"dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size",
                                 "hidden_dim", "multiple_of", "ffn_dim_multiplier", "norm_eps",
                                 "rope_theta", "max_seq_len", "tie_embeddings", "head_dim"})

_NO_IDS = np.zeros(0, dtype=np.int64)
_NO_IDS_2D = np.zeros((0, 0), dtype=np.int64)


def _vocab(plan) -> int:
    """V of a decode plan (float or quantized)."""
    return plan["V"] if plan.get("quant") else plan["emb"].shape[0]


def _model_args(plan, kc, vc):
    """The arguments of the :mod:`.decode.float_step` kernels between the positions and the logits:
    the weights of ``plan`` (:meth:`DecodePlans._decode_plan`), the cache lists kc, vc, the
    RoPE tables and the constants."""
    return (plan["emb"], plan["out"], plan["norm"], *plan["layers"], kc, vc, plan["cos"],
            plan["sin"], plan["eps"], plan["heads"], plan["zero"])


def _read_only(a: np.ndarray) -> np.ndarray:
    """A read-only view of block data: one array type for the kernels whether the blocks were
    mapped from a GGUF file (read-only) or quantized in memory, so one compiled step serves
    both (and :mod:`.rows_compile`'s scratch arguments are of that type)."""
    v = a.view()
    v.flags.writeable = False
    return v


_PROMPT = threading.local()


def in_prompt_rows() -> bool:
    """Whether this thread is inside :meth:`FusedDecode.prompt_rows`."""
    return getattr(_PROMPT, "on", False)


class DecodePlans:
    """The weights of a model and the arrays of a cache as the fused kernels take them, built
    once per model and per cache (weak references) and rebuilt when an array is replaced."""

    def prefill_decode_invariant(self, model) -> bool:
        """Whether ``model``'s decode steps compute a position bit for bit as its prompt rows do:
        float32, layer matrices of the integer GEMM's types (blocks of 32 and the K-quants:
        :mod:`.quant.int8_lanes`), hd a multiple of 16 (attention in the prompt rows' order).
        The embedding rows are dequantized by one kernel on both sides
        (:meth:`~.backend.NumbaBackend.embedding_forward`)."""
        if not self.prompt_rows_invariant(model) or np.dtype(model.dtype) != np.float32 \
                or model.cfg.head_dim % 16:
            return False
        from .quant.int8_lanes import LANE_TYPES

        plan = self._decode_plan(model)
        return bool(np.isin(plan["codes"], LANE_TYPES).all())

    def _decode_plan(self, model):
        """The model's weights as the lists :func:`.decode.float_step.decode_step` takes, built once
        per model (the arrays themselves, so in-place updates are seen; rebuilt when a parameter
        array is replaced). None when the model is not a plain LLaMA this step implements."""
        plan = self._decode_plans.get(model)
        p = model.params
        if plan is not None and all(map(operator.is_, map(p.get, plan["keys"]), plan["arrays"])):
            return plan
        cfg = model.cfg
        if model.dtype not in _FLOATS or not dataclasses.is_dataclass(cfg):
            return None
        for f in dataclasses.fields(cfg):
            if f.name not in FUSED_DECODE_FIELDS and (
                    f.default is dataclasses.MISSING or getattr(cfg, f.name) != f.default):
                return None
        shapes = param_shapes(cfg)
        if set(p) != set(shapes):
            return None
        if any(isinstance(a, QuantMatrix) for a in p.values()):
            plan = self._quant_plan(model, shapes)
            if plan is not None:
                self._decode_plans[model] = plan
            return plan
        if any(not isinstance(a, np.ndarray) for a in p.values()):
            return None
        dt = model.dtype

        def arr(a):  # C-contiguous and writeable: one array type for every list entry
            return np.require(a, dtype=dt, requirements=("C", "W"))

        typed_list = self._numba.typed.List

        def stack(name):  # a typed list: its type does not depend on L (one compilation)
            return typed_list([arr(p[f"layers.{i}.{name}"]) for i in range(cfg.n_layers)])

        plan = {
            "keys": list(shapes), "arrays": [p[k] for k in shapes],
            "emb": arr(p["tok_embeddings.weight"]),
            "out": arr(model.output_weight),
            "norm": arr(p["norm.weight"]),
            "layers": tuple(stack(n) for n in (
                "attention_norm.weight", "attention.wq.weight", "attention.wk.weight",
                "attention.wv.weight", "attention.wo.weight", "ffn_norm.weight",
                "feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight")),
            "cos": arr(model.cos), "sin": arr(model.sin),
            "eps": float(cfg.norm_eps), "heads": int(cfg.n_heads), "zero": dt.type(0),
        }
        if self._decode is None:
            from .decode import float_step as numba_decode

            self._decode = numba_decode
        self._decode_plans[model] = plan
        return plan

    _decode = None
    _qdecode = None

    #: the linear weights of a layer in the order of :func:`.decode.quant_step.decode_step_one_q`
    _QUANT_LINEAR = ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
                     "attention.wo.weight", "feed_forward.w1.weight", "feed_forward.w2.weight",
                     "feed_forward.w3.weight")

    def _quant_plan(self, model, shapes):
        """The decode plan of a float32 model whose linear weights are all GGML block matrices
        (:class:`~minillama.core.quant.QuantMatrix`; the embedding and the classifier may be
        either): the block arrays as typed lists and each matrix's type id. None otherwise."""
        p, cfg = model.params, model.cfg
        L = cfg.n_layers
        names = [f"layers.{i}.{n}" for i in range(L) for n in self._QUANT_LINEAR]
        if model.dtype != np.float32 or not all(isinstance(p[k], QuantMatrix) for k in names):
            return None
        q = self._quant()

        def side(w):  # (block data, type id, float matrix); type 0 for a float matrix
            if isinstance(w, QuantMatrix):
                return _read_only(w.data), q.qcode(w.qtype), np.zeros((1, 1), np.float32)
            return _read_only(np.zeros((1, 1), np.uint8)), 0, np.require(w, np.float32,
                                                                          ("C", "W"))

        rest = [k for k in shapes if k not in names and k not in (
            "tok_embeddings.weight", "output.weight")]
        if any(not isinstance(p[k], np.ndarray) for k in rest):
            return None

        def arr(a):
            return np.require(a, dtype=np.float32, requirements=("C", "W"))

        lst = self._numba.typed.List
        mats = tuple(lst([_read_only(p[f"layers.{i}.{n}"].data) for i in range(L)])
                     for n in self._QUANT_LINEAR)
        self._quant_kernels()
        return {
            "keys": list(shapes), "arrays": [p[k] for k in shapes], "quant": True,
            "V": cfg.vocab_size, "emb": side(p["tok_embeddings.weight"]),
            "out": side(model.output_weight),
            "codes": np.array([[q.qcode(p[f"layers.{i}.{n}"].qtype) for n in self._QUANT_LINEAR]
                               for i in range(L)], dtype=np.int64),
            "norm": arr(p["norm.weight"]),
            "g_att": lst([arr(p[f"layers.{i}.attention_norm.weight"]) for i in range(L)]),
            "g_ffn": lst([arr(p[f"layers.{i}.ffn_norm.weight"]) for i in range(L)]),
            "mats": mats, "cos": arr(model.cos), "sin": arr(model.sin),
            "eps": float(cfg.norm_eps), "heads": int(cfg.n_heads),
        }

    def _quant_kernels(self):
        """The kernels of GGML block weights (:mod:`.decode.quant_step`), imported on first use."""
        if self._qdecode is None:
            from .decode import quant_step as numba_qdecode

            DecodePlans._qdecode = numba_qdecode
        return self._qdecode

    def _cache_lists(self, cache, dt):
        """The cache's per-layer K and V arrays as typed lists (built once per cache), or None
        when they are not C-contiguous writeable NumPy arrays of the model dtype or, for a
        float32 model, half-precision ones (passed as their uint16 bits, which the kernels
        convert: :mod:`.floats.half`)."""
        got = self._cache_plans.get(cache)
        if got is not None and all(map(operator.is_, got[2], cache.k + cache.v)):
            return got[:2]
        arrays = list(cache.k) + list(cache.v)
        kinds = (dt, np.float16) if dt == np.float32 else (dt,)
        for a in arrays:
            if not (isinstance(a, np.ndarray) and a.dtype in kinds and a.flags.c_contiguous
                    and a.flags.writeable and a.dtype == arrays[0].dtype):
                return None
        lst = self._numba.typed.List

        def bits(a):
            return a.view(np.uint16) if a.dtype == np.float16 else a

        got = (lst(map(bits, cache.k)), lst(map(bits, cache.v)), arrays)
        self._cache_plans[cache] = got
        return got[:2]


class DraftSteps:
    """What :class:`FusedDecode` offers speculative decoding: whether a step of several rows
    computes each row as alone (:meth:`speculation_exact`) and is compiled
    (:meth:`verification_ready`), the step over rows that need not be one per sequence
    (:meth:`decode_rows`) and its thread tuner."""

    #: a kernel of several rows missing from the disk cache compiles in a worker process, the
    #: answers going on without drafts meanwhile (:mod:`.rows_compile`); False: in the thread
    #: that first wants it
    compile_in_background = True

    def verification_ready(self, model) -> bool:
        """Whether drafts can be verified for ``model`` now: :meth:`speculation_exact`, and its
        kernel of several rows compiled in this process or loaded now from the disk cache. If
        it is in neither, a worker process compiles it (:attr:`compile_in_background`; else it
        compiles here, now) and this says False until the worker has ended."""
        plan = self._exact_plan(model)
        if plan is None:
            return False
        from . import rows_compile

        kind = "quant" if plan.get("quant") else np.dtype(model.dtype).name
        if np.dtype(getattr(model, "kv_dtype", model.dtype)) == np.float16:
            kind += "-f16"
        state = self.__dict__.setdefault("_rows_compiled", {})
        st = state.get(kind)
        if isinstance(st, bool):
            return st
        dispatcher, args = rows_compile.scratch_args(kind)
        if st is None:  # first asked
            if rows_compile.loadable(dispatcher, args) or not self.compile_in_background:
                state[kind] = True
                return True
            state[kind] = rows_compile.start_worker(kind)
            return False
        if st.poll() is None:  # the worker is compiling
            return False
        state[kind] = st.returncode == 0 and rows_compile.loadable(dispatcher, args)
        return state[kind]

    def speculation_exact(self, model) -> bool:
        """Whether a step of several rows computes each row as a one-row step would, bit for bit,
        for ``model`` (the batch-invariant fused steps: float weights, or GGML blocks with 8-bit
        products), so that verified drafts give the plain greedy ids."""
        return self._exact_plan(model) is not None

    def _exact_plan(self, model):
        """``model``'s decode plan where :meth:`speculation_exact`, else None."""
        plan = self._decode_plan(model)
        return plan if plan is not None and (not plan.get("quant") or self._quant_int8()) \
            else None

    def decode_rows(self, model, tok, pos, seq, cache, tuner: ThreadTuner | None = None):
        """One fused step over R rows, row r feeding tok[r] at position pos[r] of cache row
        seq[r], each row computed as the one-row step computes it (where
        :meth:`speculation_exact`, and R > 1 unless the cache has one row; else None): the logits
        (R, V). The thread count is ``tuner``'s, by default the verification steps'
        (:attr:`verify_tuner`)."""
        plan = self._exact_plan(model)
        kv = self._cache_lists(cache, model.dtype) if plan is not None else None
        if kv is None:
            return None
        tok, pos, seq = (np.array(a, dtype=np.int64).reshape(-1) for a in (tok, pos, seq))
        if pos.min() < 0 or pos.max() >= cache.max_seq_len or seq.min() < 0 \
                or seq.max() >= cache.batch_size:
            raise MinillamaError(f"rows at positions up to {int(pos.max())} of cache rows up to "
                                 f"{int(seq.max())} exceed the KV cache ({cache.batch_size} x "
                                 f"{cache.max_seq_len})")
        if len(tok) == 1 and cache.batch_size != 1:
            return None  # one row: the one-sequence kernel takes a cache of one row
        logits = np.empty((len(tok), _vocab(plan)), dtype=model.dtype)
        self._rows(plan, tok, pos, seq, *kv, logits, tuner or self.verify_tuner)
        return logits

    @property
    def verify_tuner(self) -> ThreadTuner:
        """The thread count of the verification steps of drafted tokens
        (:class:`SpeculativeDecoder`), by measured seconds per row: one tuner for their several
        sizes, so that it settles in a few steps."""
        if self.__dict__.get("_verify_tuner") is None:
            self._verify_tuner = ThreadTuner(self.num_threads)
        return self._verify_tuner


class FusedDecode(DraftSteps, DecodePlans):
    """The fused decode entry points: :meth:`decode_step` (taken by
    :meth:`minillama.model.transformer.Transformer.forward` at T = 1), :meth:`greedy_steps` and
    :meth:`greedy_decoder`."""

    _tuner: ThreadTuner | None = None  # one sequence's, made on first use (:attr:`tuner`)

    def _step_one(self, plan, tok, pos, kc, vc, logits, stop, ids, threads=None):
        """One sequence's fused step(s) on ``threads`` threads (default: all):
        :func:`.decode.float_step.decode_step_one`, or
        :func:`.decode.quant_step.decode_step_one_q` for a quantized plan. Returns its count."""
        threads = self.num_threads if threads is None else threads
        if not plan.get("quant"):
            return self._decode.decode_step_one(tok, pos, *_model_args(plan, kc, vc), logits,
                                                threads, stop, ids)
        q = self._quant()
        wq, wk, wv, wo, w1, w2, w3 = plan["mats"]
        return self._qdecode.decode_step_one_q(
            tok, pos, *plan["emb"], *plan["out"], plan["codes"], plan["norm"], plan["g_att"],
            wq, wk, wv, wo, plan["g_ffn"], w1, w2, w3, kc, vc, plan["cos"], plan["sin"],
            plan["eps"], plan["heads"], logits, threads, stop, ids, q._F16,
            q._KVALUES)

    def _step_rows_q(self, plan, tok, pos, seq, kc, vc, logits, threads):
        """One fused step of B > 1 rows of a quantized plan, each at its own position in cache
        row seq[b], on ``threads`` threads: :func:`.decode.quant_step.decode_step_rows_q`."""
        self._qdecode.decode_step_rows_q(  # the wrapper adds the 8-bit switch
            *self._rows_q_args(plan, tok, pos, seq, kc, vc, logits, threads)[:-1])

    def _rows_q_args(self, plan, tok, pos, seq, kc, vc, logits, threads) -> tuple:
        """The arguments of :func:`.decode.quant_step.decode_step_rows_q_kernel`, the 8-bit
        products on unless ``MINILLAMA_QUANT_DOTS=float``."""
        q = self._quant()
        wq, wk, wv, wo, w1, w2, w3 = plan["mats"]
        return (tok, pos, seq, *plan["emb"], *plan["out"], plan["codes"], plan["norm"],
                plan["g_att"], wq, wk, wv, wo, plan["g_ffn"], w1, w2, w3, kc, vc, plan["cos"],
                plan["sin"], plan["eps"], plan["heads"], logits, threads, q._F16, q._KVALUES,
                self._qdecode.int8_enabled())

    def decode_step(self, model, tok, start_pos, cache):
        r"""One KV-cached decode step of ``model`` in one compiled call, or None to decline.

        tok: (B, 1) token ids (checked by the model); start_pos: int or (B,) ints, the position p_b
        each token is written at; cache: the model's :class:`~minillama.model.kvcache.KVCache`.
        Computes exactly :meth:`minillama.model.transformer.Transformer.forward` at T = 1 with
        ``last_only`` (rmsnorm, linear, rope, attention over positions 0..p_b, swiglu, head; see
        :mod:`.decode.float_step`) and writes k, v at p_b. Returns logits (B, V). Quantized weights:
        one sequence by :func:`.decode.quant_step.decode_step_one_q`, several (rows at their own
        positions, as continuous batching feeds them) by
        :func:`.decode.quant_step.decode_step_rows_q`. Declines (None: the model runs its per-op
        path) for model variants it does not implement, T > 1 and caches it cannot write in place.
        """
        B, T = tok.shape
        if T != 1 or cache.batch_size != B:
            return None
        plan = self._decode_plan(model)
        if plan is None:
            return None
        kv = self._cache_lists(cache, model.dtype)
        if kv is None:
            return None
        kc, vc = kv
        if isinstance(start_pos, (int, np.integer)):
            lo = hi = int(start_pos)
            pos = np.full(B, lo, dtype=np.int64)
        else:
            pos = np.array(  # a writable copy: one array type for the kernels
                np.broadcast_to(np.asarray(start_pos, dtype=np.int64).reshape(-1), (B,)))
            lo, hi = int(pos.min()), int(pos.max())
        if lo < 0 or hi >= model.cfg.max_seq_len:
            raise MinillamaError(f"positions up to {hi} exceed the model context of "
                                 f"{model.cfg.max_seq_len}")
        if hi >= cache.max_seq_len:
            raise MinillamaError(f"sequence of {hi + 1} positions exceeds the KV cache length "
                                 f"{cache.max_seq_len}")
        logits = np.empty((B, _vocab(plan)), dtype=model.dtype)
        self._rows(plan, np.ascontiguousarray(tok[:, 0], dtype=np.int64), pos,
                   np.arange(B, dtype=np.int64), kc, vc, logits)
        return logits

    def _rows(self, plan, tok, pos, seq, kc, vc, logits, tuner=None) -> None:
        """One fused step of the B rows tok (B,) at positions pos (B,) in cache rows seq (B,),
        into logits (B, V), on the thread count a tuner picks: one row (a cache of one row) by
        the one-sequence kernel, several by the kernel of several rows (each row computed as it
        would be alone). ``tuner``: one that times the step per row (B steps), instead of the
        batch size's own."""
        B = len(tok)
        if B == 1:
            self.tuner.run(self._numba_team, lambda threads, k: self._step_one(
                plan, tok, pos, kc, vc, logits, _NO_IDS, _NO_IDS, threads) or 1, 1)
            return
        if plan.get("quant"):
            def step(threads):
                self._step_rows_q(plan, tok, pos, seq, kc, vc, logits, threads)
        else:
            def step(threads):
                self._decode.decode_step(tok, pos, seq, *_model_args(plan, kc, vc), logits,
                                         threads, _NO_IDS, _NO_IDS_2D)
        if tuner is None:
            self.rows_tuner(B).run(self._numba_team, lambda threads, k: step(threads) or 1, 1)
        else:
            tuner.run(self._numba_team, lambda threads, k: step(threads) or B, B, whole=True)

    @property
    def invariance(self) -> frozenset[str]:
        """The bitwise identities this backend keeps. On GGML blocks with 8-bit products (the
        default; none with ``MINILLAMA_QUANT_DOTS=float``): a sequence's logits whatever is
        batched with it, whether its prefix came from a cache, the thread count, a draft's
        verification step against the decode steps, and (blocks of 32:
        :meth:`prefill_decode_invariant`) a prefill against decode steps. On float weights: the
        decode steps whatever is batched with them and the thread count."""
        from .quant.int8_dots import int8_enabled  # the switch alone: compiles nothing

        floats = frozenset({"float_decode_batch", "float_decode_threads"})
        if int8_enabled():
            return floats | {"batch", "prefix_cache", "threads", "speculative", "prefill_decode"}
        return floats

    def prompt_rows_invariant(self, model) -> bool:
        """Whether ``model``'s prompt rows on this backend can be computed row by row alike
        whatever their count (:meth:`prompt_rows`): a plan of GGML block weights with 8-bit
        products, where the last prompt token then takes the fused decode step."""
        plan = self._decode_plan(model)  # a quantized plan has imported .decode.quant_step
        return plan is not None and bool(plan.get("quant")) and self._quant_int8()

    @contextlib.contextmanager
    def prompt_rows(self):
        """Within it (in this thread) the per-op forward computes each row of a prompt as it would
        alone: every 8-bit product by the integer GEMM whatever the row count
        (:func:`.quant.int8_dots.gemm_products`) and attention row by row in the decode steps' spans
        (:func:`.floats.attention_forward.attend_rows`). So a prompt's K/V rows do not depend on how
        the prompt was cut into chunks, on a cached prefix or on the prompts prefilled beside it."""
        before = in_prompt_rows()
        _PROMPT.on = True
        try:
            with self._quant_kernels().gemm_products():
                yield
        finally:
            _PROMPT.on = before

    def _quant_int8(self) -> bool:
        return self._qdecode.int8_enabled()

    def greedy_steps(self, model, tok, start_pos, cache, k: int):
        """Up to ``k`` greedy decode steps of B > 1 sequences in one compiled call, or None to
        decline (the caller steps one token at a time). tok: (B,) the tokens to feed; start_pos:
        (B,) their positions (each sequence then advances by one per step, capped at the cache's
        last slot). Returns ids (B, k'), k' <= k: the argmax of each step's logits per sequence;
        -1 where a row held NaN/inf (the call ended after that step)."""
        B = len(tok)
        plan = self._decode_plan(model)
        kv = self._cache_lists(cache, model.dtype) if plan is not None else None
        if B < 2 or kv is None or cache.batch_size != B or k < 1 or plan.get("quant"):
            return None
        pos = np.ascontiguousarray(start_pos, dtype=np.int64).reshape(B)
        if pos.min() < 0 or pos.max() >= cache.max_seq_len:
            raise MinillamaError(f"positions up to {int(pos.max())} exceed the KV cache length "
                                 f"{cache.max_seq_len}")
        ids = np.empty((B, int(k)), dtype=np.int64)
        logits = np.empty((B, _vocab(plan)), dtype=model.dtype)
        n = self._decode.decode_step(
            np.ascontiguousarray(tok, dtype=np.int64).reshape(B), pos,
            np.arange(B, dtype=np.int64), *_model_args(plan, *kv),
            logits, self.num_threads, _NO_IDS, ids)
        return ids[:, :n]

    @property
    def tuner(self) -> ThreadTuner:
        """The thread count of one sequence's decode steps, by measured speed
        (:mod:`minillama.backends.tuner`)."""
        if self._tuner is None:
            self._tuner = ThreadTuner(self.num_threads)
        return self._tuner

    def rows_tuner(self, B: int) -> ThreadTuner:
        """The thread count of the steps of B > 1 sequences, one
        :mod:`minillama.backends.tuner` per B (a step's time grows with B, so each batch size is
        measured on its own)."""
        tuners = self.__dict__.setdefault("_rows_tuners", {})
        if B not in tuners:
            tuners[B] = ThreadTuner(self.num_threads)
        return tuners[B]

    def greedy_decoder(self, model, max_seq_len: int, stop_ids=(), speculate: bool = False,
                       cache=None, cached: int = 0):
        """A :class:`GreedyDecoder` for one sequence of ``model`` and a cache of ``max_seq_len``
        positions (greedy decoding, several steps per compiled call, ending a call at a token
        of ``stop_ids``), or None where the fused step does not apply. ``speculate``: a
        :class:`SpeculativeDecoder` (the same ids) where :meth:`speculation_exact`. ``cache``:
        a one-sequence cache to write into instead of a new one, its first ``cached`` positions
        holding the prompt's first tokens (only the rest is prefilled)."""
        if self._decode_plan(model) is None:
            return None
        kind = SpeculativeDecoder if speculate and self.speculation_exact(model) else GreedyDecoder
        dec = kind(self, model, max_seq_len, stop_ids, cache, cached)
        ok = dec.cache.batch_size == 1 and self._cache_lists(dec.cache, model.dtype) is not None
        return dec if ok else None



class GreedyDecoder(ChunkDecoder):
    """Greedy decoding of one sequence on the numba backend, many steps per compiled call.

    :func:`.decode.float_step.decode_step_one` with an ``ids`` buffer of k entries runs k greedy
    steps (each token is the argmax of the previous step's logits) without returning to Python,
    so the per-token Python work of the eager loop (the model call, checks, the argmax and the
    bookkeeping, about 0.1 ms a token) is paid once per call. The interface is that of the
    CUDA-graph decoder (``prefill``, ``room``, ``more``, ``cache``, ``S``), driven by
    :func:`minillama.infer.generate.stream_greedy`; ``stop`` ends a call early (the stop id is the
    last one returned)."""

    def __init__(self, backend, model, max_seq_len: int, stop_ids=(), cache=None,
                 cached: int = 0):
        self.backend = backend
        self.model = model
        self.cache = model.new_cache(1, max_seq_len) if cache is None else cache
        self.cached = int(cached)  # prompt positions the cache already holds
        self.S = self.cache.max_seq_len
        self.stop = np.array(sorted({int(t) for t in stop_ids}), dtype=np.int64)
        self._P = None  # prompt length
        self._done = 0  # ids decoded so far, the prefill's included
        self._last = 0  # the last id decoded (fed at the next step)
        #: the thread tuners of its plain steps and of its steps of known ids (:meth:`refeed`):
        #: the backend's, unless a decoder of another model sharing the backend (a draft
        #: model's) is given its own so that their times do not mix
        self.tuner, self.rows_tuner = backend.tuner, None

    def prefill(self, prompt) -> np.ndarray:
        """Run the (1, P) prompt through the model (per-op path, BLAS), filling the cache; the
        first new id (argmax of the last position's logits), shape (1,)."""
        prompt = np.asarray(prompt, dtype=np.int64)
        if prompt.ndim != 2 or prompt.shape[0] != 1:
            raise MinillamaError(f"prompt must be (1, P) token ids, got {prompt.shape}")
        P = prompt.shape[1]
        if not 1 <= P <= self.S or not 0 <= self.cached < P:
            raise MinillamaError(f"a prompt of {P} tokens ({self.cached} cached) does not fit "
                                 f"the cache of {self.S}")
        z = _finite(self.model.forward(prompt[:, self.cached:], self.cached, self.cache,
                                       last_only=True), "the prompt")
        self._last = int(z[0].argmax())
        self._P, self._done = P, 1
        return np.array([self._last], dtype=np.int64)

    def more(self, k: int) -> np.ndarray:
        """Up to ``k`` more greedy ids, (1, k') with k' = k unless a stop id came first (then it
        is the last id). Raises on logits holding NaN/inf."""
        k = self._check_more(k)
        ids = np.empty(k, dtype=np.int64)
        got = 0
        while got < k:  # in calls whose thread count the tuner picks
            rest = ids[got:]
            n = self.tuner.run(self.backend._numba_team,
                               lambda threads, n, rest=rest: self._steps(rest[:n], threads),
                               k - got)
            if n == 0:
                break
            got += n
            if ids[got - 1] < 0:
                raise nonfinite_error(f"position {self._P + self._done - 2}")
            if ids[got - 1] in self.stop:
                break
        return ids[None, :got]

    def _steps(self, ids: np.ndarray, threads: int) -> int:
        """Up to len(ids) greedy steps in one compiled call on ``threads`` threads, into
        ``ids``; the count run (fewer after a stop id or non-finite logits, whose -1 ends it)."""
        be, m = self.backend, self.model
        plan = be._decode_plan(m)
        kc, vc = be._cache_lists(self.cache, m.dtype)
        p0 = self.positions  # where the last id goes
        logits = np.empty((1, _vocab(plan)), dtype=m.dtype)
        n = be._step_one(plan, np.array([self._last], dtype=np.int64),
                         np.array([p0], dtype=np.int64), kc, vc, logits, self.stop, ids, threads)
        self._done += n
        if n:
            self._last = int(ids[n - 1])
        return n

    def own_tuners(self) -> GreedyDecoder:
        """This decoder with thread tuners of its own (a draft model's: its steps' times are
        not its target's, whose tuners the backend keeps), on all threads without trials (a
        draft model's calls are few and short: trials would cost more than they find)."""
        self.tuner = ThreadTuner(self.backend.num_threads, adapt=False)
        self.rows_tuner = ThreadTuner(self.backend.num_threads, adapt=False)
        return self

    def refeed(self, positions: int, tokens) -> int | None:
        """Make cache positions ``positions``... hold the known ids ``tokens`` (a draft model
        following its target's text, :class:`minillama.core.speculative.ModelDraft`), in fused
        steps of up to 16 rows (:meth:`DraftSteps.decode_rows`), forgetting the positions after
        them: the greedy id after them, which is then the next one fed. None (nothing done)
        where the backend has no such step for the model, or not yet."""
        be, m = self.backend, self.model
        tokens = [int(t) for t in tokens]
        if (self._P is None or not self._P <= positions <= self.S - len(tokens) or not tokens
                or not be.verification_ready(m)):
            return None
        for i in range(0, len(tokens), 16):
            rows = tokens[i:i + 16]
            p = positions + i
            z = be.decode_rows(m, rows, np.arange(p, p + len(rows)),
                               np.zeros(len(rows), dtype=np.int64), self.cache, self.rows_tuner)
            if z is None:
                return None
        self._last = int(_finite(z[-1:], f"position {positions + len(tokens) - 1}")[0].argmax())
        self._done = positions + len(tokens) - self._P + 1
        return self._last


class SpeculativeDecoder(Speculation, GreedyDecoder):
    """:class:`GreedyDecoder` with prompt-lookup drafts verified in one step of several rows
    (:class:`minillama.core.speculative.Speculation`): the rows are the one sequence at
    consecutive positions, all in cache row 0, each computed as the one-row step computes it,
    so the ids are the plain decoder's."""

    def prefill(self, prompt) -> np.ndarray:
        first = GreedyDecoder.prefill(self, prompt)
        self._start_lookup(np.asarray(prompt).reshape(-1), int(first[0]))
        return first

    def _plain(self, n: int) -> list[int]:
        return GreedyDecoder.more(self, n)[0].tolist()

    def verify(self, tokens) -> list[int]:
        """Each row's argmax (-1 for a row holding NaN/inf) of one step over ``tokens`` fed at
        the positions from the last id's on."""
        logits = self.verify_logits(tokens)
        ok = np.isfinite(logits).all(axis=1)
        return np.where(ok, logits.argmax(axis=1), -1).tolist()

    def verify_logits(self, tokens) -> np.ndarray:
        """The logits (len(tokens), V) of one step over the rows ``tokens`` fed at positions
        p, p + 1, ... of cache row 0 (p where the last id goes), each row's K/V written there
        (:meth:`DraftSteps.decode_rows`)."""
        B, p0 = len(tokens), self.positions
        return self.backend.decode_rows(self.model, tokens, np.arange(p0, p0 + B),
                                        np.zeros(B, dtype=np.int64), self.cache)

    def timing_settled(self) -> bool:
        """Whether the thread tuners of plain and verification steps have measured every count
        they choose between (before, steps run on trial counts and their times mislead)."""
        return self.tuner.settled and self.backend.verify_tuner.settled

    _ready = False

    def verify_ready(self) -> bool:
        """:meth:`DraftSteps.verification_ready`, asked until it says yes (then it stays so)."""
        self._ready = self._ready or self.backend.verification_ready(self.model)
        return self._ready

    def _take(self, ids) -> None:
        if ids[-1] < 0:
            raise nonfinite_error(f"position {self._P + self._done + len(ids) - 2}")
        self._done += len(ids)
        self._last = int(ids[-1])
