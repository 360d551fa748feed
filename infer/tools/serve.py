"""``specheads serve``: an OpenAI-compatible HTTP server with continuous batching.

    specheads serve --verifier default --draft auto            # http://127.0.0.1:8000/v1

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (plain JSON, or ``stream: true``
as server-sent events in OpenAI's chunk format), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus text). One thread, the engine loop, owns the model: it takes new
requests at every step boundary (they join the running batch) and hands each step's tokens to
the requests' queues; the HTTP side (FastAPI on uvicorn) only validates, tokenizes, queues and
streams. Every queue, size and wait is bounded (rows decoded at once, requests waiting, requests
open, prompt and completion tokens, body bytes, seconds for a request's head and body to arrive
and for the whole request); what is refused gets an OpenAI-style JSON error, nothing a client
does logs a traceback, and the server keeps serving. A client that disconnects, streaming or not,
frees its row within ``DISCONNECT_CHECK_S``; SIGTERM stops accepting, lets running requests finish
within ``--shutdown-timeout`` seconds, ends the rest with what they have (``finish_reason``
``abort``) and exits 0. A seeded request is the same text alone or batched, drafted or not.

FastAPI, uvicorn and prometheus-client are imported here only (``pip install specheads[serve]``).
(No ``from __future__ import annotations``: FastAPI reads the handlers' annotations at definition.)
"""

import asyncio
import copy
import json
import threading
import time
import uuid
from dataclasses import dataclass, field, replace

from ..core.engine import Chunk, Engine, StepReport
from ..core.errors import UserError
from ..core.params import SamplingParams
from . import protocol
from .protocol import APIError, check_content_type, parse_body


@dataclass(frozen=True)
class Limits:
    """What one server accepts (each a ``specheads serve`` flag)."""

    max_rows: int = 16  # sequences decoded at once (the batch)
    max_queue: int = 64  # requests waiting for a row; one more gets 429
    max_prompt_tokens: int | None = None  # None: the verifier's context
    max_tokens: int = 1024  # completion tokens per request
    max_body_bytes: int = 1 << 20
    timeout_s: float = 300.0  # per request, from arrival to its last token
    shutdown_timeout_s: float = 30.0
    join_wait: int = 4  # steps queued requests may wait for a row about to end, to join in one prefill pass
    max_connections: int = 1024  # HTTP requests open at once (reading, queued, decoding): 503 beyond
    read_timeout_s: float = 10.0  # for a request's head and body to arrive (408 / closed beyond)

    def __post_init__(self) -> None:
        if not isinstance(self.join_wait, int) or isinstance(self.join_wait, bool) or self.join_wait < 0:
            raise UserError(f"--join-wait must be a non-negative integer, not {self.join_wait!r}")
        flags = {"max_rows": "--max-seqs", "max_queue": "--max-queue", "max_tokens": "--max-tokens",
                 "max_body_bytes": "--max-body-bytes", "max_prompt_tokens": "--max-prompt-tokens",
                 "max_connections": "--max-connections"}
        for name, flag in flags.items():
            v = getattr(self, name)
            if v is None and name == "max_prompt_tokens":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise UserError(f"{flag} must be a positive integer, not {v!r}")
        for name, flag in (("timeout_s", "--timeout"), ("shutdown_timeout_s", "--shutdown-timeout"),
                           ("read_timeout_s", "--read-timeout")):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                raise UserError(f"{flag} must be a positive number of seconds, not {getattr(self, name)!r}")
        if self.max_connections < self.max_queue + self.max_rows:
            raise UserError(f"--max-connections ({self.max_connections}) must be at least --max-queue + --max-seqs "
                            f"({self.max_queue + self.max_rows}): requests beyond the queue get 429, not 503")


# --------------------------------------------------------------------------------------------
# the engine loop: one thread owns the model
# --------------------------------------------------------------------------------------------


@dataclass
class Request:
    """One request in flight: what the engine loop hands to the HTTP side."""

    ids: list[int]
    params: SamplingParams
    stop: list[str]
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    index: int | None = None  # the engine's
    arrived: float = field(default_factory=time.perf_counter)
    cancelled: bool = False

    def put(self, item) -> None:
        """From the engine thread: hand ``item`` (a Chunk, or an exception) to the request's queue."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class EngineLoop:
    """Runs :meth:`Engine.step` in its own thread while there is work; requests join at step
    boundaries. ``metrics`` (a :class:`Metrics`) is updated every step."""

    def __init__(self, engine: Engine, eos, tokenizer, limits: Limits, metrics: "Metrics"):
        self.engine, self.eos, self.tokenizer, self.limits, self.metrics = engine, eos, tokenizer, limits, metrics
        self._inbox: list[Request] = []
        self._cancel: list[Request] = []
        self._by_index: dict[int, Request] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="specheads-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def waiting(self) -> int:
        """Requests queued for a row (not yet decoding)."""
        return len(self._inbox) + len(self.engine.pending)

    @property
    def running(self) -> int:
        return len(self.engine.rows)

    def submit(self, req: Request) -> None:
        """Queue ``req``; a full queue is a 429 (nothing is queued)."""
        with self._cond:
            if self._stopping:
                raise APIError(503, "the server is shutting down", "server_error")
            if self.waiting >= self.limits.max_queue:
                raise APIError(429, f"the server's queue is full ({self.limits.max_queue} requests waiting): retry later",
                               "rate_limit_error", code="queue_full")
            self._inbox.append(req)
            self._cond.notify()

    def cancel(self, req: Request) -> None:
        """Free ``req``'s row at the next step (a client that went away, a timeout)."""
        with self._cond:
            req.cancelled = True
            if req in self._inbox:
                self._inbox.remove(req)
            else:
                self._cancel.append(req)
            self._cond.notify()

    def stop(self, deadline_s: float) -> None:
        """Take no more requests; let the running ones finish for ``deadline_s`` seconds, then
        cancel what is left (their clients get what was generated, finish_reason ``abort``)."""
        with self._cond:
            self._stopping = True
            for req in self._inbox:
                req.put(APIError(503, "the server is shutting down", "server_error"))
            self._inbox.clear()
        end = time.monotonic() + deadline_s
        while self.engine.busy and time.monotonic() < end:
            time.sleep(0.05)
        with self._cond:
            for req in list(self._by_index.values()):
                self._cancel.append(req)
            self._cond.notify()
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._inbox or self._cancel or self.engine.busy or self._stopping):
                    self._cond.wait()
                if self._stopping and not self.engine.busy and not self._cancel:
                    return
                inbox, self._inbox = self._inbox, []
                cancels, self._cancel = self._cancel, []
            for req in cancels:
                if req.index is not None and self.engine.cancel(req.index):
                    self._by_index.pop(req.index, None)
                    req.put(Chunk([], None, req.index))  # the end (no stats: cut short, finish_reason abort)
            for req in inbox:
                try:
                    req.index = self.engine.add(req.ids, req.params, eos_token_id=self.eos, stop=req.stop or None,
                                                tokenizer=self.tokenizer)
                except UserError as e:
                    req.put(APIError(400, str(e)))
                    continue
                self._by_index[req.index] = req
            t0 = time.perf_counter()
            try:
                report = self.engine.step()
            except Exception as e:  # noqa: BLE001 - fail the requests in flight, keep serving
                for req in self._by_index.values():
                    req.put(APIError(500, f"the engine failed: {type(e).__name__}: {e}", "server_error"))
                self._by_index.clear()
                self.engine.reset()
                continue
            self.metrics.step(self, report, time.perf_counter() - t0)
            for chunk in report.chunks:
                req = self._by_index.get(chunk.index)
                if req is None:
                    continue
                # the engine's chunks share one running stats object per generation: the request's
                # reader (another thread) gets them as they were at this step, not as a later step
                # left them (a reader behind the engine took an earlier chunk for the last one)
                req.put(replace(chunk, stats=copy.copy(chunk.stats)))
                if chunk.stats.finish_reason:
                    del self._by_index[chunk.index]


# --------------------------------------------------------------------------------------------
# metrics (Prometheus text, one registry per server: no global state)
# --------------------------------------------------------------------------------------------


class Metrics:
    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        self.requests = Counter("specheads_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("specheads_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generated = Counter("specheads_generation_tokens", "tokens generated", registry=r)
        self.verify_steps = Counter("specheads_row_verify_steps", "verify steps summed over rows", registry=r)
        self.accepted = Counter("specheads_row_accepted_tokens", "tokens emitted by verify steps, summed over rows", registry=r)
        self.nodes = Counter("specheads_row_tree_nodes", "tree nodes verified, summed over rows (1 a row-step: no draft)",
                             registry=r)
        self.tau = Gauge("specheads_tau", "tokens per verify step of the last step's rows (mean accepted length)", registry=r)
        self.batch = Gauge("specheads_batch_size", "rows in the last engine step", registry=r)
        self.drafting = Gauge("specheads_drafting", "1 when the last decode step drafted (the batch's measured choice)",
                              registry=r)
        self.running = Gauge("specheads_running_requests", "requests decoding", registry=r)
        self.waiting = Gauge("specheads_queue_length", "requests waiting for a row", registry=r)
        self.step_s = Histogram("specheads_step_seconds", "wall time of one engine step", registry=r,
                                buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0))
        self.admissions = Counter("specheads_admissions", "admission steps (the joining rows' prefill passes)", registry=r)
        self.admitted_rows = Counter("specheads_admitted_rows", "rows admitted, summed over admission steps", registry=r)
        self.admission_s = Counter("specheads_admission_seconds", "wall time of admission steps", registry=r)
        self.decode_s = Counter("specheads_decode_seconds", "wall time of decode steps", registry=r)

    def step(self, loop: EngineLoop, report: StepReport, seconds: float) -> None:
        """One engine step, from its report."""
        chunks, sizes = report.chunks, report.sizes
        self.step_s.observe(seconds)
        self.batch.set(len(chunks))
        self.running.set(loop.running)
        self.waiting.set(loop.waiting)
        emitted = sum(len(c.token_ids) for c in chunks)
        self.generated.inc(emitted)
        if report.kind == "join":
            self.admissions.inc()
            self.admitted_rows.inc(len(chunks))
            self.admission_s.inc(seconds)
        if report.kind == "decode":
            self.decode_s.inc(seconds)
            self.drafting.set(int(report.drafted > 0))
            self.verify_steps.inc(len(sizes))
            self.nodes.inc(sum(sizes))
            self.accepted.inc(emitted)
            self.tau.set(emitted / len(sizes))

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


# --------------------------------------------------------------------------------------------
# requests: checked before anything is queued
# --------------------------------------------------------------------------------------------


async def read_json(request, limits: Limits) -> dict:
    """The request's body as a JSON object, read within ``limits.read_timeout_s`` (408 beyond) and
    ``limits.max_body_bytes`` (413 beyond); a client that leaves mid-body is a :class:`Gone`."""
    from starlette.requests import ClientDisconnect

    check_content_type(request.headers)
    parts, size = [], 0

    async def read() -> None:
        nonlocal size
        async for part in request.stream():
            parts.append(part)
            size += len(part)
            if size > limits.max_body_bytes:
                raise APIError(413, f"the request body is over this server's limit of {limits.max_body_bytes} bytes",
                               code="body_too_large")

    try:
        await asyncio.wait_for(read(), timeout=limits.read_timeout_s)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {limits.read_timeout_s:g} s", "timeout_error",
                       code="timeout") from None
    except ClientDisconnect:
        raise Gone from None
    return parse_body(b"".join(parts))


class Gone(Exception):
    """The client went away: nothing to answer, nothing to log."""


#: how often a request whose client may have left is checked while it decodes (seconds)
DISCONNECT_CHECK_S = 0.25


# --------------------------------------------------------------------------------------------
# the app
# --------------------------------------------------------------------------------------------


class _Handlers:
    """The generation endpoints of one app: a request is read, checked and queued
    (:meth:`admit`), then answered whole (:meth:`whole`) or streamed (:meth:`stream`) from the
    chunks the engine loop hands it (:meth:`chunks`)."""

    def __init__(self, loop_: EngineLoop, metrics: Metrics, tokenizer, name: str, limits: Limits, context: int | None):
        self.loop, self.metrics, self.tokenizer, self.name = loop_, metrics, tokenizer, name
        self.limits, self.context = limits, context

    async def generate(self, request, chat: bool):
        """``POST /v1/completions`` (``chat`` False) or ``/v1/chat/completions``."""
        from fastapi.responses import StreamingResponse

        body = await read_json(request, self.limits)
        protocol.check_model(body, self.name)
        ids = await asyncio.to_thread(protocol.encode_request, self.tokenizer, body, chat)
        if not ids:
            raise APIError(400, "the prompt encodes to no tokens", param="prompt")
        params, stop = protocol.sampling_from(body, self.limits, len(ids), self.context)
        stream, include_usage = protocol.stream_options(body)
        req = Request(ids, params, stop, asyncio.get_running_loop())
        self.loop.submit(req)
        self.metrics.prompt_tokens.inc(len(ids))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if not stream:
            return await self.whole(request, req, rid, chat)
        return StreamingResponse(self.stream(request, req, rid, chat, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def chunks(self, request, req: Request):
        """``req``'s chunks until its last (an APIError is raised; a client that left, at most
        ``DISCONNECT_CHECK_S`` ago, is a :class:`Gone`)."""
        deadline, checked = req.arrived + self.limits.timeout_s, time.perf_counter()
        while True:
            now = time.perf_counter()
            left = deadline - now
            if left <= 0:
                raise APIError(408, f"the request took longer than this server's limit of {self.limits.timeout_s:g} s",
                               "timeout_error", code="timeout")
            if now - checked >= DISCONNECT_CHECK_S:
                checked = now
                if await request.is_disconnected():
                    raise Gone
            try:
                item = await asyncio.wait_for(req.queue.get(), timeout=min(left, DISCONNECT_CHECK_S))
            except asyncio.TimeoutError:
                continue
            if isinstance(item, APIError):
                raise item
            yield item
            if item.stats is None or item.stats.finish_reason:
                return

    def pieces(self, request, req: Request):
        """``(new text, finish_reason or None, tokens so far)`` per chunk of ``req``."""
        text = protocol.StreamText(self.tokenizer, req.stop)
        n_tokens = 0

        async def gen():
            nonlocal n_tokens
            async for chunk in self.chunks(request, req):
                n_tokens += len(chunk.token_ids)
                new = text.push(chunk.token_ids, chunk.stats is None or bool(chunk.stats.finish_reason))
                reason = None
                if text.done:
                    reason = protocol.finish_reason(chunk.stats.finish_reason if chunk.stats else None,
                                                    protocol.cut_at_stop(text.text, req.stop)[1])
                yield new, reason, n_tokens
        return gen()

    async def whole(self, request, req: Request, rid: str, chat: bool) -> dict:
        out, last = [], ("", None, 0)
        try:
            async for last in self.pieces(request, req):
                out.append(last[0])
        except BaseException:
            self.loop.cancel(req)
            raise
        self.metrics.requests.labels(request.url.path, "200").inc()
        return protocol.completion_body(rid, chat, self.name, "".join(out), last[1], protocol.usage(len(req.ids), last[2]))

    async def stream(self, request, req: Request, rid: str, chat: bool, include_usage: bool):
        finished, n_tokens = False, 0
        try:
            if chat:
                yield protocol.chunk_event(rid, chat, self.name, None, None, first=True, include_usage=include_usage)
            async for new, reason, count in self.pieces(request, req):
                n_tokens = count
                if new or reason:
                    yield protocol.chunk_event(rid, chat, self.name, new, reason, include_usage=include_usage)
            if include_usage:
                yield protocol.usage_event(rid, chat, self.name, protocol.usage(len(req.ids), n_tokens))
            yield protocol.SSE_DONE
            finished = True
            self.metrics.requests.labels(request.url.path, "200").inc()
        except APIError as e:
            self.metrics.requests.labels(request.url.path, str(e.status)).inc()
            yield protocol.sse(e.body())
        except Gone:
            pass  # nobody to answer
        finally:
            if not finished:
                self.loop.cancel(req)  # the client went away (or an error): free the row


def _error_handlers(app, metrics: Metrics) -> None:
    """Every error an OpenAI-style JSON body: refusals, validation, unknown routes, a client gone
    (no answer, no log), and anything unexpected (a 500 naming the exception type only)."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException as StarletteHTTPException

    def error(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        metrics.requests.labels(request.url.path, str(e.status)).inc()
        return error(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return error(APIError(422, f"{where or 'body'}: {first.get('msg', 'invalid request')}", param=where or None))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e: StarletteHTTPException):
        msg = {404: f"no route {request.url.path}: this server has /v1/completions, /v1/chat/completions, /v1/models, "
                    "/health and /metrics", 405: f"method {request.method} is not allowed on {request.url.path}"}.get(
            e.status_code, str(e.detail))
        return error(APIError(e.status_code, msg, "invalid_request_error" if e.status_code < 500 else "server_error"))

    @app.exception_handler(Gone)
    async def _gone(request, e: Gone):
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _unexpected(request, e: Exception):  # never a traceback to the client
        return error(APIError(500, f"internal error: {type(e).__name__}", "server_error"))


def build_app(model, tokenizer, drafter, *, name: str, limits: Limits, linear: str = "auto", host: str | None = None,
              budget="auto", compile: str = "off"):
    """The FastAPI app serving ``model`` with ``drafter`` (see the module docstring). Its engine
    loop starts with the app (lifespan) and stops with it. ``host``: the address it is served on;
    on a loopback address, requests naming another ``Host`` are refused (DNS rebinding)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi import Request as HTTPRequest
    from fastapi.responses import Response

    from ..core.text import eos_ids
    from ..core.verifier import Verifier, context_length

    engine = Engine(Verifier(model, linear=linear), drafter, max_rows=limits.max_rows, budget=budget, compile=compile,
                    join_wait=limits.join_wait)
    metrics = Metrics()
    loop_ = EngineLoop(engine, eos_ids(model, tokenizer), tokenizer, limits, metrics)
    handlers = _Handlers(loop_, metrics, tokenizer, name, limits, context_length(model.config))
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        loop_.start()
        yield
        await asyncio.to_thread(loop_.stop, limits.shutdown_timeout_s)

    app = FastAPI(title="specheads", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine_loop = loop_
    _error_handlers(app, metrics)
    app.add_middleware(_Gate, limits=limits, hosts=loopback_names(host))

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        return await handlers.generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        if getattr(tokenizer, "chat_template", None) is None:
            raise APIError(400, f"the model {name!r} has no chat template: use /v1/completions")
        return await handlers.generate(request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "specheads"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "running": loop_.running, "waiting": loop_.waiting}

    @app.get("/metrics")
    async def metrics_():
        metrics.running.set(loop_.running)
        metrics.waiting.set(loop_.waiting)
        return Response(metrics.text(), media_type="text/plain; version=0.0.4")

    return app


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def loopback_names(host: str | None) -> frozenset[str] | None:
    """The ``Host`` names a server bound to ``host`` answers: on a loopback address, the loopback
    names (a page that rebinds its own name to 127.0.0.1 still sends that name); None (any) else."""
    if host is None or not (host in LOOPBACK or host.startswith("127.")):
        return None
    return frozenset((*LOOPBACK, host))


def host_name(header: bytes) -> str:
    """The name in a ``Host`` header (``[::1]:8000`` -> ``::1``, ``localhost:8000`` -> ``localhost``)."""
    text = header.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:].split("]", 1)[0]
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


async def send_error(send, e: APIError) -> None:
    """``e`` as a whole JSON response, on a raw ASGI ``send``."""
    body = json.dumps(e.body()).encode()
    await send({"type": "http.response.start", "status": e.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class _Gate:
    """ASGI middleware in front of the app, before any body is read: a foreign ``Host`` on a
    loopback bind (421), a declared body over the limit (413), and more than
    ``limits.max_connections`` requests open at once (503) are answered in OpenAI's JSON."""

    def __init__(self, app, limits: Limits, hosts: frozenset[str] | None):
        self.app, self.limits, self.hosts = app, limits, hosts
        self.open = 0

    def refusal(self, headers: dict) -> APIError | None:
        host = headers.get(b"host")
        if self.hosts is not None and host is not None and host_name(host) not in self.hosts:
            return APIError(421, f"this server answers requests for {', '.join(sorted(self.hosts))} only, not "
                                 f"{host.decode('latin-1')[:60]!r}", code="misdirected_request")
        size = headers.get(b"content-length")
        if size is not None and (not size.isdigit() or int(size) > self.limits.max_body_bytes):
            return APIError(413, f"the request body is over this server's limit of {self.limits.max_body_bytes} bytes",
                            code="body_too_large")
        if self.open >= self.limits.max_connections:
            return APIError(503, f"the server has {self.open} requests open, its limit (--max-connections): retry later",
                            "server_error", code="server_overloaded")
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        e = self.refusal(dict(scope.get("headers") or ()))
        if e is not None:
            await send_error(send, e)
            return
        self.open += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.open -= 1


def _protocol(read_timeout_s: float):
    """uvicorn's h11 protocol, but a connection whose request head has not arrived within
    ``read_timeout_s`` (a new connection, or the next request on a kept-alive one) is closed: a
    client that opens connections and sends nothing, or half a head, holds nothing for long."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        _head_timer = None
        _head_cycle = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._await_head()

        def _await_head(self) -> None:
            if self._head_timer is not None and self._head_cycle is self.cycle:
                return  # already waiting for this head: more bytes of it do not extend the wait
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_cycle = self.cycle
            self._head_timer = self.loop.call_later(read_timeout_s, self._head_late)

        def _head_late(self) -> None:
            self._head_timer = None
            if self.cycle is self._head_cycle and not self.transport.is_closing():  # no request began since
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self.cycle is None or self.cycle.response_complete:  # between requests: a head is coming
                self._await_head()
            super().data_received(data)

        def connection_lost(self, exc) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

    return Protocol


def make_server(app, host: str, port: int, limits: Limits):
    """The uvicorn server of ``app`` (built by :func:`build_app`): its h11 protocol with the head
    timeout (:func:`_protocol`), no concurrency limit of uvicorn's (``_Gate`` answers in JSON), and
    on SIGTERM / SIGINT: stop accepting, let running requests finish within the shutdown timeout,
    end the rest with what they have (``abort``), then close; a SIGTERM exits 0."""
    import contextlib
    import signal

    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            """uvicorn's, but a SIGTERM is a requested stop: after the graceful shutdown the process
            exits 0 instead of raising the signal again (SIGINT still ends as an interrupt)."""
            if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
                yield
                return
            handled = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)
            if self.should_exit and self.force_exit is False and signal.SIGINT in getattr(self, "_captured_signals", ()):
                raise KeyboardInterrupt

        async def shutdown(self, sockets=None) -> None:
            """The engine drains first, while the handlers still run (uvicorn's own graceful wait
            would cancel them mid-answer), then uvicorn closes what is left."""
            for server in self.servers:
                server.close()
            await asyncio.to_thread(app.state.engine_loop.stop, limits.shutdown_timeout_s)
            await super().shutdown(sockets)

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", http=_protocol(limits.read_timeout_s),
                            timeout_graceful_shutdown=10, limit_concurrency=None, access_log=False)
    return Server(config)


def serve(app, host: str, port: int, limits: Limits) -> int:
    """Run ``app`` with uvicorn until SIGTERM / SIGINT (:func:`make_server`); 0 after a SIGTERM."""
    make_server(app, host, port, limits).run()
    return 0


def add_parser(sub, add_common, add_placement) -> None:
    """The ``serve`` subcommand's arguments (``add_common`` / ``add_placement``: the CLI's shared ones)."""
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching (/v1/completions, "
                                     "/v1/chat/completions, /v1/models, /health, /metrics)")
    add_common(s)
    d = Limits()  # the one source of the limits' defaults
    s.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--model-name", default=None, help="the model id clients send and /v1/models lists (default: --verifier)")
    s.add_argument("--max-seqs", type=int, default=d.max_rows, help="sequences decoded at once (the batch)")
    s.add_argument("--max-queue", type=int, default=d.max_queue, help="requests waiting for a free sequence; one more gets 429")
    s.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens, help="longest prompt (default: the model's context)")
    s.add_argument("--max-tokens", type=int, default=d.max_tokens, help="most completion tokens one request may ask for")
    s.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, help="largest request body (413 beyond)")
    s.add_argument("--timeout", type=float, default=d.timeout_s, help="seconds one request may take (408 beyond)")
    s.add_argument("--join-wait", type=int, default=d.join_wait,
                   help="steps queued requests may wait, with a sequence free, for a running one that reaches its token "
                        "limit within them, so that they are prefilled in one pass (0: join at the next step)")
    s.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout_s,
                   help="on SIGTERM: seconds for running requests to finish before they are cut (finish_reason abort)")
    s.add_argument("--max-connections", type=int, default=d.max_connections,
                   help="HTTP requests open at once, reading, queued or decoding (503 beyond; at least --max-queue + "
                        "--max-seqs: requests beyond the queue get 429)")
    s.add_argument("--read-timeout", type=float, default=d.read_timeout_s,
                   help="seconds for a request's head and body to arrive (beyond: the connection is closed, or 408)")


def cmd_serve(args) -> int:
    """``specheads serve``: every argument checked before the model loads (exit 2 otherwise)."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise UserError(f"specheads serve needs {e.name}: pip install 'specheads[serve]'") from None
    if not 0 < args.port < 65536:
        raise UserError(f"--port must be in 1..65535, not {args.port}")
    limits = Limits(max_rows=args.max_seqs, max_queue=args.max_queue, max_prompt_tokens=args.max_prompt_tokens,
                    max_tokens=args.max_tokens, max_body_bytes=args.max_body_bytes, timeout_s=args.timeout,
                    shutdown_timeout_s=args.shutdown_timeout, join_wait=args.join_wait,
                    max_connections=args.max_connections, read_timeout_s=args.read_timeout)
    from .load import check_drafts, drafter_for, tree_for, verifier_for

    tree = tree_for(args)
    check_drafts(args.draft, trees=[tree])
    _check_port_free(args.host, args.port)
    lv = verifier_for(args, "serve needs a tokenizer (random shapes without one cannot take text)")
    drafter = drafter_for(args, args.draft, lv.model, tree)
    name = args.model_name or args.verifier
    app = build_app(lv.model, lv.tokenizer, drafter, name=name, limits=limits, linear=args.linear, host=args.host,
                    budget=args.tree_budget, compile=args.compile)
    import sys

    print(f"specheads serve: {name} with --draft {args.draft} on http://{args.host}:{args.port}/v1 "
          f"(batch {limits.max_rows}, queue {limits.max_queue})", file=sys.stderr, flush=True)
    return serve(app, args.host, args.port, limits)


def _check_port_free(host: str, port: int) -> None:
    """A one-line error, before the model loads, when ``host:port`` cannot be listened on."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        raise UserError(f"--host {host!r} is not an address this machine has") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise UserError(f"cannot listen on {host}:{port} ({e.strerror}): choose another --port or stop what uses it") from None
