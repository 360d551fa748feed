"""The verifier's cost of checking a tree, and choosing draft sizes that pay for themselves.

Verifying ``n`` tree nodes costs more than one token (on CPU the matrix products stop being
memory-bound), so a draft is worth its size only if the tokens it is expected to add outweigh
that cost. :class:`VerifyCost` holds the measured curve (``specheads cost`` measures it);
:func:`best_chain_depth` picks the draft depth that maximises expected tokens per unit of time.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from functools import lru_cache

import torch


@dataclass(frozen=True)
class VerifyCost:
    """Time of a verify pass over ``nodes[i]`` nodes relative to one token (``relative[i]``),
    linearly interpolated in between and extrapolated beyond the last point."""

    nodes: tuple[int, ...]
    relative: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.nodes) != len(self.relative) or len(self.nodes) < 2 or list(self.nodes) != sorted(set(self.nodes)):
            raise ValueError("VerifyCost needs >= 2 increasing node counts with one cost each")

    def __call__(self, n: int) -> float:
        xs, ys = self.nodes, self.relative
        if n <= xs[0]:
            return ys[0]
        for i in range(1, len(xs)):
            if n <= xs[i] or i == len(xs) - 1:
                x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
                return y0 + (y1 - y0) * (n - x0) / (x1 - x0)
        raise AssertionError("unreachable")

    def observe(self, nodes: int, seconds: float) -> None:
        """A fixed curve learns nothing from a timed pass (the :class:`OnlineCost` interface)."""

    def table(self, n_max: int, device=None) -> torch.Tensor:
        """``[n_max + 1]``: ``self(max(n, 1))`` for ``n = 0..n_max``, on ``device`` (cached)."""
        return _table(self, n_max, str(device or "cpu"))

    @classmethod
    def from_measurement(cls, measured: dict, min_token_seconds: float = 2e-3) -> VerifyCost | None:
        """From :func:`measure_verify_cost`'s result, made non-decreasing (a bigger
        tree never costs less; a dip is timing noise). ``None`` when the measurement cannot be
        trusted to size trees: one token takes under ``min_token_seconds`` (tiny models, where
        Python overhead and noise dominate). A flat curve is kept: big trees are then cheap."""
        rel = {int(n): float(r) for n, r in measured["relative"].items()}  # JSON keys are strings
        secs = {int(n): float(s) for n, s in measured.get("seconds", {}).items()}
        nodes = sorted(rel)
        if secs and secs[nodes[0]] < min_token_seconds:
            return None
        return cls(tuple(nodes), tuple(nondecreasing([rel[n] for n in nodes])))


def nondecreasing(values) -> list[float]:
    """The running maximum of ``values``: a cost curve's monotone envelope (a bigger tree never
    costs less; a dip is timing noise)."""
    out, top = [], 0.0
    for v in values:
        top = max(top, float(v))
        out.append(top)
    return out


@lru_cache(maxsize=64)
def _table(cost: VerifyCost, n_max: int, device: str) -> torch.Tensor:
    return torch.tensor([cost(max(n, 1)) for n in range(n_max + 1)], dtype=torch.float32, device=device)


#: node-count buckets of :class:`OnlineCost` (upper bounds)
_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1 << 30)


class OnlineCost:
    """The verify-cost curve as the engine measures it, step by step.

    Starts from a ``prior`` curve (relative times, e.g. the probe at load or :data:`DEFAULT_COST`)
    and takes every verify pass the engine times (:meth:`observe`). Node counts are bucketed
    (1, 2, 3-4, 5-8, ...); a bucket with ``min_samples`` recent passes contributes the median of
    its last ``window`` (node count, seconds) pairs, so one slow step (another process on the
    machine, a page fault) moves nothing. Buckets without enough passes follow the prior, scaled
    by the median ratio of measured to prior times. The curve is made non-decreasing and is
    relative to one token, like :class:`VerifyCost`, which it can be used in place of."""

    def __init__(self, prior: VerifyCost | None = None, *, window: int = 15, min_samples: int = 3, refresh: int = 4):
        self.prior = prior or DEFAULT_COST
        self.window, self.min_samples, self.refresh = window, min_samples, refresh
        self._samples: dict[int, deque] = {}
        self._pending = 0
        self._curve: VerifyCost = self.prior
        self._seconds_1: float | None = None

    def observe(self, nodes: int, seconds: float) -> None:
        """One verify pass over ``nodes`` tree nodes took ``seconds``."""
        if nodes < 1 or not seconds > 0:
            return
        b = next(i for i, top in enumerate(_BUCKETS) if nodes <= top)
        self._samples.setdefault(b, deque(maxlen=self.window)).append((nodes, seconds))
        self._pending += 1
        if self._pending >= self.refresh:
            self._rebuild()

    def _rebuild(self) -> None:
        self._pending = 0
        points = {}
        for samples in self._samples.values():
            if len(samples) >= self.min_samples:
                n = statistics.median(s[0] for s in samples)
                points[n] = statistics.median(s[1] for s in samples)
        if not points:
            return
        scale = statistics.median(sec / self.prior(n) for n, sec in points.items())
        for n in self.prior.nodes:  # the prior's shape where nothing was measured nearby
            if not any(abs(n - m) <= 0.25 * n for m in points):
                points[float(n)] = scale * self.prior(n)
        xs = sorted(points)
        values = nondecreasing([points[x] for x in xs])
        one = values[0] if xs[0] <= 1 else scale * self.prior(1)
        xs, values = [1.0] + [x for x in xs if x > 1], [one] + [v for x, v in zip(xs, values) if x > 1]
        self._seconds_1 = one
        self._curve = VerifyCost(tuple(xs), tuple(max(v / one, 1.0) for v in values))

    @property
    def curve(self) -> VerifyCost:
        """The current estimate as a :class:`VerifyCost`."""
        return self._curve

    @property
    def seconds_per_token(self) -> float | None:
        """Estimated seconds of a one-token verify pass (None before enough measurements)."""
        return self._seconds_1

    def __call__(self, n: int) -> float:
        return self._curve(n)

    def table(self, n_max: int, device=None) -> torch.Tensor:
        return self._curve.table(n_max, device)


class BatchCost:
    """A verify-cost curve as one row of a batch of ``rows`` sees it: a pass costs what its total
    rows (batch x tree nodes) cost on ``base``, so ``n`` nodes per row cost
    ``base(rows * n) / base(rows)`` times a plain step of the batch. Trees shrink as the batch
    grows (where ``base`` turns from memory-bound to compute-bound, a node costs nearly a whole
    row), and where no draft can pay, drafters size their trees to the root alone: speculation
    steps back under load. ``seconds_per_token`` is a row's share of a plain batched step, what a
    drafter's own time is weighed against.

    ``alone``: the row drafts alone (the others decode plainly, their trees padded to its own):
    the whole of the pass's growth is its cost, ``1 + rows * (base(rows * n) / base(rows) - 1)``
    times its share of a plain step, so a lone draft at a large batch is sized small or not at all."""

    def __init__(self, base, rows: int, *, alone: bool = False):
        if rows < 1:
            raise ValueError(f"a batch has at least one row, not {rows}")
        self.base, self.rows, self.alone = base, rows, alone

    def __call__(self, n: int) -> float:
        grown = float(self.base(self.rows * max(n, 1))) / float(self.base(self.rows))
        return 1.0 + self.rows * (grown - 1.0) if self.alone else grown

    @property
    def seconds_per_token(self) -> float | None:
        spt = getattr(self.base, "seconds_per_token", None)
        return spt * float(self.base(self.rows)) / self.rows if spt else None

    def observe(self, nodes: int, seconds: float) -> None:
        """The engine gives timed passes to the base curve (in total rows), not to this view."""


def has_timing(cost) -> bool:
    """Whether ``cost`` has measured the seconds of a one-token pass (what the gate needs to
    weigh a draft's wall time against the verifier's)."""
    return bool(getattr(cost, "seconds_per_token", None))


def cost_summary(cost, nodes=(2, 4, 8, 16, 32)) -> dict | None:
    """What a cost curve says now, for benchmark records: relative cost at ``nodes`` and, for an
    :class:`OnlineCost`, the seconds of a one-token pass it measured (None: no curve)."""
    if cost is None:
        return None
    out = {"relative": {n: round(float(cost(n)), 3) for n in nodes}}
    spt = getattr(cost, "seconds_per_token", None)
    if spt is not None:
        out["seconds_per_token"] = round(spt, 5)
    return out


def measure_verify_cost(model, nodes=(1, 4, 8, 16, 32, 64), *, prefix_len: int = 256, repeats: int = 7,
                        linear: str = "auto") -> dict:
    """Median wall time of one verify pass over ``n`` tree nodes after a ``prefix_len`` prefix,
    for each ``n`` in ``nodes``, on the ``linear`` kernel (:mod:`infer.core.kernels`); returns
    ``{"seconds": {n: s}, "relative": {n: s / s(1)}, "kernel": ...}``."""
    from .tree import build_tree
    from .verifier import Verifier

    verifier = Verifier(model, linear=linear)
    vocab = verifier.vocab_size
    g = torch.Generator().manual_seed(0)
    verifier.prefill(torch.randint(0, vocab, (prefix_len,), generator=g))
    seconds = {}
    for n in nodes:
        tree = build_tree([-1] + [(i - 1) // 2 for i in range(1, n)])  # a binary tree
        tokens = torch.randint(0, vocab, (n,), generator=g)
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            verifier.verify(tokens, tree)
            if verifier.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            verifier.rollback()
        seconds[n] = statistics.median(times[1:])
    base = seconds[nodes[0]]
    return {"prefix_len": prefix_len, "seconds": seconds, "relative": {n: s / base for n, s in seconds.items()},
            "kernel": verifier.kernel}


#: Measured with `specheads cost` for the default verifier on the 2-core CPU machine (BENCHMARKS.md).
DEFAULT_COST = VerifyCost((1, 4, 8, 16, 32, 64), (1.0, 1.55, 1.85, 2.1, 2.6, 3.8))


def expected_tokens(alpha: float, depth: int) -> float:
    """Expected tokens from a chain of ``depth`` drafts, each accepted with probability ``alpha``
    given its predecessor was, plus the bonus token: ``sum_{i=0..depth} alpha**i``."""
    return sum(alpha**i for i in range(depth + 1))


def best_chain_depth(alpha: float, max_depth: int, cost: VerifyCost) -> int:
    """The chain depth in ``0..max_depth`` that maximises expected tokens per verify cost."""
    return max(range(max_depth + 1), key=lambda d: (expected_tokens(alpha, d) / cost(d + 1), -d))


@dataclass
class _Ema:
    """An exponential moving average and how many values it has seen."""

    value: float = 0.0
    steps: int = 0

    def add(self, x: float, alpha: float) -> None:
        self.value = x if self.steps == 0 else (1 - alpha) * self.value + alpha * x
        self.steps += 1


@dataclass
class _Bucket:
    """What :class:`SpecPolicy` has measured for one range of batch sizes."""

    plain_time: dict[int, _Ema] = field(default_factory=dict)  # seconds of a step that did not draft, per row count
    extra_tokens: _Ema = field(default_factory=_Ema)  # one row drafting: tokens beyond the plain step's
    extra_time: _Ema = field(default_factory=_Ema)  # one row drafting: seconds beyond the plain step's
    probe_rate: _Ema = field(default_factory=_Ema)  # plain tokens/s at the row counts those probes ran at
    full_gain: _Ema = field(default_factory=_Ema)  # every row drafting: tokens/s over plain tokens/s at its row count
    pause: int = 4
    skip: int = 0
    full_pause: int = 4
    full_skip: int = 0

    @property
    def plain_steps(self) -> int:
        return sum(e.steps for e in self.plain_time.values())

    def plain_seconds(self, rows: int) -> float | None:
        """A plain step's seconds at ``rows`` rows (at the nearest row count measured), or None."""
        if not self.plain_time:
            return None
        return self.plain_time[min(self.plain_time, key=lambda r: (abs(r - rows), r))].value


#: How many of a step's rows draft, as :meth:`SpecPolicy.plan` decides it
PLAIN, ONE, ALL = 0, 1, -1


class SpecPolicy:
    """How many rows of a batched step draft (dynamic speculation): measured, not modelled.

    Per batch-size bucket (2, 3-4, 5-8, 9-16, 17-32, 33-64, more rows) it measures plain steps (seconds, per
    row count), steps where a single row drafts (the tokens and seconds that row's draft adds: its
    marginal rate), and steps where every row drafts (tokens/s over plain tokens/s at the same row
    count). A batch decodes plainly until a single row's draft has measured to add tokens faster
    than plain decoding emits them (by ``margin``); then every row drafts, for as long as that
    measures faster than plain decoding. While plain, one row drafts again after a pause that
    starts at ``first_pause`` steps and doubles (up to ``max_pause``) with every probe that does not
    pay, and is at least long enough that probes cost at most ``probe_share`` of the plain decoding
    time (a probe pads every row to its tree: its cost grows with the batch). Where one row's draft
    did not pay at a smaller batch size, a larger batch (which only adds rows to pad) starts with
    that pause before its own first probe. A single row always drafts (its drafter's own gate
    decides)."""

    #: a bucket's upper row counts: one row's draft that pays at 2 rows (it adds to 2 tokens a step)
    #: says little about 4 (where it must beat 4), so no bucket spans a doubling
    BUCKETS = (1, 2, 4, 8, 16, 32, 64, 1 << 30)

    def __init__(self, *, alpha: float = 0.25, warmup: int = 2, margin: float = 0.05, first_pause: int = 4,
                 max_pause: int = 256, probe_share: float = 0.005):
        self.alpha, self.warmup, self.margin = alpha, warmup, margin
        self.first_pause, self.max_pause, self.probe_share = first_pause, max_pause, probe_share
        self._buckets: dict[int, _Bucket] = {}

    def _bucket(self, rows: int) -> _Bucket:
        b = next(i for i, top in enumerate(self.BUCKETS) if rows <= top)
        if b not in self._buckets:  # where one row's draft did not pay in a smaller batch, it pays less here:
            lost = [k.pause for i, k in self._buckets.items() if i < b and self._measured(k) and not self._one_pays(k)]
            pause = max(lost, default=0)  # wait as long as the smaller batch waits before the first probe
            self._buckets[b] = _Bucket(pause=pause or self.first_pause, skip=pause, full_pause=self.first_pause)
        return self._buckets[b]

    def _measured(self, k: _Bucket) -> bool:
        return k.plain_steps >= self.warmup and k.extra_time.steps >= self.warmup

    def _one_pays(self, k: _Bucket) -> bool:
        """Whether one row's draft adds tokens faster than plain decoding emits them (by the margin)."""
        return k.extra_tokens.value > (1.0 + self.margin) * k.probe_rate.value * max(k.extra_time.value, 1e-9)

    def plan(self, rows: int) -> int:
        """How many rows of a step of ``rows`` rows draft: :data:`ALL`, :data:`ONE` or :data:`PLAIN`."""
        if rows < 2:
            return ALL
        k = self._bucket(rows)
        if k.plain_steps < self.warmup:
            return PLAIN
        if k.extra_time.steps < self.warmup:
            if k.skip > 0:  # the last probe's cost, or a smaller batch's verdict, says wait
                k.skip -= 1
                return PLAIN
            return ONE
        margin = 1.0 + self.margin
        one_pays = self._one_pays(k)
        if one_pays:
            if k.full_gain.steps < self.warmup or k.full_gain.value > margin:
                return ALL
            if k.full_skip > 0:  # every row drafting lost: try it again after a pause that doubles
                k.full_skip -= 1
            else:
                k.full_skip = k.full_pause
                k.full_pause = min(2 * k.full_pause, self.max_pause)
                k.full_gain = _Ema()
                return ALL
        if k.skip > 0:
            k.skip -= 1
            return PLAIN
        k.skip = k.pause  # probe one row now, then pause longer unless it pays
        k.pause = min(2 * k.pause, self.max_pause) if not one_pays else self.first_pause
        return ONE

    def quiet_steps(self, rows: int) -> int:
        """How many of the coming steps of ``rows`` rows :meth:`plan` makes plain whatever is
        recorded meanwhile: where one row's draft has not paid at this size (measured here, or
        not yet here but at a smaller size), the steps before the next probe; else 0. Rows that
        end within them never draft (the engine prefills them without the drafter's features)."""
        if rows < 2:
            return 0
        k = self._bucket(rows)
        if self._measured(k) and self._one_pays(k):
            return 0
        return k.skip + max(self.warmup - k.plain_steps, 0)

    def record(self, rows: int, drafted: int, tokens: int, seconds: float) -> None:
        """A step of ``rows`` rows, ``drafted`` of which drafted, emitted ``tokens`` in ``seconds``.

        Drafting steps are compared with plain steps of the same row count (the nearest measured):
        a bucket holds several row counts, and a plain step of 4 rows emits twice the tokens of one
        of 2 in about the same time. After a probe, the next waits until the probe's extra time is
        at most ``probe_share`` of the plain decoding time in between."""
        if rows < 2 or not seconds > 0:
            return
        k, a = self._bucket(rows), self.alpha
        if drafted == 0:
            k.plain_time.setdefault(rows, _Ema()).add(seconds, a)
            return
        plain = k.plain_seconds(rows)
        if plain is None:
            return
        if drafted < rows:
            extra = max(seconds - plain, 0.0)
            k.extra_tokens.add((tokens - rows) / drafted, a)
            k.extra_time.add(extra / drafted, a)
            k.probe_rate.add(rows / plain, a)
            if (tokens - rows) * plain < (1.0 + self.margin) * rows * extra:  # this probe did not pay
                k.skip = max(k.skip, math.ceil(extra / (self.probe_share * plain)))
        else:
            k.full_gain.add((tokens / seconds) / (rows / plain), a)

    def state(self) -> dict:
        """What was measured per bucket, for benchmark records."""
        return {f"<= {self.BUCKETS[b]} rows": {"plain_ms": {r: round(1e3 * e.value, 2) for r, e in sorted(k.plain_time.items())},
                                               "one_row_extra_tokens": round(k.extra_tokens.value, 3),
                                               "one_row_extra_ms": round(1e3 * k.extra_time.value, 2),
                                               "all_rows_gain": round(k.full_gain.value, 3)}
                for b, k in sorted(self._buckets.items())}
