"""Where a verify pass's time goes: the default verifier's one-token (and small-tree) pass, eager
and compiled, under ``torch.profiler``, its CPU time split into matrix products, attention, the
rest of the operators, and what no operator accounts for (Python, dispatch, the mask and the
cache); beside it, the floor that streaming every weight once from memory sets on this machine
(the weights' bytes over the measured bandwidth of a one-row float32 product).

    .venv/bin/python bench/profile_step.py --out results/profile-step.json

The pass is the engine's (``Verifier.verify_rows`` / ``StaticVerifier``, one row after a 256-token
prefix), rolled back after each repeat, as :func:`infer.core.schedule.measure_verify_cost` does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from compiled_step import command, machine  # the run's record (python puts bench/ on the path)

#: operator-name fragments of each category (first match wins; lower case)
CATEGORIES = (
    ("matmul", ("linear", "addmm", "aten::mm", "matmul", "mkldnn", "onednn", "gemm", "extern_kernels.mm")),
    ("attention", ("attention", "sdpa", "softmax", "bmm")),
)


def category(name: str) -> str:
    """The category of a profiled operator's name."""
    low = name.lower()
    for cat, parts in CATEGORIES:
        if any(p in low for p in parts):
            return cat
    return "other operators"


def _self_ms(prof, repeats: int) -> dict:
    """Self CPU milliseconds per pass by category, and the ten costliest operators."""
    totals: dict[str, float] = {}
    ops = []
    for e in prof.key_averages():
        ms = e.self_cpu_time_total / 1e3 / repeats
        if e.key.startswith("ProfilerStep") or ms <= 0:
            continue
        cat = category(e.key)
        totals[cat] = totals.get(cat, 0.0) + ms
        ops.append((ms, e.key, e.count // repeats))
    ops.sort(reverse=True)
    return {"by_category_ms": {k: round(v, 2) for k, v in sorted(totals.items())},
            "top": [{"op": k, "ms": round(ms, 2), "calls": c} for ms, k, c in ops[:10]]}


def profile(verifier, nodes: int, repeats: int) -> dict:
    """Wall and profiled time of ``repeats`` verify passes of a ``nodes``-node binary tree."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from infer.core.batch import stack_drafts
    from infer.core.drafter import host_draft

    g = torch.Generator().manual_seed(0)
    vocab = verifier.vocab_size
    verifier.drop_rows([])
    verifier.add_rows([torch.randint(0, vocab, (256,), generator=g)], features=False)
    parents = [-1] + [(i - 1) // 2 for i in range(1, nodes)]
    trees = stack_drafts([host_draft(torch.randint(0, vocab, (nodes,), generator=g).tolist(), parents)], verifier.device)

    def one():
        t0 = time.perf_counter()
        verifier.verify_rows(trees, features=False)
        verifier.rollback()
        return time.perf_counter() - t0

    with torch.inference_mode():
        walls = [one() for _ in range(repeats + 2)][2:]
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(repeats):
                one()
    verifier.drop_rows([])
    out = {"wall_ms": round(statistics.median(walls) * 1e3, 2)}
    out.update(_self_ms(prof, repeats))
    out["unaccounted_ms"] = round(out["wall_ms"] - sum(out["by_category_ms"].values()), 2)
    return out


def weights_floor(model) -> dict:
    """The bytes of every weight a pass reads, the bandwidth of a one-row product over the
    largest matrix (the output projection), and the milliseconds streaming them all takes."""
    import torch

    from infer.core.kernels import median_seconds

    weight = model.get_output_embeddings().weight
    x = torch.randn(1, weight.shape[1], dtype=weight.dtype)
    with torch.inference_mode():
        seconds = median_seconds(lambda: torch.nn.functional.linear(x, weight), 20)
    gbps = weight.numel() * weight.element_size() / seconds / 1e9
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    read = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    if tied:  # the tied output projection is read by the pass; the embedding lookup reads a row
        read += weight.numel() * weight.element_size()
    return {"weight_bytes_read": read, "one_row_linear_gb_s": round(gbps, 2), "floor_ms": round(read / gbps / 1e6, 2)}


def main() -> int:
    import torch

    from heads.io import write_atomic
    from infer.core.models import load_verifier
    from infer.core.static import StaticVerifier
    from infer.core.verifier import Verifier

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="1,8")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    lv = load_verifier("default", dtype=torch.float32)
    eager = Verifier(lv.model)
    t0 = time.perf_counter()
    compiled = StaticVerifier(lv.model, compile=True)
    compiled.warm_up(1)
    warm = round(time.perf_counter() - t0, 1)
    result = {"machine": machine(), "command": command("profile_step.py", args), "compile_warm_up_s": warm,
              "kernel": {"eager": eager.kernel, "compiled": compiled.kernel}, "floor": weights_floor(lv.model), "passes": {}}
    for n in (int(x) for x in args.nodes.split(",")):
        for name, v in (("eager", eager), ("compiled", compiled)):
            result["passes"][f"{name}, {n} node{'s' * (n > 1)}"] = r = profile(v, n, args.repeats)
            print(f"{name} {n}: {r['wall_ms']} ms {r['by_category_ms']} unaccounted {r['unaccounted_ms']}", flush=True)
    print(json.dumps(result["floor"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, lambda tmp: tmp.write_text(json.dumps(result, indent=1)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
