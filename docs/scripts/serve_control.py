"""How far apart two servers measure through `specheads loadgen` when they are the same: the noise
floor of serve_bench.py's auto / none ratio on this machine (an A/A control).

    python docs/scripts/serve_control.py --draft none,none --levels 16 --requests 32 --rounds 6 --out results/serve-control.json

Starts one `specheads serve` per entry of ``--draft`` (one after another, as serve_bench.py does)
and gives every level to them in turns, ``--rounds`` times (loadgen pools the rounds). Prints,
per level, each server's pooled tokens/s and round times and the first server's tokens/s over
the second's, pooled and per round (the median of the per-round ratios too).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_bench import start, stop, wait_up  # noqa: E402


def main() -> int:
    sys.path.insert(0, str(ROOT))
    from infer.tools import loadgen
    from infer.tools.prompts import read_prompts

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", default="none,none", help="one server per entry (two entries)")
    p.add_argument("--levels", default="16")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--prompts", default="configs/prompts/unseen.jsonl")
    p.add_argument("--limit", type=int, default=3)
    p.add_argument("--base-port", type=int, default=8301)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    drafts = args.draft.split(",")
    if len(drafts) != 2:
        raise SystemExit("--draft: two comma-separated entries (e.g. none,none)")
    levels = [int(x) for x in args.levels.split(",")]
    procs, servers = [], {}
    try:
        for i, draft in enumerate(drafts):
            label, port = f"{draft} ({i + 1})", args.base_port + i
            procs.append(start(["--draft", draft], port, "default", max(levels)))
            servers[label] = f"http://127.0.0.1:{port}"
            wait_up(servers[label], procs[-1])
        models = {label: httpx.get(url + "/v1/models").json()["data"][0]["id"] for label, url in servers.items()}
        texts = [q.text for q in read_prompts(ROOT / args.prompts, limit=args.limit)]
        run = loadgen.run({label: (url, models[label]) for label, url in servers.items()}, texts, levels, args.requests,
                          args.max_tokens, rounds=args.rounds)
        first, second = list(servers)
        summary = {}
        for c in map(str, levels):
            a, b = run[first][c], run[second][c]
            per_round = [round(y / x, 3) for x, y in zip(a["round_wall_s"], b["round_wall_s"])]  # same tokens per round
            summary[c] = {"pooled": round(a["tokens_per_s"] / b["tokens_per_s"], 3), "per_round": per_round,
                          "median_per_round": round(statistics.median(per_round), 3)}
            print(f"{c} clients: {first} {a['tokens_per_s']} tok/s {a['round_wall_s']}, {second} {b['tokens_per_s']} tok/s "
                  f"{b['round_wall_s']}; ratio pooled {summary[c]['pooled']}, per round {per_round}", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"drafts": drafts, "levels": levels, "requests": args.requests,
                                        "max_tokens": args.max_tokens, "rounds": args.rounds, "run": run,
                                        "ratio": summary}, indent=1))
    finally:
        stop(procs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
