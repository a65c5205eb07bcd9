r"""Same input, same output: a sequence's logits do not depend on what is batched with it, on
whether its prefix came from a cache, on the thread count, or on whether a position was computed
in a prefill or in a decode step.

These are promises of an implementation, not of the math: every one of them holds exactly in
real numbers and within rounding on any backend (``model_batch_independence`` and
``model_kv_cache_decode`` check that, with tolerances). Here the tolerance is zero: the two
sides must agree bit for bit, which holds only where a backend fixes the order of every float
sum whatever the batch, cache and threads (docs/KERNELS.md, "Same input, same output").

A backend declares the ones it keeps in ``invariance`` (a set of the names below without
``_invariance``; the reference declares none). On a backend that promises an identity, any
difference fails it; on one that does not, ``minillama check`` runs it all the same and reports
"not guaranteed" with the largest difference it met, relative to the logits' largest magnitude.

The model is what users run these engines on: float32, its linear weights in GGML blocks
(Q4_0, Q4_1, Q5_0, Q8_0, cycled), prompts up to 80 tokens, so that the sizes cross the paths'
thresholds (more than one attention span of 64 cached rows, the 8-bit GEMM above 8 rows);
``prefill_decode_invariance`` draws as often a model of rows of 256 in the K-quants (Q4_K, Q6_K,
Q5_K, Q3_K, Q2_K, cycled: sub-blocks of 32 and of 16), the product whose order its decode steps
and its prompts' GEMM must share. The
``float_decode_*`` identities take the same model with float32 weights and hold its decode
steps only (a float prompt's products take BLAS, whose order depends on the row count).
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from minillama.core.config import ModelConfig
from minillama.core.quantize import quantize
from minillama.identities import strategies as ids
from minillama.identities.base import MODEL_FORWARD_OPS, Identity, Subject
from minillama.identities.model import lively_params
from minillama.model.transformer import Transformer

#: the block types the model's matrices cycle through (blocks of 32 values)
TYPES = ("Q4_0", "Q8_0", "Q4_1", "Q5_0")
#: the K-quants :func:`kquant_model`'s matrices cycle through (super-blocks of 256)
K_TYPES = ("Q4_K", "Q6_K", "Q5_K", "Q3_K", "Q2_K")
#: the longest prompt drawn, and the context
MAX_PROMPT = 80
CONTEXT = 96
VOCAB = 61


def block_model(s: Subject, seed: int, types=TYPES) -> Transformer:
    """A float32 LLaMA of two layers (D 64, 4 query heads on 2 KV heads, F 96, V 61) on the
    subject's backend with :func:`~minillama.identities.model.lively_params`, its linear
    weights quantized to ``types`` (cycled), the embedding and norm gains float. K-quant
    ``types`` take rows of 256: D 256, F 512."""
    wide = any(t in K_TYPES for t in types)
    cfg = ModelConfig(dim=256 if wide else 64, n_layers=2, n_heads=4, n_kv_heads=2,
                      vocab_size=VOCAB, hidden_dim=512 if wide else 96, max_seq_len=CONTEXT)
    params, k = {}, 0
    for name, w in lively_params(cfg, seed).items():
        if w.ndim == 2 and name != "tok_embeddings.weight":
            params[name] = quantize(w, types[k % len(types)])
            k += 1
        else:
            params[name] = w.astype(np.float32)
    return Transformer(cfg, params, backend=s.backend, dtype=np.float32)


def kquant_model(s: Subject, seed: int) -> Transformer:
    """:func:`block_model` in the K-quants (:data:`K_TYPES`)."""
    return block_model(s, seed, K_TYPES)


def float_model(s: Subject, seed: int) -> Transformer:
    """:func:`block_model`'s shape with every weight float32 (a float checkpoint)."""
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB,
                      hidden_dim=96, max_seq_len=CONTEXT)
    params = {k: w.astype(np.float32) for k, w in lively_params(cfg, seed).items()}
    return Transformer(cfg, params, backend=s.backend, dtype=np.float32)


def deviation(a, b) -> float:
    """max |a - b| / max |a|: 0 exactly when the two agree bit for bit (inf where either has a
    NaN or an infinity)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("inf")
    d = float(np.abs(a - b).max(initial=0.0))
    return 0.0 if d == 0 else d / max(float(np.abs(a).max(initial=0.0)), 1e-300)


def _tokens(seed: int, *shape) -> np.ndarray:
    return np.random.default_rng([seed, 12]).integers(0, VOCAB, shape)


def _steps(s: Subject, model, cache, toks, start) -> list[np.ndarray]:
    """Decode steps feeding ``toks`` (B, N) one column at a time from positions ``start``
    ((B,) ints): each step's logits (B, V)."""
    out = []
    for i in range(toks.shape[1]):
        out.append(s.logits(model, toks[:, i:i + 1], start_pos=np.asarray(start) + i,
                            cache=cache, last_only=True))
    return out


def _alone(s: Subject, model, prompt, follow) -> list[np.ndarray]:
    """A prompt (T,) prefilled alone into a fresh cache, then the tokens ``follow`` (N,)
    stepped one at a time: the prompt's last logits and each step's, each (V,)."""
    cache = model.new_cache(1)
    got = [s.logits(model, prompt[None], cache=cache, last_only=True)[0]]
    got += [z[0] for z in _steps(s, model, cache, follow[None], [len(prompt)])]
    return got


def _batch(s: Subject, ex: dict) -> float:
    model = block_model(s, ex["seed"])
    lens = [ex["P"]] + ex["others"]
    B, T, N = len(lens), max(lens), ex["steps"]
    block = _tokens(ex["seed"], B, T)
    follow = _tokens(ex["seed"] + 1, B, N)
    want = _alone(s, model, block[0, :lens[0]], follow[0])
    cache = model.new_cache(B)  # the padded group, then its rows stepped at their own positions
    got = [s.logits(model, block, cache=cache, output_index=np.array(lens) - 1)[0]]
    got += [z[0] for z in _steps(s, model, cache, follow, lens)]
    return max(deviation(w, g) for w, g in zip(want, got))


def _prefix_cache(s: Subject, ex: dict) -> float:
    model = block_model(s, ex["seed"])
    P, c = ex["P"], min(ex["cached"], ex["P"] - 2)
    prompt, follow = _tokens(ex["seed"], P), _tokens(ex["seed"] + 1, 2)
    want = _alone(s, model, prompt, follow)
    # an earlier request shared the first c tokens; its rows 0..c-1 are kept, the rest is new
    earlier = model.new_cache(1)
    other = np.concatenate([prompt[:c], _tokens(ex["seed"] + 2, ex["extra"])])
    s.logits(model, other[None], cache=earlier, last_only=True)
    cache = model.new_cache(1)
    for kept, old in zip(cache.k + cache.v, earlier.k + earlier.v):
        kept[:, :c] = old[:, :c]
    got = [s.logits(model, prompt[None, c:], start_pos=c, cache=cache, last_only=True)[0]]
    got += [z[0] for z in _steps(s, model, cache, follow[None], [P])]
    return max(deviation(w, g) for w, g in zip(want, got))


def _chunks(s: Subject, ex: dict) -> float:
    model = block_model(s, ex["seed"])
    P = ex["P"]
    prompt, follow = _tokens(ex["seed"], P), _tokens(ex["seed"] + 1, 2)
    want = _alone(s, model, prompt, follow)
    cache, got = model.new_cache(1), []
    cuts = [0]  # chunks of two tokens or more: a call of one token is a decode step
    for c in sorted(ex["cuts"]) + [P]:
        if c - cuts[-1] >= 2 and P - c >= 2 or c == P:
            cuts.append(c)
    for a, b in zip(cuts, cuts[1:]):  # each chunk's last logits, as a caller streaming it would
        got.append(s.logits(model, prompt[None, a:b], start_pos=a, cache=cache,
                            last_only=True)[0])
    got = got[-1:] + [z[0] for z in _steps(s, model, cache, follow[None], [P])]
    return max(deviation(w, g) for w, g in zip(want, got))


def _next_turn(s: Subject, ex: dict) -> float:
    model = block_model(s, ex["seed"])
    P, N = ex["P"], ex["reply"]
    prompt, follow = _tokens(ex["seed"], P), _tokens(ex["seed"] + 1, 2)
    # the earlier turn: its prompt prefilled, then a greedy reply fed by decode steps
    earlier = model.new_cache(1)
    z, reply = s.logits(model, prompt[None], cache=earlier, last_only=True)[0], []
    for i in range(N):
        reply.append(int(np.argmax(z)))
        z = s.logits(model, np.array([[reply[-1]]]), start_pos=P + i, cache=earlier,
                     last_only=True)[0]
    turn = np.concatenate([prompt, reply, _tokens(ex["seed"] + 2, ex["extra"])])
    want = _alone(s, model, turn, follow)
    # the next turn keeps the rows the model allows of the earlier one and prefills the rest
    c = model.reusable_rows(P, P + N)
    cache = model.new_cache(1)
    for kept, old in zip(cache.k + cache.v, earlier.k + earlier.v):
        kept[:, :c] = old[:, :c]
    got = [s.logits(model, turn[None, c:], start_pos=c, cache=cache, last_only=True)[0]]
    got += [z[0] for z in _steps(s, model, cache, follow[None], [len(turn)])]
    return max(deviation(w, g) for w, g in zip(want, got))


def _threads(s: Subject, ex: dict) -> float:
    model = block_model(s, ex["seed"])
    prompt, follow = _tokens(ex["seed"], ex["P"]), _tokens(ex["seed"] + 1, ex["steps"])
    runs = []
    for n in (1, ex["threads"]):
        with model.backend.threads(n):
            runs.append(_alone(s, model, prompt, follow))
    return max(deviation(w, g) for w, g in zip(*runs))


def _prefill_decode(s: Subject, ex: dict, make=block_model) -> float:
    model = (kquant_model if ex.get("kquants") else make)(s, ex["seed"])
    P = ex["P"]
    prompt = _tokens(ex["seed"], P)
    want = s.logits(model, prompt[None], cache=model.new_cache(1), last_only=True)[0]
    cache = model.new_cache(1)  # the same prompt fed one token at a time
    got = _steps(s, model, cache, prompt[None], [0])[-1][0]
    return deviation(want, got)


def _float_prefill_decode(s: Subject, ex: dict) -> float:
    return _prefill_decode(s, ex, float_model)


def _prefilled_alone(s: Subject, model, prompts) -> object:
    """A cache of len(prompts) rows, row b holding prompt b prefilled alone (so its K/V rows
    are those of a one-sequence prefill whatever the other rows hold)."""
    cache = model.new_cache(len(prompts))
    for b, prompt in enumerate(prompts):
        s.logits(model, prompt[None], cache=cache.rows(b, b + 1), last_only=True)
    return cache


def _float_batch(s: Subject, ex: dict) -> float:
    model = float_model(s, ex["seed"])
    lens = [ex["P"]] + ex["others"]
    prompts = [_tokens(ex["seed"] + b, n) for b, n in enumerate(lens)]
    follow = _tokens(ex["seed"] + 99, len(lens), ex["steps"])
    want = _steps(s, model, _prefilled_alone(s, model, prompts[:1]), follow[:1], lens[:1])
    got = _steps(s, model, _prefilled_alone(s, model, prompts), follow, lens)
    return max(deviation(w[0], g[0]) for w, g in zip(want, got))


def _float_threads(s: Subject, ex: dict) -> float:
    model = float_model(s, ex["seed"])
    prompt, follow = _tokens(ex["seed"], ex["P"]), _tokens(ex["seed"] + 1, 1, ex["steps"])
    runs = []
    for n in (1, ex["threads"]):
        cache = _prefilled_alone(s, model, [prompt])
        with model.backend.threads(n):
            runs.append(_steps(s, model, cache, follow, [ex["P"]]))
    return max(deviation(w, g) for w, g in zip(*runs))


def _speculative(s: Subject, ex: dict) -> float:
    model = block_model(s, ex["seed"])
    prompt, rows = _tokens(ex["seed"], ex["P"]), _tokens(ex["seed"] + 1, ex["rows"])
    want = _alone(s, model, prompt, rows)[1:]  # each row fed by a decode step of its own
    dec = model.backend.greedy_decoder(model, CONTEXT, speculate=True)
    if hasattr(dec, "verify_logits"):  # the backend's verification step
        dec.prefill(prompt[None])
        got = s.get(dec.verify_logits(rows))
    else:  # a backend without one: the rows in one forward, as a prompt's next chunk
        cache = model.new_cache(1)
        s.logits(model, prompt[None], cache=cache, last_only=True)
        got = s.logits(model, rows[None], start_pos=ex["P"], cache=cache)[0]
    return max(deviation(w, g) for w, g in zip(want, got))


def _prompts(lo: int, hi: int, fields) -> st.SearchStrategy:
    """Examples of a seed, a prompt length P in lo..hi and the strategies ``fields(P)``."""
    return st.integers(lo, hi).flatmap(lambda P: st.fixed_dictionaries({
        "seed": ids.seeds, "P": st.just(P), **fields(P)}))


_PROMPT = st.integers(1, MAX_PROMPT)
#: a prompt stepped beside 1-3 others, and one on 1 and 2-4 threads
_BESIDE = st.fixed_dictionaries({"seed": ids.seeds, "P": _PROMPT, "steps": st.integers(1, 3),
                                 "others": st.lists(_PROMPT, min_size=1, max_size=3)})
_THREADS = st.fixed_dictionaries({"seed": ids.seeds, "P": _PROMPT, "steps": st.integers(1, 3),
                                  "threads": st.integers(2, 4)})

IDENTITIES = [
    Identity(
        name="batch_invariance", topic="invariance",
        statement="A sequence's logits are the same bit for bit alone and batched: prefilled in "
                  "a padded group beside 1-3 other prompts, then stepped beside them at their "
                  "own positions.",
        equation=r"z(X)_b \equiv z(X_b)",
        strategy=_BESIDE,
        tolerance="zero where the backend promises it (its invariance set); else the largest "
                  "difference is reported",
        ops=MODEL_FORWARD_OPS, fn=_batch, for_functions=False, exact="batch"),
    Identity(
        name="prefix_cache_invariance", topic="invariance",
        statement="A prompt's logits, and those of the steps after it, are the same bit for "
                  "bit prefilled cold and after its first c tokens' K/V came from another "
                  "request's cache (a rest of two tokens or more: a call of one token with a "
                  "cache is a decode step).",
        equation=r"z(x_{c:P} \mid \mathrm{cache}(x_{0:c})) \equiv z(x_{0:P})_{c:P}",
        strategy=_prompts(3, MAX_PROMPT, lambda P: {"cached": st.integers(1, P - 2),
                                                    "extra": st.integers(1, 9)}),
        tolerance="zero where the backend promises it; else reported",
        ops=MODEL_FORWARD_OPS, fn=_prefix_cache, for_functions=False, exact="prefix_cache"),
    Identity(
        name="chunked_prefill_invariance", topic="invariance",
        statement="A prompt's logits, and those of the steps after it, are the same bit for "
                  "bit prefilled at once and cut into chunks of two tokens or more (a call of "
                  "one token with a cache is a decode step) prefilled one after another, each "
                  "asked for its last logits.",
        equation=r"z(x_{c_k:P} \mid \mathrm{cache}(x_{0:c_1}, \dots, x_{c_{k-1}:c_k})) "
                 r"\equiv z(x_{0:P})_{c_k:P}",
        strategy=_prompts(2, MAX_PROMPT, lambda P: {
            "cuts": st.lists(st.integers(1, P - 1), min_size=1, max_size=4)}),
        tolerance="zero where the backend promises prefix-cache invariance; else reported",
        ops=MODEL_FORWARD_OPS, fn=_chunks, for_functions=False, exact="prefix_cache"),
    Identity(
        name="next_turn_invariance", topic="invariance",
        statement="A conversation's next turn (an earlier prompt, its greedy reply fed by "
                  "decode steps, then new tokens) gets the same logits bit for bit prefilled "
                  "cold and on the rows of the earlier turn's cache that the model lets a later "
                  "prompt keep (Transformer.reusable_rows), as chat and the server keep them.",
        equation=r"z(t_{c:} \mid \mathrm{cache}_{<c}(x, y)) \equiv z(t)_{c:},\ "
                 r"t = (x, y, u),\ c = \mathrm{reusable}(|x|, |x| + |y|)",
        strategy=_prompts(1, MAX_PROMPT - 12, lambda P: {"reply": st.integers(1, 8),
                                                        "extra": st.integers(1, 4)}),
        tolerance="zero where the backend promises prefix-cache invariance; else reported",
        ops=MODEL_FORWARD_OPS, fn=_next_turn, for_functions=False, exact="prefix_cache"),
    Identity(
        name="thread_invariance", topic="invariance",
        statement="A prompt's logits and its decode steps' are the same bit for bit on one "
                  "thread and on several.",
        equation=r"z_{1\ \mathrm{thread}}(x) \equiv z_{n\ \mathrm{threads}}(x)",
        strategy=_THREADS,
        tolerance="zero where the backend promises it; else reported",
        ops=MODEL_FORWARD_OPS, fn=_threads, for_functions=False, exact="threads"),
    Identity(
        name="prefill_decode_invariance", topic="invariance",
        statement="A prompt's last logits are the same bit for bit prefilled at once and fed "
                  "one token at a time through decode steps.",
        equation=r"z(x_{0:P})_{P-1} \equiv \mathrm{step}(x_{P-1} \mid \mathrm{steps}(x_{0:P-1}))",
        strategy=st.fixed_dictionaries({"seed": ids.seeds, "P": st.integers(2, MAX_PROMPT),
                                        "kquants": st.booleans()}),
        tolerance="zero where the backend promises it; else reported",
        ops=MODEL_FORWARD_OPS, fn=_prefill_decode, for_functions=False,
        exact="prefill_decode"),
    Identity(
        name="float_decode_batch_invariance", topic="invariance",
        statement="On float32 weights, a sequence's decode steps give the same logits bit for "
                  "bit stepped alone and beside 1-3 other sequences at their own positions "
                  "(each prompt prefilled alone).",
        equation=r"\mathrm{step}(X)_b \equiv \mathrm{step}(X_b)",
        strategy=_BESIDE,
        tolerance="zero where the backend promises it; else reported",
        ops=MODEL_FORWARD_OPS, fn=_float_batch, for_functions=False,
        exact="float_decode_batch"),
    Identity(
        name="float_decode_thread_invariance", topic="invariance",
        statement="On float32 weights, the decode steps after a prompt give the same logits "
                  "bit for bit on one thread and on several.",
        equation=r"\mathrm{step}_{1}(x) \equiv \mathrm{step}_{n}(x)",
        strategy=_THREADS,
        tolerance="zero where the backend promises it; else reported",
        ops=MODEL_FORWARD_OPS, fn=_float_threads, for_functions=False,
        exact="float_decode_threads"),
    Identity(
        name="float_prefill_decode_invariance", topic="invariance",
        statement="On float32 weights, a prompt's last logits are the same bit for bit "
                  "prefilled at once and fed one token at a time through decode steps.",
        equation=r"z(x_{0:P})_{P-1} \equiv \mathrm{step}(x_{P-1} \mid \mathrm{steps}(x_{0:P-1}))",
        strategy=st.fixed_dictionaries({"seed": ids.seeds, "P": st.integers(2, MAX_PROMPT)}),
        tolerance="zero where the backend promises it (none does: a float prompt's products "
                  "take BLAS); else reported",
        ops=MODEL_FORWARD_OPS, fn=_float_prefill_decode, for_functions=False,
        exact="float_prefill_decode"),
    Identity(
        name="speculative_equals_greedy", topic="invariance",
        statement="After a prompt, one verification step over k drafted tokens (the rows at "
                  "positions P ... P + k - 1, each attending up to its own) gives each row the "
                  "logits bit for bit of feeding the tokens one decode step at a time, so "
                  "speculative decoding keeps the greedy tokens.",
        equation=r"\mathrm{verify}(d_{0:k} \mid x)_i \equiv \mathrm{step}(d_i \mid x, d_{0:i})",
        strategy=_prompts(1, MAX_PROMPT, lambda P: {
            "rows": st.integers(1, min(16, CONTEXT - P))}),
        tolerance="zero where the backend promises it; else reported",
        ops=MODEL_FORWARD_OPS, fn=_speculative, for_functions=False, exact="speculative"),
]
