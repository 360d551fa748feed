"""Sync points per verify step, by drafter, counted at the dispatch level (infer.core.diagnostics).

    PYTHONPATH=. python bench/sync_points.py --verifier default --prompts 3 --max-new-tokens 64
    PYTHONPATH=. python bench/sync_points.py --verifier tiny

Counts every host read and host<->device copy between two yielded chunks of ``infer.stream``
(one verify step each, with the drafting before it), on a CPU standing in for a GPU (every
tensor counts as a device tensor). Counting is not timing: the numbers do not depend on the
machine's load. Prints a Markdown table: steps, sync points per step (mean / max) and the
totals by kind.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch
from compiled_step import texts  # the shared prompt picking (python puts bench/ on the path)

from heads import HeadConfig, VerifierSpec, build_head, default_aux_layers
from infer import stream
from infer.core.diagnostics import HostReadCounter
from infer.core.models import load_verifier
from infer.core.text import encode_prompt, eos_ids
from infer.core.tree import DynamicTreeSpec
from infer.drafting.head_drafters import EagleDrafter
from infer.drafting.loading import load_drafter
from infer.drafting.lookup import PromptLookupDrafter
from infer.drafting.union import UnionDrafter

ROOT = Path(__file__).resolve().parents[1]


def count(model, make_drafter, prompts, max_new_tokens, eos, temperature):
    """(steps, per-step totals, Counter by kind) over ``prompts`` (token id tensors)."""
    per_step, kinds = [], Counter()
    for i, ids in enumerate(prompts):
        drafter = make_drafter()
        kw = {"temperature": temperature, "seed": i} if temperature > 0 else {}
        with HostReadCounter(device=model.device) as c:
            last, before = None, Counter()
            for _ in stream(model, drafter, ids, max_new_tokens=max_new_tokens, eos_token_id=eos, **kw):
                if last is not None:
                    per_step.append(c.total - last)
                    kinds += c.counts - before
                last, before = c.total, Counter(c.counts)
    return len(per_step), per_step, kinds


def tiny_head(model):
    cfg = HeadConfig("eagle3", VerifierSpec.of(model), draft_vocab_size=200,
                     aux_layers=default_aux_layers(model.config.num_hidden_layers), layer_config=model.config.to_dict())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return build_head(cfg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--verifier", default="default", help="default, or tiny (tiny-random:llama with a random EAGLE-3 head)")
    ap.add_argument("--prompts", type=int, default=3, help="how many prompts of configs/prompts/unseen.jsonl")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--drafts", default="auto,default,pld", help="--draft specs to count (default verifier)")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    prompts_text = texts(ROOT / "configs/prompts/unseen.jsonl", args.prompts)
    if args.verifier == "tiny":
        lv = load_verifier("tiny-random:llama")
        model = lv.model
        head = tiny_head(model)
        spec = DynamicTreeSpec(depth=5, top_k=4, num_nodes=16)
        makers = {"eagle3 (random)": lambda: EagleDrafter(head, model, spec),
                  "pld": lambda: PromptLookupDrafter(),
                  "eagle3+pld": lambda: UnionDrafter([EagleDrafter(head, model, spec), PromptLookupDrafter()])}
        prompts = [encode_prompt(lv.tokenizer, t, chat=False) for t in prompts_text]
    else:
        lv = load_verifier(args.verifier)
        model = lv.model
        makers = {d: (lambda d=d: load_drafter(d, model)) for d in args.drafts.split(",")}
        prompts = [encode_prompt(lv.tokenizer, t) for t in prompts_text]
    eos = eos_ids(model, lv.tokenizer)
    rows = []
    print("| verifier | draft | mode | steps | sync points / step (mean) | max | by kind (all steps) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, make in makers.items():
        steps, per_step, kinds = count(model, make, prompts, args.max_new_tokens, eos, args.temperature)
        mode = "greedy" if args.temperature == 0 else f"T={args.temperature}"
        row = {"verifier": args.verifier, "draft": name, "mode": mode, "steps": steps,
               "mean": round(sum(per_step) / max(1, steps), 2), "max": max(per_step, default=0), "kinds": dict(kinds)}
        rows.append(row)
        by_kind = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))
        print(f"| {args.verifier} | {name} | {mode} | {steps} | {row['mean']} | {row['max']} | {by_kind} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
