"""The compiled static-shape verify step against the eager one, side by side in one process: HF
``generate`` (eager), specheads ``--draft none`` and ``--draft auto`` with ``--compile off`` and
``--compile on`` (and ``auto`` with the verify step compiled but the heads drafting eagerly, row by
row: ``on-eager-draft``), each on one long-lived engine (as ``Speculator``, ``chat`` and ``serve`` keep
one), in alternating rounds over the same unseen prompts, greedy; then the verify-cost curve
(1 to 64 nodes) of the eager verifier and of the compiled one.

    .venv/bin/python bench/compiled_step.py --out results/compiled-step.json

Prints and writes tokens/s per method and round, each method's median over HF's, the compiled
engines' warm-up seconds (compilation included) and the two cost curves; every engine's output
must equal HF's.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path


def texts(path, limit: int) -> list[str]:
    """``limit`` prompts spread evenly over the JSON lines at ``path`` (each its ``prompt``, or a
    Spec-Bench question's first turn): the prompt picking every script here shares."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    rows = [json.loads(line) for line in lines[:: max(1, len(lines) // limit)][:limit]]
    return [r["prompt"] if "prompt" in r else r["turns"][0] for r in rows]


def add_run_args(p: argparse.ArgumentParser) -> None:
    """The options of a side-by-side run over unseen prompts (shared with ``draft_loop.py``)."""
    p.add_argument("--prompts", default="configs/prompts/unseen.jsonl")
    p.add_argument("--limit", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--out", type=Path, required=True)


def prompt_ids(tokenizer, args) -> list:
    """``--limit`` prompts spread over ``--prompts``, encoded (chat-templated)."""
    from infer.core.text import encode_prompt

    return [encode_prompt(tokenizer, t) for t in texts(args.prompts, args.limit)]


def machine() -> dict:
    import torch

    from infer.core.static import cpu_name

    return {"cpu": cpu_name(), "cores": torch.get_num_threads(), "python": platform.python_version(), "torch": torch.__version__}


def command(script: str, args) -> str:
    """The command line that reproduces ``args``."""
    return f"python bench/{script} " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items())


def main() -> int:
    import torch

    from heads.io import write_atomic
    from infer.core.engine import Engine
    from infer.core.models import load_verifier
    from infer.core.params import SamplingParams
    from infer.core.schedule import measure_verify_cost
    from infer.core.static import StaticVerifier
    from infer.core.text import eos_ids
    from infer.core.verifier import Verifier
    from infer.drafting.loading import load_drafter

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(p)
    p.add_argument("--drafts", default="none,auto")
    args = p.parse_args()
    lv = load_verifier("default")
    ids = prompt_ids(lv.tokenizer, args)
    eos = eos_ids(lv.model, lv.tokenizer)
    engines, warmup = {}, {}
    for draft in args.drafts.split(","):
        for mode in ("off", "on", "on-eager-draft")[: 2 if draft == "none" else 3]:
            t0 = time.perf_counter()  # on: the verify step and the heads' draft loop compiled; on-eager-draft: the step alone
            d = load_drafter(draft, lv.model, tokenizer=lv.tokenizer, compile=mode == "on")
            engines[f"{draft}/{mode}"] = Engine(Verifier(lv.model), d, budget="auto", compile="off" if mode == "off" else "on")
            warmup[f"{draft}/{mode}"] = round(time.perf_counter() - t0, 1)
            print(f"{draft}/{mode}: ready in {warmup[draft + '/' + mode]} s "
                  f"({engines[draft + '/' + mode].verifier.path.name})", flush=True)

    def hf(x):
        out = lv.model.generate(x[None], attention_mask=torch.ones(1, x.numel(), dtype=torch.long), do_sample=False,
                                max_new_tokens=args.max_new_tokens, eos_token_id=eos, pad_token_id=eos[0])
        return out[0, x.numel():].tolist()

    def spec(engine):
        def run(x):
            engine.add(x, SamplingParams(max_new_tokens=args.max_new_tokens), eos_token_id=eos)
            return [t for c in engine.run() for t in c.token_ids]
        return run

    runners = {"hf": hf, **{name: spec(e) for name, e in engines.items()}}
    with torch.inference_mode():
        for run in runners.values():  # one short generation each
            run(ids[0][:8])
    rates: dict[str, list[float]] = {m: [] for m in runners}
    outputs: dict[str, list] = {}
    for r in range(args.rounds):
        for m, run in runners.items():
            got, t0 = [], time.perf_counter()
            for x in ids:
                got.append(run(x))
            rates[m].append(sum(map(len, got)) / (time.perf_counter() - t0))
            outputs.setdefault(m, got)
            print(f"round {r + 1} {m}: {rates[m][-1]:.1f} tokens/s", flush=True)
    same = {m: outputs[m] == outputs["hf"] for m in runners}
    median = {m: statistics.median(v) for m, v in rates.items()}
    eager_v = Verifier(lv.model)
    static_v = StaticVerifier(lv.model, compile=True)
    static_v.warm_up(1)
    curves = {"eager": measure_verify_cost(eager_v, (1, 2, 4, 8, 16, 32, 64)),
              "compiled": measure_verify_cost(static_v, (1, 2, 4, 8, 16, 32, 64))}
    result = {
        "machine": machine(),
        "command": command("compiled_step.py", args),
        "prompts": args.prompts, "limit": args.limit, "max_new_tokens": args.max_new_tokens,
        "tokens_per_s": rates, "median_tokens_per_s": median,
        "over_hf": {m: round(v / median["hf"], 3) for m, v in median.items()},
        "compiled_over_eager": {d: round(median[f"{d}/on"] / median[f"{d}/off"], 3) for d in args.drafts.split(",")},
        "ready_s": warmup, "identical_to_hf": same,
        "verify_cost": {k: {"seconds": c["seconds"], "relative": c["relative"]} for k, c in curves.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, lambda tmp: tmp.write_text(json.dumps(result, indent=1, default=str)))
    print(json.dumps({k: result[k] for k in ("over_hf", "compiled_over_eager", "ready_s", "identical_to_hf")}, indent=1))
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
