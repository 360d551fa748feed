"""Interoperability: export heads in the layouts vLLM and SGLang load, import published ones.

Export formats (rules read from the engines' loaders; ``tests/test_interop.py`` writes them down;
every export is a fresh directory swapped into place, :func:`~heads.io.write_directory`):

* ``speculators`` - the ``speculators`` library's EAGLE-3 checkpoint, which vLLM reads natively
  (:func:`export_speculators`; proven against the library in ``tests/test_speculators.py``).

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
SpecForge) and ``speculators`` EAGLE-3 checkpoints (``speculators_model_type`` in ``config.json``;
the layout alone, ``layers.0.*`` with a nested ``transformer_layer_config``, is recognised too),
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
from .io import CheckpointError, load_state_strict, read_safetensors, write_directory
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


def _check_eagle3_exportable(head: Eagle3Head, fmt: str) -> list[int]:
    """The head's fused layers (vLLM's ids), or a CheckpointError saying why the engines cannot run it."""
    cfg = head.config
    if cfg.head_type != "eagle3":
        raise CheckpointError(f"the {fmt} format needs an EAGLE-3 head, not {cfg.head_type}")
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
    return aux


def _draft_state(head: Eagle3Head, dtype: torch.dtype) -> dict:
    """The head's weights for the engines: ``d2t`` / ``t2d`` for a reduced vocabulary; over the full
    vocabulary none (vLLM then creates no mapping), with ``lm_head``'s rows in target order."""
    cfg = head.config
    state = {k: v.to(dtype) for k, v in head.state_dict().items() if k not in ("d2t", "t2d")}
    if cfg.draft_vocab_size < cfg.verifier.vocab_size:
        state["d2t"], state["t2d"] = head.d2t.to(torch.int64), head.t2d.to(torch.bool)
    else:  # full vocabulary: no mapping, so lm_head's rows go in target order (a no-op after set_vocab)
        targets = head.target_ids(torch.arange(cfg.draft_vocab_size, device=head.d2t.device))
        state["lm_head.weight"] = state["lm_head.weight"][torch.argsort(targets).to(state["lm_head.weight"].device)]
    return state


def _llama_layer_fields(cfg) -> dict:
    """The Llama decoder-layer fields of the head's one layer, as vLLM and SGLang read them
    (``model_type`` llama whatever the verifier's family; ``cfg``: the head's config)."""
    lc, h = cfg.layer_config, cfg.verifier.hidden_size
    n_heads = lc["num_attention_heads"]
    return {
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
        "max_position_embeddings": lc.get("max_position_embeddings", 8192),
    }


def export_eagle3(head: Eagle3Head, out: str | Path, *, dtype: torch.dtype = torch.bfloat16, overwrite: bool = False) -> Path:
    """Write ``head`` in the EAGLE-3 layout that vLLM and SGLang load (into a fresh directory:
    :func:`~heads.io.write_directory`; a non-empty ``out`` needs ``overwrite``)."""
    cfg = head.config
    aux = _check_eagle3_exportable(head, "eagle3")
    if cfg.layer_config.get("norm_before_residual") or cfg.layer_config.get("norm_output"):
        raise CheckpointError("SGLang runs only the plain EAGLE-3 layer; this head normalises before the residual or "
                              "its output (a speculators variant): export it with --format speculators (vLLM)")
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        **_llama_layer_fields(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        **_rope_fields(cfg.layer_config),
        "tie_word_embeddings": False,
        "attention_bias": False,
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": aux,
        "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux]},
        "torch_dtype": str(dtype).removeprefix("torch."),
        "specheads": {"verifier": cfg.verifier.name, "fingerprint": cfg.verifier.fingerprint},
    }
    return _write_export(out, config, _draft_state(head, dtype), overwrite)


#: the speculators release whose config schema :func:`export_speculators` writes (tested against it)
SPECULATORS_VERSION = "0.9.0"
#: names that only specheads resolves: vLLM cannot load a verifier by them
_SPECHEADS_ONLY = re.compile(r"^(default|tiny-random:.*|random:.*)$")


def _hf_rope(lc: dict) -> dict:
    """``rope_parameters`` (transformers 5) and ``rope_theta`` / ``rope_scaling`` (older readers) of a layer config."""
    fields = _rope_fields(lc)
    params = {"rope_theta": fields["rope_theta"], "rope_type": "default", **fields.get("rope_scaling", {})}
    return {"rope_parameters": params, **fields}


def export_speculators(head: Eagle3Head, out: str | Path, *, embed_tokens: torch.Tensor | None = None, verifier: str | None = None,
                       architectures: list[str] | None = None, speculative_tokens: int = 3, dtype: torch.dtype = torch.bfloat16,
                       overwrite: bool = False) -> Path:
    """Write ``head`` as a ``speculators`` EAGLE-3 checkpoint (the format vLLM reads natively:
    ``vllm serve DIR`` serves the verifier named in ``speculators_config.verifier`` with it).

    ``verifier``: the Hub id or directory vLLM loads the verifier from (default: the name the head
    records; ``default``, ``tiny-random:*`` and ``random:*`` are names only specheads knows and are
    refused). ``architectures``: the verifier's (default: transformers' causal-LM class of its
    ``model_type``). ``speculative_tokens``: vLLM's default ``num_speculative_tokens``. The aux
    layer ids are always written (vLLM's convention: the input of decoder layer ``i``); weights
    ``fc``, ``layers.0.*``, ``norm``, ``lm_head``, ``d2t`` / ``t2d``, and ``embed_tokens``: the
    verifier's input embedding ``[V, h]`` (``embed_tokens``), a frozen copy as speculators writes
    it. Without one, vLLM takes the verifier's, but speculators 0.9 under transformers 5 initialises
    the missing embedding at random, so pass it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cfg = head.config
    aux = _check_eagle3_exportable(head, "speculators")
    name = verifier or cfg.verifier.name
    if not name or _SPECHEADS_ONLY.match(name):
        raise CheckpointError(
            f"vLLM loads the verifier named in speculators_config.verifier, but this head records {name!r}, a name only "
            "specheads knows: pass the verifier's Hub id or model directory (export --verifier)"
        )
    if Path(name).is_dir():
        name = str(Path(name).resolve())
    if speculative_tokens < 1:
        raise CheckpointError(f"speculative_tokens must be >= 1, not {speculative_tokens}")
    arch = architectures or [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(cfg.verifier.model_type, "LlamaForCausalLM")]
    lc, h = cfg.layer_config, cfg.verifier.hidden_size
    layer = {
        **_llama_layer_fields(cfg),  # vLLM runs every EAGLE-3 draft layer as a Llama layer
        **_hf_rope(lc),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }
    config = {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": name, "architectures": arch},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": aux,
        "norm_before_residual": bool(lc.get("norm_before_residual", False)),  # vLLM's default when absent is true
        "norm_output": bool(lc.get("norm_output", False)),
        "norm_before_fc": False,
        "fc_norm": False,
        "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "dtype": str(dtype).removeprefix("torch."),
        "specheads": {"verifier": cfg.verifier.name, "fingerprint": cfg.verifier.fingerprint},
    }
    state = {("layers.0." + k[len("midlayer."):]) if k.startswith("midlayer.") else k: v for k, v in _draft_state(head, dtype).items()}
    if embed_tokens is not None:
        if tuple(embed_tokens.shape) != (cfg.verifier.vocab_size, h):
            raise CheckpointError(f"embed_tokens has shape {tuple(embed_tokens.shape)}, not the verifier's [{cfg.verifier.vocab_size}, {h}]")
        state["embed_tokens.weight"] = embed_tokens.detach().to(dtype)
    return _write_export(out, config, state, overwrite)


def export_medusa(head: MedusaHeads, out: str | Path, verifier=None, *, dtype: torch.dtype = torch.bfloat16,
                  overwrite: bool = False) -> Path:
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
    return _write_export(out, config, state, overwrite)


def _write_export(out: str | Path, config: dict, state: dict, overwrite: bool = False) -> Path:
    """``model.safetensors`` + ``config.json`` as the only files of ``out`` (a fresh directory swapped
    into place: :func:`~heads.io.write_directory`)."""
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}

    def fill(tmp: Path) -> None:
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=1))

    return write_directory(out, fill, overwrite=overwrite)


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
    """``specheads``, ``speculators`` (its ``config.json`` has ``speculators_model_type``; only
    ``eagle3`` is imported), ``eagle3``, ``eagle1``, ``medusa-vllm`` or ``medusa-fd`` (FasterDecoding).
    Without a config saying so, EAGLE-3 in the ``speculators`` layout names its layer ``layers.0.``
    like EAGLE-1: it is told apart by ``hidden_norm``, ``d2t`` or an ``fc`` that reads 3x its output
    (``state``'s shapes)."""
    if config.get("format") == "specheads":
        return "specheads"
    if "speculators_model_type" in config:
        if config["speculators_model_type"] != "eagle3":
            raise CheckpointError(
                f"this is a speculators {config['speculators_model_type']!r} checkpoint; specheads imports speculators "
                "EAGLE-3 checkpoints only (speculators_model_type 'eagle3')"
            )
        return "speculators"
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
    if kind == "speculators":
        return _import_eagle3(_speculators_config(config, spec), state, spec, verifier)
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


def _speculators_config(config: dict, spec: VerifierSpec) -> dict:
    """A speculators EAGLE-3 ``config.json`` checked for what :class:`Eagle3Head` computes, with
    its two supported variants (``norm_before_residual``, ``norm_output``) moved into the layer
    config and the aux layer ids resolved as speculators and vLLM do (null: ``2, N // 2, N - 3``)."""
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise CheckpointError("this speculators checkpoint has no transformer_layer_config object in its config.json")
    unsupported = [k for k in ("norm_before_fc", "fc_norm", "embed_requires_grad") if config.get(k)]
    if unsupported:
        raise CheckpointError(f"this speculators EAGLE-3 head uses {', '.join(unsupported)}, which specheads does not implement")
    if layer.get("model_type", "llama") != "llama":
        raise CheckpointError(
            f"this speculators EAGLE-3 head has a {layer.get('model_type')!r} draft layer; specheads runs Llama draft layers only"
        )
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise CheckpointError(f"this speculators EAGLE-3 head has {layer['num_hidden_layers']} draft layers; specheads runs one")
    if config.get("target_hidden_size") not in (None, layer.get("hidden_size")):
        raise CheckpointError("this speculators EAGLE-3 head's hidden size differs from its verifier's (target_hidden_size); not supported")
    n = spec.num_layers
    try:
        aux = [int(i) for i in config.get("eagle_aux_hidden_state_layer_ids") or [2, n // 2, n - 3]]
    except (TypeError, ValueError):
        raise CheckpointError("eagle_aux_hidden_state_layer_ids in this speculators config.json must be a list of integers") from None
    if len(aux) != 3 or len(set(aux)) != 3 or min(aux) < 0 or max(aux) >= n:
        raise CheckpointError(
            f"this speculators EAGLE-3 head fuses verifier layers {list(aux)}: specheads needs three distinct inputs of "
            f"decoder layers 0..{n - 1} of this {n}-layer verifier"
        )
    if "sliding_attention" in (layer.get("layer_types") or []):
        log.warning("this speculators head's draft layer uses sliding-window attention (window %s); specheads attends to the "
                    "whole context: drafts are the same while the context fits the window (the output is the verifier's either way)",
                    layer.get("sliding_window"))
    extra = {k: bool(config.get(k)) for k in ("norm_before_residual", "norm_output") if config.get(k)}
    layer = {k: v for k, v in layer.items() if k not in ("layer_types", "sliding_window", "use_sliding_window")}
    return {"transformer_layer_config": {**layer, **extra}, "eagle_aux_hidden_state_layer_ids": list(aux),
            "norm_before_residual": False}


def _import_eagle3(config, state, spec, verifier) -> Eagle3Head:
    state = {k.removeprefix("model."): v for k, v in state.items() if not k.removeprefix("model.").startswith("embed_tokens")}
    state = {k: v for k, v in state.items() if not k.startswith(("verifier_lm_head.", "verifier_norm."))}  # speculators' frozen copies
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
    if config.get("norm_before_residual"):  # EAGLE-3 research layout: vLLM reads this flag too
        layer = {**layer, "norm_before_residual": True}
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
