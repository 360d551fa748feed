"""Scheduling speculation: what a draft costs, and how much of it each step may draft.

The engine owns one :class:`Schedule`. It holds the verifier's cost of checking a tree (a
measured :class:`VerifyCost`, learnt online as :class:`OnlineCost`, seen from a batch as
:class:`BatchCost`), the drafter's own measured cost per drafted node (:class:`DraftCost`), the
batch's draft-or-plain policy (:class:`SpecPolicy`) and every row's :class:`Gate`; all of them
pause with one primitive, :class:`Backoff`. Each step it gives every drafting row a
:class:`~infer.core.drafter.Budget`: the depth it may reach and the price of a draft of ``n``
nodes in plain steps, drafting included, so that a drafter sizes its tree to what pays, and a
drafter that cannot pay is not asked at all.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from .tree import MAX_TREE_DEPTH


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
    for each ``n`` in ``nodes``, through the engine's batched verify (one row) on the ``linear``
    kernel (:mod:`infer.core.kernels`); ``model``: an HF causal LM or a
    :class:`~infer.core.verifier.Verifier` (whose rows are dropped). Returns ``{"seconds": {n: s},
    "relative": {n: s / s(1)}, "kernel": ...}``."""
    from .batch import stack_drafts
    from .drafter import host_draft
    from .verifier import Verifier

    verifier = model if isinstance(model, Verifier) else Verifier(model, linear=linear)
    vocab = verifier.vocab_size
    g = torch.Generator().manual_seed(0)
    verifier.drop_rows([])
    verifier.add_rows([torch.randint(0, vocab, (prefix_len,), generator=g)], features=False)
    seconds = {}
    for n in nodes:
        parents = [-1] + [(i - 1) // 2 for i in range(1, n)]  # a binary tree
        trees = stack_drafts([host_draft(torch.randint(0, vocab, (n,), generator=g).tolist(), parents)], verifier.device)
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            verifier.verify_rows(trees, features=False)
            if verifier.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            verifier.rollback()
        seconds[n] = statistics.median(times[1:])
    verifier.drop_rows([])
    base = seconds[nodes[0]]
    return {"prefix_len": prefix_len, "seconds": seconds, "relative": {n: s / base for n, s in seconds.items()},
            "kernel": verifier.kernel}


def probe_cost(verifier) -> OnlineCost | None:
    """The verify-cost curve to size drafts by: a short probe (about a second on a small model)
    of ``verifier`` (a :class:`~infer.core.verifier.Verifier`), refined by the engine's own
    measurements. None when the model is so fast that the probe is timing noise (tiny test
    models): drafts then keep their fixed size."""
    prior = VerifyCost.from_measurement(measure_verify_cost(verifier, (1, 2, 4, 8, 16, 32), prefix_len=128, repeats=3))
    return OnlineCost(prior) if prior is not None else None


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
class Backoff:
    """A pause before the next try of something that did not pay, doubling with every try that
    does not pay (from ``first`` up to ``most`` steps), reset by one that does. The one pause
    every controller here uses: a row's :class:`Gate`, the batch's probes and full drafting in
    :class:`SpecPolicy`, and the :class:`Schedule`'s refusal of a drafter that cannot pay."""

    first: int = 1
    most: int = 64
    pause: int = 0  # the pause after the next try that does not pay (0: ``first``)
    skip: int = 0  # steps left in the current pause

    def __post_init__(self) -> None:
        self.pause = self.pause or self.first

    def waiting(self) -> bool:
        """Whether this step falls in the pause (counting it down)."""
        if self.skip > 0:
            self.skip -= 1
            return True
        return False

    def failed(self, *, reset: bool = False) -> None:
        """A try did not pay: pause for ``pause`` steps, and double the next pause (``reset``: the
        next pause is ``first`` again)."""
        self.skip = self.pause
        self.pause = self.first if reset else min(2 * self.pause, self.most)

    def paid(self) -> None:
        """A try paid: no pause, and the next one starts from ``first``."""
        self.pause, self.skip = self.first, 0

    def hold(self, steps: int) -> None:
        """Pause at least ``steps`` steps from now."""
        self.skip = max(self.skip, steps)


@dataclass
class _Bucket:
    """What :class:`SpecPolicy` has measured for one range of batch sizes."""

    probe: Backoff  # the pause before one row drafts again while one row's draft does not pay
    full: Backoff  # the pause before every row drafts again after that lost
    plain_time: dict[int, _Ema] = field(default_factory=dict)  # seconds of a step that did not draft, per row count
    extra_tokens: _Ema = field(default_factory=_Ema)  # one row drafting: tokens beyond the plain step's
    extra_time: _Ema = field(default_factory=_Ema)  # one row drafting: seconds beyond the plain step's
    probe_rate: _Ema = field(default_factory=_Ema)  # plain tokens/s at the row counts those probes ran at
    full_gain: _Ema = field(default_factory=_Ema)  # every row drafting: tokens/s over plain tokens/s at its row count

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
    that pause before its own first probe. A single row always drafts (its :class:`Gate` decides)."""

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
            lost = [k.probe.pause for i, k in self._buckets.items() if i < b and self._measured(k) and not self._one_pays(k)]
            pause = max(lost, default=0)  # wait as long as the smaller batch waits before the first probe
            self._buckets[b] = _Bucket(probe=Backoff(self.first_pause, self.max_pause, pause=pause, skip=pause),
                                       full=Backoff(self.first_pause, self.max_pause))
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
        if k.extra_time.steps < self.warmup:  # the last probe's cost, or a smaller batch's verdict, may say wait
            return PLAIN if k.probe.waiting() else ONE
        one_pays = self._one_pays(k)
        if one_pays and not k.full.waiting():  # (waiting: every row drafting lost, and its pause runs)
            if k.full_gain.steps < self.warmup or k.full_gain.value > 1.0 + self.margin:
                return ALL  # a try being measured (the first, or one after a pause), or one that pays
            k.full.failed()  # it lost: not again before a pause that doubles, then measured afresh
            k.full_gain = _Ema()
        if k.probe.waiting():
            return PLAIN
        k.probe.failed(reset=one_pays)  # probe one row now, then pause longer unless it pays
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
        return k.probe.skip + max(self.warmup - k.plain_steps, 0)

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
                k.probe.hold(math.ceil(extra / (self.probe_share * plain)))
        else:
            k.full_gain.add((tokens / seconds) / (rows / plain), a)

    def state(self) -> dict:
        """What was measured per bucket, for benchmark records."""
        return {f"<= {self.BUCKETS[b]} rows": {"plain_ms": {r: round(1e3 * e.value, 2) for r, e in sorted(k.plain_time.items())},
                                               "one_row_extra_tokens": round(k.extra_tokens.value, 3),
                                               "one_row_extra_ms": round(1e3 * k.extra_time.value, 2),
                                               "all_rows_gain": round(k.full_gain.value, 3)}
                for b, k in sorted(self._buckets.items())}


@dataclass
class Gate:
    """Whether one row's drafting pays: an exponential moving average of each drafted step's gain
    (tokens it emitted over its cost in plain steps, drafting included; 1.0 = as fast as not
    drafting). Below 1, the row decodes plainly for a pause (:class:`Backoff`, 1 step doubling up
    to 64: a head that never pays, e.g. when sampling from a broad distribution, costs one probe
    per 65 steps) and then probes once; a probe counts on its own. Host floats only."""

    ema: float = 1.2
    backoff: Backoff = field(default_factory=lambda: Backoff(1, 64))
    alpha: float = 0.3
    paused: int = 0  # steps it paused drafting for

    def should_draft(self) -> bool:
        if self.backoff.waiting():
            self.paused += 1
            return False
        return True

    def record(self, gain: float) -> None:
        """One drafted step's ``gain``."""
        gain = float(gain)
        probe = self.backoff.pause > self.backoff.first
        self.ema = gain if probe else (1 - self.alpha) * self.ema + self.alpha * gain
        if self.ema > 1.0:
            self.backoff.paid()
        else:
            self.backoff.failed()

    def carried(self) -> Gate:
        """The gate the next sampled generation starts from: one still drafting where this one
        ended drafting; else one paused for half of this one's next pause, then probing (a head's
        value for one kind of generation seldom changes from one prompt to the next: at
        temperature 1.0, where it rarely pays, a fresh gate drafted ~10 of 256 steps to learn it
        again). Halving forgets: generations too short to probe shorten the pause."""
        if self.ema > 1.0:
            return Gate(self.ema)
        pause = max(1, self.backoff.pause // 2)
        return Gate(self.ema, Backoff(1, 64, pause=pause, skip=pause))


def draft_gain(verify, nodes: int, accepted: int, draft_s: float, *, free: float = 0.01) -> float | None:
    """A drafted step's gain for a :class:`Gate`: the ``1 + accepted`` tokens a ``nodes``-node
    draft emitted over its cost in plain steps, the verify pass over its nodes (``verify``, a
    curve with ``seconds_per_token``) plus its drafting seconds ``draft_s``. None where there is
    nothing to judge: no curve timed yet, or a root-only draft that cost under ``free`` of a plain
    step (a prompt lookup that found nothing); a root-only draft that cost more (a head that
    pays a pass, then finds that no tree pays) is judged at its drafting cost."""
    spt = getattr(verify, "seconds_per_token", None)
    if not spt:
        return None
    drafting = draft_s / spt
    if nodes <= 1 and drafting < free:
        return None
    return (1.0 + accepted) / (float(verify(max(nodes, 1))) + drafting)


@dataclass(frozen=True)
class DraftSeconds:
    """A proposal's drafting time: ``fixed`` seconds whenever a row drafts at all (catching the
    drafter up, a head pass that does not grow with the tree) and ``per_node`` seconds per drafted
    node beyond the root."""

    fixed: float
    per_node: float


class DraftCost:
    """The drafter's own cost as the engine times its proposals (not a row's first, which also
    feeds the drafter its prompt), from the last ``window`` drafting steps, known after
    ``min_samples`` of them: ``fixed + per_node * nodes`` (:class:`DraftSeconds`) fitted robustly
    (Theil-Sen: the median of the slopes between steps of unlike sizes, the median intercept)
    where the steps drafted unlike numbers of nodes; where they all drafted alike (the cautious
    one-node drafts that measure a drafter first), every second is counted per node, which never
    underprices a large draft. Counting an average per node instead overprices the large trees of
    a drafter with a fixed cost (an EAGLE head's catch-up, a Medusa pass), so that it drafts
    smaller trees, whose average per node is higher still."""

    def __init__(self, *, window: int = 15, min_samples: int = 2):
        self.window, self.min_samples = window, min_samples
        self._samples: deque = deque(maxlen=window)
        self._fit: DraftSeconds | None = None  # of the samples as they are; None: fit again

    def observe(self, nodes: int, seconds: float) -> None:
        """A proposal drafted ``nodes`` nodes beyond its roots in ``seconds`` (none: its fixed
        cost counted as one node's)."""
        if seconds > 0:
            self._samples.append((max(nodes, 1), seconds))
            self._fit = None

    @property
    def seconds(self) -> DraftSeconds | None:
        """The fitted cost (see the class docstring), or None before ``min_samples`` steps; fitted
        once per observation (the engine prices several drafts between two)."""
        if len(self._samples) < self.min_samples:
            return None
        if self._fit is None:
            self._fit = fit_draft_seconds(list(self._samples))
        return self._fit

    @property
    def seconds_per_node(self) -> float | None:
        """The average seconds per drafted node (for the records), or None before it is known."""
        if len(self._samples) < self.min_samples:
            return None
        return statistics.median(s / n for n, s in self._samples)


def fit_draft_seconds(samples: list[tuple[int, float]]) -> DraftSeconds:
    """``samples`` ``(nodes, seconds)`` -> :class:`DraftSeconds` (see :class:`DraftCost`); the
    slope is at least 0 and at most the largest average per node, the intercept at least 0."""
    slopes = [(s2 - s1) / (n2 - n1) for i, (n1, s1) in enumerate(samples) for n2, s2 in samples[i + 1:] if n2 != n1]
    if not slopes:
        return DraftSeconds(0.0, statistics.median(s / n for n, s in samples))
    per_node = min(max(statistics.median(slopes), 0.0), max(s / n for n, s in samples))
    return DraftSeconds(max(statistics.median(s - per_node * n for n, s in samples), 0.0), per_node)


@dataclass(frozen=True)
class Price:
    """What a draft of ``n`` nodes costs one row, in its plain steps: the verify pass over ``n``
    nodes (``verify``, a curve such as :class:`BatchCost`) plus, where it drafts at all
    (``n > 1``), ``fixed`` plain steps and ``draft`` plain steps per node beyond the root. Drafters
    size their trees by it (:class:`~infer.core.drafter.Budget`)."""

    verify: object
    draft: float = 0.0
    fixed: float = 0.0

    def __call__(self, n: int) -> float:
        return float(self.verify(n)) + (self.fixed + self.draft * (n - 1) if n > 1 else 0.0)

    def pays(self, depth: int, margin: float = 0.05) -> bool:
        """Whether any draft of at most ``depth`` levels could pay: a chain of ``d`` tokens, all
        accepted, emits ``d + 1`` tokens for ``self(d + 1)`` plain steps, more than ``1 + margin``
        tokens per plain step. The margin: a drafter whose best case gains under 5% (a draft model
        as costly as the verifier measures a hair under a plain step per token) loses more than
        that on what the price leaves out (feeding it a new row's prompt, a rejected token). No
        tree is deeper than :data:`~infer.core.tree.MAX_TREE_DEPTH`, so no deeper chain is priced."""
        return any((d + 1) / self(d + 1) > 1.0 + margin for d in range(1, min(depth, MAX_TREE_DEPTH) + 1))



class AllDraft:
    """The batch policy of an untimed schedule: every row drafts at every step."""

    def plan(self, rows: int) -> int:
        return ALL

    def quiet_steps(self, rows: int) -> int:
        return 0

    def record(self, rows: int, drafted: int, tokens: int, seconds: float) -> None:
        pass

    def state(self) -> dict:
        return {}


@dataclass
class RowView:
    """What the schedule needs of one running row: whether it may draft at all (``warm``), the
    deepest draft its token limit leaves (``depth``), and its :class:`Gate`."""

    warm: bool
    depth: int
    gate: Gate


@dataclass(frozen=True)
class StepRecord:
    """One decode step as the engine timed it: ``rows`` rows, ``drafted`` of which drafted,
    emitting ``tokens`` in ``seconds``; the verify pass over ``verify_nodes`` nodes (rows x padded
    tree) in ``verify_s``; the proposal of ``draft_nodes`` nodes beyond the roots in ``draft_s``."""

    rows: int
    drafted: int
    tokens: int
    seconds: float
    verify_nodes: int
    verify_s: float
    draft_nodes: int = 0
    draft_s: float = 0.0


class Schedule:
    """Every scheduling decision of one :class:`~infer.core.engine.Engine` (it owns one, for as
    long as it lives, so what it learns persists from one generation to the next).

    ``cost``: the verify-cost curve (an :class:`OnlineCost` learns from every timed pass; a
    :class:`VerifyCost` is fixed; None: drafts keep their fixed size and no gate runs).
    ``policy``: the batch's draft-or-plain policy (default: :class:`SpecPolicy` where the cost is
    measured, else :class:`AllDraft`: nothing timed decides anything).

    Each step, :meth:`plan` gives every row a :class:`~infer.core.drafter.Budget` or None (plain):
    the policy picks the rows that may draft, each row's :class:`Gate` may pause it, and the
    budget's :class:`Price` adds the drafter's measured cost per node (:class:`DraftCost`) to the
    verify cost of the batch as the row sees it (:class:`BatchCost`). Until that cost is measured
    a draft is one node deep; where it makes every draft a loss, no row drafts for a pause that
    starts at ``refusal_pause`` steps and doubles, and then the price is weighed again with the
    cost measured (it is steady: measuring it again would mean feeding a draft model the whole
    context it missed). A row whose probe loses waits until the loss is ``probe_share`` of the
    plain steps in between where drafting the probe took a plain step or more (:meth:`judge`)."""

    def __init__(self, cost=None, policy=None, *, refusal_pause: int = 256, max_refusal_pause: int = 8192,
                 probe_share: float = 0.02):
        self.cost, self.probe_share = cost, probe_share
        measured = has_timing(cost) or isinstance(cost, OnlineCost)
        self.policy = policy if policy is not None else SpecPolicy() if measured else AllDraft()
        self.draft = DraftCost()
        self.refusal = Backoff(refusal_pause, max_refusal_pause)
        self._sampled_gate: Gate | None = None
        self._probe = 0  # the row that drafts when the policy probes one
        self._view = None  # the verify-cost view of the last planned step
        self.measuring = False  # while the engine measures the drafter: one-node drafts, no gate, no refusal

    @property
    def timed(self) -> bool:
        """Whether the cost curve knows a plain step's seconds (drafting can then be weighed)."""
        return has_timing(self.cost)

    def gate(self, sampled: bool) -> Gate:
        """A new row's gate: a sampled row starts from the last sampled row's (:meth:`Gate.carried`),
        a greedy row fresh (greedy acceptance depends on the prompt: code and copied text against free writing)."""
        return self._sampled_gate.carried() if sampled and self._sampled_gate is not None else Gate()

    def retire(self, gate: Gate, sampled: bool) -> None:
        """A row left: a sampled row's gate is what the next sampled row starts from."""
        if sampled:
            self._sampled_gate = gate

    def quiet_steps(self, rows: int, depth: int = MAX_TREE_DEPTH) -> int:
        """Coming steps of ``rows`` rows that are plain whatever happens: the policy's
        (:meth:`SpecPolicy.quiet_steps`), the refusal's pause while it runs, and the pause a
        refusal would start where the drafter's measured cost makes every draft of up to ``depth``
        levels a loss at this batch size (rows that join then are never fed to a draft model that
        would not draft for them)."""
        quiet = self.policy.quiet_steps(rows)
        if not self.timed or self.measuring:
            return quiet
        price = self.price(rows)
        refused = price is not None and not price.pays(depth)
        return max(quiet, self.refusal.skip, self.refusal.pause if refused else 0)

    def _view_of(self, rows: int, alone: bool):
        return self.cost if rows == 1 and not alone else BatchCost(self.cost, rows, alone=alone)

    def price(self, rows: int, alone: bool = False) -> Price | None:
        """What a draft costs one row of ``rows`` (``alone``: the only one drafting), its drafting
        rounded to a hundredth of a plain step; None before the drafter's own cost is measured."""
        view = self._view_of(rows, alone)
        drafting, spt = self.draft.seconds, getattr(view, "seconds_per_token", None)
        if drafting is None or not spt:
            return None
        # to a hundredth of a plain step: a price that stays the same keeps the drafters' cost tables
        return Price(view, round(drafting.per_node / spt, 2), round(drafting.fixed / spt, 2))

    def plan(self, rows: list[RowView]) -> list:
        """Each row's budget this step (None: it decodes plainly)."""
        from .drafter import Budget

        n = len(rows)
        plan = self.policy.plan(n)
        if plan == ONE:  # one warm row drafts, the warm rows in turn
            turn = [(self._probe + 1 + j) % n for j in range(n)]
            self._probe = next((i for i in turn if rows[i].warm), self._probe)
        chosen = [r.warm and r.depth > 0 and (plan == ALL or (plan == ONE and i == self._probe)) for i, r in enumerate(rows)]
        if not any(chosen) or self.cost is None:
            return [Budget(r.depth) if c else None for r, c in zip(rows, chosen)]
        if self.measuring:  # the engine's probe of the drafter's own cost: every chosen row drafts a node
            self._view = self._view_of(n, plan == ONE)
            return [Budget(min(r.depth, 1), cost=self._view) if c else None for r, c in zip(rows, chosen)]
        if self.timed and self.refusal.waiting():
            return [None] * n
        self._view = self._view_of(n, plan == ONE)
        price, depth = self.price(n, plan == ONE), max(r.depth for r, c in zip(rows, chosen) if c)
        if price is not None and not price.pays(depth):  # no draft the rows have room for pays
            if not price.pays(MAX_TREE_DEPTH):  # nor would any: the drafter's own cost makes every draft a loss,
                self.refusal.failed()  # priced again after the pause (a drafter's own cost is steady)
            return [None] * n  # (rows near their end: this step only, not the next generation's)
        budgets = []
        for r, c in zip(rows, chosen):
            if not c or (self.timed and not r.gate.should_draft()):
                budgets.append(None)
            elif price is None:  # not measured yet: one node deep, priced by the verifier alone
                budgets.append(Budget(min(r.depth, 1) if self.timed else r.depth, cost=self._view))
            else:
                budgets.append(Budget(r.depth, cost=price))
        return budgets

    def record(self, step: StepRecord) -> None:
        """What a decode step measured: the verify pass, the batch's rates, the drafter's cost."""
        observe = getattr(self.cost, "observe", None)
        if observe is not None and step.verify_nodes:
            observe(step.verify_nodes, step.verify_s)
        self.policy.record(step.rows, step.drafted, step.tokens, step.seconds)
        if step.drafted:
            self.draft.observe(step.draft_nodes, step.draft_s)

    def judge(self, gate: Gate, nodes: int, accepted: int, draft_s: float) -> None:
        """A row's drafted step: ``accepted`` of its ``nodes``-node draft, drafted in its share
        ``draft_s`` of the proposal (:func:`draft_gain`: a root-only draft is judged by what
        proposing it cost, so that a drafter that pays to propose nothing is paused too).
        Where drafting it took a plain step or more (a draft model), a probe (the first draft after
        a pause) that does not pay pauses the row at least until what it lost is ``probe_share``
        of the plain steps in between, as the batch's probes do, so that such a drafter probes
        seldom; a cheaper drafter's lost probe costs less than a plain step, and the gate's
        doubling pause (at most 64 steps) bounds it (holding a head's row for dozens of steps
        after one lost probe missed the stretches where it pays)."""
        gain = draft_gain(self._view, nodes, accepted, draft_s) if self.timed else None
        if gain is None:
            return
        cost = (1.0 + accepted) / gain
        probe = gate.backoff.pause > gate.backoff.first
        gate.record(gain)
        if probe and gate.backoff.skip and draft_s >= self._view.seconds_per_token:
            gate.backoff.hold(min(math.ceil((cost - 1.0 - accepted) / self.probe_share), 1 << 20))

    def state(self) -> dict:
        """What was learnt, for benchmark records."""
        spn, fitted = self.draft.seconds_per_node, self.draft.seconds
        return {"cost": cost_summary(self.cost), "draft_ms_per_node": round(1e3 * spn, 3) if spn else None,
                "draft_ms": None if fitted is None else {"fixed": round(1e3 * fitted.fixed, 3),
                                                        "per_node": round(1e3 * fitted.per_node, 3)},
                "refusal_pause": self.refusal.skip, "batch": self.policy.state()}
