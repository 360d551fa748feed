"""Draft-head architectures: Medusa, EAGLE-1 and EAGLE-3 (and the block drafter from :mod:`heads.dflash`).

All heads share one small interface (:class:`DraftHead`): they consume the verifier's features
(``config.feature_layers``) and produce draft logits for one tree depth. Decoder layers are built
from a transformers config with the stock HF classes (no copied modeling code).

Shapes: ``B`` batch, ``T`` positions, ``h`` the verifier's hidden size, ``V`` its vocabulary,
``Vd`` the EAGLE-3 draft vocabulary.
"""

from __future__ import annotations

import copy
import inspect

import torch
from torch import nn

from .base import DraftHead, DraftVocab
from .config import HeadConfig
from .dflash import DFlashHead

# --------------------------------------------------------------------------------------------
# Medusa
# --------------------------------------------------------------------------------------------


class ResBlock(nn.Module):
    """``x + SiLU(W x + b)``, each block with its own weights; ``W`` starts at zero so a new head
    starts as the identity (as in Medusa)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(DraftHead):
    """Medusa-1: ``num_heads`` heads on the verifier's last hidden state; head ``i`` predicts the
    token ``i + 2`` positions ahead. Each head is ``num_layers`` residual blocks, then a projection
    to the vocabulary: its own (``own_lm_head``) or the verifier's LM head."""

    def __init__(self, config: HeadConfig):
        super().__init__(config)
        h, v = config.verifier.hidden_size, config.verifier.vocab_size
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(h) for _ in range(config.num_layers)]) for _ in range(config.num_heads)
        )
        self.lm_heads = nn.ModuleList(nn.Linear(h, v, bias=False) for _ in range(config.num_heads)) if config.own_lm_head else None

    def hidden(self, features: torch.Tensor) -> torch.Tensor:
        """``features [..., h]`` -> per-head hidden states ``[K, ..., h]``."""
        return torch.stack([blk(features) for blk in self.blocks])

    def forward(self, features: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor:
        """``features [..., h]`` (the verifier's last hidden state) -> logits ``[K, ..., V]``."""
        hid = self.hidden(features)
        if self.lm_heads is not None:
            return torch.stack([head(x) for head, x in zip(self.lm_heads, hid)])
        if lm_head is None:
            raise ValueError("these Medusa heads use the verifier's LM head: pass lm_head=")
        return lm_head(hid)


# --------------------------------------------------------------------------------------------
# EAGLE
# --------------------------------------------------------------------------------------------


def _one_layer_model(layer_config: dict, *, llama: bool = False):
    """A one-layer HF base model of the verifier's architecture (or a Llama of its sizes), with a
    one-token embedding: we only keep its decoder layer, rotary embedding and final norm."""
    from transformers import AutoConfig, AutoModel

    skip = ("quantization_config", "architectures", "auto_map")
    d = {k: v for k, v in layer_config.items() if k not in skip}
    model_type = "llama" if llama else d.pop("model_type")
    d.pop("model_type", None)
    d.update(num_hidden_layers=1, vocab_size=1, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if "layer_types" in d:
        d["layer_types"] = ["full_attention"]
    if llama:
        keep = (
            "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "rope_parameters", "rope_theta", "rope_scaling", "max_position_embeddings",
            "num_hidden_layers", "vocab_size", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
        )
        d = {k: v for k, v in d.items() if k in keep}
        rope = d.get("rope_parameters")
        if isinstance(rope, dict) and "full_attention" in rope:  # per-layer-type rope (Gemma 3)
            d["rope_parameters"] = rope["full_attention"]
    cfg = AutoConfig.for_model(model_type, **d)
    with torch.device("cpu"):
        return AutoModel.from_config(cfg)


class _EagleBase(DraftHead):
    """Shared parts of EAGLE-1/3: ``fc`` fusing the verifier's features, one decoder layer, its
    rotary embedding; the layer attends over a KV cache like the verifier's."""

    def _cache_kw(self, module) -> str:
        params = inspect.signature(module.forward).parameters
        return "cache" if "cache" in params else "past_key_values"

    def rope(self, x: torch.Tensor, position_ids: torch.Tensor):
        """``(cos, sin)`` for ``position_ids``; models with per-layer-type rope (Gemma 3) get the
        full-attention one, as the draft layer attends to everything."""
        if "layer_type" in inspect.signature(self.rotary_emb.forward).parameters:
            return self.rotary_emb(x, position_ids, "full_attention")
        return self.rotary_emb(x, position_ids)


class Eagle1Head(_EagleBase):
    """EAGLE-1: ``fc(concat(embed(token_{t+1}), f_t))`` (2h -> h), then one decoder layer of the
    verifier's own architecture. It predicts the verifier's next feature ``f_{t+1}``; draft
    logits come from the verifier's frozen LM head. Later depths feed its own predictions back."""

    def __init__(self, config: HeadConfig):
        super().__init__(config)
        h = config.verifier.hidden_size
        base = _one_layer_model(config.layer_config)
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.layer = base.layers[0]
        if not config.eagle1_input_norm:  # the original EAGLE-1 layout drops the first norm
            self.layer.input_layernorm = nn.Identity()
        self.rotary_emb = base.rotary_emb
        self._kw = self._cache_kw(self.layer)

    def forward(self, features, token_embeds, position_ids, attention_mask, cache=None) -> torch.Tensor:
        """``features [B, T, h]``, ``token_embeds [B, T, h]``, ``position_ids [B, T]``,
        ``attention_mask [B, 1, T, S]`` additive -> predicted features ``[B, T, h]``."""
        x = self.fc(torch.cat([token_embeds, features.to(token_embeds.dtype)], dim=-1))
        out = self.layer(
            x,
            attention_mask=attention_mask,
            position_ids=position_ids,
            position_embeddings=self.rope(x, position_ids),
            use_cache=cache is not None,
            **{self._kw: cache},
        )
        return out[0] if isinstance(out, tuple) else out


class Eagle3Head(_EagleBase, DraftVocab):
    """EAGLE-3: ``fc`` fuses three verifier hidden states (3h -> h); one Llama decoder layer whose
    attention input is ``concat(input_norm(embedding), hidden_norm(hidden))`` (2h); a final norm
    and its own LM head over a reduced draft vocabulary (``d2t``: draft id -> target id offset,
    ``t2d``: which target ids are in the draft vocabulary). The layer's output (before the final
    norm) is the feature fed back at the next depth.

    Two variants that ``speculators`` trains are flags of ``layer_config`` (default false):
    ``norm_before_residual`` (the residual is ``hidden_norm(hidden)``, not ``hidden``) and
    ``norm_output`` (the final norm is applied to the layer's output, which is what is fed back;
    the logits are ``lm_head`` of it, without a second norm)."""

    def __init__(self, config: HeadConfig):
        super().__init__(config)
        h, vd, v = config.verifier.hidden_size, config.draft_vocab_size, config.verifier.vocab_size
        base = _one_layer_model(config.layer_config, llama=True)
        layer = base.layers[0]
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):  # the attention reads 2h
            old = getattr(attn, name)
            setattr(attn, name, nn.Linear(2 * h, old.out_features, bias=old.bias is not None))
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.midlayer = layer
        self.midlayer.hidden_norm = copy.deepcopy(layer.input_layernorm)
        self.norm = base.norm
        self.rotary_emb = base.rotary_emb
        self.lm_head = nn.Linear(h, vd, bias=False)
        self.register_buffer("d2t", torch.zeros(vd, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(v, dtype=torch.bool))

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """``aux [B, T, 3, h]`` (the verifier's three hidden states) -> ``[B, T, h]``."""
        return self.fc(aux.flatten(-2))

    def forward(self, hidden, token_embeds, position_ids, attention_mask, cache=None) -> torch.Tensor:
        """``hidden [B, T, h]`` (fused verifier features, or this head's own output at later depths),
        ``token_embeds [B, T, h]`` -> output hidden ``[B, T, h]`` (apply :meth:`logits` for draft logits)."""
        layer = self.midlayer
        normed = layer.hidden_norm(hidden)
        residual = normed if self.config.layer_config.get("norm_before_residual") else hidden
        x = torch.cat([layer.input_layernorm(token_embeds), normed], dim=-1)
        attn_out, _ = layer.self_attn(x, self.rope(hidden, position_ids), attention_mask, cache)
        x = residual + attn_out
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x) if self.config.layer_config.get("norm_output") else x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., h]`` (:meth:`forward`'s output) -> draft-vocabulary logits ``[..., Vd]``."""
        return self.lm_head(hidden if self.config.layer_config.get("norm_output") else self.norm(hidden))


HEAD_CLASSES = {"medusa": MedusaHeads, "eagle1": Eagle1Head, "eagle3": Eagle3Head, "dflash": DFlashHead}


def build_head(config: HeadConfig) -> DraftHead:
    """A freshly initialised head of ``config.head_type``."""
    return HEAD_CLASSES[config.head_type](config)
