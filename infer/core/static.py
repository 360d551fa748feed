"""The static-shape verify step: fixed row slots, bucketed sizes, one compiled forward.

The eager :class:`~infer.core.verifier.Verifier` runs a pass whose shapes change every step: the
cache grows by the accepted tokens, the mask is ``[B, 1, N, S + N]`` with a new ``S`` and ``N``
each time. A compiled graph (Inductor on a CPU, CUDA graphs on a GPU) needs the opposite, so
:class:`StaticVerifier` keeps every shape of a verify pass within a few buckets:

* the KV cache is one ``[R, H, C, D]`` buffer per layer (:class:`SlotLayer`): ``R`` row slots
  (the rows bucketed: 1, 2, 4, ... 64) of capacity ``C`` (a multiple of 256, grown by doubling
  when a row would run out, never per step); a pass writes each row's nodes at its own columns
  (a per-row scatter, which transformers' ``StaticLayer`` cannot do: it writes every row at the
  same columns) and attends over all ``C`` columns, the mask hiding what a row does not own;
* the tree's node count is padded to a bucket (:data:`NODE_BUCKETS`); padding nodes see only
  themselves, padding rows only their own padding nodes;
* the mask ``[R, 1, N, C]``, the positions and the write columns are computed inside the step
  from the rows' ``starts`` / ``ends`` and the trees' ancestors (small device tensors), so the
  compiled graph takes only fixed-shape inputs and nothing is built on the host;
* the accepted path is committed in place with padded index tensors (as the eager verifier
  does), and nothing is cropped: what lies past a row's end is masked and written over.

:func:`compile_step` compiles the step with ``torch.compile`` (dynamic sizes, so that the few
buckets share a handful of graphs: sizes 1 and above 1 of rows and nodes are told apart, nothing
else, the varying sizes marked dynamic on the buffers); on a CPU with Inductor's freezing (weights
folded in as constants, linears prepacked for MKL or oneDNN; graphs that Inductor's cache cannot
keep, so ``--compile auto`` stays eager there), on CUDA with ``mode="reduce-overhead"`` (CUDA graphs; the buffers are then marked as
static addresses and the outputs copied out, since a replay reuses them). Prefill stays eager (a
prompt's length is its own): its cache is copied into the slots once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .errors import UserError
from .kernels import MIN_PROBE_WEIGHTS, kernel_context
from .verifier import RowsOutput, StepPath, Verifier, cache_layers

#: node counts a verify pass is padded to (beyond the last: a multiple of it)
NODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
#: row counts the slots are padded to
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
#: the smallest slot capacity; capacities are this times a power of two
CAPACITY_STEP = 256


def bucket(n: int, buckets: Sequence[int] = NODE_BUCKETS) -> int:
    """The smallest of ``buckets`` that holds ``n`` (past the last: the next multiple of it)."""
    for b in buckets:
        if n <= b:
            return b
    last = buckets[-1]
    return -(-n // last) * last


def capacity_for(length: int) -> int:
    """The slot capacity for ``length`` columns: :data:`CAPACITY_STEP` times a power of two."""
    c = CAPACITY_STEP
    while c < length:
        c *= 2
    return c


class SlotLayer(CacheLayerMixin):
    """One layer's keys and values in fixed buffers ``[R, H, C, D]``: a pass writes row ``r``'s
    ``N`` new entries at its own columns ``cols[r]`` (``[R, N]``, set on the cache before the
    pass) and attends over the whole buffer (the caller's mask hides what the row does not own)."""

    is_compileable = True
    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.keys, self.values = keys, values
        self.is_initialized = True
        self.cols: torch.Tensor | None = None

    def lazy_initialization(self, key_states, value_states) -> None:  # the buffers exist from the start
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Scatter ``key_states`` / ``value_states`` ``[R, H, N, D]`` to columns ``cols``; the
        whole buffers ``[R, H, C, D]``."""
        index = self.cols[:, None, :, None].expand(key_states.shape)
        self.keys.scatter_(2, index, key_states)
        self.values.scatter_(2, index, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return 0  # positions are always given: nothing asks

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_max_length(self) -> int:
        return self.keys.shape[2]

    def get_max_cache_shape(self) -> int:
        return self.keys.shape[2]


class SlotCache(Cache):
    """The :class:`SlotLayer` s of every layer of the model."""

    def __init__(self, layers: list[SlotLayer]):
        super().__init__(layers=layers)

    def set_cols(self, cols: torch.Tensor) -> None:
        """Where each row's entries of the next pass go: ``[R, N]`` columns."""
        for layer in self.layers:
            layer.cols = cols

    @property
    def shape(self) -> tuple[int, int]:
        """``(R, C)``: row slots and columns per slot."""
        k = self.layers[0].keys
        return int(k.shape[0]), int(k.shape[2])


def slot_cache(like: Sequence[torch.Tensor], rows: int, capacity: int, static_address: bool) -> SlotCache:
    """Zeroed slots ``[rows, H, capacity, D]`` for every layer, shaped after ``like`` (one keys
    tensor ``[*, H, *, D]`` per layer); ``static_address`` marks them for CUDA graphs."""
    layers = []
    for k in like:
        shape = (rows, k.shape[1], capacity, k.shape[3])
        keys, values = k.new_zeros(shape), k.new_zeros(shape)
        for t in (keys, values):  # every capacity, and every row count above 1, in one graph
            torch._dynamo.maybe_mark_dynamic(t, 2)
            if rows > 1:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        if static_address:
            torch._dynamo.mark_static_address(keys)
            torch._dynamo.mark_static_address(values)
        layers.append(SlotLayer(keys, values))
    return SlotCache(layers)


def grow_slots(old: SlotCache | None, attn, layers: int, rows: int, need: int, dtype, device,
               static_address: bool) -> tuple[SlotCache, torch.Tensor] | None:
    """Slots for a head's ``layers`` attention layers like ``attn`` (an HF attention module: its
    key heads and head size) holding ``rows`` rows of ``need`` columns, grown from ``old`` (its
    rows and columns copied; the capacity doubles, never shrinks), and their columns ``[C]``
    (0..C-1, marked dynamic); None where ``old`` already holds them."""
    if old is not None and old.shape[0] >= rows and old.shape[1] >= need:
        return None
    like = torch.empty(1, attn.k_proj.out_features // attn.head_dim, 1, attn.head_dim, dtype=dtype, device=device)
    cap = capacity_for(max(need, old.shape[1] if old is not None else 0))
    cache = slot_cache([like] * layers, max(rows, old.shape[0] if old is not None else 0), cap, static_address)
    columns = torch.arange(cap, device=device)
    torch._dynamo.maybe_mark_dynamic(columns, 0)
    if old is not None:
        with torch.inference_mode():
            for a, b in zip(old.layers, cache.layers):
                b.keys[: a.keys.shape[0], :, : a.keys.shape[2]].copy_(a.keys)
                b.values[: a.values.shape[0], :, : a.values.shape[2]].copy_(a.values)
    return cache, columns


def step_inputs(ancestors: torch.Tensor, depths: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
                capacity: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A static pass's ``(mask [R, 1, N, C], positions [R, N], cols [R, N])``.

    Row ``r``'s committed entries are columns ``[starts[r], ends[r])``; its ``N`` nodes are
    written at columns ``ends[r] + i`` and node ``i`` sees the committed columns and its own
    ancestors there (``ancestors [R, N, N]`` bool, ``depths [R, N]``): additive mask, 0 where
    seen, the dtype's minimum elsewhere; positions are committed length + depth."""
    r, n, _ = ancestors.shape
    cols = torch.arange(capacity, device=ancestors.device)
    rel = cols - ends[:, None]  # [R, C]: a column's place after the row's end
    seen = (cols >= starts[:, None]) & (rel < 0)
    in_tree = (rel >= 0) & (rel < n)
    tree = ancestors.gather(2, rel.clamp(0, n - 1)[:, None, :].expand(r, n, capacity)) & in_tree[:, None, :]
    allowed = seen[:, None, :] | tree  # [R, N, C]
    zero = torch.zeros((), dtype=dtype, device=ancestors.device)
    mask = torch.where(allowed, zero, torch.finfo(dtype).min)[:, None]
    positions = depths + (ends - starts)[:, None]
    write = ends[:, None] + torch.arange(n, device=ancestors.device)
    return mask, positions, write


class StaticVerifier(Verifier):
    """A :class:`~infer.core.verifier.Verifier` whose verify passes have static shapes (row
    slots, bucketed nodes, a fixed-capacity cache), run eagerly or compiled (:func:`compile_step`).
    Greedy output is the eager verifier's, token for token (the tests check it).

    Args:
        model, feature_layers, linear: as :class:`~infer.core.verifier.Verifier` (``linear``
            applies to prefill and to the eager static step; a compiled step picks its own kernels).
        compile: ``False`` (the static step eagerly), ``True`` (compiled with Inductor, or CUDA
            graphs on CUDA), or a ``torch.compile`` backend (a name, or a callable: tests use ``"eager"`` and an
            inspecting wrapper of Inductor).
    """

    def __init__(self, model, feature_layers: Sequence[int] = (), *, linear: str = "auto", compile=False):
        super().__init__(model, feature_layers, linear=linear)
        self.slots: SlotCache | None = None
        self.path = StepPath(static=True)
        self._step: Callable = self._eager_step
        self._buffers: dict[tuple[int, int], StepInputs] = {}
        self._warm: set[tuple] = set()  # (feature layers, rows, nodes) warmed up already
        if compile:
            self._step = compile_step(self._eager_step, self.device, "inductor" if compile is True else compile)
            self.path = StepPath(True, True, "inductor" if compile is True else str(compile))

    # ---- the slots -----------------------------------------------------------------------------

    def _merge(self, cache, pads: list[int], width: int) -> None:
        """Copy the prefilled rows of ``cache`` (``width`` columns, row ``r`` from ``pads[r]``)
        into the slots after the running rows (growing the slots to their buckets first)."""
        first = self.rows
        self.starts += list(pads)
        self.ends += [width] * len(pads)
        new = cache_layers(cache)
        self._fit([k.keys for k in new], 0)
        with torch.inference_mode():
            for slot, layer in zip(self.slots.layers, new):
                slot.keys[first : self.rows, :, :width].copy_(layer.keys)
                slot.values[first : self.rows, :, :width].copy_(layer.values)
        self.cache = self.slots
        self._sync_rows()

    def _fit(self, like: Sequence[torch.Tensor], nodes: int) -> None:
        """Make the slots ``bucket(rows)`` by a capacity that holds every row's end plus ``nodes``
        (a new buffer, holding what the old one held, only when the bucket changes)."""
        rows, need = bucket(max(self.rows, 1), ROW_BUCKETS), capacity_for(max(self.ends, default=0) + max(nodes, 64))
        if self.slots is not None and self.slots.shape[0] == rows and self.slots.shape[1] >= need:
            return
        old = self.slots
        cap = max(need, old.shape[1] if old is not None else 0)
        self.slots = slot_cache(like, rows, cap, self.device.type == "cuda" and self.path.compiled)
        if old is not None:
            keep, width = min(old.shape[0], rows), old.shape[1]
            with torch.inference_mode():
                for a, b in zip(old.layers, self.slots.layers):
                    b.keys[:keep, :, :width].copy_(a.keys[:keep])
                    b.values[:keep, :, :width].copy_(a.values[:keep])
        self.cache = self.slots

    @torch.inference_mode()
    def drop_rows(self, keep: Sequence[int]) -> None:
        """Keep only the rows ``keep`` (in that order): their slots move to the front (one copy of
        the kept rows, at a step boundary), the slots shrink to the rows' bucket."""
        keep = list(keep)
        if keep == list(range(self.rows)):
            return
        if not keep:
            self.cache, self.slots, self.starts, self.ends = None, None, [], []
            self._sync_rows()
            return
        index = torch.tensor(keep, dtype=torch.long).to(self.device, non_blocking=True)
        for layer in self.slots.layers:
            for buf in (layer.keys, layer.values):
                buf[: len(keep)] = buf.index_select(0, index)
        self.starts = [self.starts[i] for i in keep]
        self.ends = [self.ends[i] for i in keep]
        self._fit([layer.keys for layer in self.slots.layers], 0)
        self._sync_rows()

    def rollback(self) -> None:
        """Nothing to drop: what a pass wrote past a row's end is masked and written over."""

    # ---- a verify pass -------------------------------------------------------------------------

    def _forward(self, tokens: torch.Tensor, ancestors: torch.Tensor, depths: torch.Tensor, n: int,
                 features: bool = True) -> RowsOutput:
        """The pass over ``tokens [B, n]``: padded to ``[R, bucket(n)]``, run by the step, cut back."""
        b, nb = self.rows, bucket(n)
        self._fit([layer.keys for layer in self.slots.layers], nb)
        inputs = self._inputs(self.slots.shape[0], nb)
        inputs.write(tokens, ancestors, depths, self._starts_dev, self._ends_dev)
        context = contextlib.nullcontext() if self.path.compiled else kernel_context(self.kernel, inputs.tokens.numel())
        with context:  # the drafters' layers whenever there are some: one graph, with or without features
            logits, feats = self._step(*inputs.args(), self._hidden_states_arg(True))
        return RowsOutput(logits[:b, :n], feats[:b, :n] if features and feats is not None else None)

    def _inputs(self, rows: int, nodes: int) -> StepInputs:
        """The preallocated input buffers of a ``rows`` by ``nodes`` pass (made once per shape)."""
        key = (rows, nodes)
        if key not in self._buffers:
            self._buffers[key] = StepInputs.empty(rows, nodes, self.device)
        return self._buffers[key]

    def _eager_step(self, tokens, ancestors, depths, starts, ends, hidden):
        """One static pass: ``tokens [R, N]``, ``ancestors [R, N, N]``, ``depths [R, N]``,
        ``starts`` / ``ends [R]`` -> logits ``[R, N, V]`` and features ``[R, N, F, H]`` (or None)."""
        mask, positions, cols = step_inputs(ancestors, depths, starts, ends, self.slots.shape[1], self.dtype)
        self.slots.set_cols(cols)
        out = self.model(input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=True,
                         output_hidden_states=hidden, **{self._cache_kw: self.slots})
        feats = None
        if out.hidden_states is not None:
            feats = torch.stack([out.hidden_states[i] for i in self.feature_layers], dim=2)
        return out.logits, feats

    def warm_up(self, max_rows: int = 1, nodes: Sequence[int] = (1, 2)) -> float:
        """Run (and so compile) the step at every graph the engine will need: 1 and 2 rows (up to
        ``max_rows``) by 1 and 2 nodes (every larger size shares the graph of 2); the rows are
        dropped after. Returns the seconds warm-ups took so far (``path.warmup_s``)."""
        from .batch import stack_drafts
        from .drafter import host_draft

        key = (tuple(self.feature_layers), min(2, max_rows), tuple(nodes))
        if key in self._warm:  # these graphs ran already
            return self.path.warmup_s
        self._warm.add(key)
        t0 = time.perf_counter()
        self.drop_rows([])
        for rows in sorted({1, min(2, max_rows)}):
            self.add_rows([torch.zeros(4, dtype=torch.long)] * rows, features=False)
            for n in nodes:
                trees = stack_drafts([host_draft([0] * n, [-1] + list(range(n - 1)))] * rows, self.device)
                self.verify_rows(trees)
            self.drop_rows([])
        self.path.warmup_s += time.perf_counter() - t0
        return self.path.warmup_s


@dataclass(frozen=True)
class StepInputs:
    """The fixed input buffers of one pass shape ``R`` by ``N`` (the same tensors every step, so
    a captured graph reads them where it was recorded): ``tokens [R, N]``, ``ancestors [R, N, N]``
    bool, ``depths [R, N]``, the rows' ``starts`` / ``ends [R]``; padding nodes hold token 0 at
    depth 0 and see only themselves, padding rows own no column."""

    tokens: torch.Tensor
    ancestors: torch.Tensor
    depths: torch.Tensor
    starts: torch.Tensor
    ends: torch.Tensor
    eye: torch.Tensor  # [R, N, N]: the ancestors of an all-padding pass

    @classmethod
    def empty(cls, rows: int, nodes: int, device) -> StepInputs:
        with torch.inference_mode():
            long = dict(dtype=torch.long, device=device)
            eye = torch.eye(nodes, dtype=torch.bool, device=device).repeat(rows, 1, 1)
            made = cls(torch.zeros(rows, nodes, **long), eye.clone(), torch.zeros(rows, nodes, **long),
                       torch.zeros(rows, **long), torch.zeros(rows, **long), eye)
        for t in made.args():  # one graph for every bucket above 1 (a size of 1 is a graph of its own)
            if rows > 1:
                torch._dynamo.maybe_mark_dynamic(t, 0)
            for dim in range(1, t.dim()):
                if nodes > 1:
                    torch._dynamo.maybe_mark_dynamic(t, dim)
        return made

    def write(self, tokens: torch.Tensor, ancestors: torch.Tensor, depths: torch.Tensor, starts: torch.Tensor,
              ends: torch.Tensor) -> None:
        """This step's ``B <= R`` rows of ``n <= N`` nodes, in place (device copies only)."""
        b, n = tokens.shape
        padded = (b, n) != tuple(self.tokens.shape)
        if padded:
            self.tokens.zero_()
            self.depths.zero_()
            self.ancestors.copy_(self.eye)
            self.starts.zero_()
            self.ends.zero_()
        self.tokens[:b, :n].copy_(tokens)
        self.depths[:b, :n].copy_(depths)
        self.ancestors[:b, :n, :n].copy_(ancestors)
        self.starts[:b].copy_(starts)
        self.ends[:b].copy_(ends)

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.tokens, self.ancestors, self.depths, self.starts, self.ends


#: the guards on a model's modules that Dynamo still checks before a compiled step: its weights
#: (a model of the same shapes is a different graph: the weights are frozen into it) and the
#: identity of its classes
KEPT_MODULE_GUARDS = frozenset({"TENSOR_MATCH", "ID_MATCH", "CLASS_MATCH", "DUPLICATE_INPUT"})


def module_guards_kept(entries) -> list[bool]:
    """Dynamo's ``guard_filter_fn``: every guard except those on a model module's hooks, plain
    attributes and types (hundreds for a 30-layer model, none of which a verifier changes), keeping
    :data:`KEPT_MODULE_GUARDS`."""
    return [e.guard_type in KEPT_MODULE_GUARDS or not _on_a_module(e) for e in entries]


def _on_a_module(entry) -> bool:
    """Whether a guard entry checks something reached through a model's modules (False where this
    PyTorch's entries do not say: the guard is then kept)."""
    source = getattr(getattr(entry, "orig_guard", None), "source", None)
    check = getattr(source, "is_unspecialized_nn_module", None)
    return bool(check()) if callable(check) else False


def compile_step(step: Callable, device: torch.device, backend: str = "inductor") -> Callable:
    """``step`` compiled; the sizes that vary (rows and nodes above 1, the capacity) are marked
    dynamic on the buffers themselves (:class:`StepInputs`, :func:`slot_cache`), so that the
    model's own constants stay constants (``dynamic=True`` would turn its float attributes into
    values read from the host at every call). Inductor on a CPU freezes the weights into the graph
    as constants, so that its linears are prepacked (MKL for a static row count, oneDNN for a
    dynamic one): the step runs under ``inference_mode`` and Inductor's global ``freezing``
    setting, which Dynamo reads when it traces (a per-call patch, about 25 us);
    on CUDA it captures CUDA graphs (``mode="reduce-overhead"``) and the outputs (any tensors it
    returns) are cloned, as a replay reuses them. On a CPU Dynamo skips the guards on the model's
    modules' hooks, attributes and types before a call (:func:`module_guards_kept`; a verifier
    holds its model unchanged), and keeps those on its weights: another model of the same shapes
    must compile a graph of its own. (``torch.compile`` takes a mode or options, not both, so
    CUDA checks them all.)"""
    if backend != "inductor":
        return torch.compile(step, backend=backend)
    if device.type == "cuda":
        compiled = torch.compile(step, mode="reduce-overhead")

        def run(*args):  # every tensor out of the replay copied out (a later replay overwrites them)
            return torch.utils._pytree.tree_map_only(torch.Tensor, torch.Tensor.clone, compiled(*args))

        return run
    compiled = torch.compile(step, options={"freezing": True, "guard_filter_fn": module_guards_kept})

    def frozen(*args):  # Dynamo reads Inductor's global `freezing` when it traces (the option alone leaves the
        with torch._inductor.config.patch(freezing=True):  # weights graph inputs, every linear a stock mm)
            return compiled(*args)

    return frozen


# ---- choosing the path: --compile auto / on / off ------------------------------------------------

COMPILE_CHOICES = ("auto", "on", "off")

def check_compile(choice: str) -> str:
    """``choice`` if it is one of :data:`COMPILE_CHOICES`, else a one-line :class:`UserError`."""
    if choice not in COMPILE_CHOICES:
        raise UserError(f"compile must be one of {', '.join(COMPILE_CHOICES)}, not {choice!r}")
    return choice


def artifacts_cached(device) -> bool:
    """Whether a later process reuses the compiled step's code on ``device`` (Inductor's FX graph
    cache), paying tracing, not code generation: on CUDA where that cache is on; never on a CPU,
    where the step's graphs hold the weights frozen and prepacked (MKL / oneDNN tensors, which the
    cache cannot store: Inductor compiles such graphs afresh in every process, 12 minutes for the
    default verifier's four graphs on the 2-core EPYC)."""
    try:
        from torch._inductor import config
    except ImportError:
        return False
    return torch.device(device).type == "cuda" and bool(getattr(config, "fx_graph_cache", False))


def cpu_name() -> str:
    """This machine's CPU model as ``/proc/cpuinfo`` names it (else what ``platform`` knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


#: the compiled step's version in :func:`model_key`: a change that can turn a measurement's verdict
#: (the weights frozen into the graphs) makes every machine measure again
STEP_VERSION = 2


def model_key(model) -> str:
    """What a compile measurement is valid for: this CPU, this PyTorch, this model's
    architecture and dtype (a hash of its config), this version of the step."""
    cpu = cpu_name()
    config = hashlib.sha256(model.config.to_json_string(use_diff=False).encode()).hexdigest()[:16]
    dtype = str(model.get_input_embeddings().weight.dtype)
    return f"{cpu}|torch {torch.__version__}|{os.cpu_count()} cpus|{config}|{dtype}|step {STEP_VERSION}"


def verdicts_file() -> Path | None:
    """Where the compile measurements are kept (``compile.json`` in the project's cache folder),
    or None where the cache is off (``SPECHEADS_CACHE=''``)."""
    from .converted import cache_root

    root = cache_root()
    return None if root is None else root / "compile.json"


def read_verdict(model) -> dict | None:
    """The stored measurement of ``model`` on this machine (``{"faster": bool, ...}``), or None."""
    path = verdicts_file()
    if path is None or not path.is_file():
        return None
    try:
        return json.loads(path.read_text()).get(model_key(model))
    except (OSError, ValueError):
        return None


def write_verdict(model, verdict: dict) -> None:
    """Store ``verdict`` for ``model`` on this machine (temp file + rename: never half-written)."""
    from heads.io import write_atomic

    path = verdicts_file()
    if path is None:
        return
    try:
        known = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        known = {}
    known[model_key(model)] = verdict
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(known, indent=1, sort_keys=True)
    write_atomic(path, lambda tmp: tmp.write_text(text))


def resolve_compile(choice: str, model) -> tuple[bool, str]:
    """Whether the verify step is compiled, and why (for the stats): ``on`` / ``off`` as given;
    ``auto`` compiles on CUDA, and on a CPU only where this machine's measurement of this model
    (:func:`measure_compile`, stored) found the compiled pass faster and compiled artifacts are
    cached across processes (:func:`artifacts_cached`: not on a CPU today), so that no run pays a
    compilation it may not win back."""
    check_compile(choice)
    if choice != "auto":
        return choice == "on", choice
    device = model.get_input_embeddings().weight.device
    if device.type == "cuda":
        return True, "auto: CUDA"
    if device.type != "cpu":
        return False, f"auto: {device.type} is not compiled"
    if not artifacts_cached(device):
        return False, "auto: compiled afresh in every process on a CPU (--compile on to pay its warm-up)"
    verdict = read_verdict(model)
    if verdict is None:
        return False, "auto: not measured on this machine (run once with --compile on)"
    return bool(verdict["faster"]), f"auto: measured {verdict['speedup']:.2f}x"


def measure_compile(verifier: StaticVerifier, nodes=(1, 8), prefix_len: int = 256, repeats: int = 5) -> dict:
    """The compiled step against the same static step run eagerly, on one row after a
    ``prefix_len`` prefix, median seconds per pass of ``nodes`` nodes, the two in turn:
    ``{"speedup": eager / compiled summed over nodes, "faster": speedup >= 1.05, ...}``."""
    from .batch import stack_drafts
    from .drafter import host_draft

    g = torch.Generator().manual_seed(0)
    verifier.drop_rows([])
    verifier.add_rows([torch.randint(0, verifier.vocab_size, (prefix_len,), generator=g)], features=False)
    times = {"eager": {n: [] for n in nodes}, "compiled": {n: [] for n in nodes}}
    compiled = verifier._step
    for r in range(repeats + 1):
        for n in nodes:
            trees = stack_drafts([host_draft([0] * n, [-1] + list(range(n - 1)))], verifier.device)
            for name, step in (("eager", verifier._eager_step), ("compiled", compiled)):
                verifier._step = step
                verifier.path.compiled = name == "compiled"
                t0 = time.perf_counter()
                verifier.verify_rows(trees, features=False)
                if r:
                    times[name][n].append(time.perf_counter() - t0)
    verifier._step, verifier.path.compiled = compiled, True
    verifier.drop_rows([])
    med = {k: {n: statistics.median(t) for n, t in v.items()} for k, v in times.items()}
    speedup = sum(med["eager"].values()) / sum(med["compiled"].values())
    return {"speedup": round(speedup, 3), "faster": speedup >= 1.05, "seconds": med}


def static_for(verifier: Verifier, choice: str, max_rows: int = 1) -> Verifier:
    """The verifier an engine runs for ``--compile choice``: ``verifier`` itself where the step is
    not compiled, and a :class:`StaticVerifier` as it is (where compiled, warmed up again for the
    row counts it was warmed up for, should the drafter's feature layers be new), else a compiled
    :class:`StaticVerifier` of its model, warmed up for up to ``max_rows`` rows; compiling on a
    CPU measures it against eager once per machine and model (stored for ``auto``)."""
    if isinstance(verifier, StaticVerifier):  # given static: it keeps its own path and the row counts it was
        if verifier.path.compiled:  # warmed up for, warmed up again for this drafter's feature layers
            verifier.warm_up(max((key[1] for key in verifier._warm), default=1))
        return verifier
    on, why = resolve_compile(choice, verifier.model)
    if not on:
        verifier.path.reason = why
        return verifier
    static = StaticVerifier(verifier.model, verifier.feature_layers, linear=verifier.kernel, compile=True)
    static.path.reason = why
    static.warm_up(max_rows)
    weights = verifier.model.get_output_embeddings().weight
    if (static.device.type == "cpu" and weights.numel() >= MIN_PROBE_WEIGHTS  # a test-sized toy's timing decides nothing
            and read_verdict(verifier.model) is None):
        write_verdict(verifier.model, measure_compile(static))
    return static
