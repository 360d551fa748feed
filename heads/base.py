"""The base class of every draft head (kept apart so that head modules outside
:mod:`heads.modules`, e.g. :mod:`heads.dflash`, import it without a cycle)."""

from __future__ import annotations

from torch import nn

from .config import HeadConfig


class DraftHead(nn.Module):
    """Base class of all heads: holds the :class:`HeadConfig`. Modules only: checkpoints are
    read and written by :mod:`heads.loading` (``load_head``, ``save_head``), which also gives every
    head ``save_pretrained``, ``from_pretrained`` and ``push_to_hub``."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
