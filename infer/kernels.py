"""Which matrix-multiply kernel the verifier's linear layers run on a CPU.

Tree verification multiplies every weight matrix by a handful of rows (one per tree node). On a
CPU, PyTorch's float32 ``linear`` goes to MKL, whose small-row products can be slow: measured on
the project's 2-core AMD machine, the default verifier's 576 x 49,152 output projection took 10.8
ms for 1 row, 24 ms for 2, 36 ms for 3 and 18 ms for 4 (2-3 rows run as separate
matrix-vector products), so a 2- or 3-node tree cost more to verify than an 8-node one. oneDNN's
``linear`` (the kernel PyTorch's own compiler emits on CPU) took 4.5 / 5.4 / 5.9 / 6.4 ms there.

:class:`OneDNNLinear` routes ``torch.nn.functional.linear`` through oneDNN for float32 CPU
tensors while it is active (a ``TorchFunctionMode``: the model and its modeling code stay as they
are). :func:`linear_kernel` decides per model: ``auto`` measures both kernels on the model's own
output projection, once per model, and keeps oneDNN only where it is clearly faster; GPUs,
half-precision models (PyTorch already uses oneDNN for bf16 on CPU) and tiny models keep the stock
kernel. The kernels round differently in the last bits, like any two batch sizes of one kernel;
greedy outputs are checked for identity by the tests and by every benchmark.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import weakref

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .errors import UserError

KERNELS = ("auto", "stock", "onednn")

#: below this many output-projection weights a model is a test-sized toy: timing is noise there
MIN_PROBE_WEIGHTS = 1 << 20

_chosen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> "stock" | "onednn" (auto's measurement)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` on oneDNN: ``x [..., in]``, ``weight [out, in]``, ``bias [out]`` -> ``[..., out]``."""
    rows = x.reshape(-1, x.shape[-1])
    y = torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")
    return y.view(*x.shape[:-1], weight.shape[0])


def _routable(x, weight) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and weight.dim() == 2 and x.dim() >= 1 and not torch.is_grad_enabled() and x.shape[-1] == weight.shape[1])


class OneDNNLinear(TorchFunctionMode):
    """While active, float32 CPU ``F.linear`` calls without autograd run on oneDNN; everything
    else runs as it would."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if _routable(x, weight):
                return onednn_linear(x, weight, bias)
        return func(*args, **kwargs)


def onednn_available() -> bool:
    """Whether this PyTorch build runs oneDNN's float32 linear (checked with a 2 x 4 product)."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        x, w = torch.ones(2, 4), torch.ones(3, 4)
        return bool(torch.equal(onednn_linear(x, w), F.linear(x, w)))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def median_seconds(fn, repeats: int) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_linear(weight: torch.Tensor, rows=(1, 4, 8), repeats: int = 3) -> dict:
    """Seconds of ``x [m, in] @ weight.T`` per kernel, summed over ``m`` in ``rows`` (medians)."""
    out = {}
    with torch.inference_mode():
        xs = [torch.randn(m, weight.shape[1], dtype=weight.dtype) for m in rows]
        out["stock"] = sum(median_seconds(lambda x=x: F.linear(x, weight), repeats) for x in xs)
        out["onednn"] = sum(median_seconds(lambda x=x: onednn_linear(x, weight), repeats) for x in xs)
    return out


def choose_kernel(measured: dict, margin: float = 0.9) -> str:
    """``onednn`` when it took under ``margin`` of the stock kernel's time, else ``stock``."""
    return "onednn" if measured["onednn"] < margin * measured["stock"] else "stock"


def check_kernel_device(choice: str, device) -> None:
    """A :class:`UserError` for ``onednn`` (a CPU kernel) on any device but a CPU: it would wrap
    every GPU operation of the verifier in a Python mode for nothing. ``device``: a string
    (``cpu``, ``cuda:0``) or a ``torch.device``; ``choice`` may be a comma-separated list."""
    kinds = {k.strip() for k in str(choice).split(",")}
    if "onednn" in kinds and str(device).split(":")[0].strip() != "cpu":
        raise UserError(f"--linear onednn is a CPU kernel: it cannot run the verifier on {device}; use --linear auto or stock there")


def linear_kernel(model, choice: str = "auto") -> str:
    """The kernel the verifier's float32 CPU linears run on: ``stock`` or ``onednn``.

    ``auto``: oneDNN where it is available, the model computes in float32 on the CPU, its output
    projection has at least :data:`MIN_PROBE_WEIGHTS` weights and a ~0.3 s measurement on that
    projection found oneDNN faster (measured once per model); otherwise stock. ``onednn`` forces
    it (a UserError where this PyTorch cannot), ``stock`` never routes anything."""
    if choice not in KERNELS:
        raise UserError(f"linear kernel must be one of {', '.join(KERNELS)}, not {choice!r}")
    if choice == "stock":
        return "stock"
    if choice == "onednn":
        check_kernel_device(choice, model.get_output_embeddings().weight.device)
        if not onednn_available():
            raise UserError("this PyTorch build has no oneDNN float32 linear: use --linear stock or auto")
        return "onednn"
    weight = model.get_output_embeddings().weight
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.numel() < MIN_PROBE_WEIGHTS:
        return "stock"
    if model not in _chosen:
        _chosen[model] = choose_kernel(measure_linear(weight.detach())) if onednn_available() else "stock"
    return _chosen[model]


def kernel_context(kernel: str) -> contextlib.AbstractContextManager:
    """A context in which the verifier's forward passes run on ``kernel`` (``stock``: nothing changes)."""
    return OneDNNLinear() if kernel == "onednn" else contextlib.nullcontext()
