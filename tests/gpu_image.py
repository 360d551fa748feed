"""A rehearsal of the GPU image that ``make gpu-check`` runs on, on this CPU machine.

The GPU image has Python 3.12, torch 2.11 (CUDA 13), transformers 5.17, accelerate 1.15,
peft, safetensors, tensorboard, huggingface_hub, pyarrow, tqdm and matplotlib; no ``datasets``,
no ``gguf``, no specheads install and no network. The rehearsal is a virtual environment with:

* the versions pinned in ``configs/gpu-image.txt`` (transformers 5.17.0, huggingface_hub 1.x,
  accelerate 1.15.0, torch 2.13.0: the oldest CPU build pip can get here), each installed with
  ``pip install --no-deps`` unless the environment it is built from has that version already;
* every other package of that environment (the project's ``.venv``) linked in, except
  ``datasets`` and ``gguf`` (absent: ``import datasets`` fails) and specheads itself (the code
  runs from the tree, through ``PYTHONPATH`` only, as on the device).

Building takes seconds (two wheels and a few hundred symlinks) instead of minutes for a fresh
torch. ``python tests/gpu_image.py [--out DIR]`` builds it if needed and runs the selfcheck's
CI-sized dry run in it (``make rehearsal``); ``tests/test_gpu_image.py`` does the same under
pytest, so ``make test`` (CI) runs it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PINS = ROOT / "configs" / "gpu-image.txt"
ABSENT = ("datasets", "gguf", "specheads")  # not on the image
DEFAULT_DIR = ROOT / ".venv-rehearsal"


def read_pins(path: Path = PINS) -> dict[str, str]:
    """``{distribution name (normalised): version}`` of the ``name==version`` lines."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[_norm(name)] = version.strip()
    return pins


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def _distributions(site: Path) -> dict[str, tuple[str, Path]]:
    """``{normalised name: (version, dist-info dir)}`` of the distributions installed in ``site``."""
    dists = {}
    for info in site.glob("*.dist-info"):
        meta = info / "METADATA"
        if not meta.exists():
            continue
        head = meta.read_text(encoding="utf-8", errors="replace").split("\n\n", 1)[0]
        name = re.search(r"^Name: (.+)$", head, re.M)
        version = re.search(r"^Version: (.+)$", head, re.M)
        if name and version:
            dists[_norm(name[1].strip())] = (version[1].strip(), info)
    return dists


def _top_level(site: Path, info: Path) -> set[str]:
    """The names directly under ``site`` that a distribution installed (from its RECORD)."""
    names = {info.name}
    record = info / "RECORD"
    if record.exists():
        for line in record.read_text(encoding="utf-8", errors="replace").splitlines():
            path = line.split(",", 1)[0]
            if path and not path.startswith(".."):
                names.add(path.split("/", 1)[0])
    return names


def _same_version(installed: str, pinned: str) -> bool:
    return installed.split("+", 1)[0] == pinned  # 2.13.0+cpu is torch 2.13.0


def build(target: Path = DEFAULT_DIR, source_python: Path | None = None, log=print) -> Path:
    """Build (or reuse) the rehearsal environment in ``target``; returns its python."""
    source_python = Path(source_python or sys.executable)
    source_site = _site_packages(source_python)
    # rebuilt when the pins, the source environment or anything installed in it changes
    listing = "\n".join(sorted(os.listdir(source_site)))
    stamp_text = hashlib.sha256((PINS.read_text() + str(source_python.resolve()) + listing).encode()).hexdigest()
    python = target / "bin" / "python"
    stamp = target / ".rehearsal-stamp"
    if stamp.exists() and stamp.read_text() == stamp_text and python.exists():
        return python
    import shutil

    shutil.rmtree(target, ignore_errors=True)
    base = subprocess.run([str(source_python), "-c", "import sys; print(getattr(sys, '_base_executable', sys.executable))"],
                          capture_output=True, text=True, check=True).stdout.strip()  # the interpreter behind the source venv
    subprocess.run([base, "-m", "venv", "--without-pip", str(target)], check=True)
    site = _site_packages(python)
    source = _distributions(source_site)
    pins = read_pins()
    missing = [f"{n}=={v}" for n, v in pins.items() if n not in source or not _same_version(source[n][0], v)]
    if missing:
        log(f"rehearsal: installing {' '.join(missing)} (no deps)")
        subprocess.run([str(source_python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
                        "--target", str(site), *missing], check=True)
    skip = set()
    for name in set(ABSENT) | {_norm(m.split("==")[0]) for m in missing}:
        if name in source:
            skip |= _top_level(source_site, source[name][1])
    linked = 0
    for entry in sorted(source_site.iterdir()):
        if entry.name in skip or entry.name.startswith("__editable__") or entry.name == "__pycache__" \
                or entry.name.endswith(".egg-link") or (site / entry.name).exists():
            continue
        (site / entry.name).symlink_to(entry)
        linked += 1
    log(f"rehearsal: {target} ({linked} entries linked from {source_site})")
    stamp.write_text(stamp_text)
    return python


CHECK = """
import importlib, importlib.metadata as md, json, sys
out = {}
for name in ("datasets", "gguf"):
    try:
        importlib.import_module(name)
        out[name] = "importable"
    except ImportError:
        out[name] = "absent"
import os
root = os.path.realpath(os.getcwd())
# installed = found outside the tree: the specheads.egg-info that `pip install -e .` leaves in the
# tree is git-ignored, so the device call (which carries tracked files only) never has it
found = [d for d in md.distributions() if (d.metadata["Name"] or "").lower() == "specheads"
         and os.path.realpath(str(d.locate_file(""))) != root]
out["specheads"] = "installed" if found else "not installed"
for name in ("torch", "transformers", "accelerate", "huggingface_hub", "peft", "safetensors"):
    out[name] = md.version(name)
import infer, heads
out["infer_from"] = infer.__file__
print(json.dumps(out))
"""


def environment(python: Path) -> dict:
    """What the rehearsal environment has: versions, and whether datasets / gguf / specheads are there."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([str(python), "-c", CHECK], capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_selfcheck(python: Path, out: Path, timeout: int = 1200) -> subprocess.CompletedProcess:
    """The selfcheck's CI-sized dry run in the rehearsal environment, offline, the tree on PYTHONPATH."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([str(python), "-m", "infer.tools.cli", "selfcheck", "--device", "cpu", "--small", "--out", str(out)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="where the environment is built (default .venv-rehearsal)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "rehearsal", help="the selfcheck's output directory")
    args = p.parse_args(argv)
    python = build(args.dir)
    env = environment(python)
    print(json.dumps(env))
    bad = [n for n in ("datasets", "gguf") if env[n] != "absent"] + (["specheads"] if env["specheads"] != "not installed" else [])
    if bad:
        print(f"rehearsal: {', '.join(bad)} should not be there", file=sys.stderr)
        return 1
    proc = run_selfcheck(python, args.out)
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
