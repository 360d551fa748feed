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
output projection, then whole forwards of 1, 2 and 8 tokens, once per model, and runs tree passes
on oneDNN only where it is faster on both. Where oneDNN wins the output projection's products but the tree-sized
forwards are slower on it (a 2-core Xeon with AVX-512 and AMX, whose MKL has no small-row slump:
2 / 8-node passes of the default verifier took 61 / 68 ms on oneDNN against 34 / 58 ms on stock)
it keeps stock; where it wins those but a one-token forward is slower on it (a 2-core AVX2 EPYC:
the inner layers' one-row products and the mode's per-operation cost; HF ``generate`` on oneDNN
ran at 0.87x the stock kernel's speed there), ``hybrid`` runs the one-token passes (plain
decoding, a step whose draft is paused) and long prompts on the stock kernel with no mode and the
tree passes on oneDNN; GPUs,
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

KERNELS = ("auto", "stock", "onednn", "hybrid")

#: below this many output-projection weights a model is a test-sized toy: timing is noise there
MIN_PROBE_WEIGHTS = 1 << 20

#: ``hybrid`` runs passes of 2 to this many tokens on oneDNN (every shipped tree preset's node count
#: fits); longer ones, a prompt, stay on the stock kernel: a 700-token prefill of the default
#: verifier took 1.50 s on stock against 1.80 s on oneDNN on the AVX2 EPYC that chose hybrid
HYBRID_MAX_ROWS = 64

_chosen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> "stock" | "onednn" (auto's measurement)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` on oneDNN: ``x [..., in]``, ``weight [out, in]``, ``bias [out]`` -> ``[..., out]``."""
    rows = x.reshape(-1, x.shape[-1])
    y = torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")
    return y.view(*x.shape[:-1], weight.shape[0])


def _routable(x, weight, min_rows: int = 1) -> bool:
    """Whether ``F.linear(x [..., in], weight [out, in])`` may run on oneDNN: float32 CPU inference
    with at least ``min_rows`` rows (shapes only: nothing waits on the device)."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and weight.dim() == 2 and x.dim() >= 1 and not torch.is_grad_enabled() and x.shape[-1] == weight.shape[1]
            and x.numel() >= min_rows * x.shape[-1])


class OneDNNLinear(TorchFunctionMode):
    """While active, float32 CPU ``F.linear`` calls without autograd of at least ``min_rows``
    rows run on oneDNN; everything else runs as it would."""

    def __init__(self, min_rows: int = 1):
        super().__init__()
        self.min_rows = min_rows

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if _routable(x, weight, self.min_rows):
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
    """Median seconds of ``x [m, in] @ weight.T`` per kernel and row count:
    ``{"stock": {m: s, ...}, "onednn": {m: s, ...}}`` for ``m`` in ``rows``."""
    out = {}
    with torch.inference_mode():
        xs = {m: torch.randn(m, weight.shape[1], dtype=weight.dtype) for m in rows}
        out["stock"] = {m: median_seconds(lambda x=x: F.linear(x, weight), repeats) for m, x in xs.items()}
        out["onednn"] = {m: median_seconds(lambda x=x: onednn_linear(x, weight), repeats) for m, x in xs.items()}
    return out


def measure_forwards(model, rows=(1, 2, 8), repeats: int = 5) -> dict:
    """Median seconds of a forward of ``model`` over ``m`` tokens (no cache) per kernel and ``m``
    in ``rows``: ``{"stock": {m: s, ...}, "onednn": {m: s, ...}}``, the kernels timed in turn so
    that a slow moment of a shared machine hits both. Unlike :func:`measure_linear` this counts
    every layer's products and the mode's own per-operation cost: what a one-token step (plain
    decoding, a paused draft) and a tree pass of a few nodes really pay."""
    device = model.get_input_embeddings().weight.device
    ids = {m: torch.zeros(1, m, dtype=torch.long, device=device) for m in rows}
    contexts = {"stock": contextlib.nullcontext, "onednn": OneDNNLinear}
    times = {k: {m: [] for m in rows} for k in contexts}
    with torch.inference_mode():
        for r in range(repeats + 1):  # the first round warms both up
            for m in rows:
                for kernel, context in contexts.items():
                    t0 = time.perf_counter()
                    with context():
                        model(input_ids=ids[m], use_cache=False)
                    if r:
                        times[kernel][m].append(time.perf_counter() - t0)
    return {k: {m: statistics.median(t) for m, t in per_rows.items()} for k, per_rows in times.items()}


def choose_kernel(measured: dict, forwards: dict | None = None, margin: float = 0.9) -> str:
    """``stock`` unless oneDNN took under ``margin`` of the stock kernel's time on the output
    projection's products (:func:`measure_linear`, summed over its row counts). Then, from whole
    forwards (:func:`measure_forwards`): ``stock`` where the forwards of 2 or more tokens (a tree
    pass), summed, are no faster on oneDNN (a 2-core Xeon with AMX: oneDNN won the projection's
    products but a 2-node pass took 61 ms on it against 34 ms on stock); else ``onednn`` where a
    one-token forward on it is no slower than on stock, or ``hybrid``: tree passes on oneDNN,
    one-token passes on the stock kernel (the 2-core AVX2 EPYC)."""
    if sum(measured["onednn"].values()) >= margin * sum(measured["stock"].values()):
        return "stock"
    if forwards is None:
        return "onednn"
    stock, onednn = forwards["stock"], forwards["onednn"]
    tree_rows = [m for m in stock if m > 1]
    if tree_rows and sum(onednn[m] for m in tree_rows) >= sum(stock[m] for m in tree_rows):
        return "stock"
    if 1 in stock and onednn[1] > stock[1]:
        return "hybrid"
    return "onednn"


def check_kernel_device(choice: str, device) -> None:
    """A :class:`UserError` for ``onednn`` (a CPU kernel) on any device but a CPU: it would wrap
    every GPU operation of the verifier in a Python mode for nothing. ``device``: a string
    (``cpu``, ``cuda:0``) or a ``torch.device``; ``choice`` may be a comma-separated list."""
    kinds = {k.strip() for k in str(choice).split(",")}
    for kind in ("onednn", "hybrid"):
        if kind in kinds and str(device).split(":")[0].strip() != "cpu":
            raise UserError(f"--linear {kind} is a CPU kernel: it cannot run the verifier on {device}; use --linear auto or stock there")


def linear_kernel(model, choice: str = "auto") -> str:
    """The kernel the verifier's float32 CPU linears run on: ``stock``, ``onednn`` or ``hybrid``.

    ``auto``: oneDNN where it is available, the model computes in float32 on the CPU, its output
    projection has at least :data:`MIN_PROBE_WEIGHTS` weights and a ~0.3 s measurement on that
    projection found oneDNN faster; then a ~2 s measurement of whole forwards of 1, 2 and 8 tokens
    keeps ``stock`` where oneDNN does not win the tree-sized ones, ``onednn`` where it wins them
    and is no slower on one token, else ``hybrid`` (measured once per model).
    ``onednn`` forces it (a UserError where this PyTorch cannot), ``hybrid`` forces it for every
    pass but the one-token ones, ``stock`` never routes anything."""
    if choice not in KERNELS:
        raise UserError(f"linear kernel must be one of {', '.join(KERNELS)}, not {choice!r}")
    if choice == "stock":
        return "stock"
    if choice in ("onednn", "hybrid"):
        check_kernel_device(choice, model.get_output_embeddings().weight.device)
        if not onednn_available():
            raise UserError("this PyTorch build has no oneDNN float32 linear: use --linear stock or auto")
        return choice
    weight = model.get_output_embeddings().weight
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.numel() < MIN_PROBE_WEIGHTS:
        return "stock"
    if model not in _chosen:
        choice = "stock"
        if onednn_available():
            measured = measure_linear(weight.detach())
            choice = choose_kernel(measured)
            if choice != "stock":  # whole forwards are timed only where oneDNN won the products
                choice = choose_kernel(measured, measure_forwards(model))
        _chosen[model] = choice
    return _chosen[model]


def kernel_context(kernel: str, rows: int | None = None) -> contextlib.AbstractContextManager:
    """A context in which forward passes run on ``kernel`` (``stock``: nothing changes). ``rows``:
    the tokens of the pass, where the caller knows them; ``hybrid`` runs a one-token pass with no
    mode at all (the mode's per-operation cost is what makes oneDNN slower there), and a pass of
    more than :data:`HYBRID_MAX_ROWS` tokens (a prompt) on the stock kernel too; with ``rows``
    unknown (HF ``generate``), it routes only the products of 2 or more rows."""
    if kernel == "onednn":
        return OneDNNLinear()
    if kernel == "hybrid":
        if rows is not None and (rows == 1 or rows > HYBRID_MAX_ROWS):
            return contextlib.nullcontext()
        return OneDNNLinear(min_rows=2)
    return contextlib.nullcontext()
