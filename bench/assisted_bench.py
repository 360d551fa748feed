"""A trained draft model under transformers' own assisted generation: HF greedy against HF
``generate(assistant_model=draft, do_sample=False)``, prompt by prompt in turn, float32, on the
chat-templated prompts of a prompt file (the draft-model table of BENCHMARKS.md).

    .venv/bin/python bench/assisted_bench.py --draft runs/draft-model-default \\
        --prompts configs/prompts/unseen.jsonl --limit 2 --max-new-tokens 128 --out results/assisted.json

Reports tokens/s of both, the speedup, how many outputs equal HF greedy, and HF's own count of
assistant tokens per step where it exposes one (``num_assistant_tokens`` at the end).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    sys.path.insert(0, str(ROOT))
    import torch
    from transformers import AutoModelForCausalLM

    from infer.core.models import load_verifier
    from infer.core.text import encode_prompt
    from infer.tools.prompts import read_prompts

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", required=True, help="a draft model directory (plain HF)")
    p.add_argument("--prompts", required=True)
    p.add_argument("--limit", type=int, default=2, help="prompts per category")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    torch.set_num_threads(2)
    lv = load_verifier("default", dtype=torch.float32)
    model, tok = lv.model, lv.tokenizer
    draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.float32).eval()
    prompts = [(pr.category, encode_prompt(tok, pr.text)) for pr in read_prompts(ROOT / args.prompts, limit=args.limit)]
    rows = []
    with torch.no_grad():
        x = prompts[0][1][None]
        model.generate(x, max_new_tokens=8, do_sample=False)  # warm-up, not timed
        model.generate(x, max_new_tokens=8, do_sample=False, assistant_model=draft)
        for cat, ids in prompts:
            x = ids[None]
            t = time.perf_counter()
            greedy = model.generate(x, max_new_tokens=args.max_new_tokens, do_sample=False)[0, x.shape[1]:].tolist()
            t_greedy = time.perf_counter() - t
            t = time.perf_counter()
            assisted = model.generate(x, max_new_tokens=args.max_new_tokens, do_sample=False,
                                      assistant_model=draft)[0, x.shape[1]:].tolist()
            t_assisted = time.perf_counter() - t
            rows.append({"category": cat, "tokens": len(greedy), "greedy_s": t_greedy, "assisted_tokens": len(assisted),
                         "assisted_s": t_assisted, "equal": greedy == assisted})
    n_g = sum(r["tokens"] for r in rows)
    n_a = sum(r["assisted_tokens"] for r in rows)
    summary = {"prompts": len(rows), "hf_greedy_tok_s": n_g / sum(r["greedy_s"] for r in rows),
               "hf_assisted_tok_s": n_a / sum(r["assisted_s"] for r in rows), "equal": sum(r["equal"] for r in rows),
               "num_assistant_tokens_at_end": getattr(draft.generation_config, "num_assistant_tokens", None)}
    summary["speedup"] = summary["hf_assisted_tok_s"] / summary["hf_greedy_tok_s"]
    report = {"date": time.strftime("%Y-%m-%d"), "draft": args.draft, "prompts_file": args.prompts,
              "max_new_tokens": args.max_new_tokens, "summary": summary, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    from heads.io import write_atomic

    write_atomic(args.out, lambda path: path.write_text(json.dumps(report, indent=1)))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
