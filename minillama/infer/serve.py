"""An OpenAI-compatible HTTP server over the continuous-batching
:class:`~minillama.infer.engine.Engine` (the ``minillama serve`` command is
:mod:`minillama.cli.serve`).

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with ``stream`` as
server-sent events), ``GET /v1/models`` (and ``/v1/models/{id}``) and ``GET /health``. Request
fields: ``model``, ``messages`` / ``prompt``, ``max_tokens``, ``stop``, ``stream`` (and
``stream_options.include_usage``) and the sampling settings of :func:`sampling_params`; answers
carry ``usage`` and a ``finish_reason`` of ``stop`` or ``length``. A bad request gets a 4xx JSON
error shaped like OpenAI's, ``{"error": {"message", "type", "param", "code"}}``, and the
server goes on serving.

Starlette and uvicorn are an optional extra (``pip install 'minillama[serve]'``), imported only
when the server is built: importing this module (the CLI does) loads neither, nor asyncio.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import math
import time
import uuid

from minillama.core.errors import MinillamaError
from minillama.core.sampling import SamplingParams
from minillama.infer.engine import StopText
from minillama.infer.generate import TextStreamer
from minillama.io.chat_template import encode_rendered, render_chat, stop_ids

#: the prompt ids kept before the generated ones when turning ids into text (enough for a
#: tokenizer's context-dependent decoding, e.g. SentencePiece's leading space)
_TEXT_PREFIX = 16


# ---------------------------------------------------------------------------------------------
# chat rendering: the model's own template (minillama.io.chat_template), its errors as 400s
# ---------------------------------------------------------------------------------------------
def _render(tok, messages: list[dict]) -> list[int]:
    """The prompt ids of ``messages`` through the model's chat template."""
    if not getattr(tok, "chat_template", None):
        raise APIError(400, "the model has no chat template; use /v1/completions with a prompt",
                       code="no_chat_template")
    try:
        return encode_rendered(tok, render_chat(tok, messages, add_generation_prompt=True))
    except MinillamaError as e:
        raise APIError(400, str(e), param="messages", code="invalid_value") from None


def _stops(tok) -> set[int]:
    """The ids that end a reply: EOS and the model's end-of-turn ids
    (:func:`minillama.io.chat_template.stop_ids`)."""
    return stop_ids(tok)


# ---------------------------------------------------------------------------------------------
# request checking (pure functions: a bad field raises APIError, a 4xx with OpenAI's shape)
# ---------------------------------------------------------------------------------------------
class APIError(Exception):
    """A request the server refuses: HTTP ``status`` and OpenAI's error object."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = \
            status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def parse_body(raw: bytes) -> dict:
    """The request's JSON object, or a 400."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise APIError(400, "the request body is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise APIError(400, f"'{name}' must be a number, got {json.dumps(v)}", param=name,
                       code="invalid_type")
    if not lo <= v <= hi:
        raise APIError(400, f"'{name}' must lie in [{lo:g}, {hi:g}], got {v}", param=name,
                       code="invalid_value")
    return float(v)


def _integer(body: dict, name: str, default: int | None, lo: int = 0) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise APIError(400, f"'{name}' must be an integer, got {json.dumps(v)}", param=name,
                       code="invalid_type")
    if v < lo:
        raise APIError(400, f"'{name}' must be >= {lo}, got {v}", param=name,
                       code="invalid_value")
    return v


def sampling_params(body: dict) -> SamplingParams:
    """The request's :class:`~minillama.core.sampling.SamplingParams`, each field checked with a
    400 naming it: OpenAI's ``temperature`` (default 1), ``top_p``, ``frequency_penalty``,
    ``presence_penalty``, ``seed``, and llama-server's ``top_k`` (0: off), ``min_p``,
    ``repeat_penalty`` and ``repeat_last_n`` (-1: the whole context), the window of all three
    penalties."""
    top_k = _integer(body, "top_k", 0)
    try:
        return _params(body, top_k)
    except MinillamaError as e:
        raise APIError(400, str(e), code="invalid_value") from None


def _params(body: dict, top_k: int) -> SamplingParams:
    return SamplingParams(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_k=top_k or None,
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0) or None,
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        repeat_penalty=_number(body, "repeat_penalty", 1.0, 1e-6, 1e6),
        repeat_last_n=_integer(body, "repeat_last_n", 64, lo=-1),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        seed=_integer(body, "seed", None))


def sampling_fields(body: dict, model_name: str) -> dict:
    """The fields both endpoints share, checked: model, max_tokens (None: not given), the
    sampling settings as ``params`` (:func:`sampling_params`), stop (a list of strings), stream,
    include_usage."""
    if "model" not in body:
        raise APIError(400, "missing required field 'model'", param="model",
                       code="missing_field")
    if body["model"] != model_name:
        raise APIError(404, f"the model {json.dumps(body['model'])} does not exist; this server "
                            f"serves {json.dumps(model_name)}", param="model",
                       code="model_not_found")
    n = body.get("n")
    if n is not None and n != 1:
        raise APIError(400, "only n = 1 is supported", param="n", code="invalid_value")
    max_tokens = _integer(body, "max_tokens", None)
    if max_tokens is None:
        max_tokens = _integer(body, "max_completion_tokens", None)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) for s in stop)):
        raise APIError(400, "'stop' must be a string or a list of at most 4 strings",
                       param="stop", code="invalid_type")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise APIError(400, "'stream' must be true or false", param="stream",
                       code="invalid_type")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise APIError(400, "'stream_options' must be an object", param="stream_options",
                       code="invalid_type")
    return {"max_tokens": max_tokens, "params": sampling_params(body),
            "stop": stop, "stream": stream,
            "include_usage": bool(opts.get("include_usage", False))}


def chat_messages(body: dict) -> list[dict]:
    """``messages`` as a list of ``{"role", "content"}`` with text content (content parts of
    type ``text`` are joined), or a 400."""
    msgs = body.get("messages")
    if msgs is None:
        raise APIError(400, "missing required field 'messages'", param="messages",
                       code="missing_field")
    if not isinstance(msgs, list) or not msgs:
        raise APIError(400, "'messages' must be a non-empty list", param="messages",
                       code="invalid_type")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a string 'role'",
                           param=f"messages[{i}]", code="invalid_type")
        c = m.get("content")
        if isinstance(c, list):
            parts = [p.get("text") for p in c if isinstance(p, dict)]
            if len(parts) != len(c) or not all(isinstance(p, str) for p in parts):
                raise APIError(400, f"messages[{i}].content parts must be text parts",
                               param=f"messages[{i}].content", code="invalid_type")
            c = "".join(parts)
        elif c is None:
            c = ""
        elif not isinstance(c, str):
            raise APIError(400, f"messages[{i}].content must be a string",
                           param=f"messages[{i}].content", code="invalid_type")
        out.append({"role": m["role"], "content": c})
    return out


def completion_prompt(body: dict, tok) -> list[int]:
    """``prompt`` as token ids: a string (encoded after BOS, as ``minillama generate`` does), a
    list holding one string, or a list of token ids; else a 400."""
    p = body.get("prompt")
    if p is None:
        raise APIError(400, "missing required field 'prompt'", param="prompt",
                       code="missing_field")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    if isinstance(p, str):
        return tok.encode(p)  # BOS where the tokenizer says so, as `minillama generate`
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                         for t in p):
        return list(p)
    raise APIError(400, "'prompt' must be a string, a list of one string or a list of token ids",
                   param="prompt", code="invalid_type")


# ---------------------------------------------------------------------------------------------
# the app
# ---------------------------------------------------------------------------------------------
class _Generation:
    """One request's run in the engine as seen from the event loop: the engine thread's events
    come through an asyncio queue; :meth:`pieces` turns ids into text deltas, cut at the stop
    strings."""

    def __init__(self, engine, tok, prompt_ids: list[int], fields: dict, stop_ids: set[int],
                 max_tokens: int):
        import asyncio

        loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        q = self.queue

        def on_event(ev):  # on the engine's thread (a closed loop raises: the request ends)
            loop.call_soon_threadsafe(q.put_nowait, ev)

        self.prompt_tokens = len(prompt_ids)
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.streamer = TextStreamer(tok, prompt_ids[-_TEXT_PREFIX:])
        self.streamer.start()
        self.stopper = StopText(fields["stop"])
        try:
            self.req = engine.submit(prompt_ids, fields["params"], stop_ids=stop_ids,
                                     on_event=on_event, max_tokens=max_tokens)
        except MinillamaError as e:
            raise APIError(400, str(e), code="invalid_value") from None

    async def pieces(self):
        """Yield text deltas (possibly empty) until the generation ends; then
        :attr:`finish_reason` is set. An engine failure raises APIError(500)."""
        while True:
            evs = [await self.queue.get()]
            while not self.queue.empty():
                evs.append(self.queue.get_nowait())
            text, end = "", None
            for kind, val in evs:
                if kind == "token":
                    self.completion_tokens += 1
                    text += self.stopper.push(self.streamer.put(val))
                    if self.stopper.hit:
                        self.req.cancel()
                        end = "stop"
                        break
                elif kind == "done":
                    text += self.stopper.push(self.streamer.flush())
                    text += self.stopper.flush()
                    end = "stop" if self.stopper.hit else val
                    break
                else:
                    raise APIError(500, val, type="server_error", code="generation_failed")
            if end is not None:
                self.finish_reason = end
                yield text
                return
            if text:
                yield text

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


async def _until_disconnect(receive, work, on_disconnect):
    """Run the coroutine ``work`` while watching ``receive`` for the client going away: then
    ``work`` is cancelled and ``on_disconnect()`` called. Returns work's result (None if cut)."""
    import asyncio

    async def watch():
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)  # both really ended
    if task in done:
        return task.result()
    on_disconnect()
    return None


class _SSEResponse:
    """An ASGI response streaming ``chunks`` (an async iterator of JSON-able dicts) as
    server-sent events ``data: {...}`` and a final ``data: [DONE]``. A client that goes away
    cancels the generation at once (``on_close``), also when nothing is being written."""

    def __init__(self, chunks, on_close):
        self.chunks, self.on_close = chunks, on_close

    async def __call__(self, scope, receive, send):
        async def pump():
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                    (b"cache-control", b"no-cache")]})
            try:
                async for obj in self.chunks:
                    data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
                    await send({"type": "http.response.body", "more_body": True,
                                "body": f"data: {data}\n\n".encode()})
            except APIError as e:  # a failure after the 200 went out: an error event
                await send({"type": "http.response.body", "more_body": True,
                            "body": f"data: {json.dumps(e.body())}\n\n".encode()})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n",
                        "more_body": False})

        try:
            await _until_disconnect(receive, pump(), self.on_close)
        except OSError:  # the socket closed under a write
            pass
        finally:
            self.on_close()
            await self.chunks.aclose()


def build_app(engine, tok, model_name: str, api_key: str | None = None):
    """The Starlette application serving ``engine`` (its model's tokenizer ``tok``) as
    ``model_name``; with ``api_key`` every route but /health needs ``Authorization: Bearer
    api_key``."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException

    async def http_error(request, exc):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _error_response(APIError(exc.status_code, str(exc.detail), code=code))

    async def server_error(request, exc):
        return _error_response(APIError(500, f"internal error: {type(exc).__name__}",
                                        type="server_error"))

    routes = (_info_routes(engine, model_name, api_key)
              + _completion_routes(engine, tok, model_name, api_key))
    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.close()

    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error,
                                                       Exception: server_error},
                    lifespan=lifespan)
    app.state.engine = engine
    return app


def _info_routes(engine, model_name: str, api_key: str | None) -> list:
    """GET /health (no key needed), /v1/models and /v1/models/{model}."""
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    created = int(time.time())

    async def health(request):
        return JSONResponse({"status": "ok", "active": engine.active, "waiting": engine.waiting})

    card = {"id": model_name, "object": "model", "created": created, "owned_by": "minillama",
            "context_length": engine.S}

    async def models(request):
        try:
            _check_key(request, api_key)
        except APIError as e:
            return _error_response(e)
        return JSONResponse({"object": "list", "data": [card]})

    async def one_model(request):
        try:
            _check_key(request, api_key)
            if request.path_params["model"] != model_name:
                raise APIError(404, f"the model {json.dumps(request.path_params['model'])} does "
                                    f"not exist", param="model", code="model_not_found")
        except APIError as e:
            return _error_response(e)
        return JSONResponse(card)

    return [Route("/health", health, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{model:path}", one_model, methods=["GET"])]


def _completion_routes(engine, tok, model_name: str, api_key: str | None) -> list:
    """POST /v1/chat/completions and /v1/completions, whole or streamed."""
    from starlette.routing import Route

    stop_ids = _stops(tok)

    async def run(request, chat: bool):
        try:
            _check_key(request, api_key)
            gen, fields = _start_generation(engine, tok, model_name, stop_ids,
                                            await request.body(), chat)
        except MinillamaError as e:  # a chat template that raises, a tokenizer failure
            return _error_response(APIError(400, str(e), code="invalid_value"))
        except APIError as e:
            return _error_response(e)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": model_name}
        if fields["stream"]:
            return _SSEResponse(_stream_chunks(gen, head, chat, fields["include_usage"]),
                                gen.req.cancel)
        return await _whole_reply(request, gen, head, chat)

    async def chat_completions(request):
        return await run(request, chat=True)

    async def completions(request):
        return await run(request, chat=False)

    return [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"])]


def _error_response(e: APIError):
    """The JSON error body of ``e`` with its status."""
    from starlette.responses import JSONResponse

    return JSONResponse(e.body(), status_code=e.status)


def _check_key(request, api_key: str | None) -> None:
    """APIError(401) unless the request carries ``Authorization: Bearer api_key`` (no key: any
    request passes); compared in constant time."""
    if api_key is None:
        return
    got = request.headers.get("authorization", "")
    want = f"Bearer {api_key}"
    if not hmac.compare_digest(got.encode(), want.encode()):
        raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')",
                       code="invalid_api_key")


def _start_generation(engine, tok, model_name: str, stop_ids: set[int], raw: bytes,
                      chat: bool) -> tuple[_Generation, dict]:
    """The request body ``raw`` checked, its prompt rendered (chat) or read (completions) and
    submitted to the engine: (the running generation, its sampling fields)."""
    body = parse_body(raw)
    fields = sampling_fields(body, model_name)
    if chat:
        prompt_ids = _render(tok, chat_messages(body))
        if not prompt_ids:
            raise APIError(400, "the rendered chat prompt is empty", param="messages",
                           code="invalid_value")
    else:
        prompt_ids = completion_prompt(body, tok)
    if len(prompt_ids) > engine.S:
        raise APIError(400, f"the prompt of {len(prompt_ids)} tokens is longer than the "
                            f"context of {engine.S} tokens", param="messages" if chat
                       else "prompt", code="context_length_exceeded")
    max_tokens = fields["max_tokens"]
    if max_tokens is None:  # OpenAI's defaults: 16 for completions, the rest for chat
        max_tokens = engine.S - len(prompt_ids) + 1 if chat else 16
    return _Generation(engine, tok, prompt_ids, fields, stop_ids, max_tokens), fields


def _choice(chat: bool, text, finish, stream: bool) -> dict:
    """One choice: completions carry ``text``; chat carries a ``message`` or, streamed,
    a ``delta`` (the role first, then content pieces, then empty with the reason)."""
    if not chat:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    if not stream:
        return {"index": 0, "message": {"role": "assistant", "content": text},
                "logprobs": None, "finish_reason": finish}
    delta = {} if text is None else {"content": text}
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}


async def _stream_chunks(gen: _Generation, head: dict, chat: bool, include_usage: bool):
    """The chunks of a streamed reply: (chat) the role, each text piece, the finish reason, and
    with ``include_usage`` a last chunk holding the token counts."""
    if chat:
        first = _choice(chat, "", None, True)
        first["delta"]["role"] = "assistant"
        yield {**head, "choices": [first]}
    async for piece in gen.pieces():
        if piece:
            yield {**head, "choices": [_choice(chat, piece, None, True)]}
    yield {**head, "choices": [_choice(chat, None if chat else "", gen.finish_reason, True)]}
    if include_usage:
        yield {**head, "choices": [], "usage": gen.usage()}


async def _whole_reply(request, gen: _Generation, head: dict, chat: bool):
    """The reply in one JSON body once generated (499 when the client went away first)."""
    from starlette.responses import JSONResponse

    async def collect():
        return "".join([p async for p in gen.pieces()])

    try:
        text = await _until_disconnect(request.receive, collect(), gen.req.cancel)
    except APIError as e:
        return _error_response(e)
    if text is None:  # the client went away; nobody reads this
        return JSONResponse({}, status_code=499)
    obj = {**head, "object": "chat.completion" if chat else "text_completion",
           "choices": [_choice(chat, text, gen.finish_reason, False)], "usage": gen.usage()}
    return JSONResponse(obj)
