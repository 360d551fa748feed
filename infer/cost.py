"""The verifier's cost of checking a tree, and choosing draft sizes that pay for themselves.

Verifying ``n`` tree nodes costs more than one token (on CPU the matrix products stop being
memory-bound), so a draft is worth its size only if the tokens it is expected to add outweigh
that cost. :class:`VerifyCost` holds the measured curve (``specheads cost`` measures it);
:func:`best_chain_depth` picks the draft depth that maximises expected tokens per unit of time.
"""

from __future__ import annotations

from dataclasses import dataclass


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

    @classmethod
    def from_measurement(cls, measured: dict, min_token_seconds: float = 2e-3) -> VerifyCost | None:
        """From :func:`infer.bench.measure_verify_cost`'s result, made non-decreasing (a bigger
        tree never costs less; a dip is timing noise). ``None`` when the measurement cannot be
        trusted to size trees: one token takes under ``min_token_seconds`` (tiny models, where
        Python overhead and noise dominate). A flat curve is kept: big trees are then cheap."""
        rel = {int(n): float(r) for n, r in measured["relative"].items()}  # JSON keys are strings
        secs = {int(n): float(s) for n, s in measured.get("seconds", {}).items()}
        nodes = sorted(rel)
        if secs and secs[nodes[0]] < min_token_seconds:
            return None
        values, top = [], 0.0
        for n in nodes:
            top = max(top, rel[n])
            values.append(top)
        return cls(tuple(nodes), tuple(values))


#: Measured with `specheads cost` for the default verifier on the 2-core CPU machine (BENCHMARKS.md).
DEFAULT_COST = VerifyCost((1, 4, 8, 16, 32, 64), (1.0, 1.55, 1.85, 2.1, 2.6, 3.8))


def expected_tokens(alpha: float, depth: int) -> float:
    """Expected tokens from a chain of ``depth`` drafts, each accepted with probability ``alpha``
    given its predecessor was, plus the bonus token: ``sum_{i=0..depth} alpha**i``."""
    return sum(alpha**i for i in range(depth + 1))


def best_chain_depth(alpha: float, max_depth: int, cost: VerifyCost) -> int:
    """The chain depth in ``0..max_depth`` that maximises expected tokens per verify cost."""
    return max(range(max_depth + 1), key=lambda d: (expected_tokens(alpha, d) / cost(d + 1), -d))
