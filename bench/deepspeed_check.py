"""DeepSpeed ZeRO-2 / ZeRO-3, executed: ``make deepspeed-check`` (CPU, no GPU needed, ~5 minutes on 2 cores).

    PYTHONPATH=. python bench/deepspeed_check.py [--stages 2,3] [--processes 2] [--steps 12] [--out runs/deepspeed-check]

For each ZeRO stage, through ``accelerate launch`` with the shipped CPU config
(``configs/accelerate/deepspeed-zero{2,3}-cpu.yaml``) and the tiny recipe (``configs/tiny-cpu.yaml``):

1. an uninterrupted run on ``--processes`` processes (``batch_size`` 4 each);
2. the same run stopped after 3/4 of the steps (a checkpoint was written at 1/2), then ``--resume``;
3. checks: the loss falls; the saved head has every tensor of a 1-process run of the same recipe
   and global batch (``accelerate launch --cpu``, ``batch_size`` 4 x processes), same shapes,
   within ``--atol``; the resumed head equals the uninterrupted one (``--resume-atol``, 0 = bit
   for bit); the head drafts for ``specheads generate`` with output identical to plain greedy.

Writes ``OUT/deepspeed-check.json``; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "tiny-cpu.yaml"
PER_PROCESS_BATCH = 4


@dataclass
class StageResult:
    stage: int
    first_loss: float
    last_loss: float
    tensors: int
    max_abs_diff_vs_one_process: float
    max_abs_diff_resumed_vs_uninterrupted: float
    generate_identical: bool
    generate_tau: float
    seconds: float


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], *, stage: int | None, processes: int, timeout: int = 900) -> subprocess.CompletedProcess:
    """``accelerate launch`` of ``train/train_heads.py`` with the tiny recipe: DeepSpeed ZeRO-``stage``
    on ``processes`` CPU processes, or (``stage`` None) one plain CPU process."""
    exe = Path(sys.executable).parent / "accelerate"
    if stage is None:
        head = ["--cpu", "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    else:
        head = ["--config_file", str(ROOT / "configs" / "accelerate" / f"deepspeed-zero{stage}-cpu.yaml"),
                "--num_processes", str(processes), "--main_process_port", str(free_port())]
    cmd = [str(exe), "launch", *head, str(ROOT / "train" / "train_heads.py"), "--config", str(RECIPE), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return proc


def recipe_args(out: Path, steps: int, batch_size: int, data: Path | None = None) -> list[str]:
    """The run's overrides: ``steps`` optimizer steps, a checkpoint at half of them."""
    args = [f"output_dir={out}", f"max_steps={steps}", f"save_every={steps // 2}", f"eval_every={steps // 2}",
            f"batch_size={batch_size}"]
    return args + ([f"data={data}", "prompts="] if data else [])


def head_tensors(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "model.safetensors"))


def max_abs_diff(a: dict, b: dict) -> float:
    """The largest elementwise difference of two heads; they must hold the same, non-empty tensors."""
    if set(a) != set(b):
        raise AssertionError(f"different tensors: {sorted(set(a) ^ set(b))[:5]}")
    worst = 0.0
    for k in a:
        if a[k].shape != b[k].shape or a[k].numel() == 0:
            raise AssertionError(f"{k}: shape {tuple(a[k].shape)} vs {tuple(b[k].shape)}")
        worst = max(worst, (a[k].double() - b[k].double()).abs().max().item())
    return worst


def losses(out: Path) -> list[float]:
    return [h["loss"] for h in json.loads((out / "train_history.json").read_text())]


def generate_check(head_dir: Path, prompt: str = "Repeat: one two three one two three") -> tuple[bool, float]:
    """``specheads generate --draft head_dir --compare`` on the tiny verifier: (identical, tau)."""
    cmd = [sys.executable, "-m", "infer.tools.cli", "generate", "--verifier", "tiny-random:llama", "--draft", str(head_dir),
           "--prompt", prompt, "--max-new-tokens", "40", "--json", "--tree-budget", "fixed", "--compare"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    cmp = next(line["compare"] for line in lines if "compare" in line)
    return cmp["output_vs_plain"] == "identical", float(cmp["tau"])


def check_stage(stage: int, out: Path, reference: dict, data: Path | None, processes: int, steps: int) -> StageResult:
    """``data`` None: each run distils its data itself, as the recipe says (the main process only)."""
    t0 = time.time()
    full, resumed = out / f"zero{stage}", out / f"zero{stage}-resumed"
    launch(recipe_args(full, steps, PER_PROCESS_BATCH, data), stage=stage, processes=processes)
    launch([*recipe_args(resumed, steps, PER_PROCESS_BATCH, data), f"interrupt_after={steps * 3 // 4}"],
           stage=stage, processes=processes)
    launch([*recipe_args(resumed, steps, PER_PROCESS_BATCH, data), "--resume"], stage=stage, processes=processes)
    head = head_tensors(full)
    identical, tau = generate_check(full)
    loss = losses(full)
    return StageResult(stage, loss[0], loss[-1], len(head), max_abs_diff(head, reference),
                       max_abs_diff(head_tensors(resumed), head), identical, tau, round(time.time() - t0, 1))


def failures(r: StageResult, atol: float, resume_atol: float) -> list[str]:
    bad = []
    if not r.last_loss < r.first_loss:
        bad.append(f"ZeRO-{r.stage}: the loss did not fall ({r.first_loss} -> {r.last_loss})")
    if not r.max_abs_diff_vs_one_process <= atol:
        bad.append(f"ZeRO-{r.stage}: head differs from the 1-process run by {r.max_abs_diff_vs_one_process:.3g} > {atol}")
    if not r.max_abs_diff_resumed_vs_uninterrupted <= resume_atol:
        bad.append(f"ZeRO-{r.stage}: resumed head differs by {r.max_abs_diff_resumed_vs_uninterrupted:.3g} > {resume_atol}")
    if not r.generate_identical:
        bad.append(f"ZeRO-{r.stage}: specheads generate with the head did not reproduce plain greedy output")
    return bad


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bench/deepspeed_check.py", description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default="2,3")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", default="runs/deepspeed-check")
    parser.add_argument("--atol", type=float, default=2e-5, help="head vs the 1-process run (float32 reduction order)")
    parser.add_argument("--resume-atol", type=float, default=0.0, help="resumed vs uninterrupted head")
    args = parser.parse_args(argv)
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        print("deepspeed_check: error: DeepSpeed is not installed: pip install 'specheads[deepspeed]'", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    for name in ("one-process", *(f"zero{s}{tail}" for s in (2, 3) for tail in ("", "-resumed"))):
        shutil.rmtree(out / name, ignore_errors=True)  # a fresh start every time
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    ref = out / "one-process"
    launch(recipe_args(ref, args.steps, PER_PROCESS_BATCH * args.processes), stage=None, processes=1)
    reference = head_tensors(ref)
    results, bad = [], []
    for stage in (int(s) for s in args.stages.split(",")):
        r = check_stage(stage, out, reference, None, args.processes, args.steps)
        results.append(r)
        bad += failures(r, args.atol, args.resume_atol)
        print(f"ZeRO-{stage}, {args.processes} processes: loss {r.first_loss:.4f} -> {r.last_loss:.4f}; {r.tensors} tensors, "
              f"max abs diff vs 1 process {r.max_abs_diff_vs_one_process:.3g}; resumed vs uninterrupted "
              f"{r.max_abs_diff_resumed_vs_uninterrupted:.3g}; generate identical={r.generate_identical} tau {r.generate_tau:.2f}; "
              f"{r.seconds:.0f} s", flush=True)
    report = {"processes": args.processes, "steps": args.steps, "global_batch": PER_PROCESS_BATCH * args.processes,
              "one_process_loss": losses(ref)[-1], "stages": [asdict(r) for r in results], "failures": bad,
              "seconds": round(time.time() - t0, 1)}
    (out / "deepspeed-check.json").write_text(json.dumps(report, indent=1))
    for line in bad:
        print(f"deepspeed_check: FAILED: {line}", file=sys.stderr)
    print(f"deepspeed_check: {'ok' if not bad else 'FAILED'}; {out / 'deepspeed-check.json'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
