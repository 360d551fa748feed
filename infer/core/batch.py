"""Drafts of several rows as one batch: every row's tree padded to a common node count.

A batch of ``B`` trees of ``N_b`` nodes becomes tensors of ``N = max(N_b)`` nodes per row. The
padding nodes of a row are marked invalid: they hang off its root, see only themselves, and are
never accepted. Built by one pure function, :func:`stack_drafts`: drafts known on the host (prompt
lookup, unions, plain steps) travel to the device as one packed copy for the whole batch; drafts
made on the device (trained heads) are padded there, without reading anything back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .drafter import Draft


@dataclass(frozen=True)
class TreeBatch:
    """``B`` draft trees padded to ``N`` nodes each, on one device.

    Attributes:
        tokens: ``[B, N]`` long; ``tokens[b, 0]`` is row ``b``'s root (padding nodes hold 0).
        parents: ``[B, N]`` long; ``-1`` at the root, ``0`` at padding nodes.
        depths: ``[B, N]`` long; the root and padding nodes have depth 0.
        ancestor_mask: ``[B, N, N]`` bool: ``[b, i, j]`` when ``j`` is ``i`` or an ancestor of ``i``
            (a padding node sees only itself).
        valid: ``[B, N]`` bool: the row's own nodes (False at padding).
        q: ``[B, N, V]`` float or None: the distribution each node was drawn from (rows of a draft
            without one are zero, which the acceptance rule reads as a deterministic draft).
        sizes: the rows' node counts ``N_b`` (host ints).
        max_depth: the deepest node of any row (host int).
        width: an upper bound on any node's number of children (host int).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    ancestor_mask: torch.Tensor
    valid: torch.Tensor
    q: torch.Tensor | None
    sizes: tuple[int, ...]
    max_depth: int
    width: int

    @property
    def rows(self) -> int:
        return len(self.sizes)

    @property
    def num_nodes(self) -> int:
        """``N``, the padded node count of every row."""
        return int(self.tokens.shape[1])

    @property
    def device(self) -> torch.device:
        return self.tokens.device


def _host_pack(forms: Sequence[tuple[Sequence[int], Sequence[int]]], n: int) -> tuple[np.ndarray, int, int]:
    """Host drafts ``(tokens, parents)`` -> one int64 array ``[B, 4N + N*N]`` holding, per row,
    tokens, parents, depths, valid and the ancestor mask, padded to ``n`` nodes; and the
    deepest node's depth and the most children of any node."""
    b = len(forms)
    tokens = np.zeros((b, n), dtype=np.int64)
    parents = np.zeros((b, n), dtype=np.int64)
    depths = np.zeros((b, n), dtype=np.int64)
    valid = np.zeros((b, n), dtype=np.int64)
    anc = np.zeros((b, n, n), dtype=np.int64)
    idx = np.arange(n)
    anc[:, idx, idx] = 1
    for r, (toks, pars) in enumerate(forms):
        k = len(toks)
        tokens[r, :k] = toks
        parents[r, :k] = pars
        valid[r, :k] = 1
        for i in range(1, k):
            p = pars[i]
            depths[r, i] = depths[r, p] + 1
            anc[r, i, :i] = anc[r, p, :i]
    width = max((int(np.bincount(np.asarray(pars[1:])).max()) for _, pars in forms if len(pars) > 1), default=0)
    packed = np.concatenate([tokens, parents, depths, valid, anc.reshape(b, n * n)], axis=1)
    return packed, int(depths.max()), width


def stack_drafts(drafts: Sequence[Draft], device) -> TreeBatch:
    """The drafts of ``B`` rows as one :class:`TreeBatch` on ``device``.

    A batch with drafts made on the host whose tensors do not exist yet (prompt lookup, unions)
    is built on the host and copied once (one host-to-device transfer for the whole batch); a
    batch of drafts whose tensors exist (trained heads, plain steps) is padded on the device with
    tensor operations only (no read back, no copy)."""
    device = torch.device(device)
    sizes = tuple(d.num_nodes for d in drafts)
    n = max(sizes)
    made = [d.made for d in drafts]
    if len(drafts) == 1 and drafts[0].q is None:  # nothing to pad: the draft's own tensors (made now if not yet)
        d = drafts[0].to(device)
        t = d.tree
        valid = torch.ones(1, n, dtype=torch.bool, device=device)
        return TreeBatch(d.tokens[None], t.parents[None], t.depths[None], t.ancestor_mask[None], valid, None, sizes,
                         t.max_depth, t.width)
    if (not all(made) or n == 1) and all(d.host is not None and d.q is None for d in drafts):  # one copy for the batch
        packed, max_depth, width = _host_pack([d.host for d in drafts], n)
        packed = torch.from_numpy(packed).to(device, non_blocking=True)
        tokens, parents, depths, valid = (packed[:, i * n : (i + 1) * n] for i in range(4))
        anc = packed[:, 4 * n :].view(-1, n, n).bool()
        return TreeBatch(tokens, parents, depths, anc, valid.bool(), None, sizes, max_depth, width)
    max_depth = max(d.tree.max_depth for d in drafts)
    width = max(d.tree.width for d in drafts)
    rows = [_pad_on_device(d.to(device), n) for d in drafts]
    tokens, parents, depths, anc, valid = (torch.stack([r[i] for r in rows]) for i in range(5))
    q = None
    if any(d.q is not None for d in drafts):
        vocab = next(d.q.shape[-1] for d in drafts if d.q is not None)
        q = torch.stack([_pad_q(d.q.to(device) if d.q is not None else None, n, vocab, device) for d in drafts])
    return TreeBatch(tokens, parents, depths, anc, valid, q, sizes, max_depth, width)


def _pad_on_device(d: Draft, n: int) -> tuple[torch.Tensor, ...]:
    """One row's ``(tokens, parents, depths, ancestor_mask, valid)`` padded to ``n`` nodes."""
    k = d.tree.num_nodes
    dev = d.tokens.device
    pad = n - k
    tokens = torch.cat([d.tokens.to(torch.long), d.tokens.new_zeros(pad, dtype=torch.long)])
    parents = torch.cat([d.tree.parents, d.tree.parents.new_zeros(pad)])
    depths = torch.cat([d.tree.depths, d.tree.depths.new_zeros(pad)])
    anc = torch.eye(n, dtype=torch.bool, device=dev)
    anc[:k, :k] = d.tree.ancestor_mask
    valid = torch.arange(n, device=dev) < k
    return tokens, parents, depths, anc, valid


def _pad_q(q: torch.Tensor | None, n: int, vocab: int, device) -> torch.Tensor:
    out = torch.zeros(n, vocab, dtype=torch.float32, device=device)
    if q is not None:
        out[: q.shape[0]] = q.float()
    return out


def prefill_groups(lengths: Sequence[int], pass_tokens: int = 64) -> list[list[int]]:
    """Prompts of ``lengths`` (``[R]`` token counts) split into left-padded prefill passes.

    A pass costs about its padded token slots (rows x its longest prompt) plus ``pass_tokens``
    slots for the pass itself (reading the weights, launching its kernels). The prompts, sorted by
    length, are cut into the consecutive groups that minimise that sum (one group when the lengths
    are alike; a short prompt is not padded to a long one's length when that costs more than a pass).
    Returns the groups as lists of indices into ``lengths``, shortest prompts first."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[j]: the cheapest split of the j shortest prompts
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        width = lengths[order[j - 1]]  # the longest prompt of a group that ends at j
        for i in range(j):
            c = best[i] + pass_tokens + width * (j - i)
            if c < best[j]:
                best[j], cut[j] = c, i
    groups, j = [], n
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]
