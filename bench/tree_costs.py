"""What one verify pass of an n-node chain costs the default verifier through ``infer.core.verifier``
(for whichever specheads is first on sys.path: run it once per commit, in turn, nothing else
running), against a one-node pass: the relative cost the gate and prompt lookup weigh drafts by.

    PYTHONPATH=. python bench/tree_costs.py [--rounds 40] [--context 300] [--linear auto]

Each round verifies chains of 1, 2, 4, 8 and 16 nodes in turn and commits the root only, so the
cache grows by one position a round; medians over the rounds.
"""
import argparse
import contextlib
import json
import statistics
import time

import torch

from infer.core.batch import stack_drafts
from infer.core.drafter import Draft
from infer.core.models import load_verifier
from infer.core.tree import build_tree
from infer.core.verifier import Verifier

SIZES = (1, 2, 4, 8, 16)


def chain_pass_times(v: Verifier, context: int, rounds: int, modes=None) -> dict:
    """Prefill ``v`` with ``context`` random tokens, then time verify passes of chains of each of
    ``SIZES`` nodes, ``rounds`` times (after a warm-up round), under each of ``modes`` (name ->
    a function making a context manager; default: one run with none) in turn within a round;
    each pass commits the root only. Returns {mode name: {nodes: [seconds, ...]}}."""
    modes = modes or {"": contextlib.nullcontext}
    v.drop_rows([])
    v.add_rows([torch.randint(100, 40000, (context,), generator=torch.Generator().manual_seed(0))])
    trees = {n: stack_drafts([Draft(torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(n)),
                                    build_tree(list(range(-1, n - 1))))], v.device) for n in SIZES}
    zero = torch.zeros(1, 1, dtype=torch.long)
    times = {name: {n: [] for n in SIZES} for name in modes}
    for r in range(rounds + 1):  # round 0 warms up
        for name, make in modes.items():
            for n in SIZES:
                with make():
                    t0 = time.perf_counter()
                    v.verify_rows(trees[n])
                    v.commit_rows(zero, [[0]])
                if r:
                    times[name][n].append(time.perf_counter() - t0)
    return times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--linear", default="auto")
    args = p.parse_args()
    model = load_verifier("default", dtype="fp32").model
    times = chain_pass_times(Verifier(model, linear=args.linear), args.context, args.rounds)[""]
    one = statistics.median(times[1])
    print(json.dumps({"context": args.context, "rounds": args.rounds, "one_node_ms": round(1000 * one, 1),
                      "relative": {n: round(statistics.median(times[n]) / one, 3) for n in SIZES},
                      "ms": {n: round(1000 * statistics.median(times[n]), 1) for n in SIZES}}))


if __name__ == "__main__":
    main()
