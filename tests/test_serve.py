"""``specheads serve``: the real server (uvicorn) on a free loopback port, spoken to with the real
``openai`` client and, for malformed requests, raw HTTP.

The verifier is ``tiny-random:llama`` (a tiny random model with a byte tokenizer and a chat
template): what the server returns is checked against the engine's own greedy output.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from infer import generate  # noqa: E402
from infer.core.drafter import NoDrafter  # noqa: E402
from infer.core.models import load_verifier  # noqa: E402
from infer.core.text import eos_ids  # noqa: E402
from infer.drafting.lookup import PromptLookupDrafter  # noqa: E402
from infer.tools.serve import Limits, build_app  # noqa: E402

NAME = "tiny-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_serving(proc, url: str, limit_s: float = 240) -> None:
    """Wait for a ``specheads serve`` subprocess to answer ``/health`` (imports and the model on a
    busy 2-core machine take a while); fail with its stderr if it dies or never does."""
    deadline = time.time() + limit_s
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.time() > deadline or proc.poll() is not None:
            proc.kill()
            pytest.fail(f"the server did not come up: {proc.communicate()[1].decode()[-2000:]}")
        time.sleep(0.2)


class Running:
    """The server ``specheads serve`` runs (:func:`make_server`), in a thread of this process, on a
    free loopback port."""

    def __init__(self, app, limits: Limits | None = None):
        from infer.tools.serve import make_server

        self.port = free_port()
        self.server = make_server(app, "127.0.0.1", self.port, limits or Limits())
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def tiny():
    return load_verifier("tiny-random:llama")


@pytest.fixture(scope="module")
def server(tiny):
    limits = Limits(max_rows=4, max_queue=8, max_tokens=64, max_body_bytes=4096, timeout_s=60)
    app = build_app(tiny.model, tiny.tokenizer, PromptLookupDrafter(), name=NAME, limits=limits)
    with Running(app, limits) as running:
        yield running


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def engine_text(tiny, prompt_ids, n) -> tuple[str, list[int]]:
    out = generate(tiny.model, None, torch.tensor(prompt_ids), max_new_tokens=n, eos_token_id=eos_ids(tiny.model, tiny.tokenizer))
    return tiny.tokenizer.decode(out.token_ids, skip_special_tokens=True), out.token_ids


def test_completion_equals_the_engines_greedy_output(client, tiny):
    res = client.completions.create(model=NAME, prompt="The cat sat on", max_tokens=20, temperature=0)
    want, ids = engine_text(tiny, tiny.tokenizer("The cat sat on")["input_ids"], 20)
    assert res.choices[0].text == want
    assert res.usage.completion_tokens == len(ids)
    assert res.usage.prompt_tokens == len(tiny.tokenizer("The cat sat on")["input_ids"])
    assert res.choices[0].finish_reason in ("length", "stop")
    assert res.model == NAME and res.object == "text_completion"


def test_chat_streams_the_same_text_as_it_returns_whole(client, tiny):
    messages = [{"role": "user", "content": "Say something."}]
    whole = client.chat.completions.create(model=NAME, messages=messages, max_tokens=24, temperature=0)
    parts, usage, reasons = [], None, []
    for ev in client.chat.completions.create(model=NAME, messages=messages, max_tokens=24, temperature=0, stream=True,
                                             stream_options={"include_usage": True}):
        if ev.usage is not None:
            usage = ev.usage
        for c in ev.choices:
            parts.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    assert "".join(parts) == whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant"
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    assert reasons[-1] == whole.choices[0].finish_reason and reasons[-1] in ("stop", "length")
    ids = tiny.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert whole.choices[0].message.content == engine_text(tiny, ids, 24)[0]


def test_concurrent_requests_are_batched_and_each_is_its_own_greedy_output(server, tiny):
    prompts = ["a", "Once upon a time there was", "1 2 3 4 5 6 7 8", "The quick brown fox jumps over the lazy"]
    results: dict[int, str] = {}

    def ask(i):
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
        results[i] = c.completions.create(model=NAME, prompt=prompts[i], max_tokens=30, temperature=0).choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, p in enumerate(prompts):
        assert results[i] == engine_text(tiny, tiny.tokenizer(p)["input_ids"], 30)[0], i
    metrics = httpx.get(server.url + "/metrics").text
    assert "specheads_step_seconds_count" in metrics and "specheads_generation_tokens_total" in metrics


def test_stop_strings_cut_the_text_as_openai_does(client, tiny):
    prompt = "abc abc abc"
    full = client.completions.create(model=NAME, prompt=prompt, max_tokens=30, temperature=0).choices[0].text
    # a stop string of two printable ASCII characters from the middle of the output (the tiny model writes bytes)
    at = next(i for i in range(1, len(full) - 1) if full[i : i + 2].isascii() and full[i : i + 2].isprintable())
    stop = full[at : at + 2]
    assert full.index(stop) > 0
    res = client.completions.create(model=NAME, prompt=prompt, max_tokens=30, temperature=0, stop=[stop])
    assert res.choices[0].text == full[: full.index(stop)]
    assert res.choices[0].finish_reason == "stop"
    streamed = "".join(e.choices[0].text for e in client.completions.create(
        model=NAME, prompt=prompt, max_tokens=30, temperature=0, stop=stop, stream=True) if e.choices)
    assert streamed == res.choices[0].text


def test_a_seed_repeats_a_sample_and_sampling_fields_are_taken(client):
    a = client.completions.create(model=NAME, prompt="x", max_tokens=16, temperature=1.0, top_p=0.9, seed=7,
                                  extra_body={"top_k": 20}).choices[0].text
    b = client.completions.create(model=NAME, prompt="x", max_tokens=16, temperature=1.0, top_p=0.9, seed=7,
                                  extra_body={"top_k": 20}).choices[0].text
    assert a == b


def test_models_health_and_metrics(server):
    models = openai.OpenAI(base_url=server.url + "/v1", api_key="x").models.list()
    assert [m.id for m in models.data] == [NAME]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    text = httpx.get(server.url + "/metrics").text
    for name in ("specheads_requests_total", "specheads_tau", "specheads_batch_size", "specheads_queue_length",
                 "specheads_step_seconds_bucket", "specheads_prompt_tokens_total", "specheads_admissions_total",
                 "specheads_admitted_rows_total", "specheads_admission_seconds_total", "specheads_decode_seconds_total"):
        assert name in text, name


@pytest.mark.parametrize("body, status, words", [
    (b"{not json", 400, "not valid JSON"),
    (json.dumps({"model": NAME}).encode(), 422, "prompt"),
    (json.dumps({"model": "gpt-4", "prompt": "x"}).encode(), 404, "does not exist"),
    (json.dumps({"model": NAME, "prompt": "x", "max_tokens": 10_000}).encode(), 400, "limit of 64"),
    (json.dumps({"model": NAME, "prompt": "x", "n": 2}).encode(), 422, "'n' must be 1"),
    (json.dumps({"model": NAME, "prompt": "x", "temperature": -1}).encode(), 422, "temperature"),
    (json.dumps({"model": NAME, "prompt": "x", "logprobs": 3}).encode(), 422, "not supported"),
    (json.dumps({"model": NAME, "prompt": "x" * 5000}).encode(), 413, "over this server's limit"),
    (json.dumps({"model": NAME, "prompt": "x", "stop": 5}).encode(), 422, "stop"),
    (json.dumps([1, 2]).encode(), 422, "JSON object"),
])
def test_malformed_requests_get_openai_errors_and_the_server_keeps_serving(server, client, body, status, words):
    r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["type"]
    assert "Traceback" not in r.text
    assert client.completions.create(model=NAME, prompt="ok", max_tokens=2, temperature=0).choices[0].text is not None


def test_unknown_routes_and_methods_get_json_errors(server):
    r = httpx.get(server.url + "/v2/nothing")
    assert r.status_code == 404 and "no route" in r.json()["error"]["message"]
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["message"]


def test_a_prompt_beyond_the_context_is_a_400(server, tiny):
    ctx = tiny.model.config.max_position_embeddings
    body = {"model": NAME, "prompt": [1] * (ctx - 4), "max_tokens": 16}
    r = httpx.post(server.url + "/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded" and str(ctx) in r.json()["error"]["message"]


class SlowPlainDrafter(NoDrafter):
    """Plain decoding, 20 ms a step: a request of 400 tokens runs for 8 s at least."""

    def propose(self, requests):
        time.sleep(0.02)
        return super().propose(requests)


def test_a_full_queue_is_a_429_and_a_client_that_leaves_frees_its_row(tiny):
    limits = Limits(max_rows=1, max_queue=1, max_tokens=400, timeout_s=60)
    app = build_app(tiny.model, tiny.tokenizer, SlowPlainDrafter(), name=NAME, limits=limits)
    with Running(app, limits) as s:
        body = {"model": NAME, "prompt": "go", "max_tokens": 400, "temperature": 0, "stream": True}
        with httpx.Client(timeout=60) as c1:
            with c1.stream("POST", s.url + "/v1/completions", json=body) as first:  # holds the one row
                lines = first.iter_lines()  # kept: a dropped iterator closes the response (the client leaves)
                next(lines)
                with httpx.Client(timeout=60) as c2, c2.stream("POST", s.url + "/v1/completions", json=body) as second:
                    time.sleep(0.3)  # queued behind the first
                    health = httpx.get(s.url + "/health").json()
                    assert (health["running"], health["waiting"]) == (1, 1), health
                    third = httpx.post(s.url + "/v1/completions", json={**body, "stream": False}, timeout=60)
                    assert third.status_code == 429 and third.json()["error"]["code"] == "queue_full"
                    assert second.status_code == 200
            # the first client closed its stream: its row is freed at the next step
            deadline = time.time() + 20
            while httpx.get(s.url + "/health").json()["running"] + httpx.get(s.url + "/health").json()["waiting"] > 0:
                assert time.time() < deadline, httpx.get(s.url + "/health").json()
                time.sleep(0.1)


@pytest.mark.slow
def test_sigterm_finishes_in_flight_requests_and_exits_0(tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "infer.tools.cli", "serve", "--verifier", "tiny-random:llama",
                             "--draft", "pld", "--port", str(port), "--shutdown-timeout", "20"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_serving(proc, url)
        got = {}

        def ask():
            got["r"] = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 60, "temperature": 0}, timeout=60)

        t = threading.Thread(target=ask)
        t.start()
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        t.join(timeout=60)
        assert proc.wait(timeout=60) == 0
        assert got["r"].status_code == 200 and got["r"].json()["choices"][0]["finish_reason"] in ("length", "stop")
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_refuses_bad_flags_before_loading(capsys):
    from conftest import run_cli

    code, out, err = run_cli(["serve", "--verifier", "tiny-random:llama", "--max-seqs", "0"], capsys)
    assert code == 2 and "--max-seqs must be a positive integer" in err and "Traceback" not in err
    code, out, err = run_cli(["serve", "--verifier", "tiny-random:llama", "--port", "70000"], capsys)
    assert code == 2 and "--port" in err
    code, out, err = run_cli(["serve", "--verifier", "tiny-random:llama", "--join-wait", "-1"], capsys)
    assert code == 2 and "--join-wait must be a non-negative integer" in err and "Traceback" not in err


def test_the_load_generator_measures_a_local_server_and_refuses_others(server):
    from infer import UserError
    from infer.tools import loadgen

    with pytest.raises(UserError, match="only sends load to this machine"):
        loadgen.check_url("http://example.com:8000")
    assert loadgen.percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5 and loadgen.percentile([], 0.5) is None
    res = loadgen.run({"a": (server.url, NAME), "b": (server.url, NAME)}, ["hello", "one two three"], [1, 2], 3, 8,
                      rounds=2)
    for label in ("a", "b"):
        for level in ("1", "2"):
            row = res[label][level]  # two rounds pooled
            assert row["requests"] == 6 and row["failed"] == 0 and row["tokens"] == 48, row
            assert len(row["round_wall_s"]) == 2 and row["wall_s"] == pytest.approx(sum(row["round_wall_s"]), abs=0.02)
            assert 1 <= row["admissions"] <= 6 and row["admission_s"] > 0 and row["decode_s"] > 0, row
            assert row["tokens_per_s"] > 0 and row["ttft_p50_s"] > 0 and row["nodes_per_row_step"] >= 1.0
    assert "| a | 2 |" in loadgen.table(res)


def test_a_reader_behind_the_engine_gets_every_chunk_as_it_was(tiny):
    """The engine thread may finish a generation before the HTTP side reads its first chunk: each
    chunk must still say whether it was the last one then (not what the running stats say later)."""
    import asyncio

    from infer.core.engine import Engine
    from infer.core.params import SamplingParams
    from infer.tools.serve import EngineLoop, Metrics, Request

    limits = Limits(max_rows=4, max_queue=8, max_tokens=64, max_body_bytes=4096, timeout_s=60)
    loop_ = EngineLoop(Engine(tiny.model, None), [], tiny.tokenizer, limits, Metrics())
    aio = asyncio.new_event_loop()
    try:
        req = Request(tiny.tokenizer("hello there")["input_ids"], SamplingParams(max_new_tokens=12), [], aio)
        loop_.start()
        loop_.submit(req)
        deadline = time.time() + 60
        while (req.index is None or req.index in loop_._by_index) and time.time() < deadline:
            time.sleep(0.01)  # the reader waits until the engine loop has handed over the whole generation
        aio.run_until_complete(asyncio.sleep(0))  # deliver what the engine thread handed over
        chunks = []
        while not req.queue.empty():
            chunks.append(req.queue.get_nowait())
    finally:
        loop_.stop(1.0)
        aio.close()
    assert sum(len(c.token_ids) for c in chunks) == 12
    assert [bool(c.stats.finish_reason) for c in chunks] == [False] * (len(chunks) - 1) + [True]
