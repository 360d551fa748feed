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

from ..core.engine import Chunk, Engine
from ..core.errors import UserError
from ..core.params import MAX_SEED, SamplingParams
from ..core.text import StreamDecoder


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


class APIError(Exception):
    """A request refused with an HTTP status and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


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
                chunks = self.engine.step()
            except Exception as e:  # noqa: BLE001 - fail the requests in flight, keep serving
                for req in self._by_index.values():
                    req.put(APIError(500, f"the engine failed: {type(e).__name__}: {e}", "server_error"))
                self._by_index.clear()
                self.engine.reset()
                continue
            self.metrics.step(self, chunks, time.perf_counter() - t0)
            for chunk in chunks:
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

    def step(self, loop: EngineLoop, chunks: list[Chunk], seconds: float) -> None:
        self.step_s.observe(seconds)
        self.batch.set(len(chunks))
        self.running.set(loop.running)
        self.waiting.set(loop.waiting)
        emitted = sum(len(c.token_ids) for c in chunks)
        self.generated.inc(emitted)
        sizes = loop.engine.last_sizes
        if not sizes and chunks:  # an admission step
            self.admissions.inc()
            self.admitted_rows.inc(len(chunks))
            self.admission_s.inc(seconds)
        if sizes:  # a decode step (not an admission)
            self.decode_s.inc(seconds)
            self.drafting.set(int(loop.engine.last_drafted))
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


#: fields this server does not implement, with the values that ask for nothing (a client that
#: sends OpenAI's defaults explicitly is served; any other value is a 422 naming the field)
_NEUTRAL = {"logprobs": (None, False, 0), "echo": (None, False), "best_of": (None, 1), "logit_bias": (None, {}),
            "suffix": (None, ""), "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "tools": (None, []),
            "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}), "top_logprobs": (None, 0),
            "functions": (None, []), "function_call": (None, "none"), "parallel_tool_calls": (None, False, True)}


def _neutral(value, allowed) -> bool:
    """Whether ``value`` asks for nothing: null, or one of ``allowed`` (a boolean is no number, but
    ``0.0`` is ``0``)."""
    return value is None or any(type(value) is type(a) and value == a for a in allowed if a is not None) or (
        type(value) is float and any(type(a) is int and value == a for a in allowed))


def _number(body: dict, key: str, default, lo, hi, kind=float):
    v = body.get(key, default)
    if v is None:
        return default
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) if kind is float else isinstance(v, int) and not isinstance(v, bool)
    if not ok or not lo <= v <= hi:
        raise APIError(422, f"'{key}' must be {'a number' if kind is float else 'an integer'} in [{lo}, {hi}], not {v!r}",
                       param=key)
    return v


def sampling_from(body: dict, limits: Limits, prompt_tokens: int, context: int | None) -> tuple[SamplingParams, list[str]]:
    """The request's sampling fields as :class:`SamplingParams` and its stop strings; an
    :class:`APIError` (422 malformed, 400 beyond a limit) otherwise."""
    for key, allowed in _NEUTRAL.items():
        if key in body and not _neutral(body[key], allowed):
            raise APIError(422, f"'{key}' is not supported by this server (send it unset or {allowed[1]!r})", param=key)
    n = body.get("n")
    if n is not None and (type(n) is not int or n != 1):
        raise APIError(422, "'n' must be 1: this server returns one choice per prompt", param="n")
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:  # an explicit null is as good as absent
        max_tokens = body.get("max_tokens")
    if max_tokens is None:  # OpenAI's defaults: 16 for a completion, up to the context for a chat
        room = limits.max_tokens if context is None else max(1, min(limits.max_tokens, context - prompt_tokens))
        max_tokens = min(16, room) if "messages" not in body else room
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise APIError(422, f"'max_tokens' must be a positive integer, not {max_tokens!r}", param="max_tokens")
    if max_tokens > limits.max_tokens:
        raise APIError(400, f"'max_tokens' is {max_tokens}, beyond this server's limit of {limits.max_tokens}",
                       param="max_tokens", code="max_tokens_exceeded")
    if limits.max_prompt_tokens is not None and prompt_tokens > limits.max_prompt_tokens:
        raise APIError(400, f"the prompt is {prompt_tokens} tokens, beyond this server's limit of {limits.max_prompt_tokens}",
                       param="prompt", code="context_length_exceeded")
    if context is not None and prompt_tokens + max_tokens > context:
        raise APIError(400, f"the prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) is beyond the model's "
                       f"context of {context} tokens: shorten the prompt or lower max_tokens", param="max_tokens",
                       code="context_length_exceeded")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise APIError(422, "'top_p' must be above 0", param="top_p")
    top_k = _number(body, "top_k", 0, -1, 1 << 20, kind=int)
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not -(1 << 63) <= seed <= MAX_SEED):
        raise APIError(422, f"'seed' must be an integer, not {seed!r}", param="seed")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is None:
        stop = []
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) for s in stop):
        raise APIError(422, "'stop' must be a string or a list of up to 4 strings", param="stop")
    params = SamplingParams(max_new_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p),
                            top_k=max(0, int(top_k)), seed=None if seed is None else seed % (MAX_SEED + 1))
    return params, [s for s in stop if s]


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def chat_turns(messages) -> list[dict]:
    """OpenAI chat ``messages`` as ``[{role, content}]`` for the chat template: roles system,
    developer (OpenAI's name for system), user and assistant; content a string or a list of text
    parts (``{"type": "text", "text": ...}``, joined by newlines). An :class:`APIError` (422) names
    what else was sent."""
    if not isinstance(messages, list) or not messages:
        raise APIError(422, "'messages' must be a non-empty list of {role, content} objects", param="messages")
    turns = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in _ROLES:
            raise APIError(422, f"messages[{i}]: 'role' must be system, developer, user or assistant, not {role!r:.40}",
                           param="messages")
        content = m.get("content")
        if isinstance(content, list) and content and all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            content = "\n".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise APIError(422, f"messages[{i}]: 'content' must be a string or a list of text parts "
                                "({\"type\": \"text\", \"text\": ...}); this server reads text only", param="messages")
        turns.append({"role": _ROLES[role], "content": content})
    return turns


def parse_body(raw: bytes) -> dict:
    """A request body as a JSON object, or an :class:`APIError`: 400 for what is not JSON (nested
    too deeply for the parser included), 422 for JSON that is not an object."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise APIError(400, "the request body is not valid JSON") from None
    except RecursionError:
        raise APIError(400, "the request body is not valid JSON here: it is nested too deeply") from None
    if not isinstance(data, dict):
        raise APIError(422, "the request body must be a JSON object")
    return data


def check_content_type(headers) -> None:
    """POST bodies must say they are JSON (a page's ``text/plain`` form post is no API call): 415."""
    kind = (headers.get("content-type") or "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise APIError(415, f"Content-Type must be application/json, not {kind or 'missing'!r:.60} "
                            "(curl: -H 'Content-Type: application/json')", code="unsupported_media_type")


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


def finish_reason(engine_reason: str | None, stop_string: bool) -> str:
    """OpenAI's ``finish_reason`` for a request that ended for ``engine_reason`` (``eos``, ``stop``,
    ``length``; None: cut short, by a shutdown) with a stop string in its text or not."""
    if stop_string or engine_reason in ("eos", "stop"):
        return "stop"
    return "length" if engine_reason == "length" else "abort"


def _cut_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """``text`` up to (not including) the first stop string in it, and whether one was found."""
    hits = [text.find(s) for s in stop if s in text]
    return (text[: min(hits)], True) if hits else (text, False)


class _Text:
    """A request's output as text: complete characters, held back while a stop string may be
    starting, cut before the stop string (as OpenAI's API does)."""

    def __init__(self, tokenizer, stop: list[str]):
        self.decoder, self.stop = StreamDecoder(tokenizer), stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text, self.sent, self.done = "", 0, False

    def push(self, token_ids: list[int], final: bool) -> str:
        """The new text that can be sent now."""
        if self.done:
            return ""
        self.text += self.decoder.push(token_ids)
        if final:
            self.text += self.decoder.flush()
        cut, found = _cut_at_stop(self.text, self.stop)
        if found or final:
            self.done = True
            out = cut[self.sent :]
            self.sent = len(cut)
            return out
        upto = max(self.sent, len(self.text) - self.hold)
        out = self.text[self.sent : upto]
        self.sent = upto
        return out


# --------------------------------------------------------------------------------------------
# the app
# --------------------------------------------------------------------------------------------


def build_app(model, tokenizer, drafter, *, name: str, limits: Limits, linear: str = "auto", host: str | None = None):
    """The FastAPI app serving ``model`` with ``drafter`` (see the module docstring). Its engine
    loop starts with the app (lifespan) and stops with it. ``host``: the address it is served on;
    on a loopback address, requests naming another ``Host`` are refused (DNS rebinding)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi import Request as HTTPRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from ..core.engine import check_prompt_ids
    from ..core.text import eos_ids
    from ..core.verifier import Verifier, context_length

    verifier = Verifier(model, linear=linear)
    engine = Engine(verifier, drafter, max_rows=limits.max_rows, spawn=True, join_wait=limits.join_wait)
    metrics = Metrics()
    eos = eos_ids(model, tokenizer)
    loop_ = EngineLoop(engine, eos, tokenizer, limits, metrics)
    context = context_length(model.config)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        loop_.start()
        yield
        await asyncio.to_thread(loop_.stop, limits.shutdown_timeout_s)

    app = FastAPI(title="specheads", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine_loop = loop_

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
    async def _gone(request, e: Gone):  # the client left: the answer goes nowhere, nothing is logged
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _unexpected(request, e: Exception):  # never a traceback to the client
        return error(APIError(500, f"internal error: {type(e).__name__}", "server_error"))

    app.add_middleware(_Gate, limits=limits, hosts=loopback_names(host))

    def check_model(body: dict) -> None:
        m = body.get("model")
        if m is not None and m != name:
            raise APIError(404, f"the model {m!r} does not exist: this server serves {name!r}", code="model_not_found",
                           param="model")

    def encode(body: dict, chat: bool) -> list[int]:
        from ..core.text import check_text, encode_prompt

        if chat:
            turns = chat_turns(body.get("messages"))
            try:
                for t in turns:
                    check_text(t["content"], "a message")
                ids = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, return_dict=False)
            except UserError as e:
                raise APIError(400, str(e), param="messages") from None
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return list(ids)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            try:
                return check_prompt_ids(prompt).tolist()
            except UserError as e:
                raise APIError(422, str(e), param="prompt") from None
        if not isinstance(prompt, str):
            raise APIError(422, "'prompt' must be a string (or one list of token ids)", param="prompt")
        try:
            return encode_prompt(tokenizer, prompt, chat=False).tolist()
        except UserError as e:
            raise APIError(400, str(e), param="prompt") from None

    async def generate(request: HTTPRequest, chat: bool):
        endpoint = request.url.path
        body = await read_json(request, limits)
        check_model(body)
        ids = await asyncio.to_thread(encode, body, chat)
        if not ids:
            raise APIError(400, "the prompt encodes to no tokens", param="prompt")
        params, stop = sampling_from(body, limits, len(ids), context)
        stream_ = body.get("stream", False)
        if not isinstance(stream_, bool):
            raise APIError(422, "'stream' must be true or false", param="stream")
        opts = body.get("stream_options") or {}
        include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
        req = Request(ids, params, stop, asyncio.get_running_loop())
        loop_.submit(req)
        metrics.prompt_tokens.inc(len(ids))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        text = _Text(tokenizer, stop)
        deadline = req.arrived + limits.timeout_s

        async def chunks():
            """The request's chunks until its last (an APIError is raised; a client that left, at
            most ``DISCONNECT_CHECK_S`` ago, is a :class:`Gone`)."""
            checked = time.perf_counter()
            while True:
                now = time.perf_counter()
                left = deadline - now
                if left <= 0:
                    raise APIError(408, f"the request took longer than this server's limit of {limits.timeout_s:g} s",
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

        def piece(chunk: Chunk) -> tuple[str, str | None]:
            final = chunk.stats is None or bool(chunk.stats.finish_reason)
            new = text.push(chunk.token_ids, final)
            reason = None
            if text.done:
                reason = finish_reason(chunk.stats.finish_reason if chunk.stats else None, _cut_at_stop(text.text, stop)[1])
            return new, reason

        def usage(completion: int) -> dict:
            return {"prompt_tokens": len(ids), "completion_tokens": completion, "total_tokens": len(ids) + completion}

        if not stream_:
            out, reason, n_tokens = [], None, 0
            try:
                async for chunk in chunks():
                    n_tokens += len(chunk.token_ids)
                    new, reason = piece(chunk)
                    out.append(new)
            except BaseException:
                loop_.cancel(req)
                raise
            content = "".join(out)
            choice = ({"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": None,
                       "finish_reason": reason} if chat else
                      {"index": 0, "text": content, "logprobs": None, "finish_reason": reason})
            metrics.requests.labels(endpoint, "200").inc()
            return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                    "model": name, "choices": [choice], "usage": usage(n_tokens)}

        def event(delta_text: str | None, reason: str | None, first: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": delta_text} if delta_text else {})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
                obj = "chat.completion.chunk"
            else:
                choice = {"index": 0, "text": delta_text or "", "logprobs": None, "finish_reason": reason}
                obj = "text_completion"
            data = {"id": rid, "object": obj, "created": int(time.time()), "model": name, "choices": [choice]}
            if include_usage:
                data["usage"] = None
            return f"data: {json.dumps(data)}\n\n"

        async def sse():
            n_tokens = 0
            finished = False
            try:
                if chat:
                    yield event(None, None, first=True)
                async for chunk in chunks():
                    n_tokens += len(chunk.token_ids)
                    new, reason = piece(chunk)
                    if new or reason:
                        yield event(new, reason)
                if include_usage:
                    data = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                            "created": int(time.time()), "model": name, "choices": [], "usage": usage(n_tokens)}
                    yield f"data: {json.dumps(data)}\n\n"
                yield "data: [DONE]\n\n"
                finished = True
                metrics.requests.labels(endpoint, "200").inc()
            except APIError as e:
                metrics.requests.labels(endpoint, str(e.status)).inc()
                yield f"data: {json.dumps(e.body())}\n\n"
            except Gone:
                pass  # nobody to answer
            finally:
                if not finished:
                    loop_.cancel(req)  # the client went away (or an error): free the row

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        if getattr(tokenizer, "chat_template", None) is None:
            raise APIError(400, f"the model {name!r} has no chat template: use /v1/completions")
        return await generate(request, chat=True)

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
    s.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--model-name", default=None, help="the model id clients send and /v1/models lists (default: --verifier)")
    s.add_argument("--max-seqs", type=int, default=16, help="sequences decoded at once (the batch)")
    s.add_argument("--max-queue", type=int, default=64, help="requests waiting for a free sequence; one more gets 429")
    s.add_argument("--max-prompt-tokens", type=int, default=None, help="longest prompt (default: the model's context)")
    s.add_argument("--max-tokens", type=int, default=1024, help="most completion tokens one request may ask for")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (413 beyond)")
    s.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take (408 beyond)")
    s.add_argument("--join-wait", type=int, default=4,
                   help="steps queued requests may wait, with a sequence free, for a running one that reaches its token "
                        "limit within them, so that they are prefilled in one pass (0: join at the next step)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM: seconds for running requests to finish before they are cut (finish_reason abort)")
    s.add_argument("--max-connections", type=int, default=1024,
                   help="HTTP requests open at once, reading, queued or decoding (503 beyond; at least --max-queue + "
                        "--max-seqs: requests beyond the queue get 429)")
    s.add_argument("--read-timeout", type=float, default=10.0,
                   help="seconds for a request's head and body to arrive (beyond: the connection is closed, or 408)")


def cmd_serve(args, load, drafter_for, tree_for) -> int:
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
    _check_port_free(args.host, args.port)
    tree = tree_for(args)
    lv = load(args, "serve needs a tokenizer (random shapes without one cannot take text)")
    drafter = drafter_for(args, args.draft, lv.model, tree)
    name = args.model_name or args.verifier
    app = build_app(lv.model, lv.tokenizer, drafter, name=name, limits=limits, linear=args.linear, host=args.host)
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
