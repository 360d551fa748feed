"""Medusa's and the block drafter's drafting per step, row by row against every row in one pass
(eager and compiled), side by side in one process: random heads shaped as the recipes train them
for the default verifier (Medusa: 4 heads of 1 layer on the verifier's LM head; the block
drafter: 2 layers, blocks of 8, 8,192 draft tokens, 5 feature layers), on 1 and 4 rows after a
256-token context, unpriced budgets (full trees, nothing read).

    .venv/bin/python bench/draft_heads.py --out results/draft-heads.json

Prints and writes, per head, drafter and row count: the median milliseconds of a proposal (the
catch-up of one committed token included) and whether its drafts equal the row-by-row drafter's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from compiled_step import command, machine  # the run's record (python puts bench/ on the path)


def heads_for(model) -> dict:
    """A random Medusa head and a random block-drafter head for ``model``."""
    import torch

    from heads import HeadConfig, VerifierSpec, build_head, default_dflash_layers

    spec = VerifierSpec.of(model, model.config.model_type)
    configs = {"medusa": HeadConfig("medusa", spec, num_heads=4, num_layers=1, layer_config=model.config.to_dict()),
               "block": HeadConfig("dflash", spec, num_layers=2, draft_vocab_size=8192, block_size=8, mask_token_id=0,
                                   aux_layers=default_dflash_layers(spec.num_layers, 5), layer_config=model.config.to_dict())}
    out = {}
    for name, cfg in configs.items():
        torch.manual_seed(0)
        head = build_head(cfg)
        with torch.no_grad():
            for p in head.parameters():
                p.normal_(0, 0.02) if p.dim() > 1 else p.normal_(1, 0.01)
        if name == "block":
            head.set_vocab(torch.arange(8192))
        out[name] = head.eval()
    return out


def drafters_for(name: str, head, model) -> dict:
    """The row-by-row drafter and the batched one, eager and compiled (compiled here: timed)."""
    from infer.drafting.block_batch import BatchBlockDrafter
    from infer.drafting.block_drafter import BlockDrafter
    from infer.drafting.head_drafters import MedusaDrafter

    if name == "medusa":  # Medusa has no row-by-row drafter any more: one row at a time is the batched one called per row
        return {"row by row": MedusaDrafter(head, model), "batched": MedusaDrafter(head, model),
                "batched, compiled": MedusaDrafter(head, model, compile=True)}
    return {"row by row": BlockDrafter(head, model), "batched": BatchBlockDrafter(head, model),
            "batched, compiled": BatchBlockDrafter(head, model, compile=True)}


def time_proposals(drafter, rows: int, width: int, hidden: int, repeats: int, one_at_a_time: bool) -> tuple[float, list]:
    """Median milliseconds of one step's proposals for ``rows`` rows (each told one committed
    token first), and the last step's drafts as lists."""
    import torch

    from infer.core.drafter import Accepted, Budget, Request, RowStart

    g = torch.Generator().manual_seed(rows)
    drafter.begin([RowStart(s, torch.zeros(256, dtype=torch.long), torch.randn(256, width, hidden, generator=g), None)
                   for s in range(rows)])
    requests = [Request(s, 5 + s, Budget(8)) for s in range(rows)]
    times, drafts = [], []
    for r in range(repeats + 1):
        told = [Accepted(s, torch.tensor([5 + s]), torch.randn(1, width, hidden, generator=g)) for s in range(rows)]
        t0 = time.perf_counter()
        drafter.update(told)
        if one_at_a_time:
            drafts = [d for q in requests for d in drafter.propose([q])]
        else:
            drafts = drafter.propose(requests)
        drafts = [d.tokens.tolist() for d in drafts]  # what the verifier would wait for
        if r:
            times.append(time.perf_counter() - t0)
    drafter.end(list(range(rows)))
    return 1e3 * statistics.median(times), drafts


def main() -> int:
    import torch

    from heads.io import write_atomic
    from infer.core.models import load_verifier

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    model = load_verifier("default").model
    hidden = model.config.hidden_size
    result = {"machine": machine(), "command": command("draft_heads.py", args), "heads": {}}
    with torch.inference_mode():
        for name, head in heads_for(model).items():
            drafters = drafters_for(name, head, model)
            width = len(drafters["batched"].feature_layers)
            rows_out = {}
            for rows in (1, 4):
                ref = None
                for label, d in drafters.items():
                    ms, drafts = time_proposals(d, rows, width, hidden, args.repeats, label == "row by row")
                    ref = drafts if ref is None else ref
                    rows_out.setdefault(str(rows), {})[label] = {"ms": round(ms, 2), "same_drafts": drafts == ref}
                    print(name, rows, label, rows_out[str(rows)][label], flush=True)
            warm = {k: round(d.warmup_s, 1) for k, d in drafters.items() if getattr(d, "warmup_s", 0)}
            result["heads"][name] = {"rows": rows_out, "compile_warm_up_s": warm}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, lambda path: path.write_text(json.dumps(result, indent=1)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
