"""Counting host reads: the calls that make the host wait for the device.

On a GPU every read of a device value (``.item()``, ``.tolist()``, ``int(t)``, ``bool(t)``, an
index computed from a tensor, ``nonzero`` and the boolean-mask indexing built on it, a copy to
the CPU) drains the kernel queue: the GPU idles while Python catches up. The decoding loop is
written to need a constant number of them per step, whatever the tree size.
:class:`HostReadCounter` counts them on any device (on a CPU machine too, where they cost
nothing), so tests can hold the loop to that; on CUDA, ``torch.cuda.set_sync_debug_mode``
confirms it.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

#: tensor methods / functions that read device values on the host (whatever the device)
_READS = {"item", "tolist", "__int__", "__bool__", "__float__", "__index__", "nonzero", "argwhere",
          "masked_select", "unique", "unique_consecutive", "numpy", "bincount"}
#: copies that are reads only when they leave a non-CPU device
_COPIES = {"cpu", "to"}


def _index_read(index) -> str | None:
    """What a ``tensor[index]`` reads on the host: a boolean mask, or a slice with tensor bounds."""
    items = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items):
        return "bool"
    if any(isinstance(i, slice) and any(isinstance(b, torch.Tensor) for b in (i.start, i.stop, i.step)) for i in items):
        return "slice"
    return None


class HostReadCounter(TorchFunctionMode):
    """A ``TorchFunctionMode`` that counts host reads by name (``counts``) and in all (``total``).

    Counted: ``item``, ``tolist``, ``int()/bool()/float()`` of a tensor, a tensor used as a Python
    index or as a slice bound, ``nonzero`` and friends, boolean-mask indexing, ``torch.where(cond)`` with one
    argument, ``repeat_interleave`` with tensor repeats, and ``.cpu()`` / ``.to(cpu)`` from
    another device."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _READS:
            self.counts[name] += 1
        elif name in ("__getitem__", "__setitem__") and len(args) > 1 and _index_read(args[1]):
            self.counts[f"{name}[{_index_read(args[1])}]"] += 1
        elif name == "where" and len(args) + len(kwargs) == 1:
            self.counts["where(cond)"] += 1
        elif name == "repeat_interleave" and len(args) > 1 and isinstance(args[1], torch.Tensor):
            self.counts["repeat_interleave(tensor)"] += 1
        elif name in _COPIES and args and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu":
            target = kwargs.get("device", args[1] if len(args) > 1 else None)
            if name == "cpu" or (target is not None and torch.device(target).type == "cpu"):
                self.counts[name] += 1
        return func(*args, **kwargs)
