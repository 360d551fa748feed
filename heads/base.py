"""The base class of every draft head (kept apart so that head modules outside
:mod:`heads.modules`, e.g. :mod:`heads.dflash`, import it without a cycle)."""

from __future__ import annotations

import torch
from torch import nn

from .config import HeadConfig


class DraftHead(nn.Module):
    """Base class of all heads: holds the :class:`HeadConfig`. Modules only: checkpoints are
    read and written by :mod:`heads.loading` (``load_head``, ``save_head``), which also gives every
    head ``save_pretrained``, ``from_pretrained`` and ``push_to_hub``."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config


class DraftVocab:
    """A reduced draft vocabulary over the verifier's (EAGLE-3, the block drafter): the buffers
    ``d2t [Vd]`` (draft id -> offset to its verifier id) and ``t2d [V]`` (verifier id kept?), as
    vLLM and SGLang store them. Mixed into a head that registers both buffers."""

    d2t: torch.Tensor
    t2d: torch.Tensor

    def set_vocab(self, draft_to_target: torch.Tensor) -> None:
        """Set the draft vocabulary from the target ids it keeps (``[Vd]``, sorted here)."""
        ids = draft_to_target.to(torch.long).sort().values
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> verifier ids."""
        return draft_ids + self.d2t[draft_ids]
