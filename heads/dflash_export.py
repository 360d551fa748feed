"""Export a block drafter in the DFlash layout that vLLM (``method: dflash``) and SGLang
(``--speculative-algorithm DFLASH``) load (rules read from their loaders; ``tests/test_dflash.py``
writes them down):

* ``config.json``: ``architectures: ["DFlashDraftModel"]``, ``model_type: "qwen3"`` with the draft
  layers' sizes (``num_hidden_layers`` = draft layers, ``vocab_size`` = the verifier's), top-level
  ``block_size`` and ``num_target_layers``, and ``dflash_config`` with ``block_size``,
  ``mask_token_id`` and ``target_layer_ids`` in DFlash's convention (layer *output* ids: id ``i``
  is HF ``hidden_states[i + 1]``; both engines capture ``i + 1``, SGLang requires
  ``0 <= i < N``), plus ``eagle_aux_hidden_state_layer_ids`` (the same layers as vLLM's runner
  counts them, HF ``hidden_states`` indices), which vLLM reads first and older vLLM only;
* ``model.safetensors``: unprefixed ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
  ``layers.{i}.self_attn.{q,k}_norm.weight``, ``layers.{i}.mlp.{gate,up,down}_proj.weight``,
  ``layers.{i}.{input,post_attention}_layernorm.weight``, ``fc.weight [h, F h]``,
  ``hidden_norm.weight``, ``norm.weight``; no embedding and no LM head (both engines use the
  target's: the mask slots are the target's embedding of ``mask_token_id``, and drafts are
  taken over the full vocabulary, where specheads restricts them to the draft vocabulary).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from .dflash import draft_layers_config
from .io import CheckpointError, write_directory


def dflash_config_json(head) -> dict:
    """The ``config.json`` of the DFlash export of ``head`` (see the module docstring)."""
    cfg = head.config
    n_target = cfg.verifier.num_layers
    aux = list(cfg.aux_layers)
    if aux[0] < 1 or aux[-1] > n_target - 1:
        raise CheckpointError(f"this head reads verifier hidden states {aux}: the serving engines capture only the "
                              f"outputs of decoder layers 0..{n_target - 2} (hidden_states 1..{n_target - 1}); "
                              "train it with layers inside that range to export it")
    layers = draft_layers_config(cfg.layer_config, cfg.num_layers).to_dict()
    keep = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "rms_norm_eps", "max_position_embeddings", "hidden_act", "attention_bias", "layer_types")
    out = {k: layers[k] for k in keep if k in layers}
    rope = layers.get("rope_parameters") or {}
    out["rope_theta"] = rope.get("rope_theta", layers.get("rope_theta", 10000.0))
    if rope.get("rope_type", "default") != "default":
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    target_ids = [i - 1 for i in aux]
    out.update(
        architectures=["DFlashDraftModel"], model_type="qwen3", vocab_size=cfg.verifier.vocab_size,
        tie_word_embeddings=False, use_sliding_window=False, sliding_window=None,
        block_size=cfg.block_size, num_target_layers=n_target,
        dflash_config={"block_size": cfg.block_size, "mask_token_id": cfg.mask_token_id, "target_layer_ids": target_ids},
        eagle_aux_hidden_state_layer_ids=aux,
        torch_dtype="bfloat16",
    )
    return out


def export_dflash(head, out: str | Path, *, dtype: torch.dtype = torch.bfloat16, overwrite: bool = False) -> Path:
    """Write ``head`` (a DFlash block drafter) in the layout vLLM and SGLang load (into a fresh
    directory: :func:`~heads.io.write_directory`; a non-empty ``out`` needs ``overwrite``)."""
    if head.config.head_type != "dflash":
        raise CheckpointError(f"the dflash format needs a block drafter (dflash head), not {head.config.head_type}")
    config = dflash_config_json(head)
    config["torch_dtype"] = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype]
    state = {k: v.detach().to(dtype).contiguous().cpu() for k, v in head.state_dict().items()
             if k.startswith(("layers.", "fc.", "hidden_norm.", "norm."))}

    def fill(tmp: Path) -> None:
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=1))

    return write_directory(out, fill, overwrite=overwrite)
