"""Two commits of the engine side by side, in one run on one machine: the drafting budget's worst
case (a draft model as costly as the verifier) and ``auto`` at 1 and 4 rows.

    git worktree add /tmp/engine-before <commit>        # the code to compare against
    .venv/bin/python bench/engine_ab.py --before /tmp/engine-before --draft-model /tmp/costly-draft \\
        --out results/engine-ab.json

``--draft-model``: a plain HF directory of the default verifier (``load_verifier("default")``
then ``save_pretrained``): a draft model exactly as costly per token as the verifier. Every
measurement is a fresh process of one tree's code (``PYTHONPATH``), the two trees in turns per
prompt: ``specheads generate --compare --json`` for one row (its speedup is over HF greedy in
the same process; the draft model's is also taken over the same tree's ``--draft none``), and ``Speculator.generate`` on four prompts at once against ``--draft none``
for four rows (both long-lived in one process, ``--rounds`` batches each in turns, the median
kept). Run it with nothing else running on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from compiled_step import texts  # the shared prompt picking (python puts bench/ on the path)

BATCH = """
import json, statistics, sys, time
from infer import Speculator
prompts, n, rounds = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
specs = {draft: Speculator.from_pretrained("default", draft=draft) for draft in ("none", "auto")}
out = {}
for _ in range(rounds):  # the two long-lived speculators in turns: drift hits both alike
    for draft, spec in specs.items():
        spec.generate(prompts[0], max_new_tokens=4)
        t0 = time.perf_counter()
        res = spec.generate(prompts, max_new_tokens=n)
        out.setdefault(draft, []).append((sum(len(r.token_ids) for r in res) / (time.perf_counter() - t0),
                                          [r.token_ids for r in res]))
print(json.dumps({d: {"tokens_per_s": statistics.median(v[0] for v in runs), "rounds": [v[0] for v in runs],
                      "tokens": runs[0][1]} for d, runs in out.items()}))
"""


def run(tree: Path, args: list[str]) -> dict:
    """One process of ``tree``'s code; its last stdout line as JSON."""
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, check=True, cwd=tree)
    return json.loads(out.stdout.strip().splitlines()[-1])


def one_row(tree: Path, draft: str, prompt: str, n: int) -> dict:
    got = run(tree, ["-m", "infer.tools.cli", "generate", "--verifier", "default", "--draft", draft,
                     "--tree-budget", "auto", "--max-new-tokens", str(n), "--compare", "--json", "--prompt", prompt])
    return {"speedup": got["compare"]["speedup"], "tau": got["compare"]["tau"],
            "identical": got["compare"]["output_vs_plain"] == "identical"}


def one_row_part(trees: dict, draft: str, prompts: list[str], n: int) -> dict:
    """``draft`` at one row, prompt by prompt, the trees in turns."""
    rows = {k: [] for k in trees}
    for prompt in prompts:
        for name, tree in trees.items():  # in turns, so that drift hits both alike
            rows[name].append(one_row(tree, draft, prompt, n))
    return {k: {"speedups": [r["speedup"] for r in v], "median_speedup": statistics.median(r["speedup"] for r in v),
                "tau": statistics.mean(r["tau"] for r in v), "identical": all(r["identical"] for r in v)}
            for k, v in rows.items()}


def four_rows_part(trees: dict, prompts: list[str], n: int, rounds: int) -> dict:
    """``auto`` over ``none`` on one batch of ``prompts``: the median of the rounds' ratios."""
    out = {}
    for name, tree in trees.items():
        got = run(tree, ["-c", BATCH, json.dumps(prompts), str(n), str(rounds)])
        ratios = [a / b for a, b in zip(got["auto"]["rounds"], got["none"]["rounds"])]
        out[name] = {"speedup_over_none": statistics.median(ratios), "ratios": ratios,
                     "auto_tokens_per_s": got["auto"]["tokens_per_s"], "none_tokens_per_s": got["none"]["tokens_per_s"],
                     "identical": got["auto"]["tokens"] == got["none"]["tokens"]}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path, required=True, help="a checkout of the commit to compare against")
    p.add_argument("--after", type=Path, default=Path(__file__).resolve().parents[1], help="the checkout measured (default: this one)")
    p.add_argument("--draft-model", required=True, help="a plain HF directory of the default verifier")
    p.add_argument("--prompts", default="configs/prompts/unseen.jsonl")
    p.add_argument("--limit", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3, help="4-row batches per method, in turns (the median is kept)")
    p.add_argument("--parts", default="draft_model,none_1_row,auto_1_row,auto_4_rows", help="which measurements to run")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    prompts = texts(args.prompts, args.limit)  # Spec-Bench: each question's first turn
    result = {"prompts": prompts, "max_new_tokens": args.max_new_tokens, "trees": {k: str(v) for k, v in trees.items()}}
    parts = set(args.parts.split(","))
    for label, draft in (("draft_model", f"model:{Path(args.draft_model).resolve()}"), ("none_1_row", "none"),
                         ("auto_1_row", "auto")):
        if label in parts:
            result[label] = one_row_part(trees, draft, prompts, args.max_new_tokens)
            print(label, {k: round(v["median_speedup"], 3) for k, v in result[label].items()}, flush=True)
    if {"draft_model", "none_1_row"} <= parts:
        for name in trees:  # against the same tree's own plain decoding, prompt by prompt
            ratios = [d / n for d, n in zip(result["draft_model"][name]["speedups"], result["none_1_row"][name]["speedups"])]
            result["draft_model"][name]["median_over_none"] = statistics.median(ratios)
        print("draft_model over none", {k: round(result["draft_model"][k]["median_over_none"], 3) for k in trees}, flush=True)
    if "auto_4_rows" in parts:
        result["auto_4_rows"] = four_rows_part(trees, prompts[:4], args.max_new_tokens, args.rounds)
        print("auto_4_rows", {k: round(v["speedup_over_none"], 3) for k, v in result["auto_4_rows"].items()}, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    from heads.io import write_atomic

    write_atomic(args.out, lambda path: path.write_text(json.dumps(result, indent=1)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
