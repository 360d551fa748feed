"""The EAGLE drafter's gate, side by side in one run: as shipped (a probe after a pause is judged
on its one drafted step), probes judged on 3 drafted steps together, and no gate at all.

Prompts: 8 Spec-Bench and 6 unseen prompts on which the head paused on > 25% of the steps in the
oneDNN-kernel runs of 2026-12-01 (docs/bench-kernel-*.json, in the history: bring them back first),
and 3 + 3 others, seeded. 256 new tokens, greedy.

    for f in specbench unseen; do git show 9ce81c7:docs/bench-kernel-$f.json > docs/bench-kernel-$f.json; done
    PYTHONPATH=. .venv/bin/python docs/scripts/gate_ab.py results/gate-ab.json   # ~20 min on a 2-core CPU
"""
import json
import math
import random
import sys

from infer.core.models import load_verifier
from infer.drafting.gate import Gate, Gates
from infer.drafting.head_drafters import EagleDrafter
from infer.drafting.loading import load_drafter
from infer.tools.bench import run_bench
from infer.tools.prompts import read_prompts


class ProbeWindow(Gate):
    """A probe after a pause is judged by the mean gain of its next 3 drafted steps."""

    window: tuple = ()

    def record(self, gain):
        if self.backoff > 1:  # probing: the shipped gate judges the gain it is given, here the window's mean
            self.window += (gain,)
            if len(self.window) < 3:
                return
            gain, self.window = sum(float(g) for g in self.window) / len(self.window), ()
        super().record(gain)


class NeverPause(Gate):
    def should_draft(self):
        return True

    def record(self, gain):
        self.ema = (1 - self.alpha) * self.ema + self.alpha * gain


class FreshGates(Gates):
    """A ``gate_cls`` gate, fresh at every generation, whatever its kind."""

    def __init__(self, gate_cls):
        self.gate_cls = gate_cls
        super().__init__()

    def begin(self):
        self.current = self.gate_cls(1.2)

    def select(self, sampled):
        return self.current


def with_gate(drafter, gate_cls):
    """``drafter`` (or its EAGLE member) with ``gate_cls`` in place of the shipped gate."""
    for d in getattr(drafter, "drafters", [drafter]):
        if isinstance(d, EagleDrafter) and gate_cls is not Gate:
            d.gates = FreshGates(gate_cls)
    return drafter


def head_of(row, m):
    state = row[m]["drafter"]
    return state["members"][0] if "members" in state else state


def main(out):
    sets = [("docs/bench-kernel-specbench.json", read_prompts("configs/prompts/spec_bench.jsonl", 10), "spec:auto", 8),
            ("docs/bench-kernel-unseen.json", read_prompts("configs/prompts/unseen.jsonl"), "spec:default", 6)]
    prompts = []
    for path, texts, method, n_heavy in sets:
        rows = json.load(open(path))["per_prompt"]
        heavy = [i for i, r in enumerate(rows) if head_of(r, method)["paused_steps"] > 0.25 * r[method]["steps"]]
        light = [i for i in range(len(rows)) if i not in heavy]
        rnd = random.Random(0)
        prompts += [texts[i] for i in rnd.sample(heavy, min(n_heavy, len(heavy))) + rnd.sample(light, 3)]
    lv = load_verifier("default")
    variants = {"shipped": Gate, "probe3": ProbeWindow, "nogate": NeverPause}
    drafters = {f"{spec}-{name}": with_gate(load_drafter(spec, lv.model), cls)
                for spec in ("auto", "default") for name, cls in variants.items()}
    res = run_bench(lv.model, lv.tokenizer, drafters, prompts, methods=("spec",), max_new_tokens=256,
                    partial=out + ".partial.jsonl", fingerprint={"script": "gate_ab"})
    json.dump(res, open(out, "w"))
    rows = res["per_prompt"]
    for m in res["methods"]:
        steps = sum(r[m]["steps"] for r in rows)
        paused = sum(head_of(r, m)["paused_steps"] for r in rows)
        base = m.rsplit("-", 1)[0] + "-shipped"
        geo = math.exp(sum(math.log((len(r[m]["tokens"]) / r[m]["seconds"]) / (len(r[base]["tokens"]) / r[base]["seconds"]))
                           for r in rows) / len(rows))
        same = sum(r[m]["tokens"] == r[base]["tokens"] for r in rows)
        o = res["methods"][m]["overall"]
        print(f"{m:22s} {o['tokens_per_s']:6.2f} tok/s  tau {o['tau']:.2f}  paused {paused / steps:.2f}  "
              f"per prompt vs shipped: geo-mean {geo:.3f}  same output {same}/{len(rows)}")


if __name__ == "__main__":
    main(sys.argv[1])
