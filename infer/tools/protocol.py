"""The OpenAI-compatible protocol of ``specheads serve``, without HTTP: request JSON in, validated
:class:`~infer.core.params.SamplingParams` and prompt token ids out; generated text in, OpenAI
response bodies and server-sent event chunks out. Every function is pure (or reads only the
tokenizer it is given) and is tested without a server (``tests/test_protocol.py``); the server
(:mod:`infer.tools.serve`) owns the engine loop, the app and the limits.
"""

from __future__ import annotations

import json
import time

from ..core.errors import UserError
from ..core.params import MAX_SEED, SamplingParams
from ..core.text import StreamDecoder


class APIError(Exception):
    """A request refused with an HTTP status and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# ---- requests ----------------------------------------------------------------------------------


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


def sampling_from(body: dict, limits, prompt_tokens: int, context: int | None) -> tuple[SamplingParams, list[str]]:
    """The request's sampling fields as :class:`SamplingParams` and its stop strings; an
    :class:`APIError` (422 malformed, 400 beyond a limit) otherwise. ``limits``: the server's
    ``max_tokens`` and ``max_prompt_tokens`` (:class:`~infer.tools.serve.Limits`); ``context``: the
    verifier's (None: unbounded)."""
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


def encode_request(tokenizer, body: dict, chat: bool) -> list[int]:
    """The prompt of a request as token ids: a chat's ``messages`` through the tokenizer's chat
    template, a completion's ``prompt`` (a string, a list of one string, or a list of token ids)."""
    from ..core.engine import check_prompt_ids
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


def stream_options(body: dict) -> tuple[bool, bool]:
    """``(stream, include_usage)`` of a request."""
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise APIError(422, "'stream' must be true or false", param="stream")
    opts = body.get("stream_options") or {}
    return stream, bool(isinstance(opts, dict) and opts.get("include_usage"))


def check_model(body: dict, name: str) -> None:
    """A request naming another model than ``name`` (the served one) is a 404."""
    m = body.get("model")
    if m is not None and m != name:
        raise APIError(404, f"the model {m!r} does not exist: this server serves {name!r}", code="model_not_found",
                       param="model")


# ---- text ----------------------------------------------------------------------------------------


def finish_reason(engine_reason: str | None, stop_string: bool) -> str:
    """OpenAI's ``finish_reason`` for a request that ended for ``engine_reason`` (``eos``, ``stop``,
    ``length``; None: cut short, by a shutdown) with a stop string in its text or not."""
    if stop_string or engine_reason in ("eos", "stop"):
        return "stop"
    return "length" if engine_reason == "length" else "abort"


def cut_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """``text`` up to (not including) the first stop string in it, and whether one was found."""
    hits = [text.find(s) for s in stop if s in text]
    return (text[: min(hits)], True) if hits else (text, False)


class StreamText:
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
        cut, found = cut_at_stop(self.text, self.stop)
        if found or final:
            self.done = True
            out = cut[self.sent :]
            self.sent = len(cut)
            return out
        upto = max(self.sent, len(self.text) - self.hold)
        out = self.text[self.sent : upto]
        self.sent = upto
        return out


# ---- responses ---------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, chat: bool, model: str, content: str, reason: str | None, counts: dict) -> dict:
    """A whole (non-streamed) response: ``chat.completion`` or ``text_completion``."""
    choice = ({"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": None, "finish_reason": reason}
              if chat else {"index": 0, "text": content, "logprobs": None, "finish_reason": reason})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": counts}


def sse(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


SSE_DONE = sse("[DONE]")


def chunk_event(rid: str, chat: bool, model: str, text: str | None, reason: str | None, *, first: bool = False,
                include_usage: bool = False) -> str:
    """A streamed chunk: a chat's delta (``first``: the assistant role) or a completion's text."""
    if chat:
        delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
    data = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice]}
    if include_usage:
        data["usage"] = None
    return sse(data)


def usage_event(rid: str, chat: bool, model: str, counts: dict) -> str:
    """The last chunk of a stream that asked for ``stream_options.include_usage``."""
    return sse({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
                "model": model, "choices": [], "usage": counts})
