"""Two methods of one `specheads bench` results file, prompt by prompt: the geometric mean of B's
tokens/s over A's per category, on how many prompts B was faster, and on what share of its steps
each method's trained head was paused by its gate.

    python bench/compare_methods.py results/bench-2026-12-04-epyc-specbench.json spec:auto spec:eagle3-default-v3k+pld
"""
import json
import math
import sys
from collections import defaultdict


def main(path: str, a: str, b: str) -> None:
    with open(path) as f:
        results = json.load(f)
    logs = defaultdict(list)
    paused = {a: [0, 0], b: [0, 0]}
    for row in results["per_prompt"]:
        speed = {m: len(row[m]["tokens"]) / row[m]["seconds"] for m in (a, b)}
        for key in (row["category"], "overall"):
            logs[key].append(math.log(speed[b] / speed[a]))
        for m in (a, b):
            members = row[m]["drafter"].get("members", [row[m]["drafter"]])
            paused[m][0] += sum(x.get("paused_steps", 0) for x in members)
            paused[m][1] += row[m]["steps"]
    for key, v in sorted(logs.items()):
        print(f"{key:16s} {b} / {a}: {math.exp(sum(v) / len(v)):.3f}x (geometric mean), faster on {sum(x > 0 for x in v)}/{len(v)}")
    for m, (p, steps) in paused.items():
        print(f"{m}: its head paused on {p} of {steps} steps ({p / steps:.0%})")


if __name__ == "__main__":
    main(*sys.argv[1:4])
