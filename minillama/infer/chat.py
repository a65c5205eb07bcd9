r"""Chat sessions over a model's own chat template
(:mod:`minillama.io.chat_template`).

* :class:`ChatSession` keeps a conversation and the KV cache of its tokens. A turn renders the
  whole conversation again (templates are not prefix-stable in general: some rewrite earlier
  turns), keeps the cached positions of the longest common token prefix
  :math:`n = \max\{k : c_{<k} = t_{<k}\}` of the cached ids c and the new ids t (at most
  |t| - 1, so that one position is fed to get the next logits; |t| - 2 on GGML block weights:
  :meth:`~minillama.model.transformer.Transformer.prefill_start`), and prefills only
  :math:`t_{n:}` at positions n, n+1, ... (rows past them still hold the old turn's K/V but
  are never read: attention reads positions below the one it feeds, and later writes overwrite
  them). The cached ids are those whose rows the model lets a later prompt keep
  (:meth:`~minillama.model.transformer.Transformer.reusable_rows`): on GGML block weights
  (numba) the rows its prompts' prefills wrote, not the reply's, which decode steps wrote in
  another order, so a turn on the cache gets the logits of the whole conversation sent fresh,
  bit for bit, for a prefill of the last reply. When the conversation no longer fits the
  context, the oldest turns are dropped (a system message stays) and
  :attr:`ChatSession.notice` says so.

The ``minillama chat`` command around it is :mod:`minillama.cli.chat`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import numpy as np

from minillama.core.errors import MinillamaError
from minillama.core.sampling import SamplingParams, StopText, first_stop
from minillama.core.speculative import DraftModel
from minillama.infer.generate import GenerationStats, TextStreamer, generate_steps
from minillama.io.chat_template import common_prefix, encode_rendered, render_chat, stop_ids


class ChatSession:
    """A conversation with a model: ``messages`` (a system message first if given) and the KV
    cache of ``cached`` (the ids whose K/V rows, positions 0..len-1, the next turn keeps).

    :meth:`reply` adds a user turn and yields the reply's tokens as they are chosen; the reply
    joins the history when the generator finishes (or is closed, e.g. after Ctrl-C: the text
    so far is kept). ``params`` (a :class:`~minillama.core.sampling.SamplingParams`, default
    greedy) with ``settings`` (its field names) replaced says how tokens are chosen; its
    ``seed`` seeds the draws."""

    def __init__(self, model, tok, system: str | None = None, max_new_tokens: int = 512,
                 context: int | None = None, params: SamplingParams | None = None, **settings):
        cfg = model.cfg
        self.model, self.tok = model, tok
        self.context = int(min(context or cfg.max_seq_len, cfg.max_seq_len))
        if self.context < 2:
            raise MinillamaError(f"a chat needs a context of >= 2 positions, got {self.context}")
        if max_new_tokens < 1:
            raise MinillamaError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.max_new_tokens = int(max_new_tokens)
        self.params = SamplingParams.of(params, **settings)
        self.rng = np.random.default_rng(self.params.seed)
        self.system = system
        self.stop = stop_ids(tok)
        self.reset()
        # a template that refuses (e.g. no system role) fails now, not at the first turn
        render_chat(tok, self.messages + [{"role": "user", "content": "hi"}])
        self.cache = model.new_cache(1, self.context)
        #: greedy replies verify prompt-lookup drafts (:mod:`minillama.core.speculative`)
        self.speculate = True
        #: a draft model for the greedy turns (``generate_steps``' ``draft``; its cache kept
        #: from turn to turn), or None
        self.draft = None
        #: called with a message when old turns are dropped to fit the context
        self.notice: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr)
        #: prompt tokens prefilled by the last turn (the part not already cached)
        self.last_prefill = 0
        #: the last turn's :class:`~minillama.infer.generate.GenerationStats`
        self.last_stats: GenerationStats | None = None

    def reset(self) -> None:
        """Forget the conversation (the system message stays)."""
        self.messages: list[dict] = ([{"role": "system", "content": self.system}]
                                     if self.system else [])
        self.cached: list[int] = []

    def _draft(self):
        """:attr:`draft` as a :class:`~minillama.core.speculative.DraftModel` (made once), so that
        its cache keeps the conversation from one turn to the next; None without one."""
        if self.draft is not None and not isinstance(self.draft, DraftModel):
            self.draft = DraftModel(self.draft)
        return self.draft

    def _prompt(self) -> list[int]:
        """The ids of the whole conversation and the generation prompt; drops the oldest turns
        while it leaves less than a quarter of the context (or max_new_tokens) for the reply."""
        room = min(self.max_new_tokens, self.context // 4)
        dropped = 0
        first = 1 if self.messages and self.messages[0]["role"] == "system" else 0
        while True:
            ids = encode_rendered(self.tok, render_chat(self.tok, self.messages))
            if len(ids) + room <= self.context:
                break
            alone = self.messages[:first] + self.messages[-1:]
            n = len(encode_rendered(self.tok, render_chat(self.tok, alone))) if not dropped else 0
            if n >= self.context:  # refused before anything is dropped
                raise MinillamaError(f"the message makes a prompt of {n} tokens, longer than "
                                     f"the context of {self.context}")
            if len(self.messages) - first <= 1:  # only the new user message is left
                break
            # drop the oldest user turn and everything up to the next user turn
            del self.messages[first]
            while len(self.messages) > first + 1 and self.messages[first]["role"] != "user":
                del self.messages[first]
            dropped += 1
        if dropped:
            self.notice(f"[context full ({self.context} tokens): dropped the {dropped} oldest "
                        f"turn{'s' if dropped > 1 else ''}]")
        return ids

    def cut_reply(self, text: str) -> None:
        """The last reply as the user saw it, ``text`` (cut at a stop text): the conversation
        goes on from it (the next turn's prompt holds ``text``, not the tokens after it)."""
        if self.messages and self.messages[-1]["role"] == "assistant":
            self.messages[-1]["content"] = text

    def reply(self, text: str):
        """Add the user message ``text`` and yield the reply's token ids (stop tokens are not
        yielded). Only the ids past the cached common prefix are prefilled. With stop texts
        (``params.stop``) the reply ends at the token whose text completes one, and the
        conversation keeps the reply cut before it (what a streaming caller's
        :class:`~minillama.core.sampling.StopText` shows)."""
        self.messages.append({"role": "user", "content": text})
        try:
            ids = self._prompt()
        except MinillamaError:
            self.messages.pop()  # refused: the conversation stays as it was
            raise
        n = self.model.prefill_start(common_prefix(self.cached, ids), len(ids))
        self.last_prefill = len(ids) - n
        self.cached = self.cached[:n]  # positions n.. are rewritten now
        out: list[int] = []
        stops = [stop for stop in self.params.stop if stop]
        stats = self.last_stats = GenerationStats(positions=n)
        # the decode loop of generate, on this conversation's cache and generator
        steps = generate_steps(self.model, [ids], self.max_new_tokens, self.params,
                               stop_ids=self.stop, stats=stats, cache=self.cache, cached=n,
                               rngs=[self.rng], speculate=self.speculate,
                               draft=self._draft())
        stopper, streamer = StopText(stops), TextStreamer(self.tok)  # the text as it grows
        try:  # an interrupted turn still gets its (maybe empty) reply: roles keep alternating
            for step in steps:
                for _, t in step:
                    out.append(t)
                    yield t
                    if stops:
                        stopper.push(streamer.put(t))
                if stopper.hit:
                    break
        finally:
            steps.close()
            # the rows a next turn may keep (a row a decode step wrote may differ from the
            # same row prefilled: the next turn prefills it again, as a fresh chat would)
            self.cached = (list(ids) + out)[:self.model.reusable_rows(len(ids),
                                                                      stats.positions)]
            said = self.tok.decode(out)
            cut = first_stop(said, stops) if stops else None
            self.messages.append({"role": "assistant",
                                  "content": said if cut is None else said[:cut]})
        # the reply ran into the end of the context (its last token has no position)
        full = len(ids) + len(out) > self.context
        if full:
            self.notice(f"[context full ({self.context} tokens): the reply is cut; older turns "
                        f"are dropped next turn]")
