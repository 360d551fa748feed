"""Grouped-query attention without copied key/value heads, through transformers' own interface.

A model whose query heads share key/value heads (Llama 3, Qwen2/3, Mistral, Gemma, SmolLM2: 9
query heads over 3 key/value heads) runs transformers' ``sdpa`` attention by copying every
key/value head once per query head that reads it (``repeat_kv``: ``[B, Hkv, C, D]`` to
``[B, H, C, D]``, keys and values, every layer, every pass) whenever a mask is given and the
query is longer than one token or traced by ``torch.compile``: every verify pass of a tree, and
every pass of the compiled step. On a 2-core CPU that copy was about a tenth of a one-token pass
of the default verifier. SDPA reads the shared heads in place when told ``enable_gqa``; on a CPU
its result is bit for bit the copied one (``tests/test_attention.py`` checks it).

:func:`use_grouped_attention` registers :func:`grouped_sdpa` with transformers'
``AttentionInterface`` (and sdpa's mask builder with ``AttentionMaskInterface``, so that a
``generate`` on the same model builds the masks it built before) and switches a model that runs
``sdpa`` to it. Anything it does not handle (no mask, a GPU, where masked ``enable_gqa`` leaves
the fused kernels, soft-capping, sinks, a position bias) goes to transformers' own function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: the name :func:`grouped_sdpa` is registered under
NAME = "specheads_grouped_sdpa"

#: keyword arguments that only transformers' own function knows what to do with
_DELEGATED = ("softcap", "position_bias", "s_aux", "sinks", "output_attentions")


def grouped_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa_attention_forward``, with the same arguments and result: ``query
    [B, H, N, D]``, ``key`` / ``value [B, Hkv, C, D]``, ``attention_mask [B, 1, N, C]`` ->
    ``[B, N, H, D]``; a masked pass on a CPU with ``H > Hkv`` reads the shared heads in place
    instead of copying them: one token's query heads become the queries of their key/value head
    (transformers' own eager packing, kept under ``torch.compile``), more tokens let SDPA index
    the shared heads (``enable_gqa``). Either way the bits are transformers' own."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if (groups == 1 or attention_mask is None or query.device.type != "cpu"
            or any(kwargs.get(k) is not None and kwargs.get(k) is not False for k in _DELEGATED)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    b, h, n, d = query.shape
    if n == 1 and attention_mask.shape[1] == 1:  # one token: its query heads as the queries of their
        packed = query.reshape(b, h // groups, groups, d)  # key/value head, as transformers packs them eagerly
        out = F.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                             scale=scaling)
    else:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                             scale=scaling, enable_gqa=True)
    return out.reshape(b, h, n, value.shape[-1]).transpose(1, 2).contiguous(), None


def use_grouped_attention(model) -> bool:
    """Switch ``model`` from transformers' ``sdpa`` attention to :func:`grouped_sdpa` (registered
    once, idempotently, under :data:`NAME`); whether it now runs it. A model on another
    attention (eager, flash, flex) keeps it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current == NAME:
        return True
    if current != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return False
    AttentionInterface.register(NAME, grouped_sdpa)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(NAME)
    return config._attn_implementation == NAME
