"""One EAGLE-3 training step of the default head, float32 against bf16 autocast, side by side.

    python bench/autocast_speed.py [--tokens 384] [--batch 8] [--repeats 3]

The features are computed once (no grad, float32); then the head's loss, backward and an AdamW
step run ``--repeats`` times in each precision, alternating, and the medians are printed. On a
CPU without native bfloat16 dot products (no AVX512-BF16 / AMX) torch runs bf16 matrix products
in a slow fallback, which is why ``train_heads`` warns there (BENCHMARKS.md, "Data": training on a CPU without native bf16).
Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import nullcontext

import torch

from heads.loading import load_head
from infer.core.models import load_verifier
from infer.drafting.head_drafters import cpu_has_fast_bf16
from train.data import Record, collate
from train.features import compute_features
from train.losses import eagle3_loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=384)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    lv = load_verifier("default")
    model = lv.model.eval()
    head = load_head("default", verifier=model, dtype=torch.float32)
    head.train()
    gen = torch.Generator().manual_seed(0)
    records = [Record(torch.randint(0, model.config.vocab_size, (args.tokens,), generator=gen).tolist(),
                      [0] * (args.tokens // 4) + [1] * (args.tokens - args.tokens // 4)) for _ in range(args.batch)]
    batch = collate(records, list(range(args.batch)))
    with torch.no_grad():
        feats = compute_features(model, batch, tuple(head.config.aux_layers))
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-6)

    def step(bf16: bool) -> float:
        t0 = time.perf_counter()
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()
        with ctx:
            loss, _ = eagle3_loss(head, model, feats, batch.input_ids, batch.loss_mask)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    print(json.dumps({"warm_up_s": {"fp32": round(step(False), 3), "bf16_autocast": round(step(True), 3)}}), flush=True)
    times: dict[str, list[float]] = {"fp32": [], "bf16_autocast": []}
    for _ in range(args.repeats):
        times["fp32"].append(step(False))
        times["bf16_autocast"].append(step(True))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({"cpu_has_fast_bf16": cpu_has_fast_bf16(), "threads": torch.get_num_threads(),
                      "batch": args.batch, "tokens": args.tokens, "median_s": {k: round(v, 3) for k, v in med.items()},
                      "bf16_over_fp32": round(med["bf16_autocast"] / med["fp32"], 2)}))


if __name__ == "__main__":
    main()
