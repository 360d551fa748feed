"""Acceptance rules: which root-to-node path of each row's verified tree to keep, and the bonus token.

All functions are pure tensor functions over a batch of rows (a :class:`~infer.core.batch.TreeBatch`;
one prompt is a batch of one): each rule returns every row's accepted end node and bonus token
on the device, and :func:`read_back_rows` reads them to the host once for the whole batch, as an
:class:`Acceptance` per row (the accepted node indices, root first, and the new tokens).

Exact sampling of a deterministic draft needs no rule of its own: the verifier's token after each
node is drawn with counter-based noise (:func:`position_uniforms`, :func:`noise_sample`) and the
greedy rule (:func:`greedy_rows`) accepts a child when it equals its parent's token. A child is
then accepted with probability ``p(child)``, as with sibling-by-sibling rejection, and the emitted
text depends on the seed, the positions and the verifier alone. :func:`q_rows` is the rule for
drafts that carry their ``q``; :func:`typical_rows` is Medusa's lossy one. Their noise is counter
based too (:func:`row_uniforms`), so no rule keeps state.

Names follow the papers: ``p`` is the verifier's (target) distribution, ``q`` the draft's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .batch import TreeBatch


@dataclass(frozen=True)
class Acceptance:
    """Accepted path and bonus token.

    Attributes:
        nodes: ``[k]`` long, on the tree's device: tree node indices from the root (always node 0)
            to the deepest accepted node; ``k - 1`` draft tokens were accepted.
        bonus: the verifier's token after the last accepted node.
        node_ids: the same ``k`` indices on the host.
        tokens: the new tokens on the host: the accepted draft tokens (root excluded), then the bonus.
    """

    nodes: torch.Tensor
    bonus: int
    node_ids: tuple[int, ...]
    tokens: tuple[int, ...]


def warp_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The verifier's sampling distribution, as HF ``generate`` builds it (temperature, then
    top-k, then top-p), for ``logits`` ``[..., V]``; returns probabilities ``[..., V]`` (float32).

    ``temperature`` must be > 0; greedy decoding does not sample and never calls this.
    """
    scores = logits.float() / temperature
    if top_k and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, sorted_idx = torch.sort(scores, descending=False, dim=-1)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        remove_sorted = cum <= (1 - top_p)
        remove_sorted[..., -1:] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores.softmax(-1)


_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 ``x`` in ``[0, 2**32)``: in 16-bit halves of ``c``, so no
    intermediate leaves int64 (no overflow to rely on, on any backend)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32): a bijection of ``[0, 2**32)`` that mixes every bit."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seed_tensor(seeds: Sequence[int], device=None) -> torch.Tensor:
    """Seeds ``0 .. 2**64 - 1`` as an int64 tensor ``[B]`` (two's complement above ``2**63 - 1``)."""
    return torch.tensor([s - (1 << 64) if s >= 1 << 63 else s for s in seeds], dtype=torch.long).to(device)


def position_uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Counter-based noise: one uniform in ``(0, 1)`` per (seed, position), a pure tensor function.

    Args:
        seeds: ``[B]`` int64 (:func:`seed_tensor`).
        positions: ``[B, ...]`` int64, ``0 <= position < 2**32``: where in the sequence the
            sampled token goes.

    Returns ``[B, ...]`` float64 with 52 random bits, the same on every device and in every batch:
    nothing is drawn from a stateful generator, so a seeded row's randomness at a position does
    not depend on what was drafted, verified or batched before it (and the step stays capturable).
    """
    shape = (-1,) + (1,) * (positions.dim() - 1)
    lo, hi = (seeds & _M32).view(shape), ((seeds >> 32) & _M32).view(shape)
    pos = positions & _M32
    a = _mix32(_mix32(_mix32(pos ^ 0x9E3779B9) ^ lo) ^ hi)
    b = _mix32(_mix32(_mix32(pos ^ 0x85EBCA6B) ^ hi) ^ lo)
    bits = (a << 20) | (b >> 12)  # 52 bits
    return (bits.double() + 0.5) / float(1 << 52)


def noise_sample(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token that inverse-CDF sampling from ``p [..., V]`` picks with uniforms ``u [...]``:
    ``[...]`` long. For ``u`` uniform, the token is distributed as ``p`` exactly; a token without
    mass is never picked."""
    cdf = p.double().cumsum(-1)
    x = (u * cdf[..., -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, x, right=True).clamp(max=p.shape[-1] - 1)
    ok = p.gather(-1, idx) > 0  # only where rounding put x at the very end of the cdf
    return torch.where(ok, idx, p.argmax(-1, keepdim=True)).squeeze(-1)


# --------------------------------------------------------------------------------------------
# A batch of rows: one tree per row (infer.core.batch.TreeBatch), one read back for them all
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowsAcceptance:
    """The accepted path and bonus token of every row of a batch.

    Attributes:
        paths: ``[B, N]`` long on the device: row ``b``'s accepted node indices, root first, in
            its first ``k_b`` entries (what follows is padding).
        lengths: ``[B]`` long on the device: ``k_b``.
        rows: per row, its :class:`Acceptance` (``nodes`` a view of ``paths``).
    """

    paths: torch.Tensor
    lengths: torch.Tensor
    rows: tuple[Acceptance, ...]


def _row_at(t: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """``t[b, i[b]]`` for ``t [B, N, ...]`` and ``i [B]``, gathered on the device: ``[B, ...]``."""
    index = i.view(-1, 1, *([1] * (t.dim() - 2))).expand(t.shape[0], 1, *t.shape[2:])
    return t.gather(1, index).squeeze(1)


def read_back_rows(trees: TreeBatch, end: torch.Tensor, bonus: torch.Tensor) -> RowsAcceptance:
    """Every row's path from its root to node ``end[b]`` and its ``bonus[b]`` token, read to the
    host in one transfer for the whole batch."""
    b, n = trees.tokens.shape
    on_path = _row_at(trees.ancestor_mask, end)  # [B, N]
    idx = torch.arange(n, device=on_path.device)
    paths = torch.sort(torch.where(on_path, idx, n), dim=-1).values  # [B, N], padded with n
    lengths = on_path.sum(-1)
    paths = paths.clamp(max=n - 1)
    toks = trees.tokens.gather(1, paths)
    host = torch.cat([lengths[:, None], bonus.view(b, 1).to(torch.long), paths, toks], dim=1).tolist()
    rows = []
    for r, row in enumerate(host):
        k, bonus_id = row[0], row[1]
        rows.append(Acceptance(nodes=paths[r, :k], bonus=bonus_id, node_ids=tuple(row[2 : 2 + k]),
                               tokens=tuple(row[3 + n : 2 + n + k]) + (bonus_id,)))
    return RowsAcceptance(paths, lengths, tuple(rows))


def _deepest_valid_rows(trees: TreeBatch, node_ok: torch.Tensor) -> torch.Tensor:
    """``[B]``: per row, the deepest node whose whole root path is ``node_ok [B, N]`` (first on ties)."""
    path_ok = ~(trees.ancestor_mask & ~node_ok[:, None, :]).any(-1)  # [B, N]
    return torch.where(path_ok, trees.depths, -1).argmax(-1)




# --------------------------------------------------------------------------------------------
# Every rule for a batch: each returns the rows' accepted end nodes and bonus tokens, ``[B]``
# each, on the device; :func:`read_back_rows` reads them once for the whole batch
# --------------------------------------------------------------------------------------------

#: seed streams of a row's noise, one per use: the sampled token at each position (the seed
#: itself), the acceptance of a node with its ``q``, and the bonus token of a q or typical row
_NODE_STREAM, _BONUS_STREAM = 0x5BD1E995_00000000, 0x27D4EB2F_00000000
#: a step's node ``i`` draws at position ``first * NODE_SLOTS + i`` of its stream (trees are smaller)
NODE_SLOTS = 2048


def greedy_rows(trees: TreeBatch, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(end, bonus)`` ``[B]`` each: a child is accepted when it equals ``target [B, N]`` (the
    verifier's token) at its parent; the bonus is the target at the end."""
    parents = trees.parents.clamp(min=0)
    match = trees.valid & (trees.tokens == target.gather(1, parents))
    match[:, 0] = True
    end = _deepest_valid_rows(trees, match)
    return end, target.gather(1, end[:, None])[:, 0]


def row_uniforms(keys: torch.Tensor, first: Sequence[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The acceptance noise of rows keyed ``keys [B]`` (on the device) whose step's first new
    token goes at position ``first[b]`` (host ints): one uniform per node ``[B, n]`` and one for
    the bonus ``[B]`` (float64), from streams of their own (:func:`position_uniforms`)."""
    nodes = torch.arange(n, device=keys.device)
    at_nodes = torch.stack([nodes + f * NODE_SLOTS for f in first])  # made on the device: no copy
    at_bonus = torch.stack([nodes[:1] + f for f in first])
    return position_uniforms(keys ^ _NODE_STREAM, at_nodes), position_uniforms(keys ^ _BONUS_STREAM, at_bonus)[:, 0]


def rows_of(trees: TreeBatch, rows: Sequence[int]) -> TreeBatch:
    """The batch of ``trees``' rows ``rows`` (host ints; stacked views: nothing copied from the host)."""
    pick = lambda t: torch.stack([t[r] for r in rows])  # noqa: E731
    return TreeBatch(pick(trees.tokens), pick(trees.parents), pick(trees.depths), pick(trees.ancestor_mask),
                     pick(trees.valid), pick(trees.q) if trees.q is not None else None,
                     tuple(trees.sizes[r] for r in rows), trees.max_depth, trees.width)


def typical_rows(trees: TreeBatch, probs: torch.Tensor, u_bonus: torch.Tensor, *, posterior_threshold: float = 0.09,
                 posterior_alpha: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    """Medusa's typical acceptance, every row at once: ``(end, bonus)`` ``[B]``. **Lossy**: the
    output does not follow the verifier's distribution exactly; it is off unless asked for.

    ``probs [B, N, V]``: the verifier's temperature-scaled distribution after each node. A child is
    accepted when its probability at its parent exceeds ``min(posterior_threshold,
    posterior_alpha * exp(-entropy))`` there; the bonus is sampled (``u_bonus [B]``) at the end."""
    probs = probs.float()
    b, n, v = probs.shape
    entropy = -(probs * probs.clamp_min(1e-20).log()).sum(-1)  # [B, N]
    threshold = torch.minimum(torch.full_like(entropy, posterior_threshold), posterior_alpha * entropy.neg().exp())
    parents = trees.parents.clamp(min=0)
    px = probs.reshape(b, n * v).gather(1, parents * v + trees.tokens)  # [B, N]: each token's p at its parent
    ok = trees.valid & (px > threshold.gather(1, parents))
    ok[:, 0] = True
    end = _deepest_valid_rows(trees, ok)
    return end, noise_sample(_row_at(probs, end), u_bonus)


def _siblings_before_rows(trees: TreeBatch) -> torch.Tensor:
    """``[B, N, N]`` bool: ``[b, i, j]`` when ``j`` is an earlier sibling of ``i`` (tried before it)."""
    n = trees.tokens.shape[1]
    idx = torch.arange(n, device=trees.tokens.device)
    same = (trees.parents[:, :, None] == trees.parents[:, None, :]) & (idx[None, None, :] < idx[None, :, None])
    same &= trees.valid[:, :, None] & trees.valid[:, None, :]
    same[:, 0] = False
    return same


def q_rows(trees: TreeBatch, p: torch.Tensor, q: torch.Tensor, u: torch.Tensor,
           u_bonus: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless multi-candidate tree rejection sampling (SpecInfer / EAGLE) for drafts that carry
    their ``q``, every row at once: ``(end, bonus)`` ``[B]``.

    Args:
        trees: the drafts; siblings are tried in index order.
        p: ``[B, N, V]`` the verifier's (warped) distribution after each node.
        q: ``[B, N, V]``: row ``i`` is the distribution node ``i``'s token was drawn from given its
            earlier siblings; a row that gives the token no mass is a deterministic candidate.
        u: ``[B, N]`` uniforms, one per node; u_bonus: ``[B]``, for the bonus token.

    Walking down from the root with ``r = p(node)``: child ``x`` is accepted with probability
    ``min(1, r(x) / q_x(x))``; on rejection ``r <- norm(max(r - q_x, 0))`` and the next sibling is
    tried; when none is accepted the bonus is drawn from ``r``. The emitted tokens are distributed
    exactly as sampling from ``p`` one token at a time. A fixed number of tensor steps (depth x
    width), nothing read mid-way."""
    b, n, v = p.shape
    dev = p.device
    rank = _siblings_before_rows(trees).sum(-1)  # [B, N]: position among siblings
    idx = torch.arange(n, device=dev)
    node = torch.zeros(b, dtype=torch.long, device=dev)
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    residual = p[:, 0].clone()
    for _ in range(trees.max_depth):
        moved = torch.zeros(b, dtype=torch.bool, device=dev)
        for j in range(max(trees.width, 1)):
            is_child = (trees.parents == node[:, None]) & (rank == j) & (idx > 0) & trees.valid
            exists = is_child.any(-1) & ~done & ~moved
            c = torch.where(is_child, idx, 0).max(-1).values  # [B]
            x = trees.tokens.gather(1, c[:, None])[:, 0]
            qc = _row_at(q, c)  # [B, V]
            qx = qc.gather(1, x[:, None])[:, 0]
            det = qx <= 0.0  # a deterministic candidate: one-hot q
            qx = torch.where(det, 1.0, qx)
            accept = exists & (u.gather(1, c[:, None])[:, 0] * qx < residual.gather(1, x[:, None])[:, 0])
            reject = exists & ~accept
            qvec = torch.where(det[:, None], torch.zeros_like(qc).scatter_(1, x[:, None], 1.0), qc)
            rejected = (residual - qvec).clamp(min=0.0)
            total = rejected.sum(-1, keepdim=True)
            rejected = torch.where(total > 1e-12, rejected / total.clamp(min=1e-30), _row_at(p, node))
            residual = torch.where(accept[:, None], _row_at(p, c), torch.where(reject[:, None], rejected, residual))
            node = torch.where(accept, c, node)
            moved = moved | accept
        done = done | ~moved
    return node, noise_sample(residual, u_bonus)
