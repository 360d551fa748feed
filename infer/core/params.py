"""Sampling parameters: one type, checked once, used by the engine, the command line and
self-distillation alike (a bad value is refused before anything is loaded)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import UserError

MAX_SEED = 2**64 - 1


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to generate.

    Attributes:
        max_new_tokens: exact upper bound on new tokens (>= 1).
        temperature: 0 = greedy; otherwise sample (<= 100) with ``top_p`` / ``top_k`` as HF does.
        top_p: nucleus mass in (0, 1]; top_k: 0 = off.
        seed: randomness of sampling (0 .. 2**64 - 1); None = a fresh seed.
        acceptance: ``exact`` (lossless) or ``typical`` (Medusa's typical acceptance, lossy).
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    acceptance: str = "exact"

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be a positive integer, not {self.max_new_tokens!r}")
        t = self.temperature
        if not (isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and 0 <= t <= 100):
            raise UserError(f"temperature must be between 0 (greedy) and 100, not {t!r}")
        if not (isinstance(self.top_p, (int, float)) and not isinstance(self.top_p, bool) and 0 < self.top_p <= 1):
            raise UserError(f"top_p must be in (0, 1], not {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise UserError(f"top_k must be a non-negative integer (0 = off), not {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise UserError(f"seed must be an integer from 0 to 2**64 - 1, not {self.seed!r}")
        if self.acceptance not in ("exact", "typical"):
            raise UserError(f"acceptance must be 'exact' or 'typical', not {self.acceptance!r}")

    @property
    def greedy(self) -> bool:
        """Plain greedy decoding (temperature 0 with exact acceptance)."""
        return self.temperature == 0 and self.acceptance == "exact"
