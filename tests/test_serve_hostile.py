"""``specheads serve`` under hostile and careless clients: the real server (:func:`make_server`) on a
loopback port, spoken to with raw sockets, httpx and the real ``openai`` client. Every refusal is
OpenAI's JSON; no client's doing leaves a traceback in the server's log or blocks other clients.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from test_serve import NAME, Running, SlowPlainDrafter, free_port, wait_until_serving  # noqa: E402

from infer.core.drafter import NoDrafter  # noqa: E402
from infer.core.models import load_verifier  # noqa: E402
from infer.drafting.lookup import PromptLookupDrafter  # noqa: E402
from infer.tools.serve import Limits, build_app  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    return load_verifier("tiny-random:llama")


class LogRecords(logging.Handler):
    """Every record uvicorn and the app log, kept (uvicorn's loggers do not propagate)."""

    NAMES = ("uvicorn", "uvicorn.error", "uvicorn.access", "specheads", "fastapi", "starlette")

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def __enter__(self):
        for n in self.NAMES:
            logging.getLogger(n).addHandler(self)
        return self

    def __exit__(self, *exc):
        for n in self.NAMES:
            logging.getLogger(n).removeHandler(self)

    def problems(self) -> list[str]:
        return [f"{r.name}: {r.getMessage()[:200]}" for r in self.records if r.exc_info or r.levelno >= logging.WARNING]


def raw(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send ``data`` on a fresh connection and read until the server closes it (or ``timeout``)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return out


def post(body: bytes, content_type: str = "application/json", path: str = "/v1/completions", host: str = "127.0.0.1") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body


def status_and_json(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


@pytest.fixture(scope="module")
def server(tiny):
    limits = Limits(max_rows=4, max_queue=8, max_tokens=64, max_body_bytes=1 << 20, timeout_s=60, read_timeout_s=1.0)
    app = build_app(tiny.model, tiny.tokenizer, PromptLookupDrafter(), name=NAME, limits=limits, host="127.0.0.1")
    with Running(app, limits) as running:
        yield running


@pytest.mark.parametrize("body", [
    b"[" * 100_000 + b"]" * 100_000,
    b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    b'{"model": "tiny-test", "prompt": "x", "extra": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
])
def test_deeply_nested_json_is_a_400_not_a_500(server, body):
    with LogRecords() as logs:
        code, err = status_and_json(raw(server.port, post(body)))
    assert code == 400 and "not valid JSON" in err["error"]["message"], err
    assert logs.problems() == []


def test_a_non_streaming_client_that_leaves_frees_its_row(tiny):
    limits = Limits(max_rows=2, max_queue=4, max_tokens=400, timeout_s=60)
    app = build_app(tiny.model, tiny.tokenizer, SlowPlainDrafter(), name=NAME, limits=limits)
    with Running(app, limits) as s, LogRecords() as logs:
        body = json.dumps({"model": NAME, "prompt": "go", "max_tokens": 400, "temperature": 0}).encode()
        with socket.create_connection(("127.0.0.1", s.port)) as sock:  # 400 tokens at 20 ms a step: 8 s at least
            sock.sendall(post(body))
            deadline = time.time() + 10
            while httpx.get(s.url + "/health").json()["running"] == 0:
                assert time.time() < deadline
                time.sleep(0.05)
        left = time.time()  # the client closed its connection without reading the answer
        while httpx.get(s.url + "/health").json()["running"] > 0:
            assert time.time() - left < 3.0, "the row of a client that left was not freed"
            time.sleep(0.05)
        assert logs.problems() == []


def test_a_burst_of_200_gets_only_200s_and_429s_in_json(tiny):
    limits = Limits()  # the defaults: 16 rows, 64 queued, 1024 connections
    app = build_app(tiny.model, tiny.tokenizer, SlowPlainDrafter(), name=NAME, limits=limits)
    body = {"model": NAME, "prompt": "hi", "max_tokens": 4, "temperature": 0}

    async def burst(url):
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=300)) as c:
            return await asyncio.gather(*(c.post(url + "/v1/completions", json=body) for _ in range(200)))

    with Running(app, limits) as s, LogRecords() as logs:
        responses = asyncio.run(burst(s.url))
    codes = sorted({r.status_code for r in responses})
    assert set(codes) <= {200, 429}, codes
    assert 429 in codes and 200 in codes
    assert all(r.json()["error"]["code"] == "queue_full" for r in responses if r.status_code == 429)
    assert logs.problems() == []


def test_stalled_bodies_time_out_and_never_block_others(tiny):
    limits = Limits(max_rows=2, max_queue=2, max_tokens=16, read_timeout_s=1.5, max_connections=8)
    app = build_app(tiny.model, tiny.tokenizer, PromptLookupDrafter(), name=NAME, limits=limits)
    with Running(app, limits) as s, LogRecords() as logs:
        stalled = []
        for _ in range(8):  # as many as the server takes at once: headers, 11 bytes of a 100-byte body, then nothing
            sock = socket.create_connection(("127.0.0.1", s.port), timeout=10)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"model\": 1")
            stalled.append(sock)
        heads = []
        for _ in range(4):  # connections that send half a request head, then nothing
            sock = socket.create_connection(("127.0.0.1", s.port), timeout=10)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0")
            heads.append(sock)
        time.sleep(0.3)
        r = httpx.post(s.url + "/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_overloaded"  # the cap, in JSON
        t0 = time.time()
        for sock in stalled:
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
                if b"\r\n\r\n" in answer and answer.rstrip().endswith(b"}"):
                    break
            code, err = status_and_json(answer)
            assert code == 408 and err["error"]["code"] == "timeout", err
            sock.close()
        assert time.time() - t0 < 5
        for sock in heads:  # closed by the server, unanswered
            assert sock.recv(100) == b""
            sock.close()
        r = httpx.post(s.url + "/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert logs.problems() == []


@pytest.mark.slow
def test_sigterm_past_the_shutdown_timeout_ends_every_request_with_abort(tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # plain decoding: prompt lookup on a tiny random model's repetitive text drafts long accepted
    # chains, and every row could finish its 900 tokens within the shutdown timeout
    proc = subprocess.Popen([sys.executable, "-m", "infer.tools.cli", "serve", "--verifier", "tiny-random:llama",
                             "--draft", "none", "--port", str(port), "--shutdown-timeout", "1", "--max-tokens", "900"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_serving(proc, url)
        got: dict[int, object] = {}
        body = {"prompt": "hi", "max_tokens": 900, "temperature": 0}  # greedy: where each ends is deterministic

        def plain(i):
            got[i] = httpx.post(url + "/v1/completions", json=body, timeout=120)

        def streamed(i):
            with httpx.stream("POST", url + "/v1/chat/completions", timeout=120,
                              json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 900, "stream": True,
                                    "temperature": 0}) as r:
                got[i] = [line for line in r.iter_lines() if line]

        threads = [threading.Thread(target=plain if i % 2 else streamed, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        deadline = time.time() + 60
        while httpx.get(url + "/health").json()["running"] < 8:  # 900 tokens take far longer than this wait
            assert time.time() < deadline and all(t.is_alive() for t in threads), got
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=60)
        assert proc.wait(timeout=60) == 0
        err = proc.stderr.read().decode()
        assert "Traceback" not in err and "CancelledError" not in err, err[-3000:]
        reasons = []
        for i in range(8):  # each answered whole, cut with abort (greedy: none reaches eos this soon)
            if i % 2:
                r = got[i]
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0, r.text[:500]
                reasons.append(r.json()["choices"][0]["finish_reason"])
            else:
                lines = got[i]
                assert lines[-1] == "data: [DONE]", lines[-3:]
                reasons.append(json.loads(lines[-2][len("data: "):])["choices"][0]["finish_reason"])
        assert reasons == ["abort"] * 8, reasons
    finally:
        if proc.poll() is None:
            proc.kill()


def test_max_completion_tokens_null_does_not_hide_max_tokens(server):
    r = httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": "hello", "max_tokens": 2,
                                                         "max_completion_tokens": None, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                                                              "max_tokens": 3, "max_completion_tokens": None})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3, r.text


NEUTRAL = {"logprobs": False, "logit_bias": {}, "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
           "best_of": 1, "echo": False, "presence_penalty": 0.0, "frequency_penalty": 0, "top_logprobs": 0, "n": 1,
           "suffix": None, "parallel_tool_calls": True}


@pytest.mark.parametrize("key, value", NEUTRAL.items())
def test_fields_sent_with_their_neutral_value_are_served(server, key, value):
    path = "/v1/chat/completions" if key in ("tools", "tool_choice", "response_format", "top_logprobs",
                                             "parallel_tool_calls") else "/v1/completions"
    body = {"model": NAME, "max_tokens": 2, "temperature": 0, key: value}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == 200, (key, r.text)


@pytest.mark.parametrize("key, value, words", [
    ("n", True, "'n' must be 1"), ("logprobs", 2, "not supported"), ("logit_bias", {"5": 1}, "not supported"),
    ("tools", [{"type": "function", "function": {"name": "f"}}], "not supported"), ("best_of", 2, "not supported"),
    ("presence_penalty", True, "not supported"),
])
def test_fields_asking_for_what_is_not_implemented_are_422(server, key, value, words):
    r = httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2, key: value})
    assert r.status_code == 422 and words in r.json()["error"]["message"], r.text


def test_text_parts_and_the_developer_role_are_chat_input(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    plain = client.chat.completions.create(model=NAME, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi.\nNow."}])
    parts = client.chat.completions.create(model=NAME, max_tokens=12, temperature=0, messages=[
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Say hi."}, {"type": "text", "text": "Now."}]}])
    assert parts.choices[0].message.content == plain.choices[0].message.content
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": NAME, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert r.status_code == 422 and "text parts" in r.json()["error"]["message"]


def test_a_foreign_host_and_a_non_json_body_are_refused(server):
    body = json.dumps({"model": NAME, "prompt": "hi", "max_tokens": 2}).encode()
    code, err = status_and_json(raw(server.port, post(body, host="evil.example:8000")))
    assert code == 421 and err["error"]["code"] == "misdirected_request"
    code, err = status_and_json(raw(server.port, post(body, content_type="text/plain")))
    assert code == 415 and "application/json" in err["error"]["message"]
    for host in ("localhost:8000", "127.0.0.1", "[::1]:80"):
        code, _ = status_and_json(raw(server.port, post(body, host=host)))
        assert code == 200, host


def seeded_texts(tiny, drafter, prompts: list[str], seed: int) -> tuple[list[str], list[str]]:
    """Each prompt sent alone, then all at once, to a server with ``drafter``: the texts."""
    limits = Limits(max_rows=8, max_queue=8, max_tokens=64)
    app = build_app(tiny.model, tiny.tokenizer, drafter, name=NAME, limits=limits)

    def ask(url, i):
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        return c.completions.create(model=NAME, prompt=prompts[i], max_tokens=40, temperature=1.0, seed=seed + i).choices[0].text

    with Running(app, limits) as s:
        alone = [ask(s.url, i) for i in range(len(prompts))]
        together: dict[int, str] = {}
        threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, ask(s.url, i))) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return alone, [together[i] for i in range(len(prompts))]


def test_a_seed_is_the_same_text_alone_batched_drafted_or_not(tiny):
    prompts = ["abc abc abc abc", "1 2 3 1 2 3 1 2 3", "the the the the", "hello"]
    alone_pld, batched_pld = seeded_texts(tiny, PromptLookupDrafter(max_ngram=2, adaptive=False), prompts, 1234)
    alone_none, batched_none = seeded_texts(tiny, NoDrafter(), prompts, 1234)
    assert alone_pld == batched_pld == alone_none == batched_none
    assert len(set(alone_pld)) > 1


def test_a_tree_goes_to_the_drafter_that_grows_it_and_a_wrong_one_is_refused_at_load(tiny, tmp_path, monkeypatch, capsys):
    """``--draft auto --tree chain:4`` with a shipped EAGLE head: the chain goes to prompt lookup,
    the engine passes no tree, and requests are served; ``--draft default --tree chain:4`` (the
    head itself) is one line and exit 2 before any model loads, for every command."""
    import torch

    import heads.io
    from conftest import run_cli
    from heads import HeadConfig, VerifierSpec, build_head, default_aux_layers
    from infer.core.tree import load_tree_spec
    from infer.drafting.loading import load_drafter

    model = tiny.model
    cfg = HeadConfig("eagle3", VerifierSpec.of(model), draft_vocab_size=200,
                     aux_layers=default_aux_layers(model.config.num_hidden_layers), layer_config=model.config.to_dict())
    torch.manual_seed(0)
    build_head(cfg).save_pretrained(tmp_path / "tiny")
    monkeypatch.setattr(heads.io, "PRETRAINED_DIR", tmp_path)
    drafter = load_drafter("auto", model, tree=load_tree_spec("chain:4"))
    assert [type(d).__name__ for d in drafter.drafters] == ["EagleDrafter", "PromptLookupDrafter"]
    limits = Limits(max_rows=2, max_queue=2, max_tokens=16)
    with Running(build_app(model, tiny.tokenizer, drafter, name=NAME, limits=limits), limits) as s:
        r = httpx.post(s.url + "/v1/completions", json={"model": NAME, "prompt": "abc abc abc", "max_tokens": 8})
        assert r.status_code == 200, r.text
    monkeypatch.undo()
    for cmd in (["serve"], ["generate", "--prompt", "hi"], ["chat"], ["bench", "--prompts", "configs/prompts/unseen.jsonl", "--out", str(tmp_path / "b.json")]):
        code, out, err = run_cli([*cmd, "--verifier", "default", "--draft", "default", "--tree", "chain:4"], capsys)
        assert code == 2 and "grows dynamic trees" in err and "Traceback" not in err, (cmd, err)
