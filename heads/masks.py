"""Attention masks in the form HF decoder layers take: additive float ``[B, 1, T, S]`` (0 where a
query may attend, the dtype's minimum elsewhere)."""

from __future__ import annotations

import torch


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool ``[..., T, S]`` (True = may attend) -> additive float mask ``[..., 1, T, S]``."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.unsqueeze(-3)


def causal_mask(t: int, past: int, batch: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive causal mask ``[B, 1, T, past + T]`` for ``t`` new positions after ``past`` cached."""
    allowed = torch.ones(t, past + t, dtype=torch.bool, device=device).tril(diagonal=past)
    return additive_mask(allowed.expand(batch, t, past + t), dtype)
