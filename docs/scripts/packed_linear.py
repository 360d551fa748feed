"""Would MKL's packed sgemm make tree passes cheaper? One verify pass of an n-node chain of the
default verifier, the stock kernel against ``torch.ops.mkl._mkl_linear`` with the weights packed once
per row count (a ``TorchFunctionMode`` routes ``F.linear``; the packed copy is used only when the
rows equal the count it was packed for, so each tree size needs its own copy of the weights).

    PYTHONPATH=. python docs/scripts/packed_linear.py [--rounds 15] [--context 300]

An experiment, not a kernel the engine offers: see BENCHMARKS.md ("Packed MKL weights").
"""
import argparse
import contextlib
import statistics

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from tree_costs import SIZES, chain_pass_times  # this script's folder is first on sys.path

from infer.core.models import load_verifier
from infer.core.verifier import Verifier


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
    mode = PackedLinear(SIZES[1:])  # packs on the warm-up round
    times = chain_pass_times(v, args.context, args.rounds, {"stock": contextlib.nullcontext, "packed": lambda: mode})
    for k, by_nodes in times.items():
        print(k, {n: round(1000 * statistics.median(t), 1) for n, t in by_nodes.items()}, "ms")


if __name__ == "__main__":
    main()
