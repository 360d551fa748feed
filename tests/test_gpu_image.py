"""The rehearsal of the GPU image (tests/gpu_image.py, ``make rehearsal``): the selfcheck's code
path under the oldest versions the project claims (transformers 5.17.0, accelerate 1.15.0,
huggingface_hub 1.x, torch 2.13), with ``datasets`` and ``gguf`` absent and the project not
installed (the tree on PYTHONPATH only), offline. What ``make gpu-check`` runs on the device. The one run of ``specheads selfcheck --small``
in the suite (it takes a minute): every part runs and writes its JSON and plot."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_image  # noqa: E402


@pytest.mark.slow
@pytest.mark.early
def test_the_selfcheck_runs_on_the_gpu_images_versions(tmp_path):
    python = gpu_image.build(log=lambda *_: None)
    env = gpu_image.environment(python)
    pins = gpu_image.read_pins()
    assert env["datasets"] == env["gguf"] == "absent" and env["specheads"] == "not installed"
    assert env["transformers"] == pins["transformers"] and env["accelerate"] == pins["accelerate"]
    assert env["huggingface_hub"] == pins["huggingface-hub"] and env["torch"].split("+")[0] == pins["torch"]
    assert Path(env["infer_from"]).parent == gpu_image.ROOT / "infer"
    proc = gpu_image.run_selfcheck(python, tmp_path / "check")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    r = json.loads((tmp_path / "check" / "selfcheck.json").read_text())
    assert r["env"]["transformers"] == pins["transformers"]
    assert (tmp_path / "check" / "selfcheck.png").stat().st_size > 1000
    assert r["identity"]["fp32_all_identical"] is True and r["identity"]["cpu_generator_sampling"] is True
    assert 0 <= r["identity"]["bf16_identical_share"] <= 1
    engine = r["speed"]["engine"]
    assert all(engine[k]["identical"] for k in engine), engine
    taus = [engine[f"oracle_chain{d}"]["tau"] for d in (1, 3, 5, 7)]
    assert taus == sorted(taus) and taus[0] > 1.5  # oracle drafts: a known tau, growing with the chain
    assert {"cost_prefix64", "cost_prefix128", "hf_generate_tok_s"} <= set(r["speed"])
    assert engine["eagle3_random_eagle2-32"]["host_reads"] > 0 and "draft_over_verify" in engine["eagle3_random_eagle2-32"]
    cli = r["cli"]
    assert cli["distill"]["rc"] == 0 and cli["distill"]["response_tokens"] > 0
    assert cli["train"]["rc"] == 0 and cli["train"]["median_step_s"] > 0
    assert cli["bench"]["rc"] == 0 and cli["bench"]["overall"]["spec:pld"]["identical"] > 0
