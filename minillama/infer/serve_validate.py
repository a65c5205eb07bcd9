"""Checking the requests of :mod:`minillama.infer.serve`: every field a request may carry, its
type and its range, as pure functions. A bad field raises :class:`APIError`, which the server
answers with a 4xx and OpenAI's error object ``{"error": {"message", "type", "param",
"code"}}``; nothing a client sends reaches the engine unchecked.

Fields read: ``model``; ``messages`` (chat: roles system, developer, user, assistant, tool; text
content as a string or a list of ``{"type": "text", "text"}`` parts) or ``prompt``
(completions); ``max_tokens`` / ``max_completion_tokens``; ``stop``; ``stream`` and
``stream_options.include_usage``; ``logprobs`` and ``top_logprobs`` (chat) or ``logprobs`` k
(completions); ``n`` and ``best_of`` (1 only); and the sampling settings of
:func:`sampling_params`. Settings the server cannot honour (``logit_bias``, ``tools``, a
``response_format`` other than text, ``echo``, ``suffix``) are refused rather than ignored;
fields it does not know otherwise (``user``, ``metadata``...) are ignored.
"""

from __future__ import annotations

import json
import math

from minillama.core.errors import MinillamaError
from minillama.core.sampling import SamplingParams
from minillama.infer.engine import MAX_TOP_LOGPROBS

#: the roles a chat message may have
ROLES = ("system", "developer", "user", "assistant", "tool")
#: the largest request body read (bytes)
MAX_BODY = 8 << 20


class APIError(Exception):
    """A request the server refuses: HTTP ``status`` and OpenAI's error object (and headers,
    e.g. Retry-After)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = \
            status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def _bad(message: str, param: str | None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def parse_body(raw: bytes) -> dict:
    """The request's JSON object, or a 400 (not UTF-8, not JSON, not an object)."""
    if len(raw) > MAX_BODY:
        raise APIError(413, f"the request body exceeds {MAX_BODY} bytes", code="body_too_large")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _bad(f"the request body is not valid UTF-8 (byte {e.start})", None,
                   "invalid_encoding") from None
    try:
        body = json.loads(text)
    except (ValueError, RecursionError):
        raise _bad("the request body is not valid JSON", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", None, "invalid_json")
    return body


def _text(s: str, param: str) -> str:
    """``s`` when it can be written as UTF-8 (a JSON string may hold a lone surrogate)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad(f"'{param}' holds a lone UTF-16 surrogate", param) from None
    return s


def _number(body: dict, name: str, default: float, lo: float, hi: float,
            lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _bad(f"'{name}' must be a number, got {json.dumps(v)}", name, "invalid_type")
    if not (lo < v if lo_open else lo <= v) or v > hi:
        span = f"({lo:g}, {hi:g}]" if lo_open else f"[{lo:g}, {hi:g}]"
        raise _bad(f"'{name}' must lie in {span}, got {v}", name)
    return float(v)


def _integer(body: dict, name: str, default: int | None, lo: int = 0,
             hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(f"'{name}' must be an integer, got {json.dumps(v)}", name, "invalid_type")
    if v < lo or (hi is not None and v > hi):
        span = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise _bad(f"'{name}' must be an integer {span}, got {v}", name)
    return v


def sampling_params(body: dict) -> SamplingParams:
    """The request's :class:`~minillama.core.sampling.SamplingParams`, each field checked with a
    400 naming it: OpenAI's ``temperature`` in [0, 2] (default 1), ``top_p`` in (0, 1],
    ``frequency_penalty`` and ``presence_penalty`` in [-2, 2], ``seed`` >= 0, and llama-server's
    ``top_k`` >= 0 (0: off), ``min_p`` in [0, 1], ``repeat_penalty`` > 0 and ``repeat_last_n``
    >= -1 (-1: the whole context), the window of all three penalties."""
    try:
        return SamplingParams(
            temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
            top_k=_integer(body, "top_k", 0) or None,
            top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
            min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
            repeat_penalty=_number(body, "repeat_penalty", 1.0, 0.0, 1e6, lo_open=True),
            repeat_last_n=_integer(body, "repeat_last_n", 64, lo=-1),
            frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
            presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
            seed=_integer(body, "seed", None))
    except MinillamaError as e:
        raise _bad(str(e), None) from None


def _unsupported(body: dict, chat: bool) -> None:
    """A 400 for settings the server would otherwise silently not honour."""
    for name in ("n", "best_of"):
        v = body.get(name)
        if v is not None and (isinstance(v, bool) or v != 1):
            raise _bad(f"only {name} = 1 is supported, got {json.dumps(v)}", name)
    for name in ("logit_bias", "tools", "functions"):
        if body.get(name):
            raise _bad(f"'{name}' is not supported by this server", name,
                       "unsupported_parameter")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise _bad("only response_format {\"type\": \"text\"} is supported", "response_format",
                   "unsupported_parameter")
    if not chat:
        if body.get("echo"):
            raise _bad("'echo' is not supported by this server", "echo", "unsupported_parameter")
        if body.get("suffix"):
            raise _bad("'suffix' is not supported by this server", "suffix",
                       "unsupported_parameter")


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) for s in stop)):
        raise _bad("'stop' must be a string or a list of at most 4 strings", "stop",
                   "invalid_type")
    return [_text(s, "stop") for s in stop]


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives per token to report log-probabilities for (None: no logprobs):
    chat's ``logprobs: true`` with ``top_logprobs`` k, completions' ``logprobs`` k."""
    if not chat:
        return _integer(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    on = body.get("logprobs")
    if on is not None and not isinstance(on, bool):
        raise _bad("'logprobs' must be true or false", "logprobs", "invalid_type")
    k = _integer(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if k is not None and not on:
        raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (k or 0) if on else None


def request_fields(body: dict, model_name: str, chat: bool) -> dict:
    """The fields both endpoints share, checked: max_tokens (None: not given), the sampling
    settings as ``params`` (:func:`sampling_params`), stop (a list of strings), stream,
    include_usage, logprobs (:func:`_logprobs`)."""
    if "model" not in body:
        raise _bad("missing required field 'model'", "model", "missing_field")
    if not isinstance(body["model"], str):
        raise _bad("'model' must be a string", "model", "invalid_type")
    if body["model"] != model_name:
        raise APIError(404, f"the model {json.dumps(body['model'])} does not exist; this server "
                            f"serves {json.dumps(model_name)}", param="model",
                       code="model_not_found")
    _unsupported(body, chat)
    max_tokens = _integer(body, "max_tokens", None, lo=1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_completion_tokens", None, lo=1)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad("'stream' must be true or false", "stream", "invalid_type")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise _bad("'stream_options' must be an object", "stream_options", "invalid_type")
    usage = opts.get("include_usage", False)
    if not isinstance(usage, bool):
        raise _bad("'stream_options.include_usage' must be true or false",
                   "stream_options.include_usage", "invalid_type")
    return {"max_tokens": max_tokens, "params": sampling_params(body), "stop": _stop(body),
            "stream": stream, "include_usage": usage, "logprobs": _logprobs(body, chat)}


def _content(c, i: int) -> str:
    """A message's text: a string, or the texts of a list of ``{"type": "text"}`` parts."""
    where = f"messages[{i}].content"
    if isinstance(c, str):
        return _text(c, where)
    if not isinstance(c, list):
        raise _bad(f"{where} must be a string or a list of text parts, got "
                   f"{type(c).__name__}", where, "invalid_type")
    texts = []
    for j, p in enumerate(c):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind != "text":
            what = f"of type {json.dumps(kind)}" if isinstance(kind, str) else "not a text part"
            raise _bad(f"{where}[{j}] is {what}; only text parts are supported",
                       f"{where}[{j}]", "invalid_type")
        if not isinstance(p.get("text"), str):
            raise _bad(f"{where}[{j}].text must be a string", f"{where}[{j}].text",
                       "invalid_type")
        texts.append(_text(p["text"], where))
    return "".join(texts)


def chat_messages(body: dict) -> list[dict]:
    """``messages`` as a list of ``{"role", "content"}`` with text content, or a 400."""
    msgs = body.get("messages")
    if msgs is None:
        raise _bad("missing required field 'messages'", "messages", "missing_field")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("'messages' must be a non-empty list", "messages", "invalid_type")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}] must be an object with a string 'role'", f"messages[{i}]",
                       "invalid_type")
        if m["role"] not in ROLES:
            raise _bad(f"messages[{i}].role must be one of {', '.join(ROLES)}; got "
                       f"{json.dumps(m['role'])}", f"messages[{i}].role")
        if m.get("content") is None:
            raise _bad(f"messages[{i}] has no content", f"messages[{i}].content",
                       "missing_field")
        out.append({"role": m["role"], "content": _content(m["content"], i)})
    return out


def completion_prompt(body: dict, tok) -> list[int]:
    """``prompt`` as token ids: a string (encoded after BOS, as ``minillama generate`` does), a
    list holding one string, or a list of token ids (or a list holding one such list); else a
    400. Several prompts in one request are refused (n = 1)."""
    p = body.get("prompt")
    if p is None:
        raise _bad("missing required field 'prompt'", "prompt", "missing_field")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        ids = tok.encode(_text(p, "prompt"))  # BOS where the tokenizer says so
    elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                           for t in p):
        ids = list(p)
    else:
        raise _bad("'prompt' must be a string or a list of token ids (one prompt per request)",
                   "prompt", "invalid_type")
    if not ids:
        raise _bad("the prompt is empty", "prompt")
    return ids


def fit_context(n_prompt: int, max_tokens: int | None, S: int, chat: bool) -> int:
    """The request's max_tokens once checked against the context of S positions: the prompt
    and the reply must fit, prompt tokens + max_tokens <= S (a 400 naming the three numbers
    otherwise). Not given: the rest of the context (chat) or 16 (completions, OpenAI's
    default), cut to what fits."""
    param = "messages" if chat else "prompt"
    if n_prompt >= S:
        raise _bad(f"the prompt has {n_prompt} tokens, which leaves no room for a reply in the "
                   f"context length of {S} tokens", param, "context_length_exceeded")
    if max_tokens is None:
        return S - n_prompt if chat else min(16, S - n_prompt)
    if n_prompt + max_tokens > S:
        raise _bad(f"the prompt has {n_prompt} tokens and max_tokens is {max_tokens}: "
                   f"{n_prompt + max_tokens} tokens exceed the context length of {S} tokens; "
                   f"shorten the prompt or lower max_tokens", "max_tokens",
                   "context_length_exceeded")
    return max_tokens
