"""Distillation throughput, side by side in one process on one thread: HF ``generate`` on a
left-padded batch (how ``specheads distill`` generated until 2026-12-03: every row runs to the
longest answer) against ``train.data._generate`` (rows leave the batch as they end) on batches
cut from length-sorted prompts, at batch 16 and 32. Also counts the answers identical to the
committed data (the float32 greedy answers in train/data/distilled, balanced series).

    OMP_NUM_THREADS=1 python bench/distill_speed.py --first 200 --n 32 [--runs hf16,new16,new32]

Nothing else may run meanwhile (stop any distillation with SIGSTOP first).
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from infer.core.models import load_verifier  # noqa: E402
from infer.core.text import encode_prompt, eos_ids  # noqa: E402
from train.data import _generate, iter_records, length_sorted, load_prompts  # noqa: E402


def hf_batch(model, seqs, pad, eos, max_new_tokens):
    """HF generate on one left-padded batch, each answer cut after its first end token."""
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, e in enumerate(seqs):
        ids[i, width - len(e):], mask[i, width - len(e):] = torch.tensor(e), 1
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=eos, pad_token_id=pad)
    answers = []
    for row in out[:, width:].tolist():
        cut = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
        answers.append(row[:cut])
    return answers


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--first", type=int, default=200, help="the first balanced prompt used")
    p.add_argument("--n", type=int, default=32)
    p.add_argument("--runs", default="hf16,new16,new32")
    p.add_argument("--max-new-tokens", type=int, default=256)
    args = p.parse_args()
    torch.set_num_threads(1)
    root = Path(__file__).resolve().parents[1]
    lv = load_verifier("default", dtype="fp32")
    model, tok = lv.model.eval(), lv.tokenizer
    prompts = load_prompts(str(root / "train/data/train_prompts_balanced.jsonl"), 0, 0)[args.first:args.first + args.n]
    committed = {r["id"]: r["input_ids"] for _, _, r in iter_records(root / "train/data/distilled")
                 if r.get("id") in {q.id for q in prompts}}
    eos = eos_ids(model, tok)
    seqs = [encode_prompt(tok, q.text)[-768:].tolist() for q in prompts]
    with torch.inference_mode():
        for run in args.runs.split(","):
            bs = int(run.lstrip("hfnew"))
            t0 = time.perf_counter()
            answers = [None] * len(seqs)
            order = list(range(len(seqs))) if run.startswith("hf") else length_sorted([len(e) for e in seqs], 8 * bs)
            for s in range(0, len(order), bs):
                idx = order[s:s + bs]
                batch = [seqs[i] for i in idx]
                got = (hf_batch(model, batch, eos[0], eos, args.max_new_tokens) if run.startswith("hf")
                       else _generate(model, batch, eos[0], eos, args.max_new_tokens, 0.0))
                for i, a in zip(idx, got):
                    answers[i] = a
            dt = time.perf_counter() - t0
            same = sum(q.id in committed and committed[q.id][len(e):] == a for q, e, a in zip(prompts, seqs, answers))
            tokens = sum(map(len, answers))
            print(f"{run}: {dt:.1f} s, {dt / len(seqs):.2f} s/record, {tokens / dt:.1f} answer tokens/s, "
                  f"identical to the committed answers {same}/{len(seqs)} ({len(committed)} committed)", flush=True)


if __name__ == "__main__":
    main()
