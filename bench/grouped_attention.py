"""Grouped-query attention read in place against transformers' ``sdpa`` (which copies the shared
key/value heads per query head), side by side in one process: the default verifier's verify pass
of one row after a 256-token prefix, eager at the given node counts and compiled (Inductor, the
``--compile on`` step) at the given node counts, on two copies of the model, one switched back to
``sdpa`` after its verifier was built; rounds in turns, median per round.

    .venv/bin/python bench/grouped_attention.py --compiled 1 --eager 1,8 --out results/grouped-attention.json

Prints and writes each pass's milliseconds per round, the medians, the median over rounds of the
ratio stock / grouped (each round's pair timed back to back), and
whether the two passes' logits are bit for bit the same (eager: they must be; compiled, one
token: transformers repeats the heads under ``torch.compile`` where it packs them eagerly, and the
grouped attention packs them in both, so the compiled pass now gives the eager pass's bits).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from compiled_step import command, machine  # the run's record (python puts bench/ on the path)


def passes(compiled_nodes: list[int], eager_nodes: list[int]) -> dict:
    """``name -> (verifier, nodes)`` for the grouped (``new``) and the stock (``old``) attention."""
    import torch

    from infer.core.models import load_verifier
    from infer.core.static import StaticVerifier
    from infer.core.verifier import Verifier

    out, kernel = {}, "auto"
    for tag in ("new", "old"):
        model = load_verifier("default", dtype=torch.float32).model
        eager = Verifier(model, linear=kernel)  # both on the kernel the first measured: only the attention differs
        kernel = eager.kernel
        compiled = StaticVerifier(model, compile=True)
        if tag == "old":
            model.set_attn_implementation("sdpa")
        compiled.warm_up(1, nodes=tuple(compiled_nodes))
        out.update({f"eager {tag} {n}": (eager, n) for n in eager_nodes})
        out.update({f"compiled {tag} {n}": (compiled, n) for n in compiled_nodes})
    return out


def main() -> int:
    import torch

    from heads.io import write_atomic
    from infer.core.batch import stack_drafts
    from infer.core.drafter import host_draft

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compiled", default="1")
    p.add_argument("--eager", default="1,8")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    compiled_nodes, eager_nodes = ([int(x) for x in a.split(",")] for a in (args.compiled, args.eager))
    vs = passes(compiled_nodes, eager_nodes)
    g = torch.Generator().manual_seed(0)
    vocab = next(iter(vs.values()))[0].vocab_size
    prefix = torch.randint(0, vocab, (256,), generator=g)
    trees = {n: stack_drafts([host_draft(torch.randint(0, vocab, (n,), generator=g).tolist(),
                                         [-1] + [(i - 1) // 2 for i in range(1, n)])], torch.device("cpu"))
             for n in set(compiled_nodes) | set(eager_nodes)}

    def one(v, n):
        t0 = time.perf_counter()
        v.verify_rows(trees[n], features=False)
        v.rollback()
        return time.perf_counter() - t0

    ms = {k: [] for k in vs}
    logits = {}
    with torch.inference_mode():
        for r in range(args.rounds):
            for k, (v, n) in vs.items():
                v.drop_rows([])
                v.add_rows([prefix], features=False)
                logits[k] = v.verify_rows(trees[n], features=False).logits.clone()
                v.rollback()
                [one(v, n) for _ in range(2)]
                ms[k].append(round(statistics.median(one(v, n) for _ in range(8)) * 1e3, 2))
            print(r, {k: x[-1] for k, x in ms.items()}, flush=True)
    median = {k: statistics.median(x) for k, x in ms.items()}
    ratios = {k.replace(" new", ""): {"stock_over_grouped": round(statistics.median(  # per round: the machine drifts
                  o / n for o, n in zip(ms[k.replace(" new ", " old ")], ms[k])), 3),
                                      "same_logits": torch.equal(logits[k], logits[k.replace(" new ", " old ")])}
              for k in median if " new " in k}
    print(json.dumps(ratios))
    result = {"machine": machine(), "command": command("grouped_attention.py", args),
              "eager_kernels": sorted({v.kernel for v, _ in vs.values()}), "ms_per_round": ms,
              "median_ms": median, "ratios": ratios}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, lambda tmp: tmp.write_text(json.dumps(result, indent=1)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
