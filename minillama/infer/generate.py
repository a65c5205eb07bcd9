r"""Text generation with a KV cache: prefill the prompt in one call, then one token per call.

The loop for a batch of B prompts of lengths n_b (right-padded to the longest):

1. **prefill**: one forward over the padded (B, max n_b) prompt block writes every prompt
   position's K/V into the cache and returns only the logits at position n_b - 1 of each
   sequence (``output_index``), so the V x D classifier runs B times, not B * T times;
2. **decode**: each step feeds the token just chosen for every sequence at its own position
   p_b (``start_pos`` is a (B,) array), appending one K/V row per layer and reading positions
   0..p_b only; padding rows beyond p_b are masked and later overwritten.

Each sequence stops on its own (a stop token, ``max_new_tokens`` or the end of the context);
the batch ends when all have stopped. Each sequence samples with its own generator seeded
``seed``, so a prompt gives the same tokens wherever it stands in a batch, and alone (without a
seed, each sequence draws a fresh one).
"""

from __future__ import annotations

import codecs
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from minillama.backends import graph_decoder
from minillama.core.decoding import ChunkDecoder, nonfinite_error, stream_greedy  # noqa: F401 (re-exported)
from minillama.core.decoding import finite_logits as _finite
from minillama.core.errors import MinillamaError
from minillama.core.sampling import SamplingParams
from minillama.core.speculative import DraftModel, Speculation


@dataclass
class GenerationStats:
    """Token counts and wall times of one generation; ``cache_bytes`` is the KV cache size
    2 * L * B * S * KVH * hd * itemsize."""

    batch_size: int = 0
    prompt_tokens: int = 0
    prefill_s: float = 0.0
    new_tokens: int = 0
    decode_steps: int = 0
    decode_s: float = 0.0
    cache_bytes: int = 0
    cache_shape: tuple = field(default_factory=tuple)
    #: the cache positions sequence 0 holds at the end (its prompt and the new tokens fed)
    positions: int = 0
    #: draft tokens verified by speculative decoding, and how many of them were taken
    drafted: int = 0
    accepted: int = 0

    @property
    def drafts_taken(self) -> str:
        """"drafts: a of d tokens taken" for a speed line, "" without drafts."""
        return f"drafts: {self.accepted} of {self.drafted} tokens taken" if self.drafted else ""

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens produced by the decode steps (every sequence still running counts) per second."""
        n = self.new_tokens - self.batch_size  # the first token of each sequence comes from prefill
        return n / self.decode_s if self.decode_s > 0 and n > 0 else float("nan")


def _as_prompts(prompts) -> tuple[list[list[int]], bool]:
    """Normalise one prompt (a sequence of ints) or several into a list of int lists."""
    if isinstance(prompts, np.ndarray):
        prompts = prompts.tolist()
    prompts = list(prompts)
    single = len(prompts) == 0 or not isinstance(prompts[0], (list, tuple, np.ndarray))
    seqs = [prompts] if single else prompts
    out = []
    for s in seqs:
        s = [int(t) for t in (s.tolist() if isinstance(s, np.ndarray) else s)]
        if not s:
            raise MinillamaError("every prompt needs at least one token (e.g. BOS)")
        out.append(s)
    if not out:
        raise MinillamaError("no prompts given")
    return out, single


def generate_steps(model, prompts, max_new_tokens: int | None = None,
                   params: SamplingParams | None = None, *, stop_ids: Iterable[int] = (),
                   stats: GenerationStats | None = None, cache=None, cached: int = 0,
                   rngs: list | None = None, speculate: bool = True, draft=None,
                   **settings) -> Iterator[list[tuple[int, int]]]:
    """Generate, yielding after every model call the list of ``(sequence index, token)`` pairs
    produced by it (stop tokens are not yielded). ``prompts`` is a list of token-id lists (or one
    list). ``params`` (a :class:`~minillama.core.sampling.SamplingParams`, default greedy) with
    ``settings`` (its field names: ``temperature=...``, ``top_k=...``, ``seed=...``) replaced says
    how tokens are chosen; the penalties look at each sequence's prompt and new tokens.
    ``max_new_tokens`` defaults to ``params.max_tokens``, else 256. ``stats`` (optional) is
    filled in as the generation runs.

    The decode loop of every front end but the server's continuous batching: ``chat`` runs its
    turns through it with ``cache`` (a one-sequence cache to write into, whose first ``cached``
    positions already hold the prompt's first tokens: only the rest is prefilled, at positions
    ``cached``...) and ``rngs`` (the generators to draw from, one per sequence, instead of new
    ones seeded ``params.seed``). ``speculate``: greedy decoding of one prompt verifies
    prompt-lookup drafts (:mod:`minillama.core.speculative`) where the backend computes them
    exactly as plain steps (the same ids, fewer reads of the weights); False turns it off.
    ``draft``: a smaller model with the same tokenizer drafting its greedy continuation (a
    :class:`~minillama.core.speculative.DraftModel` keeps its cache from call to call)."""
    params = SamplingParams.of(params, **settings)
    if max_new_tokens is None:
        max_new_tokens = 256 if params.max_tokens is None else params.max_tokens
    seqs, _ = _as_prompts(prompts)
    if max_new_tokens < 0:
        raise MinillamaError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    cfg, be = model.cfg, model.backend
    B = len(seqs)
    lens = _prompt_lengths(cfg, seqs)
    stop = {int(t) for t in stop_ids}
    stats = stats if stats is not None else GenerationStats()
    stats.__dict__.update(GenerationStats().__dict__)  # a reused stats object starts afresh
    stats.batch_size = B
    if max_new_tokens == 0:
        return
    cache_len, budget = _cache_len_and_budget(cfg, lens, max_new_tokens, cache, cached)
    stats.cache_shape = (2, cfg.n_layers, B, cache_len, cfg.n_kv_heads, cfg.head_dim)
    rngs = _sequence_rngs(params.seed, B) if rngs is None else rngs
    penalised = params.penalised
    hist = [list(s) for s in seqs] if penalised else None  # each sequence's context so far
    greedy = params.temperature == 0

    def pick(b, z):
        return params.pick(z, rngs[b], hist[b] if penalised else ())

    if B == 1 and greedy and not penalised:  # many steps per call
        dec = _greedy_decoder(model, cache_len, stop, speculate, cache, cached, draft)
        if dec is not None:
            yield from _decoded(dec, seqs[0], max_new_tokens, cfg.max_seq_len, stop, stats,
                                cached)
            return
    if cache is None:
        cache = model.new_cache(B, cache_len)
    stats.cache_bytes = cache.nbytes
    # greedy with several sequences: a backend may run up to 16 steps per call
    many = be.greedy_steps if greedy and B > 1 and not penalised else None
    yield from _prefill_and_decode(model, seqs, lens, cache, pick, many, stop, budget, hist,
                                   stats, cached)


def _greedy_decoder(model, cache_len: int, stop, speculate: bool, cache, cached: int, draft):
    """The backend's decoder of one greedy sequence (several steps per call), drafting from
    ``draft``'s own decoder where it verifies drafts; None where the backend has none."""
    dec = model.backend.greedy_decoder(model, cache_len, stop, speculate=speculate, cache=cache,
                                       cached=cached)
    if dec is not None and draft is not None and isinstance(dec, Speculation):
        src = draft if isinstance(draft, DraftModel) else DraftModel(draft)
        if src.decoder is None or src.decoder.S < cache_len:
            d = draft_decoder(src.model, cache_len)
            src.decoder, src.last = getattr(d, "own_tuners", lambda: d)(), None
        dec.draft_source = src
    return dec


def draft_decoder(draft, cache_len: int):
    """A plain greedy decoder of model ``draft`` (on its backend, a cache of ``cache_len``),
    or a one-line error where its backend has none."""
    d = draft.backend.greedy_decoder(draft, cache_len)
    if d is None:
        raise MinillamaError(f"the draft model has no multi-step greedy decoder on the "
                             f"{draft.backend.name} backend")
    return d


def _decoded(dec, prompt, max_new_tokens: int, context: int, stop, stats, cached: int):
    """:func:`stream_greedy` through a backend's decoder ``dec``, ``stats`` kept up to date
    (the drafts taken, the positions held, the prompt tokens prefilled)."""
    stats.cache_bytes = dec.cache.nbytes
    for out in stream_greedy(dec, prompt, max_new_tokens, context, stop, stats):
        stats.drafted, stats.accepted = dec.drafted, dec.accepted
        stats.positions = dec.positions
        stats.prompt_tokens = len(prompt) - cached
        yield out


def _cache_len_and_budget(cfg, lens, max_new_tokens: int, cache, cached: int):
    """The cache length (a given cache's, else the longest prompt plus the new tokens, capped
    at the context) and each sequence's budget of new tokens (B,); a given cache must take one
    prompt that it holds fewer than all of."""
    if cache is not None and (len(lens) != 1 or not 0 <= cached < int(lens[0])
                              or int(lens[0]) > cache.max_seq_len):
        raise MinillamaError(f"a given cache takes one prompt of at most {cache.max_seq_len} "
                             f"tokens with fewer than its length cached ({cached} of "
                             f"{int(lens[0])})")
    cache_len = (cache.max_seq_len if cache is not None
                 else int(min(cfg.max_seq_len, int((lens + max_new_tokens).max()))))
    # token k of sequence b lands at position n_b + k - 1 and is sampled after feeding position
    # n_b + k - 2, which must lie inside the context: k <= S - n_b + 1
    return cache_len, np.minimum(max_new_tokens, min(cfg.max_seq_len, cache_len) - lens + 1)


def _prompt_lengths(cfg, seqs) -> np.ndarray:
    """The prompts' lengths (B,), each checked against the model context."""
    lens = np.array([len(s) for s in seqs], dtype=np.int64)
    longest = int(lens.max())
    if longest > cfg.max_seq_len:
        raise MinillamaError(
            f"prompt of {longest} tokens is longer than the model context of {cfg.max_seq_len}")
    return lens


def _sequence_rngs(seed, B: int) -> list:
    """One generator per sequence, each seeded ``seed`` (its draws do not depend on its place
    in the batch); without a seed, a fresh one per sequence."""
    if seed is None:
        return [np.random.default_rng() for _ in range(B)]
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise MinillamaError(f"seed must be a non-negative integer, got {seed!r}")
    return [np.random.default_rng(seed) for _ in range(B)]


def _prefill(model, seqs, lens, cache, cached: int = 0) -> np.ndarray:
    """The prompts in one call (padded to the longest, the cache filled; one prompt from
    position ``cached`` on, the cache holding the rest): each sequence's last-position logits
    (B, V) on the host, checked finite."""
    B = len(seqs)
    block = np.zeros((B, int(lens.max())), dtype=np.int64)
    for b, s in enumerate(seqs):
        block[b, :len(s)] = s
    if B == 1:
        logits = model.forward(block[:, cached:], start_pos=cached, cache=cache, last_only=True)
    else:
        logits = model.forward(block, start_pos=0, cache=cache, output_index=lens - 1)
    return _finite(model.backend.to_numpy(logits), "the prompt")


def _prefill_and_decode(model, seqs, lens, cache, pick, many, stop, budget, hist, stats,
                        cached=0):
    """The prompts in one call (padded to the longest, each sequence's last position read),
    then one token per running sequence per step until every one stops; yields each call's
    ``(sequence index, token)`` pairs. ``many``: the backend's greedy_steps, or None;
    ``cached``: the positions of a one-prompt cache already filled."""
    be, B, cache_len = model.backend, len(seqs), cache.max_seq_len
    # -- prefill ----------------------------------------------------------------------------
    t0 = time.perf_counter()
    z = _prefill(model, seqs, lens, cache, cached)
    stats.prompt_tokens = int(lens.sum()) - cached
    alive = np.ones(B, dtype=bool)
    pos = lens.copy()  # where each sequence's next token goes
    stats.positions = int(pos[0])
    last = np.zeros(B, dtype=np.int64)
    emitted = np.zeros(B, dtype=np.int64)
    step_out = _choose(lambda b: pick(b, z[b]), alive, stop, last, emitted, budget, hist)
    stats.prefill_s = time.perf_counter() - t0
    stats.new_tokens += len(step_out)
    if step_out:
        yield step_out
    # -- decode (the time the caller spends between our yields is not counted) ---------------
    # with ``many``, the ids of every sequence at each of up to 16 steps come from one call,
    # replayed below step by step exactly as the loop does
    ids, j = None, 0  # the steps of the last such call, and the next one to replay
    while True:
        t0 = time.perf_counter()
        # a sequence keeps running while it may emit and its next token has a slot to go
        alive &= pos < cache_len
        if not alive.any():
            break
        feed_pos = np.minimum(pos, cache_len - 1)
        if many is not None and (ids is None or j == ids.shape[1]):
            left = np.minimum(budget - emitted, cache_len - pos)[alive]
            ids, j = many(model, last, feed_pos, cache, int(min(16, left.max()))), 0
            if ids is None:
                many = None
        if ids is not None:  # the step's ids from the call above
            picked = ids[:, j]
            j += 1
            bad = alive & (picked < 0)
            if bad.any():
                raise nonfinite_error(f"position {int(feed_pos[bad].max())}")
            pos = pos + alive
            stats.positions = int(pos[0])
            step_out = _choose(lambda b, picked=picked: int(picked[b]), alive, stop, last,
                               emitted, budget, hist)
        else:
            sp = int(feed_pos[0]) if B == 1 else feed_pos
            logits = model.forward(last[:, None], start_pos=sp, cache=cache, last_only=True)
            z = _finite(be.to_numpy(logits), f"position {int(np.max(feed_pos))}")
            pos = pos + alive
            stats.positions = int(pos[0])
            step_out = _choose(lambda b, z=z: pick(b, z[b]), alive, stop, last, emitted,
                               budget, hist)
        stats.decode_steps += 1
        stats.new_tokens += len(step_out)
        stats.decode_s += time.perf_counter() - t0
        if step_out:
            yield step_out


def _choose(pick, alive, stop, last, emitted, budget, hist=None):
    """Take the next token ``pick(b)`` of every running sequence b; update ``alive``/``last``/
    ``emitted`` (and ``hist``, each sequence's ids, when given); the (b, token) pairs
    emitted."""
    out = []
    for b in np.flatnonzero(alive):
        if emitted[b] >= budget[b]:
            alive[b] = False
            continue
        tok = pick(b)
        if tok in stop:
            alive[b] = False
            continue
        last[b] = tok
        if hist is not None:
            hist[b].append(tok)
        emitted[b] += 1
        if emitted[b] >= budget[b]:
            alive[b] = False
        out.append((int(b), tok))
    return out


def generate(model, prompts, max_new_tokens: int | None = None,
             params: SamplingParams | None = None, *, stop_ids: Iterable[int] = (),
             callback: Callable[[int, int], None] | None = None,
             stats: GenerationStats | None = None, **settings):
    """Generate continuations. One prompt (list of ints) -> its new tokens (list of ints);
    several prompts -> a list of lists. ``callback(seq_index, token)`` is called for each token as
    it is produced (streaming). Stop tokens end a sequence and are not included. ``params`` and
    ``settings``: how tokens are chosen (see :func:`generate_steps`)."""
    seqs, single = _as_prompts(prompts)
    outs: list[list[int]] = [[] for _ in seqs]
    for step in generate_steps(model, seqs, max_new_tokens, params, stop_ids=stop_ids,
                               stats=stats, **settings):
        for b, tok in step:
            outs[b].append(tok)
            if callback is not None:
                callback(b, tok)
    return outs[0] if single else outs


def stream(model, prompt: Sequence[int], **kwargs) -> Iterator[int]:
    """Yield the new tokens of one prompt as they are produced (keyword arguments as
    :func:`generate`)."""
    for step in generate_steps(model, [list(prompt)], **kwargs):
        for _, tok in step:
            yield tok


class TextStreamer:
    """Turns a growing list of token ids into text pieces without splitting UTF-8 characters.

    Uses the tokenizer's ``decode_bytes`` (prefix-stable bytes) with an incremental UTF-8 decoder
    when it has one, else re-decodes the ids and emits the new suffix once it is stable.
    """

    def __init__(self, tokenizer, prefix_ids: Sequence[int] = ()):
        self.tok = tokenizer
        self.ids = list(prefix_ids)
        self._bytes_mode = hasattr(tokenizer, "decode_bytes")
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._nbytes = 0
        self._text = ""

    def put(self, token: int) -> str:
        self.ids.append(int(token))
        if self._bytes_mode:
            data = self.tok.decode_bytes(self.ids)
            new = data[self._nbytes:]
            self._nbytes = len(data)
            return self._dec.decode(new)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd") or not text.startswith(self._text):
            return ""
        new = text[len(self._text):]
        self._text = text
        return new

    def start(self) -> str:
        """The text of the prefix ids (the prompt)."""
        if self._bytes_mode:
            data = self.tok.decode_bytes(self.ids)
            self._nbytes = len(data)
            return self._dec.decode(data)
        self._text = self.tok.decode(self.ids)
        return self._text

    def flush(self) -> str:
        if self._bytes_mode:
            return self._dec.decode(b"", final=True)
        text = self.tok.decode(self.ids)
        new = text[len(self._text):] if text.startswith(self._text) else ""
        self._text = text
        return new


def graph_decoder_for(model, mode: str, temperature: float, cache_len: int):
    """The CUDA-graph decoder (:func:`minillama.backends.graph_decoder`) that ``--cuda-graph
    mode`` asks for, or None for the eager loop (``off``; ``auto`` where the graph does not
    apply); ``on`` where it does not apply is a one-line error saying why."""
    if mode == "off" or temperature != 0.0 or model.backend.name != "cupy":
        return None  # `on` with these was refused by the command's flag check
    decoder = graph_decoder(model, 1, cache_len)
    if isinstance(decoder, str):  # why the graph does not apply
        if mode == "on":
            raise MinillamaError(f"--cuda-graph on: the CUDA-graph decoder {decoder}")
        return None
    return decoder


#: backends that compile kernels on first use (Numba's JIT, NVRTC), cached on disk afterwards
COMPILING_BACKENDS = ("numba", "cupy")


def warm_prefill(model) -> None:
    """Run the kernels of prompts and batches once, on scratch caches longer than what is
    written (so attention reads a view of them, as in use): prompts of 8 and 64 tokens (the
    latter: attention by tiles, products and row ops of many rows split over threads), four
    rows of 64 tokens, two short rows, two rows of 12 tokens at their own positions deep in a
    cache (the mid-length attention, split over threads) and one decode step of those two rows,
    as prompts and a server's batches reach them."""
    S, V = model.cfg.max_seq_len, model.cfg.vocab_size
    ids = np.arange(1, 65, dtype=np.int64) % V
    T = min(64, S - 1)
    if T < 2:
        return
    for t in sorted({min(8, T), T}):  # a short prompt (attention in one thread) and a long one
        model.forward(ids[None, :t], 0, model.new_cache(1, t + 1), last_only=True)
    # four long rows together (the row ops over threads, as a server's padded prefill has them)
    model.forward(np.tile(ids[:T], (4, 1)), 0, model.new_cache(4, T + 1), last_only=True)
    t = min(8, T - 1)  # two short rows (one thread; with B > 1 the keys are a strided view)
    model.forward(np.stack([ids[:t], ids[8:8 + t]]), np.array([1, 0]),
                  model.new_cache(2, t + 2), output_index=np.array([t - 1, t - 1]))
    n = min(S, 280)
    deep = np.array([n - 22, n - 30]) if n >= 64 else np.array([1, 0])
    cache = model.new_cache(2, n)
    if deep[0] + 12 < n:
        model.forward(np.stack([ids[:12], ids[12:24]]), deep, cache,
                      output_index=np.array([11, 11]))
    model.forward(ids[:2, None], deep + 12 if deep[0] + 13 < n else deep, cache, last_only=True)


def _warm_steps(model, prompt_ids: Sequence[int], params) -> None:
    """A prefill of the prompt's last 64 tokens or fewer (the prompt's own kernels), a few
    decode steps and a verification step (:func:`warm_verify`), thrown away."""
    prompt = list(prompt_ids[-64:])
    n = min(3, model.cfg.max_seq_len - len(prompt) + 1)
    if n > 0:
        for _ in generate_steps(model, [prompt], n, params, seed=0):
            pass
    warm_verify(model)


def warm_verify(model) -> None:
    """One verification step of a speculative decoder (:mod:`minillama.core.speculative`) on a
    scratch cache, where the backend speculates and has the kernel of several rows (loaded from
    the disk cache now, not at the first draft of an answer; where it is not cached, the
    backend compiles it in another process and answers go on without drafts meanwhile)."""
    if not model.backend.verification_ready(model):  # none, or compiling in another process
        return
    dec = model.backend.greedy_decoder(model, min(16, model.cfg.max_seq_len), speculate=True)
    if hasattr(dec, "verify") and dec.S >= 8:
        V = model.cfg.vocab_size
        dec.prefill(np.array([[1 % V, 2 % V]], dtype=np.int64))
        dec.verify([3 % V, 4 % V, 5 % V, 6 % V])


def warm_up(model, prompt_ids: Sequence[int], params: SamplingParams | None = None,
            note_after: float = 1.0, say=None, run: Callable[[], object] | None = None,
            then: Callable[[object], object] | None = None) -> float:
    """Run the generation's code paths once (``run``, by default a prefill of the prompt's last
    64 tokens or fewer, a few decode steps and a drafts' verification step, thrown away; a
    given ``run`` calls :func:`warm_verify` itself) on a backend that compiles kernels
    on first use, so the first answer and the reported speeds time the model and not the
    compiler. ``then(model)`` runs after it (e.g. :func:`warm_prefill`: a server's long prompts
    and batches); the kernels of other paths compile, or load, when first used.

    When it runs longer than ``note_after`` seconds a notice goes to stderr while it runs, and its
    time once done: "compiling kernels (once, cached)" when the backend compiled a kernel by then
    (numba: a cache miss, :meth:`NumbaBackend.watch_compiles`), "loading compiled kernels" when it
    only read them from the disk cache so far (then "compiling kernels" as the first compile
    begins, if one does, and the count compiled at the end); a backend that cannot tell says
    "compiling kernels". Nothing is said when it ends sooner. Returns the seconds spent."""
    name = model.backend.name
    if name not in COMPILING_BACKENDS:
        return 0.0
    say = say or (lambda text: print(text, end="", file=sys.stderr, flush=True))
    said: list[str] = []

    lock = threading.Lock()  # the notice's timer and the first compile may come together
    t0 = time.perf_counter()
    with model.backend.watch_compiles() as seen:
        def note() -> None:
            with lock:
                loading = seen is not None and seen.started == 0
                said.append("loading" if loading else "compiling")
                say(f"{name}: " + ("loading compiled kernels" if loading
                                   else "compiling kernels (once, cached)") + " ...")

        def first_compile() -> None:
            with lock:
                if said == ["loading"]:  # compiling after all (e.g. a kernel source changed)
                    said.append("compiling")
                    say(" compiling kernels (once, cached) ...")

        if seen is not None:
            seen.on_first = first_compile

        timer = threading.Timer(note_after, note)
        if note_after <= 0:
            note()  # due at once: said before the work, never raced by it
        else:
            timer.start()
        try:
            (run or (lambda: _warm_steps(model, prompt_ids, params)))()
            if then is not None:
                then(model)
        finally:
            timer.cancel()
            if timer.is_alive():
                timer.join()
    dt = time.perf_counter() - t0
    if said:
        extra = f" ({seen.compiled} compiled)" if said[0] == "loading" and seen.compiled else ""
        say(f" done in {dt:.1f} s{extra}\n")
    return dt
