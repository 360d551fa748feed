"""Batched `--draft auto` against batched plain decoding at each batch size, step by step
interleaved: the number behind "auto never more than 3% slower than plain at any batch size".

    python bench/batch_ab.py --batch-sizes 1,2,4,8,16 --out results/batch-ab.json

Two engines on one verifier model, one with the drafter `--draft` names (built as `specheads serve`
builds it: a drafter per row, the batch policy kept with the drafter) and one with none. At batch
size ``b`` each engine keeps ``b`` generations running (continuous batching: a finished row's
place is taken by the next request at the next step boundary, as in the server at ``b`` clients)
until ``--requests`` requests are done, after a warm-up of ``b`` short requests. The two engines
take steps in turn (their order alternating), each step timed alone, so that whatever slows the
machine for a while slows both alike (whole rounds taken in turns through a server differ by
10%). They take turns going first for each kind of step apart (admission, decode): rows that start
together admit on steps of one parity, so alternating whole turns put the first engine first at
every admission, and in a control of two plain engines that engine's admission steps took
0.7-5.8% longer (three runs, 16 rows, Spec-Bench prompts). ``--draft none`` runs that control: two
plain engines (reported as ``auto`` and ``none``), whose spread is the resolution of a level.

Greedy, chat-templated prompts; every request's tokens are compared between the engines (they
must be identical). Writes ``--out`` (JSON) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_level(engines: dict, prompts: list, b: int, requests: int, max_tokens: int, params_cls, eos) -> dict:
    """``requests`` generations through each engine, ``b`` at a time, steps interleaved; per
    engine: tokens, seconds of its steps, verify row-steps and tree nodes, and the tokens per request."""
    out = {}
    state = {}
    for label in engines:
        state[label] = {"next": 0, "running": 0, "tokens": {}, "seconds": 0.0, "admission_s": 0.0, "row_steps": 0,
                        "nodes": 0, "index": {}}
    labels = list(engines)
    first = {True: 0, False: 0}  # per kind of step (admission or decode): which engine goes first next
    while True:
        for label in labels:  # fill free rows (a step boundary)
            eng, st = engines[label], state[label]
            while st["running"] < b and st["next"] < requests:
                k = st["next"]
                st["index"][eng.add(prompts[k % len(prompts)], params_cls(max_new_tokens=max_tokens), eos_token_id=eos)] = k
                st["tokens"][k] = []
                st["next"] += 1
                st["running"] += 1
        if not any(engines[label].busy for label in labels):
            break
        # the engines take turns going first, for each kind of step apart: of two plain engines, the
        # one that went first at every admission took 0.7-5.8% longer there (see the docstring)
        kind = any(engines[label].joins_next for label in labels)
        order = labels if first[kind] == 0 else labels[::-1]
        first[kind] ^= 1
        for label in order:
            eng, st = engines[label], state[label]
            if not eng.busy:
                continue
            t = time.perf_counter()
            chunks = eng.step()
            dt = time.perf_counter() - t
            st["seconds"] += dt
            if not eng.last_sizes:  # an admission step (prefill of the joining rows)
                st["admission_s"] += dt
            st["row_steps"] += len(eng.last_sizes)
            st["nodes"] += sum(eng.last_sizes)
            for c in chunks:
                st["tokens"][st["index"][c.index]] += c.token_ids
                if c.stats.finish_reason:
                    st["running"] -= 1
    for label, st in state.items():
        n = sum(len(t) for t in st["tokens"].values())
        out[label] = {"tokens": n, "seconds": round(st["seconds"], 3), "tokens_per_s": round(n / st["seconds"], 2),
                      "admission_s": round(st["admission_s"], 3),
                      "nodes_per_row_step": round(st["nodes"] / st["row_steps"], 3) if st["row_steps"] else None,
                      "outputs": [st["tokens"][k] for k in sorted(st["tokens"])]}
    return out


def main() -> int:
    sys.path.insert(0, str(ROOT))
    import torch

    from infer.core.engine import Engine
    from infer.core.params import SamplingParams
    from infer.core.text import encode_prompt, eos_ids
    from infer.core.verifier import Verifier
    from infer.tools import cli
    from infer.tools.prompts import read_prompts

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--verifier", default="default")
    p.add_argument("--draft", default="auto")
    p.add_argument("--batch-sizes", default="1,2,4,8,16")
    p.add_argument("--requests", type=int, default=32,
                   help="requests per batch size, at least 4 x the batch size (four rounds of the batch: at 16 rows one "
                        "round's prefill of Spec-Bench's long prompts moves a level's ratio by 4%%)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompts", default="configs/prompts/spec_bench.jsonl,configs/prompts/unseen.jsonl")
    p.add_argument("--limit", type=int, default=2, help="prompts per category of each file")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    torch.set_num_threads(args.threads)
    sargs = cli.build_parser().parse_args(["serve", "--verifier", args.verifier, "--draft", args.draft])
    lv = cli._load(sargs, "the benchmark encodes chat prompts")
    drafter = cli._drafter(sargs, args.draft, lv.model, cli._tree(sargs))
    eos = eos_ids(lv.model, lv.tokenizer)
    report = {"date": time.strftime("%Y-%m-%d"), "verifier": args.verifier, "draft": args.draft, "max_tokens": args.max_tokens,
              "threads": args.threads, "sets": {}}
    for path in args.prompts.split(","):
        name = Path(path).stem
        prompts = [encode_prompt(lv.tokenizer, q.text) for q in read_prompts(ROOT / path, limit=args.limit)]
        # fresh engines per prompt set; the drafter's batch policy and cost curve carry over, as in a server
        engines = {"auto": Engine(Verifier(lv.model, linear=sargs.linear), drafter, max_rows=max(sizes)),
                   "none": Engine(Verifier(lv.model, linear=sargs.linear), None, max_rows=max(sizes))}
        levels = {}
        for b in sizes:
            engines["auto"].max_rows = engines["none"].max_rows = b
            run_level(engines, prompts, b, b, 8, SamplingParams, eos)  # warm-up: the policy meets this batch size
            requests = max(args.requests, 4 * b)
            got = run_level(engines, prompts, b, requests, args.max_tokens, SamplingParams, eos)
            a, n = got["auto"], got["none"]
            levels[str(b)] = {"requests": requests, "auto": {k: v for k, v in a.items() if k != "outputs"},
                              "none": {k: v for k, v in n.items() if k != "outputs"},
                              "ratio": round(a["tokens_per_s"] / n["tokens_per_s"], 3),
                              "identical": sum(x == y for x, y in zip(a["outputs"], n["outputs"]))}
            print(f"{name} b={b}: auto {a['tokens_per_s']} tok/s, none {n['tokens_per_s']} tok/s, "
                  f"ratio {levels[str(b)]['ratio']}, nodes/row-step {a['nodes_per_row_step']}, "
                  f"identical {levels[str(b)]['identical']}/{requests}", file=sys.stderr, flush=True)
        report["sets"][name] = levels
    args.out.parent.mkdir(parents=True, exist_ok=True)
    from heads.io import write_atomic

    write_atomic(args.out, lambda path: path.write_text(json.dumps(report, indent=1)))
    print(table(report))
    return 0


def table(report: dict) -> str:
    lines = ["| prompts | batch | auto tok/s | none tok/s | auto / none | nodes per row-step (auto) | identical |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, levels in report["sets"].items():
        for b, r in levels.items():
            lines.append(f"| {name} | {b} | {r['auto']['tokens_per_s']} | {r['none']['tokens_per_s']} | {r['ratio']:.3f}x | "
                         f"{r['auto']['nodes_per_row_step']} | {r['identical']}/{r['requests']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
