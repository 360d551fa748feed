"""Resumable training checkpoints without pickle.

A checkpoint is a directory ``output_dir/checkpoints/step_N``, written as ``.tmp-step_N`` and
renamed when complete (``train_state.json`` is written last, so a directory without it is torn
and skipped). Without DeepSpeed it holds only:

* ``trainable.safetensors``: the head's weights and buffers, and the verifier's trainable
  (LoRA) parameters for Medusa-2;
* ``optimizer.safetensors``: the optimizer's per-parameter tensors (e.g. AdamW's moments and
  step), its param groups and scalar state as JSON in the safetensors header;
* ``rng_<rank>.safetensors``: each process's torch CPU (and CUDA) generator state;
* ``train_state.json``: the step (the LR schedule is rebuilt from it), the loss history.

Reading one back never unpickles anything (safetensors and JSON only). Under DeepSpeed the
engine writes and reads its own files (``pytorch_model/``: torch pickles, read with torch's
restricted unpickler, ``train/accel.py``) in place of the first two.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file

TRAINABLE, OPTIMIZER, STATE = "trainable.safetensors", "optimizer.safetensors", "train_state.json"


class CheckpointWriteError(RuntimeError):
    """Writing a checkpoint or the final head failed (a full disk, a vanished directory): one line."""


def write_errors() -> tuple[type[BaseException], ...]:
    """The exceptions a failed write raises: ``OSError`` (Python files), safetensors' own error
    (its writer reports ENOSPC as ``SafetensorError``), torch.save's ``RuntimeError``."""
    return (OSError, SafetensorError, RuntimeError)


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest complete checkpoint ``step_N`` (it has ``train_state.json``, written last);
    torn ones (killed mid-write) and temporary ``.tmp-*`` directories are skipped."""
    return max(complete_checkpoints(ckpt_dir), key=_step_of, default=None)


def complete_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Every complete ``step_N`` under ``ckpt_dir``, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    done = [p for p in ckpt_dir.glob("step_*") if p.name[5:].isdigit() and (p / STATE).is_file()]
    return sorted(done, key=_step_of)


def _step_of(path: Path) -> int:
    return int(path.name[5:])


def prune_checkpoints(ckpt_dir: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints (``keep`` 0: keep all), and torn
    ``step_N`` directories older than the newest complete one; returns what was deleted."""
    done = complete_checkpoints(ckpt_dir)
    if not done:
        return []
    old = done[:-keep] if keep > 0 else []
    newest = _step_of(done[-1])
    torn = [p for p in ckpt_dir.glob("step_*") if p.name[5:].isdigit() and not (p / STATE).is_file()
            and _step_of(p) < newest]
    for path in old + torn:
        shutil.rmtree(path, ignore_errors=True)
    return old + torn


def trainable_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state entries that training changes: everything under ``head.`` and every
    parameter that requires grad (Medusa-2's LoRA adapters); CPU copies, no shared storage."""
    train_names = {n for n, p in module.named_parameters() if p.requires_grad}
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in module.state_dict().items()
            if k.startswith("head.") or k in train_names}


def optimizer_to_flat(state: dict) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``optimizer.state_dict()`` -> (tensors ``state.<param id>.<key>``, a safetensors metadata
    header with the param groups and the non-tensor state values as JSON)."""
    tensors, scalars = {}, {}
    for pid, values in state["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{pid}.{key}"] = value.detach().to("cpu", copy=True).contiguous()
            else:
                scalars[f"{pid}.{key}"] = value
    meta = {"param_groups": json.dumps(state["param_groups"]), "scalars": json.dumps(scalars)}
    return tensors, meta


def optimizer_from_flat(tensors: dict[str, torch.Tensor], meta: dict[str, str], current: dict) -> dict:
    """The inverse of :func:`optimizer_to_flat`; tuples in ``current``'s groups (AdamW's betas)
    come back as tuples."""
    groups = json.loads(meta["param_groups"])
    for group, now in zip(groups, current["param_groups"]):
        for key, value in now.items():
            if isinstance(value, tuple) and isinstance(group.get(key), list):
                group[key] = tuple(group[key])
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        _, pid, key = name.split(".", 2)
        state.setdefault(int(pid), {})[key] = value
    for name, value in json.loads(meta["scalars"]).items():
        pid, key = name.split(".", 1)
        state.setdefault(int(pid), {})[key] = value
    return {"state": state, "param_groups": groups}


def rng_state() -> dict[str, torch.Tensor]:
    """This process's torch generator states (uint8 tensors)."""
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        out |= {f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())}
    return out


def set_rng_state(states: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(states["cpu"])
    cuda = [states[k] for k in sorted((k for k in states if k.startswith("cuda")), key=lambda k: int(k[4:]))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


def write_rng(directory: Path, rank: int) -> None:
    """This process's generator states into ``directory/rng_<rank>.safetensors``."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file(rng_state(), str(directory / f"rng_{rank}.safetensors"))


def read_rng(directory: Path, rank: int) -> None:
    """Restore what :func:`write_rng` wrote (nothing when the file is absent)."""
    rng = directory / f"rng_{rank}.safetensors"
    if rng.is_file():
        set_rng_state(load_file(str(rng)))


def write_training_state(directory: Path, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         rank: int, main: bool) -> None:
    """Every process writes its generator state; the main process the weights and the optimizer."""
    write_rng(directory, rank)
    if main:
        save_file(trainable_state(module), str(directory / TRAINABLE))
        tensors, meta = optimizer_to_flat(optimizer.state_dict())
        save_file(tensors, str(directory / OPTIMIZER), metadata=meta)


def read_training_state(directory: Path, module: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> None:
    """Load what :func:`write_training_state` wrote into ``module`` and ``optimizer`` (safetensors
    and JSON only). Every trainable entry must be there and nothing else."""
    saved = load_file(str(directory / TRAINABLE))
    expected = trainable_state(module)
    if set(saved) != set(expected):
        missing, extra = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
        raise ValueError(f"{directory / TRAINABLE} does not match this run's head (missing {missing[:3]}, unexpected {extra[:3]})")
    device_state = {k: v.to(module.state_dict()[k].device) for k, v in saved.items()}
    module.load_state_dict(device_state, strict=False)
    with safe_open(str(directory / OPTIMIZER), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    optimizer.load_state_dict(optimizer_from_flat(tensors, meta, optimizer.state_dict()))
    read_rng(directory, rank)
