"""The heads' compiled batched draft loop against the eager row-by-row drafter, side by side in
one process: the shipped head (``--draft default``) on two long-lived engines whose verify step is
compiled (``--compile on``), one drafting with :class:`~infer.drafting.head_drafters.EagleDrafter`
(eager, per row, its early stop per depth), one with
:class:`~infer.drafting.eagle_batch.BatchEagleDrafter` (compiled), in alternating rounds over the
same unseen prompts, greedy.

    .venv/bin/python bench/draft_loop.py --budget fixed --out results/draft-loop.json

Prints and writes, per drafter and round: tokens/s, verify steps, tokens per step, drafting and
verify milliseconds per step; every engine's output must equal plain greedy decoding.
"""

from __future__ import annotations

import argparse
import json
import time

from compiled_step import add_run_args, command, machine, prompt_ids  # the run's options, prompts and record


def main() -> int:
    from heads.io import write_atomic
    from infer.core.engine import Engine
    from infer.core.models import load_verifier
    from infer.core.params import SamplingParams
    from infer.core.text import eos_ids
    from infer.core.verifier import Verifier
    from infer.drafting.loading import load_drafter

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(p)
    p.add_argument("--budget", choices=("auto", "fixed"), default="fixed")
    args = p.parse_args()
    lv = load_verifier("default")
    ids = prompt_ids(lv.tokenizer, args)
    eos = eos_ids(lv.model, lv.tokenizer)
    ready, engines = {}, {}
    for name, compiled in (("eager drafter", False), ("compiled loop", True)):
        t0 = time.perf_counter()
        engines[name] = Engine(Verifier(lv.model), load_drafter("default", lv.model, compile=compiled),
                               budget=args.budget, compile="on")
        ready[name] = round(time.perf_counter() - t0, 1)

    def run(engine, x):
        engine.add(x, SamplingParams(max_new_tokens=args.max_new_tokens), eos_token_id=eos)
        tokens, stats = [], None
        for c in engine.run():
            tokens += c.token_ids
            stats = c.stats
        return tokens, stats

    plain = Engine(Verifier(lv.model), None)
    reference = [run(plain, x)[0] for x in ids]
    for e in engines.values():
        run(e, ids[0][:8])
    rounds: dict[str, list[dict]] = {name: [] for name in engines}
    identical = {}
    for r in range(args.rounds):
        for name, e in engines.items():
            t0, n, draft_s, verify_s, steps, outs = time.perf_counter(), 0, 0.0, 0.0, 0, []
            for x in ids:
                tokens, st = run(e, x)
                outs.append(tokens)
                n, draft_s, verify_s, steps = n + len(tokens), draft_s + st.draft_s, verify_s + st.verify_s, steps + st.verify_steps
            rounds[name].append({"tokens_per_s": round(n / (time.perf_counter() - t0), 2), "steps": steps,
                                 "tokens_per_step": round(n / steps, 3), "draft_ms_per_step": round(1e3 * draft_s / steps, 2),
                                 "verify_ms_per_step": round(1e3 * verify_s / steps, 2)})
            identical[name] = identical.get(name, True) and outs == reference
            print(f"round {r + 1} {name}: {rounds[name][-1]}", flush=True)
    result = {
        "machine": machine(),
        "command": command("draft_loop.py", args),
        "rounds": rounds, "ready_s": ready, "identical_to_plain": identical,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, lambda tmp: tmp.write_text(json.dumps(result, indent=1, default=str)))
    return 0 if all(identical.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
