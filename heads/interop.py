"""Interoperability: export heads in the layouts vLLM and SGLang load, import published ones.

Export formats (rules read from the engines' loaders; ``tests/test_interop.py`` writes them down):

* ``eagle3`` - one directory for vLLM (``method: eagle3``) and SGLang (``EAGLE3``):
  ``architectures: ["LlamaForCausalLMEagle3"]``, ``model_type: "llama"``, one layer, unprefixed
  weights ``fc.weight [h, 3h]``, ``midlayer.*`` (q/k/v read 2h), ``norm.weight``,
  ``lm_head.weight [draft_vocab, h]``, ``d2t`` (int64, ``target = draft + d2t[draft]``) and ``t2d``
  (bool); no embedding (both engines share the target's). A head over the full vocabulary has
  neither ``d2t`` nor ``t2d`` (vLLM then creates no mapping and refuses the extra tensor). The
  three fused layers must be distinct inputs of decoder layers (0..N-1; both engines capture
  each id once): heads for verifiers of fewer than 3 layers are not exported. They are written twice:
  top-level ``eagle_aux_hidden_state_layer_ids`` in vLLM's convention (id ``i`` = the *input* of
  decoder layer ``i``, HF ``hidden_states[i]``), and ``eagle_config.eagle_aux_hidden_state_layer_ids``
  for SGLang, which reads that list only and captures ``id + 1`` (so it holds ``i - 1``).
* ``medusa`` - vLLM's Medusa (vLLM <= 0.32; 0.33 removed it): ``model_type: "medusa"``,
  ``architectures: ["MedusaModel"]``, ``blocks.{h}.layers.{l}.weight/bias``, ``lm_heads.{h}.weight``
  (or, with ``original_lm_head``, the verifier's LM head once as ``lm_heads.0.weight``).

Imports: our export layouts, EAGLE-3 checkpoints in the published layout (yuhuili/EAGLE3-*,
SpecForge) and in the ``speculators`` layout (``layers.0.*``, a nested ``transformer_layer_config``),
EAGLE-1 checkpoints (``fc.*``, ``layers.0.*``) and FasterDecoding Medusa heads
(``{head}.{layer}.linear.*``, ``{head}.{n}.weight``). Only safetensors files are read.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from .config import HeadConfig, VerifierSpec, default_aux_layers
from .io import CheckpointError, load_state_strict, read_safetensors, write_atomic
from .modules import DraftHead, Eagle3Head, MedusaHeads, build_head

log = logging.getLogger(__name__)

#: verifier families whose EAGLE-3 aux-hidden-state capture both engines implement
EAGLE3_TARGETS = ("llama", "qwen2", "qwen3", "mistral")
BIN_MESSAGE = (
    "{path} holds only pickle weights ({name}); specheads loads safetensors only. Convert it once, in an "
    "environment you trust: python -c \"import torch; from safetensors.torch import save_file; "
    "save_file(torch.load('{name}', weights_only=True), 'model.safetensors')\""
)


# --------------------------------------------------------------------------------------------
# export
# --------------------------------------------------------------------------------------------


def _rope_fields(layer_config: dict) -> dict:
    rope = layer_config.get("rope_parameters") or {}
    if isinstance(rope, dict) and "full_attention" in rope:
        rope = rope["full_attention"]
    theta = rope.get("rope_theta", layer_config.get("rope_theta", 10000.0))
    out = {"rope_theta": theta}
    if rope.get("rope_type", "default") != "default":
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return out


def export_eagle3(head: Eagle3Head, out: str | Path, *, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``head`` in the EAGLE-3 layout that vLLM and SGLang load."""
    cfg = head.config
    if cfg.head_type != "eagle3":
        raise CheckpointError(f"the eagle3 format needs an EAGLE-3 head, not {cfg.head_type}")
    if cfg.verifier.model_type not in EAGLE3_TARGETS:
        raise CheckpointError(
            f"vLLM and SGLang run EAGLE-3 only on {', '.join(EAGLE3_TARGETS)} verifiers, not {cfg.verifier.model_type}; "
            "use this head with specheads itself"
        )
    n_layers = cfg.verifier.num_layers
    aux = sorted(cfg.aux_layers)
    if n_layers < 3:
        raise CheckpointError(
            f"vLLM and SGLang fuse the inputs of three distinct decoder layers: the verifier needs at least 3 layers, "
            f"not {n_layers}; use this head with specheads itself"
        )
    if len(set(aux)) != 3 or aux[0] < 0 or aux[-1] >= n_layers:
        raise CheckpointError(
            f"this head fuses verifier layers {aux}, but vLLM and SGLang capture three distinct inputs of decoder "
            f"layers 0..{n_layers - 1}: retrain it with the default aux_layers, or use it with specheads itself"
        )
    lc = cfg.layer_config
    h = cfg.verifier.hidden_size
    n_heads = lc["num_attention_heads"]
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": h,
        "intermediate_size": lc["intermediate_size"],
        "num_attention_heads": n_heads,
        "num_key_value_heads": lc.get("num_key_value_heads") or n_heads,
        "head_dim": lc.get("head_dim") or h // n_heads,
        "hidden_act": "silu",
        "rms_norm_eps": lc.get("rms_norm_eps", 1e-6),
        "vocab_size": cfg.verifier.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "max_position_embeddings": lc.get("max_position_embeddings", 8192),
        **_rope_fields(lc),
        "tie_word_embeddings": False,
        "attention_bias": False,
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": aux,
        "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux]},
        "torch_dtype": str(dtype).removeprefix("torch."),
        "specheads": {"verifier": cfg.verifier.name, "fingerprint": cfg.verifier.fingerprint},
    }
    state = {k: v.to(dtype) for k, v in head.state_dict().items() if k not in ("d2t", "t2d")}
    if cfg.draft_vocab_size < cfg.verifier.vocab_size:
        state["d2t"], state["t2d"] = head.d2t.to(torch.int64), head.t2d.to(torch.bool)
    else:  # full vocabulary: no mapping, so lm_head's rows go in target order (a no-op after set_vocab)
        targets = head.target_ids(torch.arange(cfg.draft_vocab_size, device=head.d2t.device))
        state["lm_head.weight"] = state["lm_head.weight"][torch.argsort(targets).to(state["lm_head.weight"].device)]
    return _write_export(out, config, state)


def export_medusa(head: MedusaHeads, out: str | Path, verifier=None, *, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``head`` in vLLM's Medusa layout. Heads that share the verifier's LM head need the
    ``verifier`` (its LM head is written once, with ``original_lm_head: true``)."""
    cfg = head.config
    if cfg.head_type != "medusa":
        raise CheckpointError(f"the medusa format needs Medusa heads, not {cfg.head_type}")
    log.warning("vLLM serves Medusa heads up to version 0.32 (0.33 removed its Medusa model): serve this export with vllm<=0.32")
    state = {}
    for hi, blocks in enumerate(head.blocks):
        for li, block in enumerate(blocks):
            state[f"blocks.{hi}.layers.{li}.weight"] = block.linear.weight.detach().to(dtype)
            state[f"blocks.{hi}.layers.{li}.bias"] = block.linear.bias.detach().to(dtype)
    original = head.lm_heads is None
    if original:
        if verifier is None:
            raise CheckpointError("these Medusa heads share the verifier's LM head: pass the verifier to export it")
        state["lm_heads.0.weight"] = verifier.get_output_embeddings().weight.detach().to(dtype)
    else:
        for hi, lm in enumerate(head.lm_heads):
            state[f"lm_heads.{hi}.weight"] = lm.weight.detach().to(dtype)
    config = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "num_heads": cfg.num_heads,
        "num_hidden_layers": cfg.num_layers,
        "hidden_size": cfg.verifier.hidden_size,
        "vocab_size": cfg.verifier.vocab_size,
        "truncated_vocab_size": cfg.verifier.vocab_size,
        "medusa_fc_bias": True,
        "original_lm_head": original,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "specheads": {"verifier": cfg.verifier.name, "fingerprint": cfg.verifier.fingerprint},
    }
    return _write_export(out, config, state)


def _write_export(out: str | Path, config: dict, state: dict) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    write_atomic(out / "model.safetensors", lambda p: save_file(state, p, metadata={"format": "pt"}))
    write_atomic(out / "config.json", lambda p: p.write_text(json.dumps(config, indent=1)))
    return out


# --------------------------------------------------------------------------------------------
# import
# --------------------------------------------------------------------------------------------


def _weights(directory: Path, names=("model.safetensors", "medusa_lm_head.safetensors")) -> dict:
    for name in names:
        if (directory / name).is_file():
            return read_safetensors(directory / name)
    shards = sorted(directory.glob("model-*.safetensors"))
    if shards:
        out = {}
        for s in shards:
            out.update(read_safetensors(s))
        return out
    for name in ("pytorch_model.bin", "medusa_lm_head.pt", "model.pt"):
        if (directory / name).is_file():
            raise CheckpointError(BIN_MESSAGE.format(path=directory, name=name))
    raise CheckpointError(f"{directory} has no safetensors weights")


def detect_format(config: dict, keys: set[str], state: dict | None = None) -> str:
    """``specheads``, ``eagle3``, ``eagle1``, ``medusa-vllm`` or ``medusa-fd`` (FasterDecoding).
    EAGLE-3 in the ``speculators`` layout names its layer ``layers.0.`` like EAGLE-1: it is told
    apart by ``hidden_norm``, ``d2t`` or an ``fc`` that reads 3x its output (``state``'s shapes)."""
    if config.get("format") == "specheads":
        return "specheads"
    if config.get("model_type") == "medusa" or any(k.startswith("blocks.") for k in keys):
        return "medusa-vllm"
    if any(re.fullmatch(r"\d+\.\d+\.linear\.weight", k) for k in keys):
        return "medusa-fd"
    stripped = {k.removeprefix("model.") for k in keys}
    if any(k.startswith("midlayer.") for k in stripped):
        return "eagle3"
    if "fc.weight" in stripped and any(k.startswith("layers.0.") for k in stripped):
        fc = next((v for k, v in (state or {}).items() if k.removeprefix("model.") == "fc.weight"), None)
        fused3 = fc is not None and fc.dim() == 2 and fc.shape[1] == 3 * fc.shape[0]
        if fused3 or "d2t" in stripped or any(k.startswith("layers.0.hidden_norm.") for k in stripped):
            return "eagle3"
        return "eagle1"
    raise CheckpointError("unrecognised draft-head checkpoint: not specheads, EAGLE-1, EAGLE-3 or Medusa")


def import_head(directory: str | Path, verifier: torch.nn.Module, name: str = "") -> DraftHead:
    """Build a specheads head from a foreign checkpoint directory, for ``verifier``."""
    directory = Path(directory)
    try:
        config = json.loads((directory / "config.json").read_text()) if (directory / "config.json").is_file() else {}
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{directory / 'config.json'} is not valid JSON ({e.msg})") from None
    state = _weights(directory)
    kind = detect_format(config, set(state), state)
    spec = VerifierSpec.of(verifier, name or str(directory))
    if kind == "eagle3":
        return _import_eagle3(config, state, spec, verifier)
    if kind == "eagle1":
        return _import_eagle1(config, state, spec, verifier)
    if kind == "medusa-vllm":
        return _import_medusa_vllm(config, state, spec, verifier)
    if kind == "medusa-fd":
        return _import_medusa_fd(config, state, spec)
    raise CheckpointError(f"{directory} is a specheads checkpoint: load it with heads.load_head")


def _check_sizes(spec: VerifierSpec, hidden: int, vocab: int | None, what: str) -> None:
    if hidden != spec.hidden_size or (vocab is not None and vocab != spec.vocab_size):
        raise CheckpointError(
            f"this {what} checkpoint was made for hidden size {hidden} / vocab {vocab}, but the verifier has "
            f"{spec.hidden_size} / {spec.vocab_size}: use the verifier it was trained for"
        )


def _load_strict(head: DraftHead, state: dict, what: str) -> DraftHead:
    load_state_strict(head, state, f"{what} weights")
    return head.float().eval()


def _import_eagle3(config, state, spec, verifier) -> Eagle3Head:
    state = {k.removeprefix("model."): v for k, v in state.items() if not k.removeprefix("model.").startswith("embed_tokens")}
    state = {("midlayer." + k[len("layers.0."):]) if k.startswith("layers.0.") else k: v for k, v in state.items()}
    nested = config.get("transformer_layer_config")  # speculators: the layer's sizes live here
    layer = nested if isinstance(nested, dict) else config
    hidden = int(config.get("target_hidden_size") or layer.get("hidden_size") or state["fc.weight"].shape[0])
    _check_sizes(spec, hidden, int(layer.get("vocab_size") or spec.vocab_size), "EAGLE-3")
    draft_vocab = int(state["lm_head.weight"].shape[0])
    if config.get("eagle_aux_hidden_state_layer_ids") is not None:
        aux = tuple(int(i) for i in config["eagle_aux_hidden_state_layer_ids"])
    elif (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") is not None:
        aux = tuple(int(i) + 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])  # SGLang's ids
    else:
        aux = default_aux_layers(spec.num_layers)
    if config.get("norm_before_residual"):
        raise CheckpointError("norm_before_residual=true EAGLE-3 heads are not supported yet")
    layer_config = {k: v for k, v in layer.items() if k not in ("eagle_config", "architectures", "specheads")}
    layer_config.setdefault("hidden_size", hidden)
    hc = HeadConfig("eagle3", spec, draft_vocab_size=draft_vocab, aux_layers=tuple(sorted(aux)), layer_config=layer_config)
    head = build_head(hc)
    if "d2t" in state:
        d2t = state.pop("d2t").to(torch.long)
        state["d2t"] = d2t
        t2d = torch.zeros(spec.vocab_size, dtype=torch.bool)
        t2d[torch.arange(draft_vocab) + d2t] = True
        state["t2d"] = state.get("t2d", t2d).to(torch.bool)
    elif draft_vocab == spec.vocab_size:
        state["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)
        state["t2d"] = torch.ones(spec.vocab_size, dtype=torch.bool)
    else:
        raise CheckpointError("this EAGLE-3 checkpoint has a reduced draft vocabulary but no d2t mapping")
    return _load_strict(head, state, "EAGLE-3")


def _import_eagle1(config, state, spec, verifier) -> DraftHead:
    state = {k.removeprefix("model."): v for k, v in state.items() if not k.removeprefix("model.").startswith("embed_tokens")}
    hidden = int(state["fc.weight"].shape[0])
    _check_sizes(spec, hidden, None, "EAGLE-1")
    has_norm = "layers.0.input_layernorm.weight" in state
    hc = HeadConfig("eagle1", spec, layer_config=verifier.config.to_dict(), eagle1_input_norm=has_norm)
    head = build_head(hc)
    mapped = {("layer." + k[len("layers.0."):]) if k.startswith("layers.0.") else k: v for k, v in state.items()}
    mapped.setdefault("fc.bias", torch.zeros(hidden))  # EAGLE-1 for LLaMA-3 has no fc bias
    return _load_strict(head, mapped, "EAGLE-1")


def _import_medusa_vllm(config, state, spec, verifier) -> MedusaHeads:
    state = {k.removeprefix("medusa_heads."): v for k, v in state.items()}
    heads_ = sorted({int(k.split(".")[1]) for k in state if k.startswith("blocks.")})
    layers = sorted({int(k.split(".")[3]) for k in state if k.startswith("blocks.0.layers.")})
    _check_sizes(spec, int(state["blocks.0.layers.0.weight"].shape[0]), int(config.get("vocab_size", spec.vocab_size)), "Medusa")
    original = bool(config.get("original_lm_head"))
    hc = HeadConfig("medusa", spec, num_heads=len(heads_), num_layers=len(layers), own_lm_head=not original)
    head = build_head(hc)
    mapped = {}
    for k, v in state.items():
        m = re.fullmatch(r"blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)", k)
        if m:
            mapped[f"blocks.{m[1]}.{m[2]}.linear.{m[3]}"] = v
        elif k.startswith("lm_heads.") and not original:
            mapped[k] = v
    for k in list(mapped):  # exported with medusa_fc_bias: false
        if k.startswith("blocks.") and k.endswith(".weight") and k[: -len("weight")] + "bias" not in mapped:
            mapped[k[: -len("weight")] + "bias"] = torch.zeros(mapped[k].shape[0])
    return _load_strict(head, mapped, "Medusa")


def _import_medusa_fd(config, state, spec) -> MedusaHeads:
    """FasterDecoding Medusa-1: ``{h}.{l}.linear.weight/bias`` then ``{h}.{n}.weight`` (to vocab)."""
    blocks = [re.fullmatch(r"(\d+)\.(\d+)\.linear\.weight", k) for k in state]
    n_heads = 1 + max(int(m[1]) for m in blocks if m)
    n_layers = 1 + max(int(m[2]) for m in blocks if m)
    claimed = config.get("medusa_num_heads")
    if claimed is not None and int(claimed) != n_heads:
        log.warning("config.json says medusa_num_heads=%s but the weights hold %d heads: using the weights", claimed, n_heads)
    _check_sizes(spec, int(state["0.0.linear.weight"].shape[0]), int(state[f"0.{n_layers}.weight"].shape[0]), "Medusa")
    hc = HeadConfig("medusa", spec, num_heads=n_heads, num_layers=n_layers, own_lm_head=True,
                    training={"imported_from": "FasterDecoding Medusa", "config_num_heads": claimed})
    head = build_head(hc)
    mapped = {}
    for h in range(n_heads):
        for layer in range(n_layers):
            for p in ("weight", "bias"):
                mapped[f"blocks.{h}.{layer}.linear.{p}"] = state[f"{h}.{layer}.linear.{p}"]
        mapped[f"lm_heads.{h}.weight"] = state[f"{h}.{n_layers}.weight"]
    return _load_strict(head, mapped, "Medusa")
