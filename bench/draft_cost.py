"""What an expensive drafter costs under ``--tree-budget auto``: the default verifier with a draft
model as costly as itself (the verifier saved as a plain HF directory) against plain decoding,
each on one long-lived engine (as ``Speculator``, ``chat`` and ``serve`` keep one), in
alternating rounds over the same prompts, greedy.

    python -c "from infer.core.models import load_verifier as l; v = l('default'); \\
        v.model.save_pretrained('/tmp/costly-draft'); v.tokenizer.save_pretrained('/tmp/costly-draft')"
    .venv/bin/python bench/draft_cost.py --draft-model /tmp/costly-draft --out results/draft-cost.json

Prints and writes tokens/s per round and the median ratio over the rounds (rounds alternate, so
drift on a shared machine hits both alike); the outputs must be identical.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from compiled_step import texts  # the shared prompt picking (python puts bench/ on the path)


def main() -> int:
    from infer.core.engine import Engine
    from infer.core.models import load_verifier
    from infer.core.params import SamplingParams
    from infer.core.text import encode_prompt, eos_ids
    from infer.core.verifier import Verifier
    from infer.drafting.loading import load_drafter

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draft-model", required=True)
    p.add_argument("--prompts", default="configs/prompts/unseen.jsonl")
    p.add_argument("--limit", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    lv = load_verifier("default")
    prompts = texts(args.prompts, args.limit)
    ids = [encode_prompt(lv.tokenizer, t) for t in prompts]
    eos = eos_ids(lv.model, lv.tokenizer)
    engines = {d: Engine(Verifier(lv.model), load_drafter(d, lv.model, tokenizer=lv.tokenizer), budget="auto")
               for d in ("none", f"model:{args.draft_model}")}
    rates: dict[str, list[float]] = {d: [] for d in engines}
    outputs: dict[str, list] = {}
    for engine in engines.values():  # warm-up: one short generation each
        engine.add(ids[0], SamplingParams(max_new_tokens=4))
        list(engine.run())
    for _ in range(args.rounds):
        for d, engine in engines.items():
            got, t0 = [], time.perf_counter()
            for x in ids:
                engine.add(x, SamplingParams(max_new_tokens=args.max_new_tokens), eos_token_id=eos)
                got.append([t for c in engine.run() for t in c.token_ids])
            rates[d].append(sum(map(len, got)) / (time.perf_counter() - t0))
            outputs.setdefault(d, got)
    plain, draft = engines
    ratios = [a / b for a, b in zip(rates[draft], rates[plain])]
    result = {"tokens_per_s": rates, "ratios": ratios, "median_ratio": statistics.median(ratios),
              "identical": outputs[plain] == outputs[draft], "schedule": engines[draft].schedule.state(),
              "prompts": prompts, "max_new_tokens": args.max_new_tokens}
    print(json.dumps({k: result[k] for k in ("tokens_per_s", "ratios", "median_ratio", "identical")}))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    from heads.io import write_atomic

    write_atomic(args.out, lambda path: path.write_text(json.dumps(result, indent=1)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
