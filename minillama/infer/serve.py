"""An OpenAI-compatible HTTP server over the continuous-batching
:class:`~minillama.infer.engine.Engine` (the ``minillama serve`` command is
:mod:`minillama.cli.serve`).

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with ``stream`` as
server-sent events), ``GET /v1/models`` (and ``/v1/models/{id}``), ``GET /health`` and
``GET /metrics`` (Prometheus text, :mod:`minillama.infer.metrics`). The request fields and their
checks are those of :mod:`minillama.infer.serve_validate`; answers carry ``usage`` (with
``prompt_tokens_details.cached_tokens``, the prompt tokens reused from the KV cache), a
``finish_reason`` of ``stop`` or ``length`` and, when asked, ``logprobs`` in OpenAI's shapes. A bad
request gets a 4xx JSON error shaped like OpenAI's, ``{"error": {"message", "type", "param",
"code"}}``; a request beyond the engine's queue bound a 503 with ``Retry-After``; the server goes
on serving the others.

Starlette and uvicorn are an optional extra (``pip install 'minillama[serve]'``), imported only
when the server is built: importing this module (the CLI does) loads neither, nor asyncio.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import time
import uuid

from minillama.core.errors import MinillamaError
from minillama.infer.engine import QueueFull, StopText
from minillama.infer.generate import TextStreamer
from minillama.infer.metrics import CountedApp, HTTPCounts, prometheus_text
from minillama.infer.serve_logprobs import TokenText, chat_logprobs, completion_logprobs
from minillama.infer.serve_validate import (
    APIError,
    chat_messages,
    completion_prompt,
    fit_context,
    parse_body,
    request_fields,
)
from minillama.io.chat_template import encode_rendered, render_chat, stop_ids

__all__ = ["APIError", "build_app"]

#: the prompt ids kept before the generated ones when turning ids into text (enough for a
#: tokenizer's context-dependent decoding, e.g. SentencePiece's leading space)
_TEXT_PREFIX = 16
#: the routes counted by name in /metrics (others count as "other")
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


def _render(tok, messages: list[dict]) -> list[int]:
    """The prompt ids of ``messages`` through the model's chat template (its errors as 400s)."""
    if not getattr(tok, "chat_template", None):
        raise APIError(400, "the model has no chat template; use /v1/completions with a prompt",
                       code="no_chat_template")
    try:
        return encode_rendered(tok, render_chat(tok, messages, add_generation_prompt=True))
    except MinillamaError as e:
        raise APIError(400, str(e), param="messages", code="invalid_value") from None


# ---------------------------------------------------------------------------------------------
# one generation as the event loop sees it
# ---------------------------------------------------------------------------------------------
class Drain:
    """The generations in flight, so that a shutdown (SIGTERM) ends each one cleanly: its
    stream gets a last chunk with ``finish_reason`` ``length`` (cut short, as by max_tokens)
    and ``[DONE]``, a whole reply its text so far; new requests get 503 from then on."""

    def __init__(self) -> None:
        import weakref

        self.closing = False
        self.live: weakref.WeakSet = weakref.WeakSet()

    def stop(self) -> int:
        """Begin the shutdown: cut every generation in flight at its next decode step. Returns
        how many there were. Safe to call from a signal handler on the event loop's thread."""
        self.closing = True
        live = list(self.live)
        for gen in live:
            gen.req.cancel("length")  # cut short, as by max_tokens
        return len(live)


class _Generation:
    """One request's run in the engine as seen from the event loop: the engine thread's events
    come through an asyncio queue; :meth:`pieces` turns ids into text deltas, cut at the stop
    strings, each with the log-probabilities of the tokens it consumed."""

    def __init__(self, engine, tok, prompt_ids: list[int], fields: dict, stops: set[int],
                 max_tokens: int, drain: Drain):
        import asyncio

        if drain.closing:
            raise APIError(503, "the server is shutting down", type="server_error",
                           code="server_busy")

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
            self.req = engine.submit(prompt_ids, fields["params"], stop_ids=stops,
                                     on_event=on_event, max_tokens=max_tokens,
                                     logprobs=fields["logprobs"])
        except QueueFull as e:
            raise APIError(503, str(e), type="server_error", code="server_busy",
                           headers={"Retry-After": "1"}) from None
        except MinillamaError as e:
            raise APIError(400, str(e), code="invalid_value") from None
        drain.live.add(self)

    async def pieces(self):
        """Yield (text delta, [(id, logprob, top alternatives)] of the tokens it took) until the
        generation ends; then :attr:`finish_reason` is set. An engine failure raises
        APIError(500)."""
        lps = self.req.token_logprobs
        while True:
            evs = [await self.queue.get()]
            while not self.queue.empty():
                evs.append(self.queue.get_nowait())
            text, end, took = "", None, []
            for ev in evs:
                kind, val = ev
                if kind == "token":
                    self.completion_tokens += 1
                    if self.req.logprobs is not None:
                        took.append((val, *lps[self.completion_tokens - 1]))
                    text += self.stopper.push(self.streamer.put(val))
                    if self.stopper.hit:
                        self.req.cancel("stop")
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
                yield text, took
                return
            if text or took:
                yield text, took

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.req.cached_tokens}}


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


# ---------------------------------------------------------------------------------------------
# the app
# ---------------------------------------------------------------------------------------------
def build_app(engine, tok, model_name: str, api_key: str | None = None):
    """The ASGI application serving ``engine`` (its model's tokenizer ``tok``) as
    ``model_name``; with ``api_key`` every route but /health needs ``Authorization: Bearer
    api_key``. Responses are counted by route and status for /metrics."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException

    async def http_error(request, exc):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _error_response(APIError(exc.status_code, str(exc.detail), code=code))

    async def server_error(request, exc):
        return _error_response(APIError(500, f"internal error: {type(exc).__name__}",
                                        type="server_error"))

    counts = HTTPCounts(ROUTES)
    drain = Drain()
    routes = (_info_routes(engine, model_name, api_key, counts)
              + _completion_routes(engine, tok, model_name, api_key, drain))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.close()

    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error,
                                                       Exception: server_error},
                    lifespan=lifespan)
    app.state.engine = engine
    app.state.drain = drain
    return CountedApp(app, counts)


def _info_routes(engine, model_name: str, api_key: str | None, counts: HTTPCounts) -> list:
    """GET /health (no key needed), /metrics, /v1/models and /v1/models/{model}."""
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    created = int(time.time())

    async def health(request):
        return JSONResponse({"status": "ok", "active": engine.active, "waiting": engine.waiting})

    card = {"id": model_name, "object": "model", "created": created, "owned_by": "minillama",
            "context_length": engine.S}

    def keyed(answer):
        async def route(request):
            try:
                _check_key(request, api_key)
                return answer(request)
            except APIError as e:
                return _error_response(e)
        return route

    def one_model(request):
        if request.path_params["model"] != model_name:
            raise APIError(404, f"the model {json.dumps(request.path_params['model'])} does "
                                f"not exist", param="model", code="model_not_found")
        return JSONResponse(card)

    def metrics(request):
        return Response(prometheus_text(engine, counts),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    return [Route("/health", health, methods=["GET"]),
            Route("/metrics", keyed(metrics), methods=["GET"]),
            Route("/v1/models", keyed(lambda r: JSONResponse({"object": "list", "data": [card]})),
                  methods=["GET"]),
            Route("/v1/models/{model:path}", keyed(one_model), methods=["GET"])]


def _completion_routes(engine, tok, model_name: str, api_key: str | None,
                       drain: Drain) -> list:
    """POST /v1/chat/completions and /v1/completions, whole or streamed."""
    from starlette.routing import Route

    stops = stop_ids(tok)
    texts = TokenText(tok)

    async def run(request, chat: bool):
        try:
            _check_key(request, api_key)
            gen, fields = _start_generation(engine, tok, model_name, stops,
                                            await request.body(), chat, drain)
        except MinillamaError as e:  # a chat template that raises, a tokenizer failure
            return _error_response(APIError(400, str(e), code="invalid_value"))
        except APIError as e:
            return _error_response(e)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": model_name}
        out = _Output(chat, texts if fields["logprobs"] is not None else None)
        if fields["stream"]:
            return _SSEResponse(_stream_chunks(gen, head, out, fields["include_usage"]),
                                gen.req.cancel)
        return await _whole_reply(request, gen, head, out)

    async def chat_completions(request):
        return await run(request, chat=True)

    async def completions(request):
        return await run(request, chat=False)

    return [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"])]


def _error_response(e: APIError):
    """The JSON error body of ``e`` with its status (and headers)."""
    from starlette.responses import JSONResponse

    return JSONResponse(e.body(), status_code=e.status, headers=e.headers or None)


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


def _start_generation(engine, tok, model_name: str, stops: set[int], raw: bytes,
                      chat: bool, drain: Drain) -> tuple[_Generation, dict]:
    """The request body ``raw`` checked, its prompt rendered (chat) or read (completions),
    checked against the context and submitted to the engine: (the running generation, its
    checked fields)."""
    body = parse_body(raw)
    fields = request_fields(body, model_name, chat)
    if chat:
        prompt_ids = _render(tok, chat_messages(body))
        if not prompt_ids:
            raise APIError(400, "the rendered chat prompt is empty", param="messages",
                           code="invalid_value")
    else:
        prompt_ids = completion_prompt(body, tok)
    max_tokens = fit_context(len(prompt_ids), fields["max_tokens"], engine.S, chat)
    return _Generation(engine, tok, prompt_ids, fields, stops, max_tokens, drain), fields


class _Output:
    """The choice objects of one reply: completions carry ``text``; chat a ``message`` or,
    streamed, a ``delta`` (the role first, then content pieces, then empty with the reason);
    ``logprobs`` (with a :class:`TokenText` ``texts``) in the endpoint's shape, else null."""

    def __init__(self, chat: bool, texts: TokenText | None):
        self.chat, self.texts, self.offset = chat, texts, 0

    def logprobs(self, took: list):
        if self.texts is None:
            return None
        if self.chat:
            return chat_logprobs(self.texts, took)
        lp = completion_logprobs(self.texts, took, self.offset)
        if lp["tokens"]:
            self.offset = lp["text_offset"][-1] + len(lp["tokens"][-1])
        return lp

    def choice(self, text, finish, stream: bool, took=()) -> dict:
        lp = self.logprobs(list(took))
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}
        if not stream:
            return {"index": 0, "message": {"role": "assistant", "content": text},
                    "logprobs": lp, "finish_reason": finish}
        delta = {} if text is None else {"content": text}
        return {"index": 0, "delta": delta, "logprobs": lp if took else None,
                "finish_reason": finish}


async def _stream_chunks(gen: _Generation, head: dict, out: _Output, include_usage: bool):
    """The chunks of a streamed reply: (chat) the role, each text piece, the finish reason, and
    with ``include_usage`` a last chunk holding the token counts."""
    if out.chat:
        first = out.choice("", None, True)
        first["delta"]["role"] = "assistant"
        yield {**head, "choices": [first]}
    async for piece, took in gen.pieces():
        if piece or took:
            yield {**head, "choices": [out.choice(piece, None, True, took)]}
    yield {**head, "choices": [out.choice(None if out.chat else "", gen.finish_reason, True)]}
    if include_usage:
        yield {**head, "choices": [], "usage": gen.usage()}


async def _whole_reply(request, gen: _Generation, head: dict, out: _Output):
    """The reply in one JSON body once generated (499 when the client went away first)."""
    from starlette.responses import JSONResponse

    async def collect():
        texts, took = [], []
        async for piece, t in gen.pieces():
            texts.append(piece)
            took += t
        return "".join(texts), took

    try:
        got = await _until_disconnect(request.receive, collect(), gen.req.cancel)
    except APIError as e:
        return _error_response(e)
    if got is None:  # the client went away; nobody reads this
        return JSONResponse({}, status_code=499)
    text, took = got
    obj = {**head, "object": "chat.completion" if out.chat else "text_completion",
           "choices": [out.choice(text, gen.finish_reason, False, took)], "usage": gen.usage()}
    return JSONResponse(obj)
