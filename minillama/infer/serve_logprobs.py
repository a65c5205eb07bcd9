"""Token log-probabilities in the shapes of OpenAI's API, for :mod:`minillama.infer.serve`.

The engine records, per generated token, log p of the token and of its k likeliest alternatives,
p being the softmax of the model's raw logits at that step (the model's own distribution, before
penalties, temperature and top-k / top-p / min-p: what OpenAI reports, whatever the sampler then
did with it); see :class:`~minillama.infer.engine.Request`. Here they become

* chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}, ...]}, ...], "refusal": null}``;
* completions: ``{"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}],
  "text_offset": [...]}`` (offsets of each token's text within the completion).
"""

from __future__ import annotations


class TokenText:
    """The text and UTF-8 bytes of single token ids (a token may hold part of a character: its
    bytes are then exact where the tokenizer gives bytes, its text has U+FFFD), memoised."""

    def __init__(self, tok):
        self.tok = tok
        self._memo: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, i: int) -> tuple[str, list[int]]:
        got = self._memo.get(i)
        if got is None:
            if hasattr(self.tok, "decode_bytes"):
                raw = self.tok.decode_bytes([i])
                text = raw.decode("utf-8", errors="replace")
            else:
                text = self.tok.decode([i])
                raw = text.encode("utf-8")
            if not raw and hasattr(self.tok, "token_text"):  # a special token: its own name
                text = self.tok.token_text(i)
                raw = text.encode("utf-8")
            got = self._memo[i] = (text, list(raw))
        return got


def chat_logprobs(texts: TokenText, took: list) -> dict:
    """Chat's ``logprobs`` object for the tokens ``took``: (id, logprob, [(id, logprob)])."""
    content = []
    for t, lp, top in took:
        text, raw = texts(t)
        alts = []
        for a, alp in top:
            atext, araw = texts(a)
            alts.append({"token": atext, "logprob": alp, "bytes": araw})
        content.append({"token": text, "logprob": lp, "bytes": raw, "top_logprobs": alts})
    return {"content": content, "refusal": None}


def completion_logprobs(texts: TokenText, took: list, offset: int = 0) -> dict:
    """The completions endpoint's ``logprobs`` object for the tokens ``took``, their text
    offsets counted from ``offset``."""
    tokens, lps, tops, offsets = [], [], [], []
    for t, lp, top in took:
        text = texts(t)[0]
        tokens.append(text)
        lps.append(lp)
        alts: dict[str, float] = {}
        for a, alp in top:  # two ids of the same text: the likelier one's
            alts.setdefault(texts(a)[0], alp)
        tops.append(alts)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
            "text_offset": offsets}
