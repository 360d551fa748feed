"""Shipped accelerate and DeepSpeed configs are accepted by accelerate."""

import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_json_accepted_by_accelerate_plugin(stage):
    from accelerate.utils import DeepSpeedPlugin

    path = ROOT / "configs" / "deepspeed" / f"zero{stage}.json"
    cfg = json.loads(path.read_text())
    assert cfg["zero_optimization"]["stage"] == stage
    plugin = DeepSpeedPlugin(hf_ds_config=str(path))
    assert plugin.zero_stage == stage
    assert plugin.hf_ds_config.config["train_micro_batch_size_per_gpu"] == "auto"  # filled in by accelerate


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs" / "accelerate").glob("*.yaml")))
def test_accelerate_configs_load(name):
    from accelerate.commands.config.config_args import load_config_from_file

    path = ROOT / "configs" / "accelerate" / name
    cfg = load_config_from_file(str(path))
    assert cfg.num_processes >= 1
    assert path.read_text().startswith("#") and "accelerate launch --config_file" in path.read_text()
    if cfg.distributed_type == "DEEPSPEED":
        ds = ROOT / cfg.deepspeed_config["deepspeed_config_file"]
        assert ds.is_file()


@pytest.mark.slow
def test_deepspeed_training_run_on_a_gpu(tmp_path):
    """The GPU config itself, where there is a GPU; the CPU variants run in tests/test_deepspeed.py."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is an extra (pip install 'specheads[deepspeed]')")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: ZeRO-2/3 on CPU processes run in tests/test_deepspeed.py")
    import subprocess
    import sys

    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
           str(ROOT / "configs" / "accelerate" / "deepspeed-zero2.yaml"), "--num_processes", "1",
           str(ROOT / "train" / "train_heads.py"), "--config", str(ROOT / "configs" / "tiny-cpu.yaml"),
           "max_steps=2", f"output_dir={tmp_path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "model.safetensors").is_file()


def test_yaml_booleans_do_not_break_string_keys():
    """``mixed_precision=no`` (YAML 1.1 reads an unquoted no as false) is the string 'no'."""
    from train.config import load_config

    assert load_config(None, ["data=x.jsonl", "mixed_precision=no"]).mixed_precision == "no"
