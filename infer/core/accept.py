"""Acceptance rules: which root-to-node path of a verified tree to keep, and the bonus token.

All functions are pure (the only state is an explicit ``torch.Generator``, where one is taken).
They take the draft tree's tokens and topology and the verifier's outputs at every node, and
return an :class:`Acceptance`: the accepted node indices (root first) and the verifier's own next
token after the last accepted node.

Exact sampling of a deterministic draft needs no rule of its own: the verifier's token after each
node is drawn with counter-based noise (:func:`position_uniforms`, :func:`noise_sample`) and the
greedy rule accepts a child when it equals its parent's token. A child is then accepted with
probability ``p(child)``, as with sibling-by-sibling rejection, and the emitted text depends on
the seed, the positions and the verifier alone. :func:`sample_accept` is the rule for drafts
that carry their ``q``.

Names follow the papers: ``p`` is the verifier's (target) distribution, ``q`` the draft's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .batch import TreeBatch
from .tree import Tree, at


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


def _read_back(tokens: torch.Tensor, tree: Tree, end: torch.Tensor, bonus: torch.Tensor) -> Acceptance:
    """The path from the root to node ``end`` (0-dim) and the ``bonus`` token (0-dim), read to the
    host in one transfer: the only device read of a verify step."""
    n = tree.num_nodes
    on_path = at(tree.ancestor_mask, end)  # [N]: ancestors come first in topological order
    path = torch.sort(torch.where(on_path, torch.arange(n, device=on_path.device), n)).values  # [N], padded with n
    packed = torch.cat([on_path.sum().view(1), bonus.view(1).to(torch.long), path, tokens.to(path.device)[path.clamp(max=n - 1)]])
    host = packed.tolist()
    k, bonus_id = host[0], host[1]
    return Acceptance(nodes=path[:k], bonus=bonus_id, node_ids=tuple(host[2 : 2 + k]),
                      tokens=tuple(host[3 + n : 2 + n + k]) + (bonus_id,))


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


def _deepest_valid(tree: Tree, node_ok: torch.Tensor) -> torch.Tensor:
    """Index (0-dim) of the deepest node whose whole root path is ``node_ok`` (first on ties)."""
    path_ok = ~(tree.ancestor_mask & ~node_ok[None, :]).any(-1)  # [N]
    return torch.where(path_ok, tree.depths, -1).argmax()


def greedy_accept(tokens: torch.Tensor, tree: Tree, target: torch.Tensor) -> Acceptance:
    """Greedy verification.

    Args:
        tokens: ``[N]`` draft tokens (node 0 = root).
        tree: the draft's topology.
        target: ``[N]`` the verifier's argmax after each node.

    A node is accepted when its token equals the verifier's argmax at its parent and its parent
    is accepted; the longest such path is kept and ``target`` at its end is the bonus token, so
    the output equals plain greedy decoding token for token. Tensor operations on the tree's
    device, one read back.
    """
    tokens, target = tokens.to(tree.device), target.to(tree.device)
    match = torch.ones(tree.num_nodes, dtype=torch.bool, device=tree.device)
    match[1:] = tokens[1:] == target[tree.parents[1:]]
    best = _deepest_valid(tree, match)
    return _read_back(tokens, tree, best, at(target, best))


def _sibling_before(tree: Tree) -> torch.Tensor:
    """``[N, N]`` bool: ``[i, j]`` when ``j`` is an earlier sibling of ``i`` (tried before it)."""
    n = tree.num_nodes
    idx = torch.arange(n, device=tree.device)
    same = (tree.parents[:, None] == tree.parents[None, :]) & (idx[None, :] < idx[:, None])
    same[0] = False
    return same


def sample_accept(
    tokens: torch.Tensor,
    tree: Tree,
    p: torch.Tensor,
    q: torch.Tensor | None,
    generator: torch.Generator | None,
) -> Acceptance:
    """Lossless multi-candidate tree rejection sampling (SpecInfer / EAGLE).

    Args:
        tokens: ``[N]`` draft tokens (node 0 = root).
        tree: the draft's topology; siblings are tried in index order.
        p: ``[N, V]`` the verifier's (warped) distribution after each node.
        q: ``[N, V]`` or None. Row ``i`` is the distribution node ``i``'s token was drawn from,
            given its earlier siblings (for i.i.d. children: the parent's draft distribution; for
            draws without replacement: that distribution without the earlier siblings). ``None``,
            or a row that gives the token no mass, means a deterministic draft (one-hot ``q``).
        generator: the source of randomness (same seed, same result).

    Walking down from the root with ``r = p(node)``: child ``x`` (drawn from ``q_x``) is accepted
    with probability ``min(1, r(x) / q_x(x))``; on rejection ``r <- norm(max(r - q_x, 0))`` and the
    next sibling is tried. When no child is accepted, the bonus token is drawn from ``r``. The
    emitted tokens are distributed exactly as sampling from ``p`` one token at a time.

    One uniform per node is drawn up front; everything runs on the device with one read back.
    For deterministic drafts (``q`` None) all nodes are decided at once: after rejecting the
    earlier siblings ``x_1..x_{j-1}``, ``r(x_j) = p(x_j) / (1 - sum p(x_i))``.
    """
    dev = p.device
    tree = tree.to(dev)
    tokens = tokens.to(dev)
    n = tree.num_nodes
    u = torch.rand(n, generator=generator, device=dev)
    if q is not None:
        return _sample_accept_q(tokens, tree, p, q.to(dev), u, generator)
    parents = tree.parents.clamp(min=0)
    px = p[parents, tokens]  # [N]: p of each node's token at its parent
    before = _sibling_before(tree)
    dup = (before & (tokens[None, :] == tokens[:, None])).any(-1)  # a repeated sibling is never accepted
    px = torch.where(dup, 0.0, px)
    tried_mass = (before.float() * px[None, :]).sum(-1)  # p-mass of the earlier siblings
    left = (1.0 - tried_mass).clamp(min=0.0)
    ok = u * left < px  # accepted, had it been tried
    ok[0] = True
    first = ok & ~(before & ok[None, :]).any(-1)  # the first accepted sibling is the one taken
    end = _deepest_valid(tree, first)
    children = (tree.parents == end) & (torch.arange(n, device=dev) > 0)  # all tried and rejected
    residual = at(p, end)
    drop = torch.zeros(p.shape[-1] + 1, dtype=torch.bool, device=dev)
    drop[torch.where(children, tokens, p.shape[-1])] = True
    residual = residual.masked_fill(drop[:-1], 0.0)
    total = residual.sum()
    residual = torch.where(total > 1e-12, residual / total.clamp(min=1e-30), at(p, end))
    bonus = torch.multinomial(residual, 1, generator=generator)[0]
    return _read_back(tokens, tree, end, bonus)


def _sample_accept_q(tokens, tree: Tree, p, q, u, generator) -> Acceptance:
    """``sample_accept`` for drafts that report their ``q``: sibling by sibling, but with tensor
    operations only (a fixed number of steps: depth x width), so nothing is read mid-way."""
    dev = p.device
    n, vocab = tree.num_nodes, p.shape[-1]
    before = _sibling_before(tree)
    rank = before.sum(-1)  # [N]: position among siblings
    idx = torch.arange(n, device=dev)
    node = torch.zeros((), dtype=torch.long, device=dev)
    done = torch.zeros((), dtype=torch.bool, device=dev)
    residual = p[0].clone()
    for _ in range(tree.max_depth):
        moved = torch.zeros((), dtype=torch.bool, device=dev)
        for j in range(max(tree.width, 1)):
            is_child = (tree.parents == node) & (rank == j) & (idx > 0)
            exists = is_child.any() & ~done & ~moved
            c = torch.where(is_child, idx, 0).max()
            x = at(tokens, c)
            qc = at(q, c)
            qx = at(qc, x)
            det = qx <= 0.0  # deterministic candidate: one-hot q
            qx = torch.where(det, 1.0, qx)
            accept = exists & (at(u, c) * qx < at(residual, x))
            reject = exists & ~accept
            onehot = torch.zeros(vocab, device=dev).index_fill_(0, x.view(1), 1.0)
            qvec = torch.where(det, onehot, qc)
            rejected = (residual - qvec).clamp(min=0.0)
            total = rejected.sum()
            rejected = torch.where(total > 1e-12, rejected / total.clamp(min=1e-30), at(p, node))
            residual = torch.where(accept, at(p, c), torch.where(reject, rejected, residual))
            node = torch.where(accept, c, node)
            moved = moved | accept
        done = done | ~moved
    bonus = torch.multinomial(residual, 1, generator=generator)[0]
    return _read_back(tokens, tree, node, bonus)


def typical_accept(
    tokens: torch.Tensor,
    tree: Tree,
    probs: torch.Tensor,
    *,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
    generator: torch.Generator | None = None,
) -> Acceptance:
    """Medusa's typical acceptance. **Lossy**: the output does not follow the verifier's
    distribution exactly; it is off unless asked for.

    Args:
        tokens: ``[N]`` draft tokens; tree: topology; probs: ``[N, V]`` the verifier's
            temperature-scaled distribution after each node.

    A child is accepted when its probability under the verifier exceeds
    ``min(posterior_threshold, posterior_alpha * exp(-entropy))`` at its parent; the longest
    accepted path is kept and the bonus token is sampled from the verifier at its end.
    """
    probs = probs.float()
    tree = tree.to(probs.device)
    entropy = -(probs * probs.clamp_min(1e-20).log()).sum(-1)  # [N]
    threshold = torch.minimum(torch.full_like(entropy, posterior_threshold), posterior_alpha * entropy.neg().exp())
    tokens = tokens.to(probs.device)
    parents = tree.parents
    ok = torch.ones(tree.num_nodes, dtype=torch.bool, device=probs.device)
    ok[1:] = probs[parents[1:], tokens[1:]] > threshold[parents[1:]]
    best = _deepest_valid(tree, ok)
    bonus = torch.multinomial(at(probs, best), 1, generator=generator)[0]
    return _read_back(tokens, tree, best, bonus)


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


def _read_back_rows(trees: TreeBatch, end: torch.Tensor, bonus: torch.Tensor) -> RowsAcceptance:
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


def greedy_accept_rows(trees: TreeBatch, target: torch.Tensor) -> RowsAcceptance:
    """:func:`greedy_accept` for every row of a batch at once.

    Args:
        trees: the rows' drafts, padded (padding nodes are never accepted).
        target: ``[B, N]`` the verifier's argmax after each node of each row.
    """
    parents = trees.parents.clamp(min=0)
    match = trees.valid & (trees.tokens == target.gather(1, parents))
    match[:, 0] = True
    best = _deepest_valid_rows(trees, match)
    return _read_back_rows(trees, best, target.gather(1, best[:, None])[:, 0])


def row_tree(trees: TreeBatch, r: int) -> tuple[torch.Tensor, Tree]:
    """Row ``r`` of a batch as its own ``(tokens [N_r], tree)`` (views; the sizes are host ints)."""
    k = trees.sizes[r]
    return trees.tokens[r, :k], Tree(trees.parents[r, :k], trees.depths[r, :k], trees.ancestor_mask[r, :k, :k],
                                     trees.max_depth, trees.width)


def stack_acceptances(accs: Sequence[Acceptance], n: int, device) -> RowsAcceptance:
    """Rows accepted one by one, as one :class:`RowsAcceptance` (paths padded to ``n``)."""
    paths = torch.stack([torch.cat([a.nodes.to(device), a.nodes.new_zeros(n - a.nodes.numel()).to(device)]) for a in accs])
    lengths = torch.tensor([len(a.node_ids) for a in accs], dtype=torch.long).to(device, non_blocking=True)
    return RowsAcceptance(paths, lengths, tuple(accs))
