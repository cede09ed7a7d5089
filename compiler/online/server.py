"""``batchc serve``: the OpenAI-compatible HTTP server (Starlette on uvicorn) in front of the
engine process.

This process parses, checks, tokenises, detokenises and streams; it never runs a forward (the
engine process does: ``compiler.online.engine_process``; with ``--dp``, one engine process per
replica behind ``compiler.online.router``). Routes:

- ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream: true``: server-sent
  events ending with ``data: [DONE]``; ``stream_options.include_usage`` adds a last chunk with the
  usage; every other answer carries ``usage``);
- ``GET /v1/models``; ``GET /health`` (200 only while the engine can take work); ``GET /metrics``
  (Prometheus, ``compiler.online.metrics``).

Limits, all answered before the engine sees the request, with the OpenAI error JSON
(``compiler.online.protocol``): a body over ``max_body_bytes`` is a 413; bad JSON, types or values a
400 naming the field; another model a 404; a prompt that does not fit the context a 400; when
a request's ``n`` completions would put more than ``dp x max_running + max_waiting`` completions in
flight, a 503 with ``Retry-After``, at once (a 400 naming ``n`` when ``n`` alone is over that).
With an API key every route but ``/health`` needs ``Authorization: Bearer <key>``, compared in
constant time (``hmac.compare_digest``), else 401. Unknown routes are 404 and wrong methods 405, in
the same JSON; an unexpected exception is a 500 without a traceback (it is logged here).

Cancellation: a client that disconnects (streaming or not) has its request aborted (``Abort`` to
the engine, which releases it before its next step); so does a request past its deadline
(``request_timeout``: a 504, or an error event on a stream). Stop strings end a request on the
detokenised text (``compiler.online.text``, ``batchc run``'s ``StopScanner``) and finish it in the
engine (``Finish``: its output cut where the text was, counted as finished), ``finish_reason``
``stop``.

``n`` completions are ``n`` choices (``index`` 0 to n - 1), each with its own text, stop string,
``finish_reason`` and logprobs; ``usage`` counts the prompt once and every choice's tokens. A stream
carries each choice's chunks under its index as its tokens come (interleaved), then one
``[DONE]``; a disconnect or a deadline aborts all of them. Logprobs (the engine's, of the target's
distribution before sampling transforms) are written in the endpoint's format (a completion's
legacy ``tokens``/``token_logprobs``/``top_logprobs``/``text_offset``, a chat's ``content`` entries
with ``bytes``), each chunk with its tokens' entries, none past a stop string.

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
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any, Final

import attrs
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from compiler.offline.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from compiler.online.chat import ChatTemplate
from compiler.online.engine_client import Tracked, completion_ids
from compiler.online.messages import Delta, Ended, Launch, Ready, Submit, TokenLogprob
from compiler.online.metrics import Metrics
from compiler.online.protocol import ApiError, GenerationRequest, Kind, bad, check_context, load_json, parse_request
from compiler.online.router import EngineRouter
from compiler.online.text import TextStream, token_text
from compiler.workload import ServeError

__all__ = ["MAX_BODY_BYTES", "READY_TIMEOUT_S", "RETRY_AFTER_S", "Server", "ServerOptions", "listen", "serve", "unavailable"]

log = logging.getLogger("batchc.online")

MAX_BODY_BYTES: Final = 8 << 20
"""``ServerOptions.max_body_bytes``' default: a larger request body is a 413."""
READY_TIMEOUT_S: Final = 600.0
"""How long ``serve`` waits for the engine processes to load the models and report ready."""
RETRY_AFTER_S: Final = 1
"""The ``Retry-After`` seconds of a 503."""


@attrs.frozen(kw_only=True)
class ServerOptions:
    """``batchc serve``'s options: the engine process's ``launch``, where to listen, the API key and
    model name, the admission and time limits, the sampling defaults and the number of replicas
    (``dp``)."""

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
    requests that do not set those fields (``compiler.offline.load.sampling_params``, as ``batchc run``)."""
    dp: int = 1
    """Engine processes (replicas) behind the router (``compiler.online.router``)."""

    @property
    def capacity(self) -> int:
        """Completions in flight before new requests get a 503: every replica's ``max_running`` and ``max_waiting``."""
        return self.dp * self.launch.max_running + self.max_waiting


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def unavailable(message: str) -> ApiError:
    """A 503 ``ApiError`` saying ``message``, with ``Retry-After``."""
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
    """The HTTP side of ``batchc serve`` (see the module): its Starlette ``app`` (behind the API-key
    check), routed to the methods below, in front of ``client``, the router over the engine processes
    built with ``ready``'s model. It never runs a forward."""

    def __init__(self, options: ServerOptions, client: EngineRouter, ready: Ready, metrics: Metrics) -> None:
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
        self._token_texts: dict[int, tuple[str, list[int]]] = {}
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
        """Why no new work is taken now (a 503: the engine is gone, or the server drains), or None."""
        if self.client.gone is not None:
            return unavailable(f"the engine is gone ({self.client.gone}); the server is stopping")
        if self.draining:
            return unavailable("the server is shutting down")
        return None

    async def health(self, request: Request) -> Response:
        """``GET /health``: 200 ``{"status": "ok"}`` while the engine can take work, else the 503 of
        ``refusal``."""
        refusal = self.refusal()
        if refusal is not None:
            return _error(refusal)
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        """``GET /v1/models``: the one model served, with its context length (``max_model_len``)."""
        return JSONResponse({"object": "list", "data": [{
            "id": self.model, "object": "model", "created": self.created, "owned_by": "batchc", "max_model_len": self.ready.max_len,
        }]})

    async def metrics_route(self, request: Request) -> Response:
        """``GET /metrics``: the Prometheus metrics (``Metrics.render``)."""
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # -- generation ----------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``: a completion request, answered whole or streamed (see the module)."""
        return await self._generate(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/chat/completions``: a chat request, its messages rendered with the model's chat
        template, answered whole or streamed (see the module)."""
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
        capacity = self.options.capacity
        try:
            refusal = self.refusal()
            if refusal is not None:
                raise refusal
            if self.client.outstanding >= capacity:
                raise unavailable(f"the server is at capacity ({self.client.outstanding} completions in flight); retry later")
            try:
                body = await self._body(request)
            except ClientDisconnect:
                return Response(status_code=499)
            req = parse_request(load_json(body), kind, model=self.model, defaults=self.options.defaults)
            n = req.sampling.n
            if n > capacity:
                raise bad("n", f"n = {n} is over the {capacity} completions this server keeps in flight (--dp x --max-running + --max-waiting)")
            if self.client.outstanding + n > capacity:
                raise unavailable(f"the server is at capacity ({self.client.outstanding} completions in flight, {n} more asked); retry later")
            ids = self._prompt_ids(req)
            sampling = check_context(req, len(ids), max_len=self.ready.max_len, reserve=self.ready.reserve)
        except ApiError as exc:
            self.metrics.rejected.labels(str(exc.status)).inc()
            return _error(exc)
        rid = self.client.new_rid()
        sub = Submit(rid=rid, prompt=tuple(ids), max_new_tokens=sampling.max_new_tokens,
                     stop=() if sampling.ignore_eos else self.ready.eos, sampling=sampling, forks=completion_ids(rid, sampling.n)[1:])
        tracked = self.client.submit(sub, arrived)
        choices = [_Choice(index=i, text=TextStream(self.tokenizer, sampling.stop, min_tokens=sampling.min_tokens))
                   for i in range(sampling.n)]
        answer = _Answer(kind=kind, model=self.model, prompt_tokens=len(ids), include_usage=req.include_usage,
                         logprobs=sampling.logprobs is not None, token_text=self._token_text)
        if req.stream:
            return StreamingResponse(self._sse(tracked, choices, answer), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._whole(request, tracked, choices, answer)

    def _token_text(self, token: int) -> tuple[str, list[int]]:
        """``text.token_text``, remembered (a vocabulary's tokens are few and asked for often)."""
        known = self._token_texts.get(token)
        if known is None:
            known = self._token_texts[token] = token_text(self.tokenizer, token)
        return known

    async def _events(self, t: Tracked, choices: list[_Choice]) -> AsyncIterator[_Piece | _Done | _Stop]:
        """The request's choices' text pieces (with their tokens' logprobs) as they come, each
        choice's ``_Done`` (``stop``: a stop string here, or a stop token; ``length``; ``abort``:
        drained), until every choice is done; or a ``_Stop`` for the whole request (``timeout``: its
        deadline, ``error``: the engine failed a completion), after which the rest is aborted."""
        deadline = t.arrived + self.options.request_timeout
        while any(c.reason is None for c in choices):
            try:
                msg = await asyncio.wait_for(t.queue.get(), max(0.0, deadline - time.perf_counter()))
            except TimeoutError:
                self.client.abort(t, "timeout")
                yield _Stop("timeout", None)
                return
            c = choices[t.index(msg.rid)]
            if c.reason is not None:
                continue  # (a choice ended here at a stop string: what the engine ran on with is not shown)
            piece = c.text.push(msg.ids)
            if msg.logprobs is not None:
                c.logprobs.extend(msg.logprobs)
            if isinstance(msg, Delta):
                if c.text.stopped:
                    self.client.finish(t, msg.rid, c.text.tokens)
                    c.reason = "stop"
                pending = c.take()
                if piece or pending:
                    yield _Piece(c.index, piece, pending)
                if c.reason is not None:
                    yield _Done(c.index, c.reason)
                continue
            piece += c.text.finish()
            pending = c.take()
            if piece or pending:
                yield _Piece(c.index, piece, pending)
            reason = {"stop": "stop", "length": "length", "abort": "abort"}.get(msg.reason, "error")
            if reason == "error":
                self.client.abort(t, "error")
                yield _Stop("error", msg)
                return
            c.reason = "stop" if c.text.stopped else reason
            yield _Done(c.index, c.reason)

    async def _whole(self, request: Request, t: Tracked, choices: list[_Choice], answer: _Answer) -> Response:
        async def collect() -> _Stop | None:
            async for event in self._events(t, choices):
                if isinstance(event, _Stop):
                    return event
            return None

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
        stop = result.result()
        if stop is not None:
            return _error(self._failure(stop))
        return JSONResponse(answer.whole(choices))

    def _failure(self, stop: _Stop) -> ApiError:
        if stop.reason == "timeout":
            return ApiError(504, f"the request did not finish within its deadline of {self.options.request_timeout:g} s; it was aborted",
                            type="timeout_error", code="request_timeout")
        ended = stop.ended
        assert ended is not None
        if self.client.gone is not None:
            return unavailable(f"the engine is gone ({self.client.gone}); the server is stopping")
        return ApiError(500, f"the engine could not finish the request: {ended.message or ended.reason}", type="server_error",
                        code=f"engine_{ended.reason}")

    async def _sse(self, t: Tracked, choices: list[_Choice], answer: _Answer) -> AsyncIterator[str]:
        finished = False
        try:
            for chunk in answer.opening(len(choices)):
                yield _event(chunk)
            async for event in self._events(t, choices):
                match event:
                    case _Piece():
                        yield _event(answer.piece(choices[event.index], event))
                    case _Done():
                        yield _event(answer.closing(event.index, event.reason))
                    case _Stop():
                        finished = True
                        yield _event(self._failure(event).body())
                        yield "data: [DONE]\n\n"
                        return
            finished = True
            if answer.include_usage:
                yield _event(answer.usage_chunk(choices))
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away mid-stream (Starlette cancelled this generator)
                self.client.abort(t, "cancelled")


def _event(obj: object) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


@attrs.define(kw_only=True)
class _Choice:
    """One choice of a request (completion ``index``) as it is answered."""

    index: int
    text: TextStream
    logprobs: list[TokenLogprob] = attrs.Factory(list)
    """The logprobs of its tokens received so far."""
    reported: int = 0
    """Entries of ``logprobs`` already given out (``take``)."""
    offset: int = 0
    """The characters of the token texts reported so far (the next ``text_offset``)."""
    reason: str | None = None
    """Its ``finish_reason`` once it is done."""

    def take(self) -> tuple[TokenLogprob, ...]:
        """The logprobs received and not given out yet, of the tokens the text keeps (none past a stop string)."""
        new = self.logprobs[self.reported : self.text.tokens]
        self.reported = max(self.reported, self.text.tokens)
        return tuple(new)

    def kept(self) -> list[TokenLogprob]:
        return self.logprobs[: self.text.tokens]


@attrs.frozen
class _Piece:
    index: int
    text: str
    logprobs: tuple[TokenLogprob, ...]


@attrs.frozen
class _Done:
    index: int
    reason: str


@attrs.frozen
class _Stop:
    reason: str
    ended: Ended | None


def _logprob(value: float | None) -> float | None:
    """A logprob as JSON has it: -inf (a token the distribution rules out) as -9999.0, as vLLM writes it."""
    return None if value is None else max(value, -9999.0)


@attrs.define(kw_only=True)
class _Answer:
    """The OpenAI response objects of one request (completion or chat, whole or chunked, one choice
    per completion)."""

    kind: Kind
    model: str
    prompt_tokens: int
    include_usage: bool
    logprobs: bool
    """Whether the request asked for logprobs."""
    token_text: Callable[[int], tuple[str, list[int]]]
    id: str = attrs.Factory(lambda: uuid.uuid4().hex)
    created: int = attrs.Factory(lambda: int(time.time()))

    def _head(self, chunk: bool) -> dict[str, object]:
        if self.kind == "completion":
            return {"id": f"cmpl-{self.id}", "object": "text_completion", "created": self.created, "model": self.model}
        return {"id": f"chatcmpl-{self.id}", "object": "chat.completion.chunk" if chunk else "chat.completion", "created": self.created,
                "model": self.model}

    def usage(self, choices: list[_Choice]) -> dict[str, int]:
        tokens = sum(c.text.tokens for c in choices)  # (every choice's tokens; the prompt once, as the OpenAI API counts)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": tokens, "total_tokens": self.prompt_tokens + tokens}

    def _logprobs(self, entries: Sequence[TokenLogprob], offset: int) -> dict[str, object] | None:
        """``entries`` in the endpoint's format: a completion's (``tokens``, ``token_logprobs``,
        ``top_logprobs`` as ``{text: logprob}``, ``text_offset`` from ``offset``) or a chat's
        (``content``: ``token``, ``logprob``, ``bytes``, ``top_logprobs``)."""
        if not self.logprobs:
            return None
        if self.kind == "chat":
            def one(token: int, logprob: float | None) -> dict[str, object]:
                text, raw = self.token_text(token)
                return {"token": text, "logprob": _logprob(logprob), "bytes": raw}

            return {"content": [one(e.id, e.logprob) | {"top_logprobs": [one(i, lp) for i, lp in e.top]} for e in entries]}
        tokens, offsets, tops = [], [], []
        for e in entries:
            text = self.token_text(e.id)[0]
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            top: dict[str, float | None] = {}
            for i, lp in e.top:
                top.setdefault(self.token_text(i)[0], _logprob(lp))  # (two ids of one text: the likelier one's)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": [_logprob(e.logprob) for e in entries], "top_logprobs": tops, "text_offset": offsets}

    def whole(self, choices: list[_Choice]) -> dict[str, object]:
        out: list[dict[str, object]] = []
        for c in choices:
            assert c.reason is not None
            logprobs = self._logprobs(c.kept(), 0)
            if self.kind == "completion":
                out.append({"index": c.index, "text": c.text.text, "logprobs": logprobs, "finish_reason": c.reason})
            else:
                out.append({"index": c.index, "message": {"role": "assistant", "content": c.text.text}, "logprobs": logprobs,
                            "finish_reason": c.reason})
        return self._head(False) | {"choices": out, "usage": self.usage(choices)}

    def _chunk(self, index: int, delta: str | None, reason: str | None, logprobs: dict[str, object] | None = None) -> dict[str, object]:
        choice: dict[str, object]
        if self.kind == "completion":
            choice = {"index": index, "text": delta or "", "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": index, "delta": {} if delta is None else {"content": delta}, "logprobs": logprobs, "finish_reason": reason}
        out = self._head(True) | {"choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    def opening(self, n: int) -> Iterator[dict[str, object]]:
        if self.kind == "chat":
            for index in range(n):
                first = self._chunk(index, "", None)
                first["choices"] = [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
                yield first

    def piece(self, c: _Choice, piece: _Piece) -> dict[str, object]:
        logprobs = self._logprobs(piece.logprobs, c.offset)
        c.offset += sum(len(self.token_text(e.id)[0]) for e in piece.logprobs)
        return self._chunk(piece.index, piece.text, None, logprobs)

    def closing(self, index: int, reason: str) -> dict[str, object]:
        return self._chunk(index, None, reason)

    def usage_chunk(self, choices: list[_Choice]) -> dict[str, object]:
        return self._head(True) | {"choices": [], "usage": self.usage(choices)}


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
        launch = server.options.launch
        parallel = "".join(f", {name} {n}" for name, n in (("tp", launch.tp), ("dp", server.options.dp)) if n > 1)
        pids = f"engine process {client.pids[0]}" if len(client.pids) == 1 else f"engine processes {', '.join(map(str, client.pids))}"
        print(f"batchc serve: {server.model!r} ({ready.name}, k={ready.k}, context {ready.max_len}{parallel}, {pids}) "
              f"listening on http://{server.options.host}:{port}{' (' + ready.sizes + ')' if ready.sizes else ''}", file=sys.stderr, flush=True)
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
    if closed is not None and not closed.ranks_equal:
        ledger += ", the tensor-parallel ranks' ledgers differ"
    print(f"batchc serve: stopped by {server.signal_name}: {client.finished} requests finished, {client.aborted} aborted; {ledger}",
          file=sys.stderr, flush=True)
    return 0 if closed is not None and closed.outstanding_tickets == 0 and closed.ranks_equal else 1


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
    client = EngineRouter(options.launch, metrics, options.dp)
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
