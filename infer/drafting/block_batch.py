"""The block drafter for every row of a step as one fixed-shape pass: what ``--compile`` captures
for a block-drafter head (:class:`~heads.dflash.DFlashHead`).

:class:`BatchBlockDrafter` drafts the chains :class:`~.block_drafter.BlockDrafter` drafts, for all
rows at once:

* the head's context cache is row slots (:class:`~infer.core.static.SlotLayer`, one
  ``[R, H, C, D]`` buffer per layer): each row's fused features at its own columns; a block's
  entries past them are written over by the next catch-up (nothing is cropped) and hidden by the
  masks until then;
* catching up (each row's features committed since its last block) is one eager pass over all
  the slots, padded to the longest row (a prompt's length is its own);
* the block pass is one function of fixed shapes (:meth:`BatchBlockDrafter.block`): every slot's
  ``[root, mask, ..., mask]`` at its own columns, attending to its context and its block, then
  each position's top-1 token and probability, packed into one tensor. With priced budgets that
  tensor is the step's one read (each row's chain cut where a longer one stops paying, as
  :meth:`~.block_drafter.BlockDrafter._depth` cuts it); without, nothing is read.
  ``compile=True`` compiles it (Inductor on a CPU, CUDA graphs on CUDA), once for one row and
  once for every row count above.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from heads.dflash import DFlashHead

from ..core.drafter import Budget, Draft, Drafter, Request, RowStart, host_draft, root_only
from ..core.static import ROW_BUCKETS, SlotCache, bucket, compile_step, grow_slots
from ..core.tree import DynamicTreeSpec
from .block_drafter import BlockDrafter, hold_block_tables
from .eagle_batch import causal_rows_mask


@dataclass
class _Slot:
    """One row's place in the slots: ``slot``, its committed ``length`` in the context cache,
    the features committed since (``[k, F, h]`` each) not yet fed."""

    slot: int
    length: int = 0
    pending: list[torch.Tensor] = field(default_factory=list)


class BatchBlockDrafter(Drafter):
    """Block drafting for all rows at once (see the module docstring).

    Args:
        head: a :class:`~heads.dflash.DFlashHead`.
        verifier_model: the verifier (its embeddings and LM head).
        tree: only its ``depth`` is used (the longest chain; default ``block_size - 1``).
        dtype: what the head computes in (default: the verifier's).
        compile: ``False`` (eagerly), ``True`` (Inductor on a CPU, CUDA graphs on CUDA) or a
            ``torch.compile`` backend (tests).
    """

    def __init__(self, head: DFlashHead, verifier_model, tree: DynamicTreeSpec | None = None, *,
                 dtype: torch.dtype | None = None, compile=False):
        hold_block_tables(self, head, verifier_model, tree, dtype)
        self.depth = min(self.block_size - 1, self.tree.depth)
        self.rows: dict[int, _Slot] = {}
        self.cache: SlotCache | None = None
        self.columns: torch.Tensor | None = None  # [C]: 0..C-1, the slots' columns
        self.compiled, self.warmup_s = bool(compile), 0.0
        self._block = self.block
        if compile:
            self._block = compile_step(self.block, self.device, "inductor" if compile is True else compile)
            self.warm_up()

    # ---- the rows and their slots ----------------------------------------------------------------

    def begin(self, rows: Sequence[RowStart]) -> None:
        for r in rows:
            taken = {x.slot for x in self.rows.values()}
            slot = next(i for i in range(len(taken) + 1) if i not in taken)
            self.rows[r.slot] = _Slot(slot, 0, [r.features])  # the prompt's features, fed at the first block

    def update(self, accepted) -> None:
        for a in accepted:
            self.rows[a.slot].pending.append(a.features)

    def end(self, slots) -> None:
        for s in slots:
            self.rows.pop(s, None)
        if not self.rows:  # the next rows start in slots of their own bucket
            self.cache = self.columns = None

    def state(self) -> dict:
        return {"block_size": self.block_size}

    def _fit(self, need: int) -> None:
        """Slots for every row (their bucket) with ``need`` columns each (grown by doubling)."""
        rows = bucket(max((r.slot for r in self.rows.values()), default=0) + 1, ROW_BUCKETS)
        grown = grow_slots(self.cache, self.head.layers[0].self_attn, len(self.head.layers), rows, need, self.dtype,
                           self.device, self.device.type == "cuda" and self.compiled)
        if grown is not None:
            self.cache, self.columns = grown

    def _catch_up(self) -> torch.Tensor:
        """Feed every row its pending features, all slots in one pass padded to the longest;
        ``lengths [R]`` (device): each slot's committed context after it."""
        t = max((sum(f.shape[0] for f in r.pending) for r in self.rows.values()), default=0)
        self._fit(max(r.length for r in self.rows.values()) + t + self.block_size)
        r_all = self.cache.shape[0]
        lengths = [0] * r_all
        for r in self.rows.values():
            lengths[r.slot] = r.length
        before = torch.tensor(lengths, dtype=torch.long).to(self.device, non_blocking=True)
        if t == 0:
            return before
        feats = torch.zeros(r_all, t, len(self.feature_layers), self.head.config.verifier.hidden_size,
                            dtype=self.dtype, device=self.device)
        for r in self.rows.values():
            if r.pending:
                f = torch.cat(r.pending).to(self.dtype)  # [k, F, h]
                feats[r.slot, : f.shape[0]] = f
                r.length += f.shape[0]
                r.pending = []
        context = self.head.fuse(feats)  # [R, t, h], rows padded
        positions = before[:, None] + torch.arange(t, device=self.device)
        self.cache.set_cols(positions)
        self.head.add_context(context, positions, causal_rows_mask(before, t, self.columns, self.dtype), self.cache)
        for r in self.rows.values():
            lengths[r.slot] = r.length
        return torch.tensor(lengths, dtype=torch.long).to(self.device, non_blocking=True)

    # ---- the block pass --------------------------------------------------------------------------

    def block(self, roots: torch.Tensor, lengths: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        """Every slot's block ``[root, mask, ...]`` after its ``lengths [R]`` committed columns
        (``roots [R]``; ``columns [C]``: 0..C-1) -> ``[2, R, bs - 1]`` float: each drafted
        position's top-1 probability, then its token (a verifier id)."""
        r, bs = roots.shape[0], self.block_size
        embeds = torch.cat([self.embed(roots).to(self.dtype)[:, None], self.mask_embeds.expand(r, -1, -1)], 1)
        positions = lengths[:, None] + torch.arange(bs, device=roots.device)  # [R, bs]
        allowed = columns[None, :] < (lengths + bs)[:, None]  # its context and its whole block
        zero = torch.zeros((), dtype=self.dtype, device=roots.device)
        mask = torch.where(allowed, zero, torch.finfo(self.dtype).min)[:, None, None, :].expand(-1, 1, bs, -1)
        self.cache.set_cols(positions)
        out = self.head(embeds, positions, mask, self.cache)  # [R, bs, h]
        top_p, top = torch.softmax(self.head.logits(out[:, 1:], self.lm_rows).float(), -1).max(-1)
        return torch.stack([top_p, self.vocab[top].to(top_p.dtype)])

    def warm_up(self, rows: Sequence[int] = (1, 2)) -> float:
        """Run (and so compile) the block pass for ``rows`` rows (one graph for 1, one for every
        count above) on a dummy prompt; the seconds it took."""
        t0 = time.perf_counter()
        width, h = len(self.feature_layers), self.head.config.verifier.hidden_size
        for r in rows:
            starts = [RowStart(-1 - i, torch.zeros(4, dtype=torch.long),
                               torch.zeros(4, width, h, dtype=self.embed.weight.dtype, device=self.device), None)
                      for i in range(r)]
            self.begin(starts)
            self.propose([Request(s.slot, 0, Budget(self.depth)) for s in starts])
            self.end([s.slot for s in starts])
        self.warmup_s += time.perf_counter() - t0
        return self.warmup_s

    def _depth_of(self, budget: Budget) -> int:
        return min(self.depth, budget.depth, (budget.nodes or self.block_size) - 1)

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request]) -> list[Draft]:
        depths = [self._depth_of(q.budget) for q in requests]
        if not any(d > 0 for d in depths):  # no pass: the context catches up at the next one
            return [root_only(q.root, self.device) for q in requests]
        lengths = self._catch_up()
        roots = [0] * lengths.shape[0]
        for q in requests:
            roots[self.rows[q.slot].slot] = q.root
        roots_t = torch.tensor(roots, dtype=torch.long).to(self.device, non_blocking=True)
        if roots_t.shape[0] > 1:  # one graph for every row count above 1
            for t in (roots_t, lengths):
                torch._dynamo.maybe_mark_dynamic(t, 0)
        packed = self._block(roots_t, lengths, self.columns)  # [2, R, bs - 1]
        host = packed.tolist() if any(q.budget.cost is not None for q, d in zip(requests, depths) if d > 0) else None
        return [self._chain(q, d, packed, host) for q, d in zip(requests, depths)]

    def _chain(self, q: Request, depth: int, packed: torch.Tensor, host: list | None) -> Draft:
        """Row ``q``'s chain: the first ``depth`` drafted tokens, cut where a longer chain stops
        paying under a priced budget (read from ``host``, the step's one read)."""
        if depth <= 0:
            return root_only(q.root, self.device)
        slot = self.rows[q.slot].slot
        if q.budget.cost is None:  # the full chain, nothing read
            ids = packed[1, slot, :depth].long()
            return Draft(torch.cat([torch.full((1,), q.root, dtype=torch.long, device=self.device), ids]),
                         self._chains[depth])
        probs, ids = host[0][slot][:depth], host[1][slot][:depth]
        depth = BlockDrafter._depth(probs, q.budget.cost)
        if depth == 0:
            return root_only(q.root, self.device)
        return host_draft((q.root, *(int(t) for t in ids[:depth])), (-1, *range(depth)), self.device)
