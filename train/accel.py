"""How the trainer sets up Accelerate, DeepSpeed included, on GPUs and on CPUs.

Three things accelerate does not do for this trainer by itself:

* on a machine without CUDA, ``accelerate launch`` with a DeepSpeed config starts N processes
  but sets up no process group (its backend is chosen from the device, and there is none), so
  each process ran alone: :func:`accelerator_kwargs` asks for ``gloo`` there;
* the training loop feeds no ``DataLoader`` to ``prepare``, so the DeepSpeed config's ``auto``
  values are filled here from the recipe (micro-batch, accumulation, clipping) and from the
  head's width (ZeRO-3 bucket sizes, which accelerate reads from a ``model.config``);
* under ZeRO-3 transformers builds every model it loads as empty parameter shards; the frozen
  verifier must stay whole on each process (:func:`whole_models`).
"""

from __future__ import annotations

import contextlib
import os

import torch


def using_deepspeed() -> bool:
    """``accelerate launch`` was given a DeepSpeed config (it says so in the environment)."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def accelerator_kwargs() -> dict:
    """Extra ``Accelerator`` arguments: the gloo process group for DeepSpeed without CUDA."""
    if using_deepspeed() and not torch.cuda.is_available():
        from accelerate.utils import InitProcessGroupKwargs

        return {"kwargs_handlers": [InitProcessGroupKwargs(backend="gloo")]}
    return {}


def whole_models(accelerator):
    """A context in which transformers builds models whole, not as ZeRO-3 shards (a no-op
    without DeepSpeed): the verifier is frozen, each process needs all of it."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return contextlib.nullcontext()
    return plugin.zero3_init_context_manager(enable=False)


def fill_deepspeed_config(accelerator, *, batch_size: int, grad_accum: int, max_grad_norm: float, hidden_size: int) -> None:
    """Fill the DeepSpeed config's ``auto`` values from the recipe before ``prepare``; a number
    that contradicts the recipe is refused (``ValueError``, one line). ZeRO-3 always gathers
    full weights for the final save."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return
    ds = plugin.deepspeed_config
    for key, want in (("train_micro_batch_size_per_gpu", batch_size), ("gradient_accumulation_steps", grad_accum)):
        have = ds.get(key, "auto")
        if have == "auto":
            ds[key] = want
        elif int(have) != want:
            raise ValueError(f"the DeepSpeed config sets {key}={have} but the recipe's is {want}: "
                             "set it to \"auto\" (the recipe decides) or make them equal")
    if ds.get("train_batch_size", "auto") == "auto":
        ds["train_batch_size"] = batch_size * grad_accum * accelerator.num_processes
    if ds.get("gradient_clipping", "auto") == "auto":
        ds["gradient_clipping"] = float(max_grad_norm)
    zero = ds.setdefault("zero_optimization", {})
    auto_sizes = {
        "reduce_bucket_size": hidden_size * hidden_size,
        "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
        "stage3_param_persistence_threshold": 10 * hidden_size,
    }
    for key, value in auto_sizes.items():
        if zero.get(key) == "auto":
            zero[key] = value
    if int(zero.get("stage", 0)) == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
