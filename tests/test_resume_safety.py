"""Resumable checkpoints are safe to read and bounded: `--resume` never unpickles (a crafted
checkpoint directory cannot run code), old checkpoints are pruned to the newest K, and a full disk
while writing one is a one-line error that leaves the earlier checkpoints as they were."""

import json
import os
import pickle
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from train.config import load_config
from train.train_heads import main, train

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "tiny-cpu.yaml"


# accelerate's process-wide state is reset after every test of this file (conftest)
pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    from infer.core.models import load_verifier
    from train.data import distill, load_prompts

    path = tmp_path_factory.mktemp("data") / "distilled.jsonl"
    lv = load_verifier("tiny-random:llama")
    distill(lv.model, lv.tokenizer, load_prompts("synthetic:32"), path, max_new_tokens=24, batch_size=16, progress=False)
    return path


def _args(distilled, out, **over):
    over = {"data": str(distilled), "prompts": "", "output_dir": str(out), "max_steps": 4, "save_every": 2,
            "eval_every": 100, "warmup_steps": 1, "batch_size": 4, **over}
    return [f"{k}={v}" for k, v in over.items()]


class _Payload:
    def __reduce__(self):  # unpickling this creates the marker file (a real attack would run anything)
        return (open, (os.environ["SPECHEADS_TEST_MARKER"], "w"))


def test_resume_never_unpickles(tmp_path, distilled, monkeypatch, capsys):
    """Pickles planted under every name accelerate would read (the LR scheduler's
    custom_checkpoint_0.pkl, random states, optimizer/model/scheduler .bin) are never opened: the
    resumed run ends where an uninterrupted one does, and no marker appears. A pickle in place of a
    file that is read (optimizer.safetensors) is refused in one line, unexecuted."""
    out = tmp_path / "run"
    train(load_config(RECIPE, _args(distilled, out, interrupt_after=3)))
    ckpt = out / "checkpoints" / "step_2"
    assert sorted(p.name for p in ckpt.iterdir()) == ["optimizer.safetensors", "rng_0.safetensors",
                                                      "train_state.json", "trainable.safetensors"]
    assert json.loads((ckpt / "train_state.json").read_text())["step"] == 2  # the LR schedule is rebuilt from it
    marker = tmp_path / "UNPICKLED"
    monkeypatch.setenv("SPECHEADS_TEST_MARKER", str(marker))
    payload = pickle.dumps({"state": _Payload()})
    for name in ("custom_checkpoint_0.pkl", "random_states_0.pkl", "optimizer.bin", "scheduler.bin", "pytorch_model.bin"):
        (ckpt / name).write_bytes(payload)

    def no_unpickling(*args, **kwargs):
        raise AssertionError("resume called torch.load / pickle")

    monkeypatch.setattr(torch, "load", no_unpickling)
    monkeypatch.setattr(pickle, "load", no_unpickling)
    monkeypatch.setattr(pickle, "loads", no_unpickling)
    assert main(["--config", str(RECIPE), "--resume", *_args(distilled, out)]) == 0
    assert not marker.exists()
    monkeypatch.undo()
    full = tmp_path / "full"
    train(load_config(RECIPE, _args(distilled, full)))
    a, b = load_file(str(out / "model.safetensors")), load_file(str(full / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in b)

    # a pickle where a safetensors file is read: refused, never executed
    bad = tmp_path / "bad"
    train(load_config(RECIPE, _args(distilled, bad, interrupt_after=3)))
    monkeypatch.setenv("SPECHEADS_TEST_MARKER", str(marker))
    (bad / "checkpoints" / "step_2" / "optimizer.safetensors").write_bytes(payload)
    capsys.readouterr()
    assert main(["--config", str(RECIPE), "--resume", *_args(distilled, bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot resume from" in err and "step_2" in err, err
    assert not marker.exists()


def test_old_checkpoints_are_pruned_to_the_newest_k(tmp_path, distilled):
    out = tmp_path / "k2"
    train(load_config(RECIPE, _args(distilled, out, max_steps=6, save_every=1, keep_checkpoints=2)))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_4", "step_5"]
    out = tmp_path / "all"
    train(load_config(RECIPE, _args(distilled, out, max_steps=4, save_every=1, keep_checkpoints=0)))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_1", "step_2", "step_3"]
    assert load_config(RECIPE).keep_checkpoints == 3  # the default


def test_full_disk_during_a_checkpoint_is_one_line(tmp_path, distilled, monkeypatch, capsys):
    """The second checkpoint's write fails as safetensors reports a full disk: one line, exit 1,
    no step_4 and no temporary directory; step_2 is intact and --resume continues from it."""
    from safetensors import SafetensorError

    import train.checkpoints as ck

    real, calls = ck.save_file, []

    def filling_disk(tensors, path, metadata=None):
        calls.append(path)
        if "step_4" in path and path.endswith("optimizer.safetensors"):
            Path(path).write_bytes(b"\0" * 100)  # half-written
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, path, metadata=metadata)

    monkeypatch.setattr(ck, "save_file", filling_disk)
    out = tmp_path / "run"
    capsys.readouterr()
    assert main(["--config", str(RECIPE), *_args(distilled, out, max_steps=6)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "cannot write checkpoint" in err and "no space left on the device" in err and "--resume" in err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2"]
    monkeypatch.undo()
    assert main(["--config", str(RECIPE), "--resume", *_args(distilled, out, max_steps=6)]) == 0
    assert (out / "model.safetensors").is_file()


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_really_full_disk_is_one_line(tmp_path, distilled, capsys):
    """The same on a real full file system (a 64 KiB tmpfs for the checkpoints; needs root)."""
    ckpts = tmp_path / "run" / "checkpoints"
    if not _mount_tmpfs(ckpts, "64k"):
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        capsys.readouterr()
        assert main(["--config", str(RECIPE), *_args(distilled, tmp_path / "run")]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "no space left on the device" in err, err
        assert list(ckpts.iterdir()) == []  # nothing half-written left behind
    finally:
        subprocess.run(["umount", str(ckpts)], check=True)


@pytest.mark.parametrize("head_type, optimizer", [("medusa2", "adamw"), ("medusa", "sgd")])
def test_resume_equals_uninterrupted_for_lora_and_sgd(tmp_path, distilled, head_type, optimizer):
    """Medusa-2's checkpoint holds the verifier's LoRA adapters beside the head; SGD's optimizer
    state is empty: both resume to the uninterrupted run's weights, bit for bit."""
    over = {"head_type": head_type, "optimizer": optimizer, "medusa_num_heads": 2, "lr": 1e-2}
    train(load_config(RECIPE, _args(distilled, tmp_path / "full", **over)))
    train(load_config(RECIPE, _args(distilled, tmp_path / "cut", interrupt_after=3, **over)))
    saved = load_file(str(tmp_path / "cut" / "checkpoints" / "step_2" / "trainable.safetensors"))
    assert any("lora_" in k for k in saved) == (head_type == "medusa2")
    assert main(["--config", str(RECIPE), "--resume", *_args(distilled, tmp_path / "cut", **{k: str(v) for k, v in over.items()})]) == 0
    a, b = load_file(str(tmp_path / "cut" / "model.safetensors")), load_file(str(tmp_path / "full" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in b)
    if head_type == "medusa2":
        ad = load_file(str(tmp_path / "cut" / "adapter" / "adapter_model.safetensors"))
        bd = load_file(str(tmp_path / "full" / "adapter" / "adapter_model.safetensors"))
        assert ad.keys() == bd.keys() and all(torch.equal(ad[k], bd[k]) for k in bd)
