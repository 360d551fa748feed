"""DeepSpeed, executed: ZeRO-2 and ZeRO-3 through `accelerate launch` with the shipped CPU configs,
2 processes, the tiny recipe. The heads are complete and equal a 1-process run of the same global
batch; a ZeRO-3 run stopped after its checkpoint and resumed ends at the same head; the head drafts
with output identical to the verifier's own. (`make deepspeed-check` also compares resumed with
uninterrupted runs bit for bit, for both stages.) DeepSpeed is in the dev extras: this runs in CI."""

import json
import os
import pickle
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from infer import generate
from infer.core.models import load_verifier
from infer.core.text import encode_prompt
from infer.drafting.head_drafters import load_head_drafter
from train.config import load_config

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "bench"))  # the harness of `make deepspeed-check`, outside the wheel
from deepspeed_check import head_tensors, launch, max_abs_diff, recipe_args  # noqa: E402

RECIPE = ROOT / "configs" / "tiny-cpu.yaml"
STEPS = 8  # a checkpoint at step 4
ATOL = 2e-5  # float32: 2 processes reduce in another order than 1


# accelerate's process-wide state is reset after every test of this file (conftest)
pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The same recipe on one process with the global batch of two (4 x 2): its head and data."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from train.train_heads import train

    out = tmp_path_factory.mktemp("ds") / "one"
    train(load_config(RECIPE, recipe_args(out, STEPS, 8)))
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()
    return head_tensors(out), out / "distilled.jsonl"


def _assert_drafts_losslessly(head_dir: Path) -> None:
    lv = load_verifier("tiny-random:llama")
    drafter = load_head_drafter(str(head_dir), lv.model)
    ids = encode_prompt(lv.tokenizer, "Repeat: one two three one two three")
    spec = generate(lv.model, drafter, ids, max_new_tokens=32)
    assert spec.token_ids == generate(lv.model, None, ids, max_new_tokens=32).token_ids
    assert spec.stats.mean_accepted > 1.0  # it drafts something the verifier accepts


@pytest.mark.slow
def test_zero2_two_processes_equal_one_process(tmp_path, one_process):
    reference, _ = one_process
    out = tmp_path / "z2"
    proc = launch(recipe_args(out, STEPS, 4), stage=2, processes=2)  # distils on the main process only
    assert "2 process(es), DistributedType.DEEPSPEED" in proc.stdout  # one process group, not 2 lone ranks
    rows = [json.loads(line) for line in (out / "distilled.jsonl").read_text().splitlines()]
    assert "specheads_distill" in rows[0]  # the header record, then the records
    ids = [r["id"] for r in rows[1:]]
    assert len(ids) == len(set(ids)) == 96  # distilled once (synthetic:96), by one process
    history = json.loads((out / "train_history.json").read_text())
    assert history[-1]["loss"] < history[0]["loss"]
    assert max_abs_diff(head_tensors(out), reference) <= ATOL  # same tensors, shapes, values
    _assert_drafts_losslessly(out)


class _Payload:
    def __reduce__(self):  # unpickling this creates the marker file (a real attack would run anything)
        return (open, (os.environ["SPECHEADS_TEST_MARKER"], "w"))


@pytest.mark.slow
def test_zero3_resumed_run_equals_one_process(tmp_path, one_process, monkeypatch):
    """ZeRO-3 partitions the head's parameters over the processes: saving must gather them (a
    head saved from shards is empty), and the frozen verifier must not be built as shards."""
    reference, data = one_process
    out = tmp_path / "z3"
    args = recipe_args(out, STEPS, 4, data)
    first = launch([*args, "interrupt_after=6"], stage=3, processes=2)
    assert "interrupted after step 6" in first.stdout and not (out / "model.safetensors").exists()
    ckpt = out / "checkpoints" / "step_4"
    assert (ckpt / "train_state.json").is_file() and not list(ckpt.glob("*.pkl"))  # no accelerate pickles
    assert sorted(p.name for p in ckpt.glob("rng_*")) == ["rng_0.safetensors", "rng_1.safetensors"]
    marker = tmp_path / "UNPICKLED"
    monkeypatch.setenv("SPECHEADS_TEST_MARKER", str(marker))  # inherited by the launched processes
    for name in ("custom_checkpoint_0.pkl", "random_states_0.pkl", "scheduler.bin"):  # what accelerate would unpickle
        (ckpt / name).write_bytes(pickle.dumps(_Payload()))
    resumed = launch([*args, "--resume"], stage=3, processes=2)
    assert not marker.exists()
    assert f"resumed from {ckpt} at step 4" in resumed.stdout
    history = json.loads((out / "train_history.json").read_text())
    assert [h["step"] for h in history] == list(range(1, STEPS + 1))
    assert history[-1]["loss"] < history[0]["loss"]
    head = head_tensors(out)
    assert all(t.numel() > 0 for t in head.values())
    assert max_abs_diff(head, reference) <= ATOL
    _assert_drafts_losslessly(out)


def test_deepspeed_config_auto_values_come_from_the_recipe():
    from train.accel import fill_deepspeed_config

    def filled(ds, **over):
        acc = SimpleNamespace(num_processes=2, state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config=ds)))
        fill_deepspeed_config(acc, **{"batch_size": 4, "grad_accum": 2, "max_grad_norm": 0.5, "hidden_size": 64, **over})
        return ds

    ds = filled(json.loads((ROOT / "configs" / "deepspeed" / "zero3.json").read_text()))
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["gradient_accumulation_steps"] == 2
    assert ds["train_batch_size"] == 16 and ds["gradient_clipping"] == 0.5
    zero = ds["zero_optimization"]
    assert zero["reduce_bucket_size"] == 64 * 64 and zero["stage3_param_persistence_threshold"] == 640
    assert zero["stage3_gather_16bit_weights_on_model_save"] is True  # the final save gathers the shards
    with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu=8 but the recipe's is 4"):
        filled({"train_micro_batch_size_per_gpu": 8})


def test_deepspeed_checkpoints_are_read_with_the_restricted_unpickler(tmp_path, monkeypatch):
    """DeepSpeed itself loads its checkpoint files with weights_only=False (any code runs); the
    trainer's engine loads them with weights_only=True and DeepSpeed's plain data classes only."""
    import torch
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from train.accel import restrict_checkpoint_loading

    marker = tmp_path / "UNPICKLED"
    monkeypatch.setenv("SPECHEADS_TEST_MARKER", str(marker))
    torch.save({"optimizer_state_dict": _Payload()}, tmp_path / "evil.pt")
    TorchCheckpointEngine().load(str(tmp_path / "evil.pt"), map_location="cpu")  # DeepSpeed's own loader...
    assert marker.exists()  # ...ran the payload: the check below can fail
    marker.unlink()
    engine = SimpleNamespace(checkpoint_engine=TorchCheckpointEngine())
    restrict_checkpoint_loading(engine)
    with pytest.raises(pickle.UnpicklingError):
        engine.checkpoint_engine.load(str(tmp_path / "evil.pt"), map_location="cpu")
    assert not marker.exists()
    torch.save({"zero_stage": ZeroStageEnum.gradients, "loss_scaler": LossScaler(1.0), "t": torch.ones(2)}, tmp_path / "ok.pt")
    state = engine.checkpoint_engine.load(str(tmp_path / "ok.pt"), map_location=lambda storage, loc: storage)
    assert state["zero_stage"] == ZeroStageEnum.gradients and state["loss_scaler"].cur_scale == 1.0


def test_shipped_deepspeed_configs():
    """accelerate refuses mixed_precision beside a deepspeed_config_file (the recipe sets it);
    a CPU variant with use_cpu would silently run plain DDP instead of DeepSpeed."""
    for stage in (2, 3):
        for suffix in ("", "-cpu"):
            path = ROOT / "configs" / "accelerate" / f"deepspeed-zero{stage}{suffix}.yaml"
            cfg = yaml.safe_load(path.read_text())
            assert cfg["distributed_type"] == "DEEPSPEED" and "mixed_precision" not in cfg, path.name
            assert not cfg.get("use_cpu", False), path.name
            ds = json.loads((ROOT / cfg["deepspeed_config"]["deepspeed_config_file"]).read_text())
            assert ds["zero_optimization"]["stage"] == stage
            assert f"--config_file configs/accelerate/deepspeed-zero{stage}{suffix}.yaml" in path.read_text()


def test_dev_extras_install_deepspeed():
    """So that the tests above run in CI (pip install -e .[dev]), with the version they ran with."""
    import re

    import deepspeed

    text = (ROOT / "pyproject.toml").read_text()
    dev = re.search(r"^dev = \[(.*)\]$", text, re.M).group(1)
    extra = re.search(r"^deepspeed = \[(.*)\]$", text, re.M).group(1)
    assert '"deepspeed>=0.19.8,<0.20"' in dev and extra == '"deepspeed>=0.19.8,<0.20"'
    assert deepspeed.__version__.startswith("0.19."), deepspeed.__version__


def test_a_run_ends_with_zero3_gathers_drained_and_the_engine_destroyed():
    """A finished or interrupted run waits for ZeRO-3's in-flight parameter gathers and destroys
    the engine before the trackers end, while the interpreter is alive (left to interpreter
    shutdown, gloo's threads can abort the process after a run that finished)."""
    from train.accel import end_run

    calls = []
    engine = SimpleNamespace(empty_partition_cache=lambda: calls.append("drain"))
    acc = SimpleNamespace(deepspeed_engine_wrapped=SimpleNamespace(engine=engine),
                          free_memory=lambda: calls.append("destroy"), end_training=lambda: calls.append("end"))
    end_run(acc)
    assert calls == ["drain", "destroy", "end"]
    calls.clear()
    end_run(SimpleNamespace(free_memory=lambda: calls.append("destroy"), end_training=lambda: calls.append("end")))
    assert calls == ["destroy", "end"]  # no DeepSpeed: nothing to drain
