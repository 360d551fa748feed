"""Hostile and careless clients against `specheads serve` with the default verifier, on loopback
ports 8101-8104: the checks behind docs/refused-inputs.md's server section, at the real model's
speed (the tests run them on a tiny model).

    python bench/serve_probe.py --out results/serve-probe.json

Prints and writes one JSON object: seeded texts under ``--draft auto`` (4 identical requests, 8
prompts alone twice and all at once) and against ``--draft none``; a deeply nested body; a
non-streaming client that leaves (how long its row lives on); a burst of 200 requests at the
defaults (status and content type counts); 96 stalled bodies (another request meanwhile, and
what the stalled ones get); ``--draft auto --tree chain:4``; SIGTERM past ``--shutdown-timeout
2`` with 8 requests of 500 tokens in flight (finish reasons, streams ending with [DONE], exit
status, tracebacks on stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

PROMPTS = ["Tell me about the moon.", "Write a short poem about rain.", "What is 17 times 23?", "List three fruits.",
           "Explain gravity to a child.", "Name a famous painter.", "How do I boil an egg?", "Describe a cat."]


def start(port: int, *flags: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "infer.tools.cli", "serve", "--verifier", "default", "--port", str(port),
                             *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    url, t0 = f"http://127.0.0.1:{port}", time.time()
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.time() - t0 > 300:
            raise SystemExit(proc.communicate()[1].decode()[-2000:])
        time.sleep(0.3)


def stop(proc: subprocess.Popen) -> dict:
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=120)
    err = proc.stderr.read().decode()
    return {"rc": rc, "tracebacks": err.count("Traceback")}


def seeded(url: str, prompt: str, seed: int) -> str:
    r = httpx.post(url + "/v1/completions", timeout=300,
                   json={"model": "default", "prompt": prompt, "max_tokens": 48, "temperature": 1.0, "seed": seed})
    return r.json()["choices"][0]["text"]


def seed_texts(url: str) -> tuple[list[str], list[list[str]], list[str]]:
    """4 identical requests; the 8 prompts alone, twice; the 8 at once."""
    same = [seeded(url, PROMPTS[0], 1234) for _ in range(4)]
    alone = [[seeded(url, p, 1000 + i) for i, p in enumerate(PROMPTS)] for _ in range(2)]
    together: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, seeded(url, PROMPTS[i], 1000 + i)))
               for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return same, alone, [together[i] for i in range(len(PROMPTS))]


async def burst(url: str, n: int = 200) -> dict:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=2 * n)) as c:
        rs = await asyncio.gather(*(c.post(url + "/v1/completions", json={"model": "default", "prompt": "Hi", "max_tokens": 4})
                                    for _ in range(n)), return_exceptions=True)
    counts: dict[str, int] = {}
    for r in rs:
        k = type(r).__name__ if isinstance(r, Exception) else f"{r.status_code} {r.headers.get('content-type')}"
        counts[k] = counts.get(k, 0) + 1
    return counts


def stalled_bodies(url: str, port: int, n: int = 96) -> tuple[dict, dict]:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"model\": 1")
        socks.append(s)
    time.sleep(0.5)
    t0 = time.time()
    r = httpx.post(url + "/v1/completions", json={"model": "default", "prompt": "Hi", "max_tokens": 4}, timeout=60)
    meanwhile = {"status": r.status_code, "seconds": round(time.time() - t0, 2)}
    answers: dict[str, int] = {}
    for s in socks:
        s.settimeout(30)
        data = s.recv(4096)
        k = data.split(b"\r\n")[0].decode() if data else "closed"
        answers[k] = answers.get(k, 0) + 1
        s.close()
    return meanwhile, answers


def left_client(url: str) -> float:
    """Seconds a non-streaming request's row lives after its client (curl -m 1.5) gave up."""
    t0 = time.time()
    subprocess.run(["curl", "-s", "-m", "1.5", url + "/v1/completions", "-H", "Content-Type: application/json",
                    "-d", json.dumps({"model": "default", "prompt": "Write a long story.", "max_tokens": 600})])
    while httpx.get(url + "/health").json()["running"] > 0 and time.time() - t0 < 60:
        time.sleep(0.05)
    return round(time.time() - t0 - 1.5, 2)


def sigterm_in_flight(port: int) -> dict:
    proc, url = start(port, "--draft", "auto", "--shutdown-timeout", "2")
    got: dict[int, object] = {}

    def body(i: int, stream: bool) -> dict:
        return {"model": "default", "prompt": f"Write a very long story about a dragon, chapter {i}.", "max_tokens": 500,
                "stream": stream}

    def plain(i: int) -> None:
        got[i] = httpx.post(url + "/v1/completions", timeout=300, json=body(i, False)).json()

    def streamed(i: int) -> None:
        with httpx.stream("POST", url + "/v1/completions", timeout=300, json=body(i, True)) as r:
            got[i] = [x for x in r.iter_lines() if x]

    threads = [threading.Thread(target=plain if i % 2 else streamed, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    while httpx.get(url + "/health").json()["running"] + len(got) < 8:  # all decoding (or already ended at eos)
        time.sleep(0.1)
    time.sleep(1)
    ended = len(got)
    out = stop(proc)
    for t in threads:
        t.join()
    out.update(ended_before_sigterm=ended,
               plain_finish=[got[i]["choices"][0]["finish_reason"] for i in range(1, 8, 2)],
               streams_end_with_done=[got[i][-1] == "data: [DONE]" for i in range(0, 8, 2)],
               stream_finish=[json.loads(got[i][-2][len("data: "):])["choices"][0]["finish_reason"] for i in range(0, 8, 2)])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out: dict = {}
    proc, url = start(8101, "--draft", "auto")
    same, alone, together = seed_texts(url)
    out["seed_identical_requests_distinct_texts"] = len(set(same))
    out["seed_prompts_alone_twice_equal"] = f"{sum(a == b for a, b in zip(*alone))}/{len(PROMPTS)}"
    out["seed_prompts_together_equal_alone"] = f"{sum(a == b for a, b in zip(alone[0], together))}/{len(PROMPTS)}"
    deep = b"[" * 100000 + b"]" * 100000
    out["deep_json_status"] = httpx.post(url + "/v1/completions", content=deep,
                                         headers={"content-type": "application/json"}).status_code
    out["row_lives_after_client_left_s"] = left_client(url)
    out["burst_200"] = asyncio.run(burst(url))
    out["during_96_stalled_bodies"], out["stalled_bodies_got"] = stalled_bodies(url, 8101)
    out["auto_server_stop"] = stop(proc)
    proc, url = start(8102, "--draft", "none")
    out["seed_none_equal_auto"] = f"{sum(a == b for a, b in zip(alone[0], seed_texts(url)[1][0]))}/{len(PROMPTS)}"
    stop(proc)
    proc, url = start(8103, "--draft", "auto", "--tree", "chain:4")
    out["auto_tree_chain4_status"] = httpx.post(url + "/v1/completions", timeout=120,
                                                json={"model": "default", "prompt": "Hi", "max_tokens": 8}).status_code
    stop(proc)
    out["sigterm_past_shutdown_timeout"] = sigterm_in_flight(8104)
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
