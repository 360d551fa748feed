"""``specheads loadgen``: bounded load on a local ``specheads serve``, measured per request.

    specheads loadgen --url auto=http://127.0.0.1:8001 --url none=http://127.0.0.1:8002 \\
        --prompts configs/prompts/unseen.jsonl --concurrency 1,4,16 --requests 16 --max-tokens 128 \\
        --out results/serve.json --plot results/serve.png

For each concurrency ``c``: ``c`` clients, each sending its next streamed chat request as soon as
the last one ended, until ``--requests`` requests are done (the prompts in file order, repeated
if needed; greedy). Several servers (``--url LABEL=URL``, repeated) take turns at every level, so
that a comparison is measured side by side in one run; ``--rounds R`` repeats each level R times in
turns and pools them (less noise in a ratio). Per request: time to first token (TTFT) and time per output token after it
(TPOT); per level, after a warm-up of ``c`` short requests at that concurrency: throughput (tokens/s over all requests), p50/p95 of both, and from the
server's ``/metrics`` the mean tree nodes per row per verify step during the level (1.0: the
server did not draft at all), the mean tokens per verify step (tau), and the admission steps
(prefill) and the seconds of admission and decode steps. Loopback addresses only:
the generator refuses to send load anywhere else.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from ..core.errors import UserError

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
MAX_REQUESTS = 10_000
MAX_CONCURRENCY = 256


@dataclass
class Sample:
    """One request: seconds to its first token, tokens after it, seconds from first to last."""

    ttft: float
    tokens: int
    decode: float
    ok: bool = True

    @property
    def tpot(self) -> float | None:
        return self.decode / (self.tokens - 1) if self.tokens > 1 else None


def check_url(url: str) -> str:
    """``url`` without a trailing slash, if it names a loopback host (a one-line error otherwise)."""
    parts = urlparse(url)
    if parts.scheme not in ("http", "https") or parts.hostname not in LOOPBACK:
        raise UserError(f"--url {url!r}: the load generator only sends load to this machine (http://127.0.0.1:PORT)")
    return url.rstrip("/")


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-quantile (0..1) of ``values`` by linear interpolation; None when empty."""
    if not values:
        return None
    v = sorted(values)
    x = q * (len(v) - 1)
    lo = int(x)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (x - lo)


async def _one(client, url: str, model: str, prompt: str, max_tokens: int) -> Sample:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return Sample(0.0, 0, 0.0, ok=False)
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
            if any(c.get("delta", {}).get("content") for c in data.get("choices", [])):
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
    if first is None:
        return Sample(time.perf_counter() - t0, tokens, 0.0)
    return Sample(first - t0, tokens, last - first)


async def _level(url: str, model: str, prompts: list[str], concurrency: int, requests: int, max_tokens: int,
                 timeout: float) -> tuple[list[Sample], float]:
    import httpx

    queue = list(range(requests))
    samples: list[Sample] = []

    async def client_loop(client):
        while queue:
            i = queue.pop(0)
            samples.append(await _one(client, url, model, prompts[i % len(prompts)], max_tokens))

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return samples, wall


def _counters(url: str) -> dict[str, float]:
    """The server's Prometheus counters that the level summary needs."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith(("specheads_row_", "specheads_generation_tokens_total", "specheads_admission",
                            "specheads_decode_seconds_total")):
            name, value = line.split()
            out[name] = float(value)
    return out


def summarize(samples: list[Sample], walls: list[float], before: dict, after: dict) -> dict:
    """One level's row of the table, over all its rounds (``walls``: each round's seconds;
    ``before``/``after``: the server's counters around the level's rounds, summed)."""
    ok = [s for s in samples if s.ok]
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    steps = delta.get("specheads_row_verify_steps_total", 0.0)
    tpots = [s.tpot for s in ok if s.tpot is not None]
    wall = sum(walls)
    return {
        "requests": len(samples), "failed": len(samples) - len(ok), "tokens": sum(s.tokens for s in ok),
        "wall_s": round(wall, 2), "tokens_per_s": round(sum(s.tokens for s in ok) / wall, 2) if wall else None,
        "round_wall_s": [round(w, 2) for w in walls],
        "ttft_p50_s": _r(percentile([s.ttft for s in ok], 0.5)), "ttft_p95_s": _r(percentile([s.ttft for s in ok], 0.95)),
        "tpot_p50_s": _r(percentile(tpots, 0.5)), "tpot_p95_s": _r(percentile(tpots, 0.95)),
        "nodes_per_row_step": round(delta.get("specheads_row_tree_nodes_total", 0.0) / steps, 3) if steps else None,
        "tau": round(delta.get("specheads_row_accepted_tokens_total", 0.0) / steps, 3) if steps else None,
        "admissions": int(delta.get("specheads_admissions_total", 0)),
        "admission_s": round(delta.get("specheads_admission_seconds_total", 0.0), 2),
        "decode_s": round(delta.get("specheads_decode_seconds_total", 0.0), 2),
    }


def _r(x):
    return None if x is None else round(x, 4)


def run(servers: dict[str, tuple[str, str]], prompts: list[str], levels: list[int], requests: int, max_tokens: int,
        timeout: float = 600.0, rounds: int = 1) -> dict:
    """Every concurrency level against every server (``{label: (url, model)}``), interleaved: at
    each level the servers take turns (in alternating order from one turn to the next), ``rounds``
    times, so that machine noise hits them alike; returns ``{label: {level: summary}}`` (a level's
    summary pools its rounds: tokens/s is all tokens over all rounds' seconds)."""
    if rounds < 1:
        raise UserError(f"rounds must be a positive integer, not {rounds!r}")
    out: dict[str, dict] = {label: {} for label in servers}
    for url, model in servers.values():  # warm-up: a server's first request pays for lazy work
        asyncio.run(_level(check_url(url), model, prompts, 1, 1, 4, timeout))
    turn = 0
    for c in levels:
        for label in servers:
            # warm-up at this concurrency (a server learns per batch size whether drafting pays): c short requests
            url, model = servers[label]
            asyncio.run(_level(url, model, prompts, c, c, 16, timeout))
        pooled = {label: ([], [], {}, {}) for label in servers}  # samples, walls, counters before, after (summed)
        for _ in range(rounds):
            order = list(servers) if turn % 2 == 0 else list(reversed(servers))
            turn += 1
            for label in order:
                url, model = servers[label]
                samples, walls, before, after = pooled[label]
                for k, v in _counters(url).items():
                    before[k] = before.get(k, 0.0) + v
                got, wall = asyncio.run(_level(url, model, prompts, c, requests, max_tokens, timeout))
                for k, v in _counters(url).items():
                    after[k] = after.get(k, 0.0) + v
                samples += got
                walls.append(wall)
        for label, (samples, walls, before, after) in pooled.items():
            out[label][str(c)] = summarize(samples, walls, before, after)
    return out


def plot(results: dict, path: Path) -> None:
    """Throughput and p50 time per output token against concurrency, one line per run label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from heads.io import write_atomic

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label, levels in results.items():
        cs = sorted(int(c) for c in levels)
        axes[0].plot(cs, [levels[str(c)]["tokens_per_s"] for c in cs], marker="o", label=label)
        axes[1].plot(cs, [1e3 * (levels[str(c)]["tpot_p50_s"] or 0) for c in cs], marker="o", label=label)
    for ax, title in zip(axes, ("throughput (tokens/s, all requests)", "time per output token, p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    write_atomic(path, lambda p: fig.savefig(p, format="png", dpi=100))
    plt.close(fig)


def add_parser(sub) -> None:
    p = sub.add_parser("loadgen", help="bounded load on a local `specheads serve` (loopback only): throughput and "
                                       "TTFT / per-token latency at several concurrency levels")
    p.add_argument("--url", action="append", default=None,
                   help="a server, or LABEL=URL (repeatable: the servers take turns at every level, for a side-by-side "
                        "comparison in one run); default http://127.0.0.1:8000")
    p.add_argument("--prompts", required=True, help="JSONL prompt file (the bench's format)")
    p.add_argument("--limit", type=int, default=None, help="at most this many prompts per category")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated numbers of concurrent clients")
    p.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every level this many times per server, in turns (pooled: less noise in a comparison)")
    p.add_argument("--label", default="run", help="the name of a run given by a plain --url in --out")
    p.add_argument("--out", required=True, help="JSON file: {label: {concurrency: summary}} (merged with what is there)")
    p.add_argument("--plot", default=None, help="PNG of every run in --out")


def cmd_loadgen(args) -> int:
    from .files import check_output_file
    from .prompts import read_prompts

    urls = {}
    for spec in args.url or ["http://127.0.0.1:8000"]:
        label, _, url = spec.partition("=") if "=" in spec.split("://")[0] else (args.label, "", spec)
        if label in urls:
            raise UserError(f"--url: the label {label!r} is given twice")
        urls[label] = check_url(url)
    try:
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        raise UserError(f"--concurrency {args.concurrency!r}: give comma-separated positive integers") from None
    if not levels or any(not 1 <= c <= MAX_CONCURRENCY for c in levels):
        raise UserError(f"--concurrency: each level must be in 1..{MAX_CONCURRENCY}")
    if not 1 <= args.requests <= MAX_REQUESTS:
        raise UserError(f"--requests must be in 1..{MAX_REQUESTS}")
    if args.max_tokens < 1:
        raise UserError("--max-tokens must be a positive integer")
    if not 1 <= args.rounds <= 100:
        raise UserError("--rounds must be in 1..100")
    out = check_output_file(args.out, "--out")
    prompts = [p.text for p in read_prompts(args.prompts, limit=args.limit)]
    if not prompts:
        raise UserError(f"{args.prompts} holds no prompts")
    import httpx

    servers = {}
    for label, url in urls.items():
        try:
            servers[label] = (url, httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"])
        except (httpx.HTTPError, KeyError, IndexError, ValueError):
            raise UserError(f"no specheads server answers at {url}: start one with `specheads serve`") from None
    results = run(servers, prompts, levels, args.requests, args.max_tokens, rounds=args.rounds)
    from heads.io import write_atomic

    merged = json.loads(out.read_text()) if out.exists() else {}
    merged.update(results)
    write_atomic(out, lambda p: p.write_text(json.dumps(merged, indent=1)))
    for label, levels_ in results.items():
        for c, row in levels_.items():
            print(json.dumps({"label": label, "concurrency": int(c), **row}))
    if args.plot:
        plot(merged, Path(args.plot))
    return 0


def table(results: dict) -> str:
    """A Markdown table of every run in ``results`` (what BENCHMARKS.md shows)."""
    head = "| run | clients | tokens/s | TTFT p50 / p95 (s) | per token p50 / p95 (ms) | nodes / row-step | tau |\n|---|---|---|---|---|---|---|"
    rows = []
    for label, levels in results.items():
        for c in sorted(levels, key=int):
            r = levels[c]
            ms = lambda x: "-" if x is None else f"{1e3 * x:.0f}"  # noqa: E731
            rows.append(f"| {label} | {c} | {r['tokens_per_s']} | {r['ttft_p50_s']} / {r['ttft_p95_s']} | "
                        f"{ms(r['tpot_p50_s'])} / {ms(r['tpot_p95_s'])} | {r['nodes_per_row_step']} | {r['tau']} |")
    return "\n".join([head, *rows])
