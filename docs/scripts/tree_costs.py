"""What one verify pass of an n-node chain costs the default verifier through ``infer.verifier``
(for whichever specheads is first on sys.path: run it once per commit, in turn, nothing else
running), against a one-node pass: the relative cost the gate and prompt lookup weigh drafts by.

    PYTHONPATH=. python docs/scripts/tree_costs.py [--rounds 40] [--context 300] [--linear auto]

Each round verifies chains of 1, 2, 4, 8 and 16 nodes in turn and commits the root only, so the
cache grows by one position a round; medians over the rounds.
"""
import argparse
import json
import statistics
import time

import torch

from infer.models import load_verifier
from infer.tree import build_tree
from infer.verifier import Verifier

SIZES = (1, 2, 4, 8, 16)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--linear", default="auto")
    args = p.parse_args()
    model = load_verifier("default", dtype="fp32").model
    v = Verifier(model, linear=args.linear)
    ids = torch.randint(100, 40000, (args.context,), generator=torch.Generator().manual_seed(0))
    v.prefill(ids)
    trees = {n: build_tree(list(range(-1, n - 1))) for n in SIZES}
    tokens = {n: torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(n)) for n in SIZES}
    zero = torch.tensor([0])
    times = {n: [] for n in SIZES}
    for r in range(args.rounds + 1):  # round 0 warms up
        for n in SIZES:
            t0 = time.perf_counter()
            v.verify(tokens[n], trees[n])
            v.commit(zero, [0])
            if r:
                times[n].append(time.perf_counter() - t0)
    one = statistics.median(times[1])
    print(json.dumps({"context": args.context, "rounds": args.rounds, "one_node_ms": round(1000 * one, 1),
                      "relative": {n: round(statistics.median(times[n]) / one, 3) for n in SIZES},
                      "ms": {n: round(1000 * statistics.median(times[n]), 1) for n in SIZES}}))


if __name__ == "__main__":
    main()
