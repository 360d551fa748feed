"""The serving table of BENCHMARKS.md: `specheads serve` with `--draft auto`, `--draft none` and
`--draft auto --max-seqs 1` (one request at a time), loaded side by side by `specheads loadgen` at
1, 4 and 16 concurrent clients, on the Spec-Bench and the unseen prompts (``make serve-bench``).

    python bench/serve_bench.py --rounds 3 --out results/serve-bench.json --plot results/serve-bench.png

The three servers run at once on loopback ports (started one after another, so that each measures
its verify-cost curve on an idle machine; each waits idle while another is measured). The load
generator gives each level to `auto` and `none` in turn, ``--rounds`` times (pooled: the ratio the
3% criterion is about is the noisiest number), then to the one-at-a-time server once. Each server
is stopped with SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
SERVERS = {"auto": ["--draft", "auto"], "none": ["--draft", "none"], "auto, one at a time": ["--draft", "auto", "--max-seqs", "1"]}
PAIRED = ("auto", "none")  # the comparison the 3% criterion is about: measured in turns, --rounds times
PROMPTS = {"spec_bench": ("configs/prompts/spec_bench.jsonl", 2), "unseen": ("configs/prompts/unseen.jsonl", 3)}


def start(extra: list[str], port: int, verifier: str, max_seqs: int) -> subprocess.Popen:
    args = [sys.executable, "-m", "infer.tools.cli", "serve", "--verifier", verifier, "--port", str(port), "--max-tokens", "512",
            "--max-queue", "256", "--max-seqs", str(max_seqs), *extra]
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wait_up(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            raise SystemExit(f"a server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"no server at {url} after {timeout} s")


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every server, then wait for each (killed after a minute)."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> int:
    sys.path.insert(0, str(ROOT))
    from infer.tools import loadgen
    from infer.tools.prompts import read_prompts

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--verifier", default="default")
    p.add_argument("--levels", default="1,4,16")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="turns of auto and none per level (pooled)")
    p.add_argument("--base-port", type=int, default=8101)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--plot", type=Path, default=None)
    args = p.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    procs, servers = [], {}
    try:
        for i, (label, extra) in enumerate(SERVERS.items()):  # one after another: each measures its verify-cost
            port = args.base_port + i                            # curve at start-up, on an otherwise idle machine
            procs.append(start(extra, port, args.verifier, max(levels)))
            servers[label] = f"http://127.0.0.1:{port}"
            wait_up(servers[label], procs[-1])
        models = {label: httpx.get(url + "/v1/models").json()["data"][0]["id"] for label, url in servers.items()}
        results = {"levels": levels, "requests": args.requests, "max_tokens": args.max_tokens, "rounds": args.rounds,
                   "sets": {}}
        for name, (path, per_category) in PROMPTS.items():
            texts = [q.text for q in read_prompts(ROOT / path, limit=per_category)]
            paired = {label: (url, models[label]) for label, url in servers.items() if label in PAIRED}
            run = loadgen.run(paired, texts, levels, args.requests, args.max_tokens, rounds=args.rounds)
            for label, url in servers.items():
                if label not in PAIRED:
                    run.update(loadgen.run({label: (url, models[label])}, texts, levels, args.requests, args.max_tokens))
            results["sets"][name] = run
            print(f"## {name}\n{loadgen.table(run)}\n", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
        if args.plot:
            loadgen.plot({f"{label} ({name})": r for name, run in results["sets"].items() for label, r in run.items()}, args.plot)
    finally:
        stop(procs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
