"""The block drafter (DFlash-style): one forward pass drafts a whole block of tokens.

Architecture (as the serving engines load it; see :mod:`heads.dflash_export`):

* context: the verifier's hidden states at ``aux_layers`` are concatenated and fused,
  ``hidden_norm(fc(concat))`` (``F h -> h``), once per committed position;
* every draft decoder layer attends to the context *directly*: its own ``k_proj`` / ``v_proj``
  (with the layer's ``k_norm`` and rotary embedding) turn the fused context into keys and values
  that sit in the layer's KV cache in front of the block's;
* the block: the newest token (the root, at position ``L``) and ``block_size - 1`` mask tokens
  (the verifier's embedding of ``mask_token_id``) at positions ``L + 1 ...``, through
  ``num_layers`` decoder layers that attend to the whole context and, non-causally, to the
  whole block; a final norm; the verifier's LM head (restricted to a draft vocabulary of
  ``draft_vocab_size`` rows, ``d2t`` / ``t2d`` as EAGLE-3's).

The decoder layers are unmodified HF Qwen3 decoder layers (per-head q/k norms: the layer every
DFlash server implements) of the verifier's sizes. The context keys come from the unmodified
attention module run on the fused context with the layer's cache (its output is discarded), so
no attention code is reimplemented here.

Shapes: ``B`` batch, ``C`` context positions, ``Q`` block positions, ``S`` cached + new keys,
``h`` the verifier's hidden size, ``F`` fused layers, ``Vd`` the draft vocabulary.
"""

from __future__ import annotations

import copy
import inspect

import torch
from torch import nn

from .base import DraftHead, DraftVocab
from .config import HeadConfig

#: verifier config keys that size the Qwen3 draft layers (everything else is Qwen3's default)
_SIZE_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "rms_norm_eps", "rope_parameters", "rope_theta", "rope_scaling", "max_position_embeddings")


def draft_layers_config(layer_config: dict, num_layers: int):
    """A Qwen3 config of the verifier's sizes with ``num_layers`` full-attention layers, no
    biases, SiLU MLPs (what vLLM's and SGLang's DFlash models build)."""
    from transformers import AutoConfig

    d = {k: v for k, v in layer_config.items() if k in _SIZE_KEYS}
    rope = d.get("rope_parameters")
    if isinstance(rope, dict) and "full_attention" in rope:  # per-layer-type rope (Gemma 3)
        d["rope_parameters"] = rope["full_attention"]
    if not d.get("head_dim"):
        d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
    d.update(num_hidden_layers=num_layers, vocab_size=1, tie_word_embeddings=False, attention_bias=False,
             hidden_act="silu", use_sliding_window=False, layer_types=["full_attention"] * num_layers,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return AutoConfig.for_model("qwen3", **d)


class DFlashHead(DraftHead, DraftVocab):
    """The block drafter: ``fc`` + ``hidden_norm`` fuse the context, ``layers`` (Qwen3 decoder
    layers), ``norm``; logits through the verifier's LM-head rows of the draft vocabulary."""

    def __init__(self, config: HeadConfig):
        super().__init__(config)
        from transformers import AutoModel

        h, v, vd = config.verifier.hidden_size, config.verifier.vocab_size, config.draft_vocab_size
        with torch.device("cpu"):
            base = AutoModel.from_config(draft_layers_config(config.layer_config, config.num_layers))
        self.fc = nn.Linear(len(config.aux_layers) * h, h, bias=False)
        self.hidden_norm = copy.deepcopy(base.norm)
        self.layers = base.layers
        self.norm = base.norm
        self.rotary_emb = base.rotary_emb
        self.register_buffer("d2t", torch.zeros(vd, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(v, dtype=torch.bool) if vd == v else torch.zeros(v, dtype=torch.bool))
        params = inspect.signature(self.layers[0].forward).parameters
        self._kw = "cache" if "cache" in params else "past_key_values"

    # ---- vocabulary ----------------------------------------------------------------------------

    def draft_index(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Verifier ids -> draft-vocabulary ids (meaningful where ``t2d[target_ids]``)."""
        return (torch.cumsum(self.t2d.long(), 0) - 1).clamp(min=0)[target_ids]

    # ---- forward -------------------------------------------------------------------------------

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """``aux [..., F, h]`` (the verifier's hidden states) -> fused context ``[..., h]``."""
        return self.hidden_norm(self.fc(aux.flatten(-2)))

    def _rope(self, x: torch.Tensor, position_ids: torch.Tensor):
        return self.rotary_emb(x, position_ids)

    def add_context(self, context: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor, cache) -> None:
        """Append the keys and values of the fused ``context [B, C, h]`` at ``position_ids [B, C]``
        to every layer's ``cache`` (an HF cache): each layer's own attention module runs on it
        (``attention_mask [B, 1, C, S]``, any that lets each row see something; its output is unused)."""
        rope = self._rope(context, position_ids)
        for layer in self.layers:
            layer.self_attn(context, rope, attention_mask, cache)

    def forward(self, block_embeds: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor, cache) -> torch.Tensor:
        """``block_embeds [B, Q, h]`` at ``position_ids [B, Q]``, attending to the cached context
        and the block itself under ``attention_mask [B, 1, Q, S]`` (additive) -> ``[B, Q, h]``
        (before the final norm; :meth:`logits` applies it). The block's keys are appended to
        ``cache``: crop it back to the context afterwards."""
        x = block_embeds
        rope = self._rope(x, position_ids)
        for layer in self.layers:
            out = layer(x, attention_mask=attention_mask, position_ids=position_ids, position_embeddings=rope,
                        use_cache=True, **{self._kw: cache})
            x = out[0] if isinstance(out, tuple) else out
        return x

    def logits(self, hidden: torch.Tensor, lm_rows: torch.Tensor) -> torch.Tensor:
        """``hidden [..., h]`` and the verifier's LM-head rows of the draft vocabulary
        ``lm_rows [Vd, h]`` -> draft logits ``[..., Vd]``."""
        return nn.functional.linear(self.norm(hidden).to(lm_rows.dtype), lm_rows)

    def lm_rows(self, lm_head: nn.Module) -> torch.Tensor:
        """The verifier LM head's rows of this head's draft vocabulary, ``[Vd, h]`` (no bias:
        the Llama / Qwen / Mistral / Gemma LM heads have none)."""
        ids = self.target_ids(torch.arange(self.config.draft_vocab_size, device=self.d2t.device))
        return lm_head.weight[ids.to(lm_head.weight.device)]
