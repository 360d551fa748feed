"""Would MKL's packed sgemm make tree passes cheaper? One verify pass of an n-node chain of the
default verifier, the stock kernel against ``torch.ops.mkl._mkl_linear`` with the weights packed once
per row count (a ``TorchFunctionMode`` routes ``F.linear``; the packed copy is used only when the
rows equal the count it was packed for, so each tree size needs its own copy of the weights).

    PYTHONPATH=. python docs/scripts/packed_linear.py [--rounds 15] [--context 300]

An experiment (session 30), not a kernel the engine offers: see BENCHMARKS.md.
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from infer.models import load_verifier
from infer.tree import build_tree
from infer.verifier import Verifier

SIZES = (1, 2, 4, 8, 16)


class PackedLinear(TorchFunctionMode):
    """float32 ``F.linear`` of ``rows`` in ``sizes`` on MKL's packed sgemm (weights packed on first use)."""

    def __init__(self, sizes):
        super().__init__()
        self.sizes, self.packed = set(sizes), {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            rows = x.numel() // x.shape[-1]
            if rows in self.sizes and w.dtype == torch.float32:
                key = (id(w), rows)
                if key not in self.packed:
                    self.packed[key] = torch.ops.mkl._mkl_reorder_linear_weight(w, rows)
                y = torch.ops.mkl._mkl_linear(x.reshape(rows, -1), self.packed[key], w, b, rows)
                return y.view(*x.shape[:-1], w.shape[0])
        return func(*args, **kwargs)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--context", type=int, default=300)
    args = p.parse_args()
    v = Verifier(load_verifier("default", dtype="fp32").model, linear="stock")
    v.prefill(torch.randint(100, 40000, (args.context,), generator=torch.Generator().manual_seed(0)))
    trees = {n: build_tree(list(range(-1, n - 1))) for n in SIZES}
    tokens = {n: torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(n)) for n in SIZES}
    zero, mode = torch.tensor([0]), PackedLinear(SIZES[1:])
    times = {(k, n): [] for k in ("stock", "packed") for n in SIZES}
    for r in range(args.rounds + 1):  # round 0 warms up (and packs)
        for k in ("stock", "packed"):
            for n in SIZES:
                with torch.no_grad(), (mode if k == "packed" else torch.no_grad()):
                    t0 = time.perf_counter()
                    v.verify(tokens[n], trees[n])
                    v.commit(zero, [0])
                if r:
                    times[(k, n)].append(time.perf_counter() - t0)
    for k in ("stock", "packed"):
        print(k, {n: round(1000 * statistics.median(times[(k, n)]), 1) for n in SIZES}, "ms")


if __name__ == "__main__":
    main()
