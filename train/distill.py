"""Self-distillation from the command line (``specheads distill`` runs this).

    python -m train.distill --verifier default --prompts train/data/train_prompts.jsonl \\
        --out runs/distilled-default.jsonl --shuffle --limit 4000 --max-new-tokens 256

Resumable: run the same command again after a stop and it continues where it left off.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from train.data import distill, load_prompts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="specheads distill", description="Generate the verifier's own responses to prompts.")
    p.error = lambda message: p.exit(2, f"specheads distill: error: {message}\n")  # one line, exit 2
    p.add_argument("--verifier", default="default")
    p.add_argument("--prompts", required=True, help="JSONL (prompt, or turns: a conversation played out turn by turn), hf:NAME[:SPLIT], or synthetic:N")
    p.add_argument("--out", required=True, help="output JSONL (appended to; resumable)")
    p.add_argument("--limit", type=int, default=0, help="first N prompts only (0 = all)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shuffle", action="store_true", help="shuffle the prompts (seeded) before --limit")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp16", "fp32"), default="auto")
    args = p.parse_args(argv)
    from infer.errors import UserError
    from infer.files import check_output_file
    from infer.models import load_verifier, resolve_device
    from infer.params import SamplingParams

    try:  # every argument is checked before the verifier loads
        SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
        if args.batch_size < 1 or args.limit < 0:
            raise UserError("--batch-size must be >= 1 and --limit >= 0")
        check_output_file(args.out, "--out")
        resolve_device(args.device)
        try:
            prompts = load_prompts(args.prompts, args.limit, args.seed, shuffle=args.shuffle)
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read prompts {args.prompts}: {e}") from None
        lv = load_verifier(args.verifier, dtype=args.dtype, device=args.device)
        if lv.tokenizer is None:
            raise UserError(f"verifier {args.verifier!r} has no tokenizer: distillation needs one")
        n = distill(lv.model, lv.tokenizer, prompts, args.out, max_new_tokens=args.max_new_tokens,
                    batch_size=args.batch_size, temperature=args.temperature, seed=args.seed)
    except UserError as e:
        print(f"specheads: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {n} records to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
