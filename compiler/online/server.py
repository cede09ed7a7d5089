"""``batchc serve``: the OpenAI-compatible HTTP server (Starlette on uvicorn) in front of the
engine process.

This process parses, checks, tokenises, detokenises and streams; it never runs a forward (the
engine process does: ``compiler.online.engine_process``). Routes:

- ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream: true``: server-sent
  events ending with ``data: [DONE]``; ``stream_options.include_usage`` adds a last chunk with the
  usage; every other answer carries ``usage``);
- ``GET /v1/models``; ``GET /health`` (200 only while the engine can take work); ``GET /metrics``
  (Prometheus, ``compiler.online.metrics``).

Limits, all answered before the engine sees the request, with the OpenAI error JSON
(``compiler.online.protocol``): a body over ``max_body_bytes`` is a 413; bad JSON, types or values a
400 naming the field; another model a 404; a prompt that does not fit the context a 400; when
``max_running + max_waiting`` requests are already in flight, a 503 with ``Retry-After``, at once.
With an API key every route but ``/health`` needs ``Authorization: Bearer <key>``, compared in
constant time (``hmac.compare_digest``), else 401. Unknown routes are 404 and wrong methods 405, in
the same JSON; an unexpected exception is a 500 without a traceback (it is logged here).

Cancellation: a client that disconnects (streaming or not) has its request aborted (``Abort`` to
the engine, which releases it before its next step); so does a request past its deadline
(``request_timeout``: a 504, or an error event on a stream). Stop strings end a request on the
detokenised text (``compiler.online.text``, ``batchc run``'s ``StopScanner``) and finish it in the
engine (``Finish``: its output cut where the text was, counted as finished), ``finish_reason``
``stop``.

Stopping: SIGTERM or SIGINT (``serve``) starts the drain: ``/health`` and new requests answer 503,
requests in flight run on for up to ``drain_timeout`` seconds, then the rest are aborted; the engine
process aborts what is left, drops its prefix cache, reports its ledger and exits; the server exits
0 and prints one line with the requests finished and aborted (and the ledger's outstanding tickets,
which a drained engine has none of). A second signal aborts at once. If the engine process dies,
every request in flight fails, everything answers 503, and the server exits 1 with one line saying
how the engine process ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import signal
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any, Final

import attrs
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from compiler.online.chat import ChatTemplate
from compiler.online.engine_client import EngineClient, Tracked
from compiler.online.messages import Delta, Ended, Launch, Ready, Submit
from compiler.online.metrics import Metrics
from compiler.online.protocol import ApiError, GenerationRequest, Kind, bad, check_context, load_json, parse_request
from compiler.online.text import TextStream
from compiler.serve.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from compiler.workload import ServeError

log = logging.getLogger("batchc.online")

MAX_BODY_BYTES: Final = 8 << 20
READY_TIMEOUT_S: Final = 600.0
RETRY_AFTER_S: Final = 1


@attrs.frozen(kw_only=True)
class ServerOptions:
    launch: Launch
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str | None = None
    """The model's id in the API (default: ``--model``, or ``batchc-bundled``)."""
    max_waiting: int = 64
    """Requests in flight beyond ``max_running`` before new ones get a 503."""
    drain_timeout: float = 30.0
    request_timeout: float = 600.0
    max_body_bytes: int = MAX_BODY_BYTES
    defaults: Mapping[str, object] = attrs.field(factory=dict)
    """The sampling defaults (``--temperature``, ``--top-p``, ``--top-k``, ``--min-p``) of the
    requests that do not set those fields (``compiler.serve.load.sampling_params``, as ``batchc run``)."""


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, type="service_unavailable", code="service_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})


class _Auth:
    """ASGI middleware: with a key, every route but ``/health`` needs ``Authorization: Bearer <key>``."""

    def __init__(self, app: ASGIApp, key: str | None) -> None:
        self.app = app
        self.key = key.encode() if key is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.key is not None and scope["type"] == "http" and scope["path"] != "/health":
            given = b""
            for name, value in scope["headers"]:
                if name == b"authorization":
                    given = value
            scheme, _, token = given.partition(b" ")
            # (compare_digest takes as long whatever prefix matches: the key is not guessed a byte at a time)
            if not (scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)):
                response = JSONResponse(
                    ApiError(401, "a valid API key is required: Authorization: Bearer <key>", type="authentication_error",
                             code="invalid_api_key").body(),
                    status_code=401, headers={"WWW-Authenticate": "Bearer"},
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class Server:
    def __init__(self, options: ServerOptions, client: EngineClient, ready: Ready, metrics: Metrics) -> None:
        self.options = options
        self.client = client
        self.ready = ready
        self.metrics = metrics
        self.model = options.model_name or options.launch.model or "batchc-bundled"
        self.tokenizer: Tokenizer = ByteTokenizer() if ready.hf_dir is None else HFTokenizer(f"{ready.hf_dir}/tokenizer.json")
        self.chat = ChatTemplate.load(ready.hf_dir)
        self._plain: Any = None
        if ready.hf_dir is not None and self.chat is not None:
            from tokenizers import Tokenizer as RawTokenizer

            self._plain = RawTokenizer.from_file(f"{ready.hf_dir}/tokenizer.json")  # a rendered chat holds its own special tokens
        self.draining = False
        self.signal_name: str | None = None
        self.created = int(time.time())
        routes = [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_route, methods=["GET"]),
        ]
        app = Starlette(routes=routes, exception_handlers={HTTPException: self._http_error, Exception: self._crash})
        self.app: ASGIApp = _Auth(app, options.api_key)

    # -- small routes --------------------------------------------------------------------------

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        return JSONResponse(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type=kind).body(),
                            status_code=exc.status_code, headers=exc.headers)

    async def _crash(self, request: Request, exc: Exception) -> Response:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return JSONResponse(ApiError(500, "internal server error (logged by the server)", type="server_error").body(), status_code=500)

    def refusal(self) -> ApiError | None:
        if self.client.gone is not None:
            return unavailable(f"the engine is gone ({self.client.gone}); the server is stopping")
        if self.draining:
            return unavailable("the server is shutting down")
        return None

    async def health(self, request: Request) -> Response:
        refusal = self.refusal()
        if refusal is not None:
            return _error(refusal)
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.model, "object": "model", "created": self.created, "owned_by": "batchc", "max_model_len": self.ready.max_len,
        }]})

    async def metrics_route(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # -- generation ----------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def _body(self, request: Request) -> bytes:
        limit = self.options.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise ApiError(413, f"the body is {int(length)} bytes, over the limit of {limit}", code="body_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the body is over the limit of {limit} bytes", code="body_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    def _prompt_ids(self, req: GenerationRequest) -> list[int]:
        if req.kind == "chat":
            if self.chat is None:
                why = (f"{self.ready.hf_dir}/tokenizer_config.json has no chat_template" if self.ready.hf_dir is not None
                       else "a byte-level model has no tokenizer_config.json")
                raise bad("messages", f"the model {self.model!r} has no chat template ({why}): use /v1/completions", code="no_chat_template")
            text = self.chat.render(req.messages, add_generation_prompt=req.add_generation_prompt)
            if self._plain is None:
                return self.tokenizer.encode(text)
            return [int(t) for t in self._plain.encode(text, add_special_tokens=False).ids]
        if isinstance(req.prompt, str):
            try:
                return self.tokenizer.encode(req.prompt)
            except ValueError as exc:
                raise bad("prompt", str(exc)) from None
        assert req.prompt is not None
        for t in req.prompt:
            if not 0 <= t < self.ready.vocab:
                raise bad("prompt", f"token id {t} is not in [0, {self.ready.vocab})")
        return list(req.prompt)

    async def _generate(self, request: Request, kind: Kind) -> Response:
        arrived = time.perf_counter()
        try:
            refusal = self.refusal()
            if refusal is not None:
                raise refusal
            if self.client.outstanding >= self.options.launch.max_running + self.options.max_waiting:
                raise unavailable(f"the server is at capacity ({self.client.outstanding} requests in flight); retry later")
            try:
                body = await self._body(request)
            except ClientDisconnect:
                return Response(status_code=499)
            req = parse_request(load_json(body), kind, model=self.model, defaults=self.options.defaults)
            ids = self._prompt_ids(req)
            sampling = check_context(req, len(ids), max_len=self.ready.max_len, reserve=self.ready.reserve)
        except ApiError as exc:
            self.metrics.rejected.labels(str(exc.status)).inc()
            return _error(exc)
        sub = Submit(rid=self.client.new_rid(), prompt=tuple(ids), max_new_tokens=sampling.max_new_tokens,
                     stop=() if sampling.ignore_eos else self.ready.eos, sampling=sampling)
        tracked = self.client.submit(sub, arrived)
        text = TextStream(self.tokenizer, sampling.stop, min_tokens=sampling.min_tokens)
        answer = _Answer(kind=kind, model=self.model, prompt_tokens=len(ids), include_usage=req.include_usage)
        if req.stream:
            return StreamingResponse(self._sse(tracked, text, answer), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._whole(request, tracked, text, answer)

    async def _events(self, t: Tracked, text: TextStream) -> AsyncIterator[str | tuple[str, Ended | None]]:
        """The request's text pieces, then ``(finish_reason, its Ended or None)``: ``stop`` (a stop
        string here, or a stop token), ``length``, ``abort`` (drained), ``timeout`` (its deadline),
        ``error`` (the engine failed it)."""
        deadline = t.arrived + self.options.request_timeout
        while True:
            try:
                msg = await asyncio.wait_for(t.queue.get(), max(0.0, deadline - time.perf_counter()))
            except TimeoutError:
                self.client.abort(t, "timeout")
                yield ("timeout", None)
                return
            piece = text.push(msg.ids)
            if isinstance(msg, Delta):
                if text.stopped:
                    self.client.finish(t, text.tokens)
                    if piece:
                        yield piece
                    yield ("stop", None)
                    return
                if piece:
                    yield piece
                continue
            piece += text.finish()
            if piece:
                yield piece
            reason = {"stop": "stop", "length": "length", "abort": "abort"}.get(msg.reason, "error")
            yield ("stop" if text.stopped else reason, msg)
            return

    async def _whole(self, request: Request, t: Tracked, text: TextStream, answer: _Answer) -> Response:
        async def collect() -> tuple[str, Ended | None]:
            async for event in self._events(t, text):
                if isinstance(event, tuple):
                    return event
            raise AssertionError("the events end with a finish reason")

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        result = asyncio.ensure_future(collect())
        watcher = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({result, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not result.done():  # the client went away (or this handler was cancelled)
                result.cancel()
                self.client.abort(t, "cancelled")
        if not result.done() or result.cancelled():
            return Response(status_code=499)
        reason, ended = result.result()
        failure = self._failure(reason, ended)
        if failure is not None:
            return _error(failure)
        return JSONResponse(answer.whole(text.text, reason, text.tokens))

    def _failure(self, reason: str, ended: Ended | None) -> ApiError | None:
        if reason == "timeout":
            return ApiError(504, f"the request did not finish within its deadline of {self.options.request_timeout:g} s; it was aborted",
                            type="timeout_error", code="request_timeout")
        if reason == "error":
            assert ended is not None
            if self.client.gone is not None:
                return unavailable(f"the engine is gone ({self.client.gone}); the server is stopping")
            return ApiError(500, f"the engine could not finish the request: {ended.message or ended.reason}", type="server_error",
                            code=f"engine_{ended.reason}")
        return None

    async def _sse(self, t: Tracked, text: TextStream, answer: _Answer) -> AsyncIterator[str]:
        finished = False
        try:
            for chunk in answer.opening():
                yield _event(chunk)
            async for event in self._events(t, text):
                if isinstance(event, str):
                    yield _event(answer.piece(event))
                    continue
                reason, ended = event
                finished = True
                failure = self._failure(reason, ended)
                if failure is not None:
                    yield _event(failure.body())
                else:
                    yield _event(answer.closing(reason))
                    if answer.include_usage:
                        yield _event(answer.usage_chunk(text.tokens))
                yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away mid-stream (Starlette cancelled this generator)
                self.client.abort(t, "cancelled")


def _event(obj: object) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


@attrs.define(kw_only=True)
class _Answer:
    """The OpenAI response objects of one request (completion or chat, whole or chunked)."""

    kind: Kind
    model: str
    prompt_tokens: int
    include_usage: bool
    id: str = attrs.Factory(lambda: uuid.uuid4().hex)
    created: int = attrs.Factory(lambda: int(time.time()))

    def _head(self, chunk: bool) -> dict[str, object]:
        if self.kind == "completion":
            return {"id": f"cmpl-{self.id}", "object": "text_completion", "created": self.created, "model": self.model}
        return {"id": f"chatcmpl-{self.id}", "object": "chat.completion.chunk" if chunk else "chat.completion", "created": self.created,
                "model": self.model}

    def usage(self, tokens: int) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": tokens, "total_tokens": self.prompt_tokens + tokens}

    def whole(self, text: str, reason: str, tokens: int) -> dict[str, object]:
        choice: dict[str, object]
        if self.kind == "completion":
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": reason}
        return self._head(False) | {"choices": [choice], "usage": self.usage(tokens)}

    def _chunk(self, delta: str | None, reason: str | None) -> dict[str, object]:
        choice: dict[str, object]
        if self.kind == "completion":
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "delta": {} if delta is None else {"content": delta}, "logprobs": None, "finish_reason": reason}
        out = self._head(True) | {"choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    def opening(self) -> Iterator[dict[str, object]]:
        if self.kind == "chat":
            first = self._chunk("", None)
            first["choices"] = [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
            yield first

    def piece(self, text: str) -> dict[str, object]:
        return self._chunk(text, None)

    def closing(self, reason: str) -> dict[str, object]:
        return self._chunk(None, reason)

    def usage_chunk(self, tokens: int) -> dict[str, object]:
        return self._head(True) | {"choices": [], "usage": self.usage(tokens)}


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: ``serve`` drains first, then stops it."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def _drain(server: Server, uv: _Uvicorn, second: asyncio.Event) -> None:
    """Wait for the requests in flight (up to the drain timeout, or a second signal), abort the rest."""
    client = server.client
    deadline = time.monotonic() + server.options.drain_timeout
    while client.outstanding and client.gone is None and time.monotonic() < deadline and not second.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(second.wait(), 0.05)
    client.abort_all("aborted")


async def _serve(server: Server, uv: _Uvicorn, sock: socket.socket) -> int:
    loop = asyncio.get_running_loop()
    client = server.client
    client.attach(loop)
    stop = asyncio.Event()
    second = asyncio.Event()

    def on_signal(signum: int) -> None:
        if server.signal_name is None:
            server.signal_name = signal.Signals(signum).name
            server.draining = True
            stop.set()
        else:
            second.set()

    def on_gone() -> None:
        stop.set()

    client.on_gone = on_gone
    for s in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(s, on_signal, s)
    server.metrics.engine_up.set(1)
    web = asyncio.ensure_future(uv.serve(sockets=[sock]))
    while not uv.started and not web.done():
        await asyncio.sleep(0.01)
    if uv.started:
        port = sock.getsockname()[1]
        ready = server.ready
        print(f"batchc serve: {server.model!r} ({ready.name}, k={ready.k}, context {ready.max_len}, engine process {ready.pid}) "
              f"listening on http://{server.options.host}:{port}", file=sys.stderr, flush=True)
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({web, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if web.done():  # uvicorn could not start: it said why
        await client.shutdown(10.0)
        return 1
    if client.gone is None:
        await _drain(server, uv, second)
    closed = await client.shutdown(10.0)
    uv.should_exit = True
    await web
    if client.gone is not None:
        print(f"batchc serve: {client.gone}; {client.finished} requests finished, {client.aborted} failed or aborted", file=sys.stderr,
              flush=True)
        return 1
    ledger = f"{closed.outstanding_tickets} outstanding tickets" if closed is not None else "the engine did not report its ledger"
    print(f"batchc serve: stopped by {server.signal_name}: {client.finished} requests finished, {client.aborted} aborted; {ledger}",
          file=sys.stderr, flush=True)
    return 0 if closed is not None and closed.outstanding_tickets == 0 else 1


def listen(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before anything starts (a taken port is one line, at once)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def serve(options: ServerOptions) -> int:
    """Bind, start the engine process, serve until a signal (or the engine's death), drain, stop.
    Returns the exit status (see the module); ``ServeError`` when the address cannot be bound or the
    engine cannot be built."""
    sock = listen(options.host, options.port)
    metrics = Metrics()
    client = EngineClient(options.launch, metrics)
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        ready = client.wait_ready(READY_TIMEOUT_S)
        server = Server(options, client, ready, metrics)
        config = uvicorn.Config(server.app, http="h11", lifespan="off", log_level="warning", access_log=False, timeout_graceful_shutdown=5)
        uv = _Uvicorn(config)
        return asyncio.run(_serve(server, uv, sock))
    finally:
        client.kill()
        sock.close()
        for s, h in old.items():
            signal.signal(s, h)
