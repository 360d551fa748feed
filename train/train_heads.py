"""Train a draft head on the hidden states of a frozen verifier.

    accelerate launch train/train_heads.py --config configs/<recipe>.yaml [key=value ...]
    python train/train_heads.py --check --config configs/<recipe>.yaml [key=value ...]   # validate only

Accelerate handles devices, DDP / DeepSpeed, mixed precision, gradient accumulation, checkpoint
state and trackers. The verifier runs in ``eval()`` under ``no_grad`` (Medusa-2: only its LoRA
adapters train); its parameters are never given to the optimizer. The final head is written
into ``output_dir`` (``config.json``, ``model.safetensors``, ``README.md``), ready for
``specheads generate --draft output_dir``; resumable checkpoints go to ``output_dir/checkpoints``
(each written as ``.tmp-step_N`` and renamed to ``step_N`` when complete; ``--resume`` takes the
newest complete one, so a kill mid-write costs only the steps since the one before; the newest
``keep_checkpoints`` are kept). Nothing in a checkpoint is unpickled (``train/checkpoints.py``),
except DeepSpeed's own files under DeepSpeed (see the README).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pickle  # only for its error type: nothing is unpickled here
import shutil
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script by `accelerate launch train/train_heads.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from safetensors import SafetensorError
from torch import nn

from heads import HeadConfig, VerifierSpec, build_head, default_aux_layers, default_dflash_layers
from heads.config import weights_fingerprint
from heads.io import ADAPTER, adapter_digest, write_atomic
from train.accel import (
    accelerator_kwargs,
    end_run,
    fill_deepspeed_config,
    keep_models_whole,
    restrict_checkpoint_loading,
    using_deepspeed,
)
from train.checkpoints import (
    CheckpointWriteError,
    latest_checkpoint,
    prune_checkpoints,
    read_rng,
    read_training_state,
    write_errors,
    write_rng,
    write_training_state,
)
from train.config import ConfigError, TrainConfig, load_config
from train.data import (
    check_source_weights,
    collate,
    distill,
    length_sorted,
    load_prompts,
    load_records,
    records_by_source,
    response_token_counts,
    source_weighted,
    split_records,
)
from train.features import FeatureCache, Features, compute_features
from train.losses import dflash_loss, eagle1_loss, eagle3_loss, estimated_tau, medusa_loss, seq_mean


class Joint(nn.Module):
    """What the optimizer trains: the head, and for Medusa-2 the verifier with LoRA adapters.
    Its forward computes the loss, so that DDP sees every training forward pass."""

    def __init__(self, cfg: TrainConfig, head: nn.Module, verifier: nn.Module, trains_verifier: bool):
        super().__init__()
        self.cfg = cfg
        self.head = head
        if trains_verifier:
            self.verifier = verifier
        else:  # frozen: kept out of the module tree (no DDP broadcast, no optimizer state)
            self._frozen = [verifier]

    @property
    def frozen_or_adapted_verifier(self) -> nn.Module:
        return self.verifier if hasattr(self, "verifier") else self._frozen[0]

    def forward(self, feats, batch):
        """``feats``: the frozen verifier's features, or None for Medusa-2, whose features come
        from the adapted verifier here, with gradients flowing into its LoRA adapters."""
        verifier = self.frozen_or_adapted_verifier
        if feats is not None:
            return loss_fn(self.cfg, self.head, verifier, feats, batch)
        out = verifier(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True)
        loss, metrics = loss_fn(self.cfg, self.head, verifier, Features(last=out.hidden_states[-1], aux=None), batch)
        kl = medusa2_kl(verifier, batch, out.logits)
        metrics["kl"] = kl.detach()
        return loss + self.cfg.medusa2_kl_weight * kl, metrics


def warm_start_facts(parent: dict, init_from: str | Path, weights_sha256: str = "") -> dict:
    """The ``training`` facts a warm-started head starts with: where it started, the SHA-256 of the
    weights it started from (``init_from_sha256``: names such as ``heads/pretrained/default`` move
    when a head ships, the digest does not) and, under ``ancestors``, where that head started,
    nearest first (from the parent's own facts; a parent's ``ancestors`` written by hand as one
    string is one entry, not a list of its characters)."""
    chain = [parent["init_from"]] if isinstance(parent.get("init_from"), str) else []
    earlier = parent.get("ancestors", [])
    chain += [earlier] if isinstance(earlier, str) else list(earlier)
    return {"init_from": str(init_from), **({"init_from_sha256": weights_sha256} if weights_sha256 else {}),
            **({"ancestors": chain} if chain else {})}


def build_draft_head(cfg: TrainConfig, model, records) -> nn.Module:
    if cfg.head_type == "draft_model":  # a standalone HF causal LM of the verifier's architecture
        from train.draft_model import build_draft_model

        try:
            return build_draft_model(model, cfg.draft_layers, cfg.draft_init_layers, cfg.draft_train_embeddings)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    spec = VerifierSpec.of(model, cfg.verifier)
    kind = "medusa" if cfg.head_type == "medusa2" else cfg.head_type
    if cfg.init_from:  # a warm start: the checkpoint's architecture and draft vocabulary
        from heads import CheckpointError, HeadMismatchError, load_head
        from heads.io import WEIGHTS, file_digest, resolve

        try:
            directory = resolve(cfg.init_from)  # once: a Hub id is looked up a single time
            head = load_head(directory, verifier=model, dtype=torch.float32, device="cpu")
        except (CheckpointError, HeadMismatchError) as e:
            raise ConfigError(f"init_from {cfg.init_from}: {e}") from None
        weights = directory / WEIGHTS  # a layout with its weights under another name: no digest
        digest = file_digest(weights) if weights.is_file() else ""
        if head.config.head_type != kind:
            raise ConfigError(f"init_from {cfg.init_from} is a {head.config.head_type} head, not {kind}")
        # the new head's card describes this run, not the one it starts from (its data, schedule,
        # benchmarks), and keeps the chain of warm starts behind it (nearest first)
        head.config = HeadConfig.from_dict({**head.config.to_dict(), "training": warm_start_facts(head.config.training, cfg.init_from, digest)})
        return head
    kwargs = {}
    if kind == "medusa":
        kwargs = dict(num_heads=cfg.medusa_num_heads, num_layers=cfg.medusa_num_layers, own_lm_head=cfg.medusa_own_lm_head)
    if kind == "eagle3":
        kwargs = dict(draft_vocab_size=min(cfg.draft_vocab_size, spec.vocab_size), aux_layers=default_aux_layers(spec.num_layers))
    if kind == "dflash":
        counts = response_token_counts(records, spec.vocab_size)
        mask_id = cfg.dflash_mask_token_id
        if mask_id < 0:  # the least frequent response token (the highest id among ties)
            mask_id = spec.vocab_size - 1 - int(torch.argmin(counts.flip(0)))
        if mask_id >= spec.vocab_size:
            raise ConfigError(f"dflash_mask_token_id {mask_id} is outside the verifier's vocabulary ({spec.vocab_size})")
        kwargs = dict(num_layers=cfg.dflash_layers, draft_vocab_size=min(cfg.draft_vocab_size, spec.vocab_size),
                      aux_layers=default_dflash_layers(spec.num_layers, cfg.dflash_num_features),
                      block_size=cfg.dflash_block_size, mask_token_id=mask_id)
    # the architecture only: not where or how this machine loaded the verifier (a local path, GGUF)
    layer_config = {k: v for k, v in model.config.to_dict().items() if k not in ("_name_or_path", "quantization_config")}
    hc = HeadConfig(kind, spec, layer_config=layer_config if kind != "medusa" else {}, **kwargs)
    head = build_head(hc)
    if kind in ("eagle3", "dflash"):  # the most frequent response tokens form the draft vocabulary
        counts = response_token_counts(records, spec.vocab_size)
        top = torch.topk(counts.float() + torch.arange(spec.vocab_size).flip(0) * 1e-9, hc.draft_vocab_size).indices
        head.set_vocab(top)
    if kind == "dflash":  # its logits go through the verifier's LM head: start from the scale its final norm gives
        norm = getattr(model.get_decoder(), "norm", None)
        if norm is not None:
            with torch.no_grad():
                head.norm.weight.copy_(norm(torch.ones(1, spec.hidden_size, dtype=head.norm.weight.dtype)).reshape(-1))
    return head


def loss_fn(cfg: TrainConfig, head, verifier, feats, batch):
    if cfg.head_type == "draft_model":
        from train.draft_model import draft_model_loss

        return draft_model_loss(head, verifier, feats, batch, cfg.draft_kl_weight, cfg.draft_ce_weight)
    if cfg.head_type in ("medusa", "medusa2"):
        return medusa_loss(head, verifier, feats, batch.input_ids, batch.loss_mask, cfg.medusa_decay)
    if cfg.head_type == "dflash":
        return dflash_loss(head, verifier, feats, batch, cfg.dflash_anchors, cfg.dflash_decay_gamma)
    if cfg.head_type == "eagle1":
        return eagle1_loss(head, verifier, feats, batch.input_ids, batch.loss_mask, cfg.eagle1_ce_weight)
    return eagle3_loss(head, verifier, feats, batch.input_ids, batch.loss_mask, cfg.ttt_steps, cfg.ttt_decay)


def medusa2_kl(verifier, batch, adapted_logits: torch.Tensor) -> torch.Tensor:
    """KL(adapter-free verifier || adapted verifier) on response tokens: keeps the adapted
    verifier's distribution close to the original (Medusa-2's self-distillation term)."""
    with torch.no_grad(), verifier.disable_adapter():
        base = verifier(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    adapted = adapted_logits.float()
    kl = (torch.softmax(base, -1) * (torch.log_softmax(base, -1) - torch.log_softmax(adapted, -1))).sum(-1)
    return seq_mean(kl, batch.loss_mask.bool())


def batch_indices(order_for_epoch, n_train: int, micro: int, global_batch: int, rank: int, per_rank: int) -> list[int]:
    """Record indices of this process's share of global micro-batch number ``micro``."""
    per_epoch = max(1, n_train // global_batch)
    epoch, k = divmod(micro, per_epoch)
    order = order_for_epoch(epoch)
    glob = order[k * global_batch : (k + 1) * global_batch]
    return glob[rank * per_rank : (rank + 1) * per_rank]


def length_sorted_windows(order: list[int], records, window: int) -> list[int]:
    """``order`` with each run of ``window`` consecutive records sorted by length (0: unchanged),
    so that a batch holds records of similar length and little padding is computed. The windows
    do not depend on the batch size, so accumulation and process count still see the same records."""
    return [order[j] for j in length_sorted([len(records[i].input_ids) for i in order], window)]


def peak_memory_mb() -> int:
    """This process's peak resident memory (MB; Linux and macOS report it in different units)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024)


def _write_json(path: Path, obj) -> None:
    write_atomic(path, lambda p: p.write_text(json.dumps(obj)))


def lr_factor(cfg: TrainConfig, step: int) -> float:
    """The learning-rate multiplier after ``step`` optimizer steps: linear warm-up, then cosine to 10%."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def lr_scheduler(optimizer, cfg: TrainConfig, step: int = 0):
    """The run's ``LambdaLR``, positioned after ``step`` optimizer steps: on resume it is rebuilt
    from the step in ``train_state.json`` (never unpickled), with the learning rates an
    uninterrupted run has at that step."""
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(cfg, s))
    if step:
        scheduler.last_epoch = step
        lrs = [base * lr_factor(cfg, step) for base in scheduler.base_lrs]
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
        scheduler._last_lr = lrs
    return scheduler


DEEPSPEED_TAG = "pytorch_model"  # the engine's checkpoint subdirectory (the name accelerate's save_state gave it)


def save_checkpoint(accelerator, joint, optimizer, ckpt_dir: Path, step: int, history: list, keep: int = 0) -> Path:
    """Every process writes its part into ``.tmp-step_N`` (without DeepSpeed: safetensors only,
    ``train/checkpoints.py``; under DeepSpeed: the engine's own files), then the main process
    writes ``train_state.json`` (the step, from which the LR schedule is rebuilt, and the history
    so far) and renames it to ``step_N``: a ``step_N`` directory is always complete. Then all but
    the newest ``keep`` checkpoints are deleted (0: none). A failed write (a full disk) removes
    the temporary directory and raises :class:`CheckpointWriteError` (one line); the checkpoints
    written before are untouched."""
    tmp, final = ckpt_dir / f".tmp-step_{step}", ckpt_dir / f"step_{step}"
    try:
        if using_deepspeed():  # the engine's files (every process writes its ZeRO shard), not accelerate's pickles
            joint.save_checkpoint(str(tmp), tag=DEEPSPEED_TAG)
            write_rng(tmp, accelerator.process_index)
        else:
            write_training_state(tmp, accelerator.unwrap_model(joint), optimizer, accelerator.process_index,
                                 accelerator.is_main_process)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            _write_json(tmp / "train_state.json", {"step": step, "history": history})
            if final.exists():  # a torn one from an earlier run
                shutil.rmtree(final)
            tmp.rename(final)
    except write_errors() as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(f"cannot write checkpoint {final}: {_reason(e)}; free space there and continue "
                                   f"with --resume (from the last complete checkpoint)") from None
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        prune_checkpoints(ckpt_dir, keep)
    return final


def _reason(e: BaseException) -> str:
    """The first line of a write error; safetensors reports ENOSPC inside a Rust debug string."""
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    if "StorageFull" in text or "No space left" in text or getattr(e, "errno", None) == 28:
        return "no space left on the device"
    return text


def load_checkpoint(accelerator, joint, optimizer, saved: Path) -> dict:
    """Restore a checkpoint written by :func:`save_checkpoint`; returns its ``train_state.json``."""
    if using_deepspeed():  # the engine's own files, through torch's restricted unpickler (restrict_checkpoint_loading)
        path, _ = joint.load_checkpoint(str(saved), tag=DEEPSPEED_TAG)
        if path is None:
            raise ValueError(f"it holds no complete DeepSpeed checkpoint {saved / DEEPSPEED_TAG}")
        read_rng(saved, accelerator.process_index)
    else:
        read_training_state(saved, accelerator.unwrap_model(joint), optimizer, accelerator.process_index)
    return json.loads((saved / "train_state.json").read_text())


def train(cfg: TrainConfig) -> dict:
    """Train (see :func:`_train`) holding ``output_dir``'s exclusive lock (main process): a second
    run into the same directory is refused at once."""
    cfg.check_paths()
    held: list = []  # the lock, taken by _train's main process once accelerate knows which that is
    try:
        return _train(cfg, held)
    finally:
        for lock in held:
            lock.release()


def slow_autocast_warning(device: torch.device, mixed_precision: str) -> str | None:
    """A one-line warning when bf16 autocast is asked for on a CPU without native bfloat16 dot
    products: torch then runs the head's bf16 matrix products in a slow fallback (one thread;
    BENCHMARKS.md, "Data": a training step of the default head ~29x slower than float32 on a
    2-core AVX2 CPU)."""
    from infer.drafting.head_drafters import cpu_has_fast_bf16

    if device.type != "cpu" or mixed_precision != "bf16" or cpu_has_fast_bf16():
        return None
    return ("train_heads: warning: mixed_precision=bf16 on a CPU without native bfloat16 dot products "
            "(no AVX512-BF16 or AMX): its matrix products run in a slow fallback; mixed_precision=no trains faster here")


def _train(cfg: TrainConfig, held: list) -> dict:
    """One training run (see :func:`train`), in its steps: the inputs checked, the verifier loaded,
    the data distilled (``prompts:``) and read, the head, optimizer and resumed state built, then
    an evaluation alone (``eval_only``) or the training loop and the trained head written."""
    from infer.core.models import load_verifier

    t_start = time.time()
    accelerator = _accelerator(cfg)
    prompts = _checked_inputs(cfg, accelerator, held)
    keep_models_whole(accelerator)  # under ZeRO-3 too: the frozen verifier is not sharded
    lv = load_verifier(cfg.verifier, device=accelerator.device)
    model = lv.model.eval()
    model.requires_grad_(False)
    records, train_idx, eval_idx = _records(cfg, accelerator, lv, prompts)
    run = _Run(cfg, accelerator, model, records, train_idx, eval_idx)
    if cfg.eval_only:
        return run.eval_only()
    if run.loop():
        return {"step": run.step, "interrupted": True, "history": run.history, "head": run.head, "verifier": run.verifier}
    return run.finish(lv.tokenizer, t_start)


def _accelerator(cfg: TrainConfig):
    """The run's Accelerator (seeded; a warning where autocast is slow on this device)."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    accelerator = Accelerator(
        gradient_accumulation_steps=cfg.grad_accum,
        mixed_precision=cfg.mixed_precision,
        log_with=cfg.log_with or None,
        project_dir=str(Path(cfg.output_dir)),
        step_scheduler_with_optimizer=False,
        **accelerator_kwargs(),
    )
    set_seed(cfg.seed)
    accelerator.print(f"{accelerator.num_processes} process(es), {accelerator.distributed_type}, device {accelerator.device}")
    warning = slow_autocast_warning(accelerator.device, cfg.mixed_precision)
    if warning and accelerator.is_main_process:
        print(warning, file=sys.stderr)
    return accelerator


def _checked_inputs(cfg: TrainConfig, accelerator, held: list):
    """On the main process, before the verifier loads: the output directory locked (``held``), and
    the prompts (returned) or the data checked; a ConfigError otherwise."""
    from train.datafile import DataError, check_data_source, headerless_message, lock_dir, scan_output

    prompts = None
    if not accelerator.is_main_process:
        return prompts
    data_path = cfg.distilled_path
    try:
        held.append(lock_dir(Path(cfg.output_dir)))  # one run per output_dir: a second stops here
        if cfg.prompts:
            prompts = load_prompts(cfg.prompts, cfg.max_prompts, cfg.seed, shuffle=cfg.shuffle_prompts)
            scan = scan_output(data_path, repair=False)  # a damaged file, or one without a header: refused now
            if scan.header is None and scan.records:
                raise DataError(headerless_message(data_path))
        else:
            check_data_source(data_path)  # parts of one verifier; a warning line for each without a header
    except DataError as e:
        raise ConfigError(str(e)) from None
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"cannot read prompts {cfg.prompts}: {e}") from None
    return prompts


def _records(cfg: TrainConfig, accelerator, lv, prompts) -> tuple[list, list[int], list[int]]:
    """The training records (distilled first where ``prompts`` are given, on the main process),
    checked against this verifier, and their train / eval split."""
    from train.datafile import DataError, check_data_source

    data_path = cfg.distilled_path
    if accelerator.is_main_process:
        try:
            if prompts is not None:  # appends to data_path: refused if another verifier or other settings made it
                distill(lv.model, lv.tokenizer, prompts, data_path, max_new_tokens=cfg.distill_max_new_tokens,
                        batch_size=cfg.distill_batch_size, temperature=cfg.distill_temperature, seed=cfg.seed,
                        verifier_name=cfg.verifier)
            check_data_source(data_path, dataclasses.asdict(VerifierSpec.of(lv.model, cfg.verifier)), warn=lambda m: None)
        except DataError as e:
            raise ConfigError(str(e)) from None
    accelerator.wait_for_everyone()
    try:
        records = load_records(data_path, cfg.max_seq_len)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read data {data_path}: {e}") from None
    if len(records) < 2:
        raise ConfigError(f"{data_path} holds fewer than 2 usable records")
    train_idx, eval_idx = split_records(records, cfg.eval_fraction, cfg.seed)
    try:
        check_source_weights(cfg.source_weights, {records[i].source for i in train_idx})
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return records, train_idx, eval_idx


class _Run:
    """A training run's state once its data is read: the head and (for Medusa-2) the adapted
    verifier, prepared with their optimizer by the Accelerator, resumed from the last checkpoint
    (``resume``), and what the loop needs: the epochs' orders, features and evaluation."""

    def __init__(self, cfg: TrainConfig, accelerator, model, records, train_idx: list[int], eval_idx: list[int]):
        self.cfg, self.accelerator, self.model, self.records, self.train_idx = cfg, accelerator, model, records, train_idx
        self.out = Path(cfg.output_dir)
        self._build()
        self._resume()
        if cfg.log_with:
            accelerator.init_trackers("specheads", config={k: v for k, v in vars(cfg).items() if isinstance(v, (int, float, str, bool))})
        self.cache = None
        if cfg.cache_features:
            source = f"verifier {weights_fingerprint(model)} {model.dtype} layers {list(self.aux_layers)}"
            self.cache = FeatureCache(cfg.cache_dir or self.out / "features", [r.key() for r in records], source)
        self.per_rank = cfg.batch_size
        self.global_batch = self.per_rank * accelerator.num_processes
        self.orders: dict[int, list[int]] = {}
        self.n_epoch = len(self.order_for_epoch(0))  # the same every epoch (source_weighted)
        if self.n_epoch < self.global_batch and not cfg.eval_only:  # eval_only trains nothing: any split will do
            raise ConfigError(f"{self.n_epoch} training records{' (weighed by source_weights)' if cfg.source_weights else ''} "
                              f"are fewer than one global batch ({self.global_batch})")
        self.eval_order = length_sorted_windows(eval_idx[: cfg.eval_batches * self.per_rank], records, cfg.length_window)
        self.last_eval: dict = {}

    def _build(self) -> None:
        """The head, the verifier it trains with, the optimizer, the schedule, all prepared."""
        cfg, model, accelerator = self.cfg, self.model, self.accelerator
        torch.manual_seed(cfg.seed)
        head = build_draft_head(cfg, model, [self.records[i] for i in self.train_idx])
        self.is_draft_model = cfg.head_type == "draft_model"
        self.aux_layers = head.config.aux_layers if not self.is_draft_model and head.config.head_type in ("eagle3", "dflash") else ()
        verifier = model
        if cfg.head_type == "medusa2":
            from peft import LoraConfig, get_peft_model

            verifier = get_peft_model(model, LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                                                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
        joint = Joint(cfg, head, verifier, trains_verifier=cfg.head_type == "medusa2")
        self.params = [p for p in joint.parameters() if p.requires_grad]
        if cfg.optimizer == "sgd":
            optimizer = torch.optim.SGD(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        else:
            optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        try:
            fill_deepspeed_config(accelerator, batch_size=cfg.batch_size, grad_accum=cfg.grad_accum,
                                  max_grad_norm=cfg.max_grad_norm, hidden_size=model.config.hidden_size)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.scheduler = lr_scheduler(optimizer, cfg)
        self.joint, self.optimizer = accelerator.prepare(joint, optimizer)
        if using_deepspeed():
            restrict_checkpoint_loading(self.joint)  # --resume reads DeepSpeed's pickles with torch's restricted unpickler
        self.unwrapped = accelerator.unwrap_model(self.joint)
        self.head = self.unwrapped.head
        self.verifier = self.unwrapped.frozen_or_adapted_verifier

    def _resume(self) -> None:
        """Step and history from the last complete checkpoint (with ``resume``); stale partial ones removed."""
        accelerator = self.accelerator
        self.ckpt_dir = self.out / "checkpoints"
        self.step, self.history = 0, []
        if self.ckpt_dir.is_dir() and accelerator.is_main_process:
            for stale in self.ckpt_dir.glob(".tmp-step_*"):  # killed mid-write
                shutil.rmtree(stale)
        accelerator.wait_for_everyone()
        saved = latest_checkpoint(self.ckpt_dir) if self.cfg.resume and self.ckpt_dir.is_dir() else None
        if saved is None:
            return
        try:
            state = load_checkpoint(accelerator, self.joint, self.optimizer, saved)
        except (OSError, ValueError, SafetensorError, pickle.UnpicklingError) as e:
            raise ConfigError(f"cannot resume from {saved}: {str(e).splitlines()[0]}") from None
        self.step, self.history = state["step"], state.get("history", [])
        self.scheduler = lr_scheduler(self.optimizer, self.cfg, self.step)
        accelerator.print(f"resumed from {saved} at step {self.step}")

    def order_for_epoch(self, epoch: int) -> list[int]:
        if epoch not in self.orders:
            cfg = self.cfg
            gen = torch.Generator().manual_seed(cfg.seed * 1000 + epoch)
            pool = source_weighted(self.train_idx, self.records, cfg.source_weights, gen)
            perm = torch.randperm(len(pool), generator=gen)
            self.orders[epoch] = length_sorted_windows([pool[i] for i in perm.tolist()], self.records, cfg.length_window)
        return self.orders[epoch]

    def features_for(self, batch):
        if self.cfg.head_type == "medusa2":
            return None  # computed inside the forward, through the adapters
        if self.cache is not None:
            return self.cache.get(self.model, batch, self.aux_layers)
        return compute_features(self.model, batch, self.aux_layers)

    def evaluate(self, order: list[int] | None = None) -> dict:
        order = self.eval_order if order is None else order
        if not order:
            return {}
        self.head.eval()
        sums: dict[str, float] = {}
        n = 0
        with torch.no_grad():
            for k in range(0, len(order), self.per_rank):
                batch = collate(self.records, order[k : k + self.per_rank]).to(self.accelerator.device)
                loss, metrics = self.unwrapped(self.features_for(batch), batch)
                for key, v in {"loss": loss, **metrics}.items():
                    sums[key] = sums.get(key, 0.0) + float(v)
                n += 1
        self.head.train()
        res = {f"eval_{k}": v / n for k, v in sums.items()}
        res["eval_tau"] = estimated_tau({k[5:]: v for k, v in res.items() if k.startswith("eval_acc_")})
        return res

    def eval_only(self) -> dict:
        """Measure a head (``init_from``) on this data's held-out split, per prompt source too; train nothing."""
        cfg, records = self.cfg, self.records
        result = self.evaluate()
        by_source = {}
        groups = records_by_source(self.eval_order, records)
        if len(groups) > 1:  # a head that gains on one kind of prompt can lose on another
            for source, idx in groups.items():
                res = self.evaluate(length_sorted_windows(idx, records, cfg.length_window))
                by_source[source] = {"records": len(idx), **{k[5:]: round(v, 4) for k, v in res.items()}}
        self.accelerator.print(json.dumps({"eval_only": True, "head": cfg.init_from, "eval_records": len(self.eval_order),
                                           **{k: round(v, 4) for k, v in result.items()}, "by_source": by_source}))
        end_run(self.accelerator)
        return {"step": self.step, "interrupted": False, "history": [], "eval": result, "eval_by_source": by_source,
                "head": self.head, "verifier": self.verifier}

    def train_step(self) -> dict:
        """One optimizer step over ``grad_accum`` micro-batches; its logged values."""
        cfg, accelerator = self.cfg, self.accelerator
        logs: dict[str, float] = {}
        for micro in range(cfg.grad_accum):
            idx = batch_indices(self.order_for_epoch, self.n_epoch, self.step * cfg.grad_accum + micro, self.global_batch,
                                accelerator.process_index, self.per_rank)
            batch = collate(self.records, idx).to(accelerator.device)
            feats = self.features_for(batch)
            with accelerator.accumulate(self.joint):
                with accelerator.autocast():
                    loss, metrics = self.joint(feats, batch)
                accelerator.backward(loss)
                if accelerator.sync_gradients and cfg.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(self.params, cfg.max_grad_norm)
                self.optimizer.step()
                self.optimizer.zero_grad()
            logs["loss"] = logs.get("loss", 0.0) + float(loss.detach()) / cfg.grad_accum
            for k, v in metrics.items():
                logs[k] = logs.get(k, 0.0) + float(v) / cfg.grad_accum
        self.scheduler.step()
        self.step += 1
        return logs

    def loop(self) -> bool:
        """Train to ``max_steps``: evaluate, log and save checkpoints on schedule; True when
        ``interrupt_after`` stopped it (for tests of resuming)."""
        cfg, accelerator = self.cfg, self.accelerator
        self.head.train()
        while self.step < cfg.max_steps:
            t0 = time.time()
            logs = self.train_step()
            step = self.step
            logs.update(lr=self.scheduler.get_last_lr()[0], step_s=time.time() - t0)
            evaluated = step % cfg.eval_every == 0 or step == cfg.max_steps
            if evaluated:
                self.last_eval = self.evaluate()
                logs.update(self.last_eval)
            self.history.append({"step": step, **logs})
            if cfg.log_with:
                accelerator.log(logs, step=step)
            if accelerator.is_main_process and (step % 10 == 0 or step == 1 or evaluated):
                accelerator.print(json.dumps({"step": step, **{k: round(v, 4) for k, v in logs.items()}}))
            if step % cfg.save_every == 0 and step < cfg.max_steps:
                save_checkpoint(accelerator, self.joint, self.optimizer, self.ckpt_dir, step, self.history, cfg.keep_checkpoints)
            if cfg.interrupt_after and step >= cfg.interrupt_after:
                accelerator.print(f"interrupted after step {step} (interrupt_after)")
                end_run(accelerator)
                return True
        return False

    def finish(self, tokenizer, t_start: float) -> dict:
        """Write the trained head (or draft model) and the history into ``output_dir``."""
        accelerator = self.accelerator
        accelerator.wait_for_everyone()
        state = accelerator.get_state_dict(self.joint)  # collective: gathers ZeRO-3 partitions (None on other ranks)
        if accelerator.is_main_process:
            weights = {k[len("head."):]: v for k, v in state.items() if k.startswith("head.")}
            if self.is_draft_model:  # a plain HF model directory, loadable without specheads
                self._write_draft_model(weights, tokenizer, t_start)
            else:
                self._write_head(weights, t_start)
        end_run(accelerator)
        return {"step": self.step, "interrupted": False, "history": self.history, "eval": self.last_eval,
                "head": self.head, "verifier": self.verifier}

    def _write_draft_model(self, weights: dict, tokenizer, t_start: float) -> None:
        from train.draft_model import save_draft_model

        cfg, out = self.cfg, self.out
        try:
            self.head.load_state_dict(weights)
            save_draft_model(self.head, tokenizer, out, {"verifier": cfg.verifier, "data": str(cfg.prompts or cfg.distilled_path),
                                                         "records": len(self.records), "steps": self.step,
                                                         "tau": round(self.last_eval.get("eval_tau", 0.0), 3),
                                                         "wall_time_s": round(time.time() - t_start)})
            _write_json(out / "train_history.json", self.history)
        except write_errors() as e:
            raise CheckpointWriteError(f"cannot write the trained draft model into {out}: {_reason(e)}; free space there "
                                       "and continue with --resume (from the last complete checkpoint)") from None

    def _write_head(self, weights: dict, t_start: float) -> None:
        cfg, out, records, last_eval = self.cfg, self.out, self.records, self.last_eval
        final = build_head(self.head.config)  # a plain CPU copy of the trained weights
        final.load_state_dict(weights)
        self.head = final
        facts = {
            "data": str(cfg.prompts or cfg.distilled_path), "records": len(records), "steps": self.step,
            "tokens": int(sum(sum(r.loss_mask) for r in records)), "wall_time_s": round(time.time() - t_start),
            "peak_memory_mb": peak_memory_mb(),
            "acceptance": {k[9:]: round(v, 4) for k, v in last_eval.items() if k.startswith("eval_acc_")},
            "tau": round(last_eval.get("eval_tau", 0.0), 3),
            **({"source_weights": dict(sorted(cfg.source_weights.items()))} if cfg.source_weights else {}), **cfg.extra,
        }
        try:
            if cfg.head_type == "medusa2":  # the adapter first; the head's config then declares it (heads.io.verifier_adapter)
                self.verifier.save_pretrained(str(out / ADAPTER))
                final.config = dataclasses.replace(final.config, adapter_sha256=adapter_digest(out))
            final.save_pretrained(out, **facts)
            _write_json(out / "train_history.json", self.history)
        except write_errors() as e:
            raise CheckpointWriteError(f"cannot write the trained head into {out}: {_reason(e)}; free space there "
                                       "and continue with --resume (from the last complete checkpoint)") from None


def _leave_process_group() -> None:
    """After a distributed run: every process waits for the others, then the default process group
    is destroyed. A process that exits with it alive tears down its communication threads during
    interpreter shutdown and can abort there ("terminate called without an active exception",
    exit -6: seen once with DeepSpeed ZeRO-3 on two CPU processes), failing a run that finished."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="train_heads.py", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="YAML recipe (configs/*.yaml)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint (= resume=true)")
    parser.add_argument("--check", action="store_true", help="only validate the config and its paths (exit 0, or 2 with the error)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the recipe")
    args = parser.parse_args(argv)
    if os.environ.get("SPECHEADS_DIE_WITH_PARENT"):  # run by `specheads train`: end with it
        from infer.tools.procs import die_with_parent

        die_with_parent()
    from infer.core.errors import UserError
    from train.datafile import DataError, probe_dir_lock

    try:
        cfg = load_config(args.config, [*args.overrides, *(["resume=true"] if args.resume else [])])
        if args.check:
            cfg.check_paths()
            probe_dir_lock(cfg.output_dir)  # another run into output_dir: refused before launching
            print(f"train_heads: config ok ({cfg.head_type} for {cfg.verifier}, output_dir {cfg.output_dir})")
            return 0
        train(cfg)
        _leave_process_group()
    except (ConfigError, UserError, DataError) as e:
        print(f"train_heads: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("train_heads: interrupted: --resume continues from the last checkpoint", file=sys.stderr)
        return 130
    except CheckpointWriteError as e:
        print(f"train_heads: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
