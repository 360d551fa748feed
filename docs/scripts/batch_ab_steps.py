"""Where batched `--draft auto` loses time to plain batched decoding: one batch size of
`batch_ab.py` with every step timed by its kind (admission, plain, drafting) and row count.

    python docs/scripts/batch_ab_steps.py --batch 16 --requests 32 --prompts configs/prompts/unseen.jsonl
    python docs/scripts/batch_ab_steps.py --batch 4 --policy never    # the drafter's rows, never drafting

``--policy never`` gives the drafter's engine a policy that never drafts: what the drafter's
presence alone costs a plain step (verifier features, per-row bookkeeping). ``--policy none``
runs two engines without a drafter (an A/A control of the measurement itself). Prints, per engine
and kind of step, the steps, their seconds and mean cache width, and the plain steps' mean
milliseconds in fifths of the run with the steps at which the drafter drafted.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class NeverDraft:
    """A batch policy under which no row of a batched step drafts."""

    def plan(self, rows: int) -> int:
        return 0  # infer.core.cost.PLAIN

    def quiet_steps(self, rows: int) -> int:
        return 0  # rows still join warm (with the drafter's features): what its bookkeeping costs is measured

    def record(self, *args) -> None:
        pass


def timed(engine, log: list) -> None:
    """Wrap ``engine.step`` so that each step appends (kind, rows, seconds, cache width) to ``log``."""
    step = engine.step

    def wrapper():
        width = engine.verifier.width
        t = time.perf_counter()
        chunks = step()
        dt = time.perf_counter() - t
        sizes = engine.last_sizes
        kind = "admit" if not sizes else ("draft" if any(s > 1 for s in sizes) else "plain")
        log.append((kind, len(sizes), dt, width))
        return chunks

    engine.step = wrapper


def main() -> int:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "docs/scripts"))
    import torch
    from batch_ab import run_level

    from infer.core.engine import Engine
    from infer.core.params import SamplingParams
    from infer.core.text import encode_prompt, eos_ids
    from infer.core.verifier import Verifier
    from infer.tools import cli
    from infer.tools.prompts import read_prompts

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--verifier", default="default")
    p.add_argument("--draft", default="auto")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompts", default="configs/prompts/unseen.jsonl")
    p.add_argument("--limit", type=int, default=2, help="prompts per category")
    p.add_argument("--policy", choices=["measured", "never", "none"], default="measured")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    sargs = cli.build_parser().parse_args(["serve", "--verifier", args.verifier, "--draft", args.draft])
    lv = cli._load(sargs, "the benchmark encodes chat prompts")
    drafter = cli._drafter(sargs, args.draft, lv.model, cli._tree(sargs))
    eos = eos_ids(lv.model, lv.tokenizer)
    prompts = [encode_prompt(lv.tokenizer, q.text) for q in read_prompts(ROOT / args.prompts, limit=args.limit)]
    first = None if args.policy == "none" else drafter
    policy = NeverDraft() if args.policy == "never" else None
    engines = {"auto": Engine(Verifier(lv.model, linear=sargs.linear), first, max_rows=args.batch, policy=policy),
               "none": Engine(Verifier(lv.model, linear=sargs.linear), None, max_rows=args.batch)}
    logs = {label: [] for label in engines}
    for label, engine in engines.items():
        timed(engine, logs[label])
    run_level(engines, prompts, args.batch, args.batch, 8, SamplingParams, eos)  # warm-up
    for log in logs.values():
        log.clear()
    got = run_level(engines, prompts, args.batch, args.requests, args.max_tokens, SamplingParams, eos)
    print(f"auto / none tokens/s: {got['auto']['tokens_per_s'] / got['none']['tokens_per_s']:.3f}")
    for label, log in logs.items():
        kinds = defaultdict(lambda: [0, 0.0, 0])
        for kind, rows, dt, width in log:
            k = kinds[f"{kind}, {rows} rows"]
            k[0], k[1], k[2] = k[0] + 1, k[1] + dt, k[2] + width
        for name, (n, sec, width) in sorted(kinds.items()):
            print(f"{label:5s} {name:16s} {n:5d} steps {sec:8.3f} s {1e3 * sec / n:8.2f} ms/step  width {width / n:.1f}")
        plain = [dt for kind, rows, dt, _ in log if kind == "plain" and rows == args.batch]
        q = max(len(plain) // 5, 1)
        fifths = [round(1e3 * sum(plain[j * q:(j + 1) * q]) / q, 2) for j in range(5) if plain[j * q:(j + 1) * q]]
        drafted = [i for i, x in enumerate(log) if x[0] == "draft"]
        print(f"{label:5s} plain ms/step by fifth {fifths}; drafting at steps {drafted}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
