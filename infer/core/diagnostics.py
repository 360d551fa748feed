"""Counting sync points: the calls that make the host wait for the device.

On a GPU every read of a device value drains the kernel queue: the GPU idles while Python
catches up. Those reads are ``item()``, ``int(t)``, ``bool(t)``, ``float(t)``, a 0-dim tensor used
as an index or slice bound (ATen calls ``item()`` for it), ``.tolist()``, ``.numpy()``,
``nonzero`` (and ``torch.where(cond)``, ``argwhere``), boolean-mask indexing (``nonzero``
inside), ``masked_select``, ``unique``, ``repeat_interleave`` with tensor repeats and no
``output_size``, ``torch.equal``, and copies between the device and host memory in either
direction (a blocking copy from pageable host memory waits for the queue too). The decoding
loop is written to need a small constant number of them per verify step, whatever the tree size.

:class:`HostReadCounter` counts them **at the dispatch level** (a ``TorchDispatchMode``, which sees
the ATen ops that Python-level interception misses, such as the ``_local_scalar_dense`` behind
``t[i]`` with a 0-dim ``i``), plus a thin ``TorchFunctionMode`` for the two reads that never
reach the dispatcher (``tolist``, ``numpy``) and for ``torch.tensor(data, device=<accelerator>)``,
whose copy is done before dispatch.

Which tensors are on "the device": those whose device type is the counter's ``device`` (the
verifier's). On a CPU run that is every tensor, i.e. the CPU stands in for a GPU: every tensor
is treated as a device tensor, so reading any tensor's value counts, and so does every tensor
made from host data (``torch.tensor(list)``, ``as_tensor``, ``from_numpy``, a Python list used as
an index: ATen's ``lift_fresh``), one host-to-device copy each. The one exception is the 0-dim
tensor that ``t[i] = <python number>`` wraps its value in (on a GPU that is a fill kernel with
the number as an argument, no copy), and an empty tensor. A tensor made from host data stays a
host tensor: reading it back (``tolist``) is free, as it would be on a GPU, where it lives in host
memory until copied; whatever is computed from it counts as a device tensor. So host bookkeeping
belongs in Python lists, numpy arrays or such host tensors. On a CUDA run the copies are counted where they cross devices
(``_to_copy`` / ``copy_`` between CPU and CUDA, and ``torch.tensor(..., device="cuda")``), and
reads of CPU tensors are free; ``torch.cuda.set_sync_debug_mode("warn")`` confirms it there
(``specheads selfcheck``).
"""

from __future__ import annotations

import weakref
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


def _ops(*names: str) -> list:
    """The ATen overloads named ``op.overload`` that this PyTorch has (older ones lack some)."""
    found = []
    for name in names:
        op, overload = name.split(".")
        packet = getattr(aten, op, None)
        if packet is not None and hasattr(packet, overload):
            found.append(getattr(packet, overload))
    return found


#: ATen ops whose result size or value needs the device's data on the host, by counted name
_READ_OPS = {
    **dict.fromkeys(_ops("_local_scalar_dense.default", "item.default", "is_nonzero.default", "equal.default"), "item"),
    **dict.fromkeys(_ops("nonzero.default"), "nonzero"),
    **dict.fromkeys(_ops("masked_select.default"), "masked_select"),
    **dict.fromkeys(_ops("_unique.default", "_unique2.default", "unique_dim.default", "unique_consecutive.default",
                         "unique_dim_consecutive.default"), "unique"),
}
#: indexing ops that sync when given a boolean mask (they run ``nonzero`` on it)
_INDEX_OPS = set(_ops("index.Tensor", "index_put.default", "index_put_.default", "_index_put_impl_.default"))
_REPEAT_OPS = set(_ops("repeat_interleave.Tensor", "repeat_interleave.self_Tensor"))
#: Python-level reads that never reach the dispatcher
_PY_READS = {"tolist": "tolist", "numpy": "numpy", "__array__": "numpy"}
#: constructors whose copy to an accelerator happens before dispatch
_CONSTRUCTORS = {"tensor", "as_tensor", "asarray"}


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, owner: HostReadCounter):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.owner._see(func, args, kwargs, out)
        return out


class _FunctionCounter(TorchFunctionMode):
    def __init__(self, owner: HostReadCounter):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        owner = self.owner
        if name in _PY_READS and args and isinstance(args[0], torch.Tensor) and owner._on_device(args[0]):
            owner.counts[_PY_READS[name]] += 1
        elif name in _CONSTRUCTORS and owner.device is not None:
            target = kwargs.get("device")
            if target is not None and torch.device(target).type == owner.device.type != "cpu":
                owner.counts["h2d"] += 1  # built on the host, copied before dispatch sees it
        elif name == "__setitem__" and len(args) > 2 and isinstance(args[2], (bool, int, float)):
            owner._scalar_setitem += 1  # its value is wrapped in a 0-dim tensor: not a copy on a GPU
            try:
                return func(*args, **kwargs)
            finally:
                owner._scalar_setitem -= 1
        return func(*args, **kwargs)


class HostReadCounter:
    """Counts sync points by kind (``counts``) and in all (``total``) while active (``with``).

    Kinds: ``item`` (``_local_scalar_dense`` / ``item`` / ``is_nonzero`` / ``equal``: every
    ``item()``, ``int()``, ``bool()``, ``float()`` and 0-dim tensor index), ``tolist``, ``numpy``,
    ``nonzero``, ``masked_select``, ``unique``, ``repeat_interleave`` (tensor repeats, no
    ``output_size``), ``index(bool)`` (boolean-mask indexing), ``d2h`` and ``h2d`` (copies between
    host memory and the device). ``device``: the verifier's device (see the module docstring);
    ``None`` or a CPU device treats every tensor as a device tensor.
    """

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else None
        self.counts: Counter = Counter()
        self._scalar_setitem = 0
        self._host: dict[int, weakref.ref] = {}  # CPU run: tensors made from host data, read for free
        self._modes = (_FunctionCounter(self), _DispatchCounter(self))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __enter__(self) -> HostReadCounter:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    # ---- classification ------------------------------------------------------------------------

    def _on_device(self, t: torch.Tensor) -> bool:
        """Whether ``t`` counts as a device tensor: on a CPU run every tensor except those made
        from host data (counted as copied when made; reading them back waits for nothing)."""
        if self._simulated():
            ref = self._host.get(id(t))
            return ref is None or ref() is not t
        return t.device.type == self.device.type

    def _see(self, func, args, kwargs, out) -> None:
        counts = self.counts
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if func in _READ_OPS:
            if first is None or self._on_device(first):
                counts[_READ_OPS[func]] += 1
        elif func in _REPEAT_OPS:
            repeats = args[0] if len(args) == 1 or not isinstance(args[1], torch.Tensor) else args[1]
            if kwargs.get("output_size") is None and self._on_device(repeats):
                counts["repeat_interleave"] += 1
        elif func in _INDEX_OPS:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices) and self._on_device(first):
                counts["index(bool)"] += 1
        elif func is aten.lift_fresh.default:
            # a tensor made from host data; on a CPU run it stands for a copy to the device
            if self._simulated() and first.numel() > 0 and not (self._scalar_setitem and first.dim() == 0):
                counts["h2d"] += 1
                key = id(out)
                self._host[key] = weakref.ref(out, lambda _, key=key: self._host.pop(key, None))
        elif func is aten._to_copy.default or func is aten.copy_.default:
            src = first if func is aten._to_copy.default else args[1]
            dst_type = (torch.device(kwargs["device"]).type if kwargs.get("device") is not None else src.device.type) \
                if func is aten._to_copy.default else first.device.type
            if isinstance(src, torch.Tensor) and src.device.type != dst_type and not self._simulated():
                if dst_type == "cpu" and src.device.type == self.device.type:
                    counts["d2h"] += 1
                elif src.device.type == "cpu" and dst_type == self.device.type:
                    counts["h2d"] += 1

    def _simulated(self) -> bool:
        """Whether the CPU stands in for the device (every tensor counts as a device tensor)."""
        return self.device is None or self.device.type == "cpu"
