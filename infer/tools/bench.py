"""Benchmarks: HF ``generate`` (vanilla, prompt lookup) against the speculative engine, and the
verifier's verify-cost curve.

All methods run in one process on the same prompts, one after another for each prompt (so that
drift on a noisy machine hits them alike), after a warm-up. Results are per method and per
category: tokens/s, tau, speedup over vanilla and, for speculative methods, how many outputs are
identical to vanilla. With several drafters, ``spec`` expands to one method per drafter
(``spec:<label>``). With a measured verify-cost curve, speculative methods also get their ideal
speedup (tau x T(1 token) / T(tree used), averaged over the verify steps) and the achieved share
of it (``efficiency``). Each speculative row also records what its drafter had learnt by the end
of that generation (``drafter``: e.g. the cost curve, the steps the gate paused, the calibration).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from ..core.engine import Engine
from ..core.errors import UserError
from ..core.kernels import kernel_context
from ..core.params import SamplingParams
from ..core.verifier import Verifier, check_fits
from .prompts import BenchPrompt

METHODS = ("vanilla", "hf-pld", "spec")


class ForwardCounter:
    """Counts forward calls of a model (to get tau for any method: new tokens per pass)."""

    def __init__(self, model):
        self.calls = 0
        self._handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.calls += 1

    def close(self) -> None:
        self._handle.remove()


def hf_generate(model, ids, max_new_tokens, eos, **kw) -> list[int]:
    out = model.generate(
        ids.view(1, -1).to(model.device),
        attention_mask=torch.ones(1, ids.numel(), dtype=torch.long, device=model.device),
        max_new_tokens=max_new_tokens,
        eos_token_id=eos or None,
        pad_token_id=eos[0] if eos else 0,
        **{"do_sample": False, **kw},
    )
    return out[0, ids.numel() :].tolist()


def check_methods(methods, temperature: float = 0.0) -> None:
    """A one-line :class:`UserError` for unknown methods, none at all, or ``hf-pld`` when sampling."""
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise UserError(f"unknown bench methods {sorted(unknown)}: choose from {', '.join(METHODS)}")
    if not methods:
        raise UserError("--methods is empty: give a comma-separated subset of vanilla,hf-pld,spec")
    if temperature > 0 and "hf-pld" in methods:
        raise UserError("hf-pld is greedy only here: drop it from --methods when sampling")


def run_bench(
    model,
    tokenizer,
    drafter,
    prompts: list[BenchPrompt],
    *,
    methods=METHODS,
    max_new_tokens: int = 128,
    budget="auto",
    compile: str = "off",
    chat: bool = True,
    pld_tokens: int = 10,
    progress: bool = True,
    temperature: float = 0.0,
    seed: int = 0,
    partial: str | Path | None = None,
    fingerprint: dict | None = None,
    kernels: dict[str, str] | None = None,
) -> dict:
    """Run the benchmark and return the results dict (see the module docstring).

    ``drafter``: one drafter (method ``spec``) or ``{label: drafter}`` (methods ``spec:<label>``).
    ``temperature > 0`` samples (vanilla: HF ``generate(do_sample=True)``; every prompt and method
    is seeded with ``seed``); outputs then differ from vanilla by design and are not compared.

    ``partial``: a JSONL file that receives each prompt's results as soon as they are measured;
    a rerun with the same ``fingerprint`` (what defines the run: prompts, methods, drafts, ...)
    takes the prompts already there and measures only the rest. A different fingerprint is refused.

    ``kernels``: ``{label: linear kernel}`` of the verifier each drafter's method runs on
    (:mod:`infer.core.kernels`; default ``auto`` for all). HF's methods run the stock model; with
    ``vanilla`` among the methods, every kernel other than stock that an engine method runs on
    also gets a ``vanilla[<kernel>]`` row, HF ``generate`` on that kernel, and each speculative
    method's ``speedup_same_kernel`` is its speed over HF's on its own kernel: ``speedup`` is what
    users see against stock HF, ``speedup_same_kernel`` what speculation alone adds.

    ``compile``: the engines' verify step (``--compile``; :mod:`infer.core.static`)."""

    from ..core.text import encode_prompt, eos_ids

    check_methods(methods, temperature)
    eos = eos_ids(model, tokenizer)
    drafters = drafter if isinstance(drafter, dict) else {"": drafter}
    run = _Methods(model, drafters, kernels or {}, eos, max_new_tokens, budget, temperature, seed, pld_tokens, compile)
    methods = run.expand(methods)
    encoded = [encode_prompt(tokenizer, p.text, chat=chat) for p in prompts]
    for i, ids in enumerate(encoded):  # before any method runs (HF would run a million tokens first)
        check_fits(model.config, ids.numel() + max_new_tokens, f"prompt {i + 1} plus max_new_tokens")
    log = PartialResults(partial, {**(fingerprint or {}), "methods": list(methods), "n_prompts": len(prompts)}) if partial else None
    rows = log.rows() if log else []
    if rows:
        for i, row in enumerate(rows):
            if row.get("prompt") != prompts[i].text[:200] or row.get("category") != prompts[i].category:
                raise UserError(f"{partial}: its prompt {i + 1} is not this run's: remove the file to start over")
    _measure(model, run, methods, prompts, encoded, rows, log, progress)
    summary = summarize(rows, methods, compare=temperature == 0)
    add_same_kernel_speedups(summary, run.baseline_of)
    return {"methods": summary, "baselines": run.baseline_of, "per_prompt": rows}


class _Methods:
    """The methods a benchmark runs, each a function of the prompt ids -> ``(tokens, stats or
    None)`` in ``runners``: HF ``generate`` (``vanilla``, on each engine kernel too), HF's prompt
    lookup, and one speculative method per drafter (``drafter_of``, ``baseline_of``: its vanilla row),
    each on one long-lived :class:`~infer.core.engine.Engine` (what it learns carries over from one
    prompt to the next, as in an application; ``budget``: the engines')."""

    def __init__(self, model, drafters: dict, kernels: dict, eos, max_new_tokens, budget, temperature, seed, pld_tokens,
                 compile: str = "off"):
        self.model, self.drafters, self.kernels, self.eos, self.compile = model, drafters, kernels, eos, compile
        self.max_new_tokens, self.budget, self.temperature, self.seed = max_new_tokens, budget, temperature, seed
        self.verifiers = {k: Verifier(model, linear=k) for k in {kernels.get(label, "auto") for label in drafters}}
        self.sample = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {}
        self.runners = {
            "vanilla": self.vanilla,
            "hf-pld": lambda ids: (hf_generate(model, ids, max_new_tokens, eos, prompt_lookup_num_tokens=pld_tokens), None),
        }
        self.drafter_of: dict = {}  # spec method -> its drafter, whose learnt state each row records
        self.baseline_of: dict = {}  # spec method -> the vanilla row on its own kernel

    def vanilla(self, ids, kernel="stock"):
        torch.manual_seed(self.seed)
        with kernel_context(kernel):
            return hf_generate(self.model, ids, self.max_new_tokens, self.eos, **self.sample), None

    def expand(self, methods) -> tuple[str, ...]:
        """``methods`` as run: ``vanilla`` with a row per engine kernel, ``spec`` with one per drafter."""
        drafters, kernels, verifiers = self.drafters, self.kernels, self.verifiers
        expanded = []
        # hybrid's baseline is stock HF: its one-token passes run on the stock kernel, as HF generate's decoding does
        engine_kernels = sorted({verifiers[kernels.get(label, "auto")].kernel for label in drafters} - {"stock", "hybrid"}) \
            if "spec" in methods else []
        for m in methods:
            if m == "vanilla":
                expanded.append(m)
                for k in engine_kernels:  # HF generate on the engine's kernel: the fair baseline of speculation
                    self.runners[f"vanilla[{k}]"] = lambda ids, k=k: self.vanilla(ids, k)
                    expanded.append(f"vanilla[{k}]")
                continue
            if m != "spec":
                expanded.append(m)
                continue
            for label, d in drafters.items():
                name = f"spec:{label}" if len(drafters) > 1 else "spec"
                v = verifiers[kernels.get(label, "auto")]
                engine = Engine(Verifier(self.model, linear=kernels.get(label, "auto")), d, budget=self.budget,
                                compile=self.compile)
                params = SamplingParams(self.max_new_tokens, self.temperature, seed=self.seed)
                self.runners[name] = lambda ids, e=engine, p=params: _spec(e, ids, p, self.eos)
                self.drafter_of[name] = engine
                self.baseline_of[name] = "vanilla" if v.kernel in ("stock", "hybrid") else f"vanilla[{v.kernel}]"
                expanded.append(name)
        return tuple(expanded)


def _measure(model, run: _Methods, methods, prompts, encoded, rows: list, log, progress: bool) -> None:
    """Warm every method up, then time each on every prompt not in ``rows`` yet (appended to
    ``rows`` and ``log`` as each prompt is done)."""
    from tqdm.auto import tqdm

    counter = ForwardCounter(model)
    try:
        if len(rows) < len(prompts):
            for m in methods:  # warm-up
                run.runners[m](encoded[0][:32])
        todo = list(zip(prompts, encoded))[len(rows):]
        for prompt, ids in tqdm(todo, desc="bench", initial=len(rows), total=len(prompts), disable=not progress):
            row = {"category": prompt.category, "prompt": prompt.text[:200], "prompt_tokens": ids.numel()}
            for m in methods:
                calls = counter.calls
                t0 = time.perf_counter()
                tokens, stats = run.runners[m](ids)
                seconds = time.perf_counter() - t0
                row[m] = {"tokens": tokens, "seconds": seconds, "passes": counter.calls - calls}
                if stats is not None:
                    row[m].update(accepted_hist=stats.accepted_hist, nodes_hist=stats.nodes_hist,
                                  draft_s=stats.draft_s, verify_s=stats.verify_s, steps=stats.verify_steps,
                                  drafter=run.drafter_of[m].drafter.state(), schedule=run.drafter_of[m].schedule.state())
            rows.append(row)
            if log:
                log.append(row)
    finally:
        counter.close()


class PartialResults:
    """Per-prompt results appended to a JSONL file as they come (line 1: the run's fingerprint),
    so a stopped benchmark keeps what it measured and the same command resumes it."""

    def __init__(self, path: str | Path, fingerprint: dict):
        self.path = Path(path)
        self.fingerprint = json.loads(json.dumps(fingerprint, default=str))

    def rows(self) -> list[dict]:
        """The rows already measured by a run with this fingerprint (a torn last line is dropped)."""
        if not self.path.exists():
            return []
        lines = self.path.read_text(encoding="utf-8").split("\n")
        try:
            head = json.loads(lines[0])
        except json.JSONDecodeError:
            raise UserError(f"{self.path} is not a specheads bench progress file: remove it to start over") from None
        if head != {"fingerprint": self.fingerprint}:
            raise UserError(f"{self.path} holds a benchmark with other settings: remove it (or use another --out) to start over")
        rows = []
        for line in lines[1:]:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break  # the line a stop cut short
        return rows

    def append(self, row: dict) -> None:
        fresh = not self.path.exists()
        if not fresh:  # drop a torn last line before appending
            data = self.path.read_bytes()
            if not data.endswith(b"\n"):
                with open(self.path, "r+b") as f:
                    f.truncate(data.rfind(b"\n") + 1)
        with open(self.path, "a", encoding="utf-8") as f:
            if fresh:
                f.write(json.dumps({"fingerprint": self.fingerprint}) + "\n")
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def _spec(engine: Engine, ids, params: SamplingParams, eos):
    """One generation on ``engine``: its tokens and stats."""
    engine.add(ids, params, eos_token_id=eos)
    tokens, stats = [], None
    for chunk in engine.run():
        tokens.extend(chunk.token_ids)
        stats = chunk.stats
    return tokens, stats


def _merged(rows: list[dict], m: str, key: str) -> list[int]:
    """Element-wise sum of the per-prompt histograms ``row[m][key]``."""
    hist: list[int] = []
    for r in rows:
        for k, v in enumerate(r[m].get(key, [])):
            hist.extend([0] * (k + 1 - len(hist)))
            hist[k] += v
    return hist


def add_efficiency(results: dict, verify_cost: dict) -> None:
    """Per speculative method (overall and per category): ``ideal_speedup`` = tokens over the
    verify passes' summed cost in single-token passes (from the measured curve, interpolated),
    and ``efficiency`` = achieved ``speedup`` / ``ideal_speedup``."""
    from ..core.schedule import VerifyCost

    rel = {int(n): float(r) for n, r in verify_cost["relative"].items()}
    nodes = sorted(rel)
    curve = VerifyCost(tuple(nodes), tuple(rel[n] for n in nodes))
    rows = results["per_prompt"]
    for m, res in results["methods"].items():
        if not rows or "nodes_hist" not in rows[0].get(m, {}):
            continue
        groups = [(res["overall"], rows)] + [(v, [r for r in rows if r["category"] == c]) for c, v in res["categories"].items()]
        for agg, sub in groups:
            hist = _merged(sub, m, "nodes_hist")
            passes = sum(n_steps * curve(n) for n, n_steps in enumerate(hist) if n_steps)
            # the first token of each generation comes from the prefill, as in vanilla
            tokens = sum(len(r[m]["tokens"]) - 1 for r in sub)
            agg["mean_tree_nodes"] = sum(n * k for n, k in enumerate(hist)) / max(1, sum(hist))
            agg["ideal_speedup"] = tokens / passes if passes else None
            if agg.get("speedup") and agg["ideal_speedup"]:
                agg["efficiency"] = agg["speedup"] / agg["ideal_speedup"]


def add_same_kernel_speedups(summary: dict, baseline_of: dict[str, str]) -> None:
    """Per speculative method (overall and per category): ``speedup_same_kernel``, its tokens/s
    over those of HF ``generate`` on the same linear kernel (``baseline_of[method]``)."""
    for m, base in baseline_of.items():
        if m not in summary or base not in summary:
            continue
        pairs = [(summary[m]["overall"], summary[base]["overall"])]
        pairs += [(v, summary[base]["categories"][c]) for c, v in summary[m]["categories"].items()]
        for ours, theirs in pairs:
            ours["speedup_same_kernel"] = ours["tokens_per_s"] / theirs["tokens_per_s"] if theirs["tokens_per_s"] else None


def summarize(rows: list[dict], methods, compare: bool = True) -> dict:
    """Per method: ``overall`` and ``categories``, each with tokens, seconds, tokens_per_s, tau,
    speedup (tokens/s over vanilla's) and, when ``compare``, identical (outputs equal to
    vanilla's, of n)."""
    cats = sorted({r["category"] for r in rows})
    out: dict = {}
    for m in methods:
        out[m] = {"overall": _agg(rows, m, compare), "categories": {c: _agg([r for r in rows if r["category"] == c], m, compare) for c in cats}}
        hist = _merged(rows, m, "accepted_hist")
        if hist:
            out[m]["accepted_hist"] = hist
    if "vanilla" in methods:
        base = out["vanilla"]
        for m in methods:
            pairs = [(out[m]["overall"], base["overall"])]
            pairs += [(out[m]["categories"][c], base["categories"][c]) for c in cats]
            for ours, theirs in pairs:
                ours["speedup"] = ours["tokens_per_s"] / theirs["tokens_per_s"] if theirs["tokens_per_s"] else None
    return out


def _agg(rows: list[dict], m: str, compare: bool = True) -> dict:
    tokens = sum(len(r[m]["tokens"]) for r in rows)
    seconds = sum(r[m]["seconds"] for r in rows)
    passes = sum(r[m]["passes"] for r in rows)
    steps = sum(r[m].get("steps", 0) for r in rows)
    res = {
        "n": len(rows),
        "tokens": tokens,
        "seconds": round(seconds, 4),
        "tokens_per_s": tokens / seconds if seconds else 0.0,
        # tokens per pass after the prefill: each generation's first pass is its prompt's, and
        # its first new token that pass's (decoding with no draft: exactly 1.0)
        "tau": (tokens - len(rows)) / max(1, passes - len(rows)),
    }
    if steps:  # the engine's own split of its time per verify step
        res["draft_ms_per_step"] = 1e3 * sum(r[m]["draft_s"] for r in rows) / steps
        res["verify_ms_per_step"] = 1e3 * sum(r[m]["verify_s"] for r in rows) / steps
    if compare and m != "vanilla" and rows and "vanilla" in rows[0]:  # vanilla[kernel] too: the kernels round differently
        res["identical"] = sum(r[m]["tokens"] == r["vanilla"]["tokens"] for r in rows)
    return res


def environment() -> dict:
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
    }


def plot_results(results: dict, path: str | Path) -> None:
    """A PNG: speedup and tau per category for every method, and the accepted-length histogram."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = results["methods"]
    names = list(methods)
    cats = list(next(iter(methods.values()))["categories"]) + ["overall"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    width = 0.8 / max(1, len(names))
    for panel, key in zip(axes[:2], ("speedup", "tau")):
        for i, m in enumerate(names):
            vals = [methods[m]["categories"][c].get(key) if c != "overall" else methods[m]["overall"].get(key) for c in cats]
            xs = [j + i * width for j in range(len(cats))]
            panel.bar(xs, [v or 0 for v in vals], width, label=m)
        panel.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(cats))], cats, rotation=30, ha="right")
        panel.set_title("speedup over vanilla (tokens/s)" if key == "speedup" else "tau (tokens per verifier pass)")
        panel.axhline(1.0, color="grey", lw=0.8)
        panel.legend()
    ax = axes[2]
    for m in names:
        hist = methods[m].get("accepted_hist")
        if hist:
            total = sum(hist)
            ax.bar(range(len(hist)), [h / total for h in hist], alpha=0.7, label=m)
    ax.set_title("tokens emitted per verify step")
    ax.set_xlabel("accepted drafts + bonus")
    ax.legend()
    fig.tight_layout()
    from heads.io import write_atomic

    write_atomic(Path(path), lambda p: fig.savefig(p, format="png", dpi=110))
    plt.close(fig)
