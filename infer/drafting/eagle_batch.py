"""EAGLE drafting for every row of a step as one fixed-shape computation: the draft loop that
``--compile`` captures.

:class:`BatchEagleDrafter` grows the trees :class:`~.head_drafters.EagleDrafter` grows (EAGLE-2:
each depth expands the ``top_k`` frontier nodes of best cumulative log-probability into their
``top_k`` most likely children; the best ``num_nodes - 1`` candidates are kept, as many as the
budget's price pays for), but for all rows at once and with every shape fixed by the step's
rows bucket and the tree spec:

* the head's KV cache is row slots (:class:`~infer.core.static.SlotLayer`, one ``[R, H, C, D]``
  buffer per layer): each row's committed pairs at its own columns, a tree's entries past them
  (written over by the next catch-up: nothing is cropped);
* catching up (the committed pairs each row has not seen, then its root's pair) is one eager
  pass over all the slots, padded to the longest row (a prompt's length is its own);
* the loop is three functions of fixed-shape buffers (:class:`LoopState`, written in place) with
  no host read and no branch on a value: :func:`first_level` (the root's children),
  :func:`next_level` (one level of every row's tree; the level is a device tensor, so one graph
  serves every depth and is replayed, as vLLM replays its one-step draft graph) and
  :func:`select` (every row's kept tree, its depth and node limits and its price as tensors,
  packed into one long tensor: the step's one read). How many levels a step drafts is chosen
  on the host before it starts, from what the last step's read already brought: one deeper
  than the deepest node any drafting row kept. ``compile=True`` compiles the three (Inductor on
  a CPU, CUDA graphs on CUDA), once for one row and once for every row count above.

Candidates are the head's most likely tokens, not samples, so the trees are deterministic and
exact under greedy and sampled verification alike. The head's confidences are used as they are
(no per-depth calibration, which :class:`~.head_drafters.EagleDrafter` learns on its eager path).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from heads import Eagle3Head
from heads.modules import DraftHead

from ..core.drafter import Budget, Draft, Drafter, Request, RowStart, host_draft, root_only
from ..core.errors import UserError
from ..core.static import ROW_BUCKETS, SlotCache, bucket, compile_step, grow_slots
from ..core.tree import DynamicTreeSpec, cost_table

#: the head's output at ``k`` frontier nodes of every row: ``(hidden [R, k, h], tokens [R, k],
#: positions [R, k], mask [R, 1, k, C], cols [R, k]) -> [R, k, h]``
RunFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LoopShape:
    """The fixed sizes of a draft loop: ``depth`` levels, ``width`` (top-k) children per expanded
    node and frontier nodes per level, ``nodes`` kept at most (root included)."""

    depth: int
    width: int
    nodes: int

    @property
    def slots(self) -> int:
        """Head-cache entries a tree takes per row: the root's, then ``width`` per later level."""
        return 1 + (self.depth - 1) * self.width

    @property
    def candidates(self) -> int:
        """Candidates per row: the root, ``width`` children of it, ``width`` squared per later level."""
        return 1 + self.width + (self.depth - 1) * self.width * self.width


def tree_mask(ancestors: torch.Tensor, base: torch.Tensor, columns: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask ``[R, 1, k, C]`` of ``k`` new tree entries per row: each sees its row's
    committed columns ``[0, base[r])`` and, among the tree's slots at columns ``base[r] + s``, the
    ones ``ancestors [R, k, S]`` (bool) names (its ancestors and itself). ``columns [C]``: 0..C-1."""
    r, k, s = ancestors.shape
    rel = columns - base[:, None]  # [R, C]
    tree = ancestors.gather(2, rel.clamp(0, s - 1)[:, None, :].expand(r, k, columns.shape[0]))
    allowed = (rel < 0)[:, None, :] | (tree & ((rel >= 0) & (rel < s))[:, None, :])
    zero = torch.zeros((), dtype=dtype, device=base.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[:, None]


def causal_rows_mask(lengths: torch.Tensor, t: int, columns: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask ``[R, 1, t, C]`` of ``t`` new entries per row written at columns
    ``lengths[r] + i``: entry ``i`` sees columns ``<= lengths[r] + i`` (``columns [C]``: 0..C-1)."""
    last = lengths[:, None] + torch.arange(t, device=lengths.device)  # [R, t]
    allowed = columns[None, None, :] <= last[:, :, None]
    zero = torch.zeros((), dtype=dtype, device=lengths.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[:, None]


def select(tok, par, dep, key, limits, caps, tables, priced, nodes: int) -> torch.Tensor:
    """Every row's tree from its candidates (``[R, M]`` each, candidate 0 the root): the best
    ``nodes - 1`` by key (ties to the older, so that parents come first) no deeper than
    ``limits [R]``, of which the first ``n``, at most ``caps [R]``: where ``priced [R]`` (bool),
    the ``n`` maximising ``(1 + sum of path probabilities) / tables[r, n]`` (``tables [R, nodes +
    1]``: the price of ``n`` nodes; the smallest on ties), elsewhere all of them.
    Returns ``[R, 2 + 4 (nodes - 1)]`` long: ``n``, the root token, then the kept candidates'
    ids, tokens, parents and depths."""
    deep = dep[:, 1:] > limits[:, None]
    ranked = torch.where(deep, torch.full_like(key[:, 1:], float("-inf")), key[:, 1:])
    order = torch.sort(ranked, dim=1, descending=True, stable=True).indices[:, : nodes - 1] + 1  # [R, L]
    valid = dep.gather(1, order) <= limits[:, None]
    probs = torch.where(valid, key.gather(1, order).exp(), torch.zeros((), device=key.device))
    expected = torch.cat([probs.new_ones(probs.shape[0], 1), 1.0 + probs.cumsum(1)], 1)  # n = 1..nodes
    n = torch.where(priced, (expected / tables[:, 1 : nodes + 1]).argmax(1) + 1, caps)
    n = torch.minimum(torch.minimum(n, caps), valid.sum(1) + 1)
    return torch.cat([n[:, None], tok[:, :1], order, tok.gather(1, order), par.gather(1, order), dep.gather(1, order)], 1)


@dataclass
class LoopState:
    """The fixed buffers of a step's draft loop for ``R`` rows (made once per rows bucket and
    written in place, so that a captured graph finds them where it was recorded): the candidates
    ``tok``, ``par`` (candidate ids, -1 at the root), ``dep`` and ``key`` (cumulative
    log-probability) ``[R, M]``; the head's outputs at the tree's slots ``hidden [R, S, h]`` and
    the slots' ancestors ``anc [R, S, S]``; the frontier's candidate ids, tokens, keys and its
    parents' slots ``[R, K]``. Candidates a level did not make have key ``-inf`` and a depth past
    every limit."""

    tok: torch.Tensor
    par: torch.Tensor
    dep: torch.Tensor
    key: torch.Tensor
    hidden: torch.Tensor
    anc: torch.Tensor
    f_ids: torch.Tensor
    f_tok: torch.Tensor
    f_key: torch.Tensor
    f_slot: torch.Tensor

    @classmethod
    def empty(cls, rows: int, shape: LoopShape, hidden: int, dtype: torch.dtype, device) -> LoopState:
        m, s, k = shape.candidates, shape.slots, shape.width
        long = dict(dtype=torch.long, device=device)
        made = cls(torch.zeros(rows, m, **long), torch.zeros(rows, m, **long), torch.zeros(rows, m, **long),
                   torch.zeros(rows, m, device=device), torch.zeros(rows, s, hidden, dtype=dtype, device=device),
                   torch.zeros(rows, s, s, dtype=torch.bool, device=device), torch.zeros(rows, k, **long),
                   torch.zeros(rows, k, **long), torch.zeros(rows, k, device=device), torch.zeros(rows, k, **long))
        if rows > 1:  # one graph for every row count above 1
            for t in made.tensors():
                torch._dynamo.maybe_mark_dynamic(t, 0)
        return made

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, f) for f in self.__dataclass_fields__)


def _write(buffer: torch.Tensor, at: torch.Tensor, values: torch.Tensor) -> None:
    """``buffer[:, at] = values`` in place (``at [k]`` a device tensor: no host read)."""
    buffer.index_copy_(1, at, values)


def first_level(state: LoopState, logprobs: Callable[[torch.Tensor], torch.Tensor], root_hidden: torch.Tensor,
                root_tok: torch.Tensor, shape: LoopShape, vocab_map: torch.Tensor | None) -> None:
    """The loop's start, in place: every candidate cleared, the root (candidate 0, slot 0: the
    head's output ``root_hidden [R, h]`` at token ``root_tok [R]``) and its ``width`` most likely
    children (candidates 1..K, depth 1), which are the first frontier."""
    k = shape.width
    state.key.fill_(float("-inf"))
    state.dep.fill_(shape.depth + 1)
    state.anc.zero_()
    state.anc[:, 0, 0] = True
    state.hidden[:, 0] = root_hidden
    kid_lp, kid_tok = logprobs(root_hidden[:, None])[:, 0].topk(k, dim=-1)  # [R, K], best first
    if vocab_map is not None:
        kid_tok = vocab_map[kid_tok]
    state.tok[:, 0], state.par[:, 0], state.dep[:, 0], state.key[:, 0] = root_tok, -1, 0, 0.0
    state.tok[:, 1 : k + 1], state.par[:, 1 : k + 1], state.dep[:, 1 : k + 1] = kid_tok, 0, 1
    state.key[:, 1 : k + 1] = kid_lp
    state.f_ids.copy_(torch.arange(1, k + 1, device=root_tok.device).expand_as(state.f_ids))
    state.f_tok.copy_(kid_tok)
    state.f_key.copy_(kid_lp)
    state.f_slot.zero_()


def next_level(state: LoopState, run: RunFn, logprobs: Callable[[torch.Tensor], torch.Tensor], level: torch.Tensor,
               base: torch.Tensor, columns: torch.Tensor, shape: LoopShape, vocab_map: torch.Tensor | None) -> None:
    """Level ``level`` (a 0-dim device tensor, 1 or more: one graph replayed for every level), in
    place: the head runs once on every row's ``width`` frontier nodes (their parents' outputs and
    their tokens, at position ``base + level``, written at the tree's next slots, seeing their
    ancestors), each gets its ``width`` most likely children (depth ``level + 1``), and the best
    of those by key, ties to the older, are the next frontier. ``base [R]``: each root's column;
    ``columns [C]``: the cache's columns ``0..C-1``."""
    r, k, s_all = state.f_ids.shape[0], shape.width, shape.slots
    dev = base.device
    new = 1 + (level - 1) * k + torch.arange(k, device=dev)  # [K]: this level's slots
    mine = new[:, None] == torch.arange(s_all, device=dev)  # [K, S]
    anc = state.anc.gather(1, state.f_slot[:, :, None].expand(r, k, s_all)) | mine
    _write(state.anc, new, anc)
    h_in = state.hidden.gather(1, state.f_slot[:, :, None].expand(r, k, state.hidden.shape[-1]))
    out = run(h_in, state.f_tok, (base + level)[:, None].expand(r, k), tree_mask(anc, base, columns, h_in.dtype),
              base[:, None] + new)
    _write(state.hidden, new, out)
    kid_lp, kid_tok = logprobs(out).topk(k, dim=-1)  # [R, K, K]
    if vocab_map is not None:
        kid_tok = vocab_map[kid_tok]
    keys = (state.f_key[:, :, None] + kid_lp).reshape(r, k * k)
    kid_tok = kid_tok.reshape(r, k * k)
    ids = 1 + k + (level - 1) * k * k + torch.arange(k * k, device=dev)  # [K * K]: their candidate ids
    _write(state.tok, ids, kid_tok)
    _write(state.par, ids, state.f_ids[:, :, None].expand(r, k, k).reshape(r, k * k))
    _write(state.dep, ids, (level + 1).expand(r, k * k))
    _write(state.key, ids, keys)
    pick = torch.sort(keys, dim=1, descending=True, stable=True).indices[:, :k]  # [R, K]
    state.f_ids.copy_(ids[pick])
    state.f_key.copy_(keys.gather(1, pick))
    state.f_tok.copy_(kid_tok.gather(1, pick))
    state.f_slot.copy_(new[pick // k])


def host_tree(row: Sequence[int], nodes: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """One row of :func:`select`'s output -> the kept tree's ``(tokens, parents)`` on the host,
    in topological order (by depth, then by creation), node 0 the root."""
    size = nodes - 1
    n, root = row[0], row[1]
    ids, toks, pars, deps = (row[2 + i * size : 2 + (i + 1) * size] for i in range(4))
    kept = sorted(range(n - 1), key=lambda j: (deps[j], ids[j]))
    index = {0: 0} | {ids[j]: i + 1 for i, j in enumerate(kept)}
    return (root, *(toks[j] for j in kept)), (-1, *(index[pars[j]] for j in kept))


@dataclass
class _Row:
    """A row's place in the head's slots and what it committed that the head has not seen:
    verifier features ``[k, F, H]`` from column ``length`` on, tokens from ``length + 1`` on."""

    slot: int
    length: int = 0
    feats: list[torch.Tensor] = field(default_factory=list)
    tokens: list[torch.Tensor] = field(default_factory=list)
    kept_depth: int = 1 << 30  # the deepest node of its last tree (none yet: every level)


class BatchEagleDrafter(Drafter):
    """EAGLE-1 / EAGLE-3 drafting for all rows at once (see the module docstring).

    Args:
        head: an :class:`~heads.Eagle1Head` or :class:`~heads.Eagle3Head`.
        verifier_model: the verifier (its embeddings, and EAGLE-1's LM head).
        tree: a :class:`~infer.core.tree.DynamicTreeSpec` (default ``dynamic:5,4,16``).
        dtype: what the head computes in (default: the verifier's).
        compile: ``False`` (the loop eagerly), ``True`` (Inductor on a CPU, CUDA graphs on
            CUDA) or a ``torch.compile`` backend (tests).
        adaptive_depth: draft one level deeper than the deepest node any drafting row kept last
            time (at least one level, at most the tree's depth), a choice made on the host from
            what it read anyway; ``False``: every level every time.
    """

    def __init__(self, head: DraftHead, verifier_model, tree: DynamicTreeSpec | None = None, *,
                 dtype: torch.dtype | None = None, compile=False, adaptive_depth: bool = True):
        w = verifier_model.get_input_embeddings().weight
        self.device, self.dtype = w.device, dtype or w.dtype
        self.head = head.to(device=self.device, dtype=self.dtype).eval()
        self.eagle3 = isinstance(head, Eagle3Head)
        self.embed = verifier_model.get_input_embeddings()
        self.lm_head = verifier_model.get_output_embeddings()
        self.feature_layers = head.config.feature_layers
        self.tree = tree or DynamicTreeSpec(depth=5, top_k=4, num_nodes=16)
        if not isinstance(self.tree, DynamicTreeSpec):
            raise UserError("EAGLE heads grow a dynamic tree: pass a dynamic tree (e.g. eagle2-16 or dynamic:5,4,16)")
        self.shape = LoopShape(self.tree.depth, self.tree.top_k, self.tree.num_nodes)
        vd = head.config.draft_vocab_size
        self.vocab_map = self.head.target_ids(torch.arange(vd, device=self.device)) if self.eagle3 else None
        self.rows: dict[int, _Row] = {}
        self.cache: SlotCache | None = None
        self.columns: torch.Tensor | None = None  # [C]: 0..C-1, the slots' columns
        self.adaptive_depth = adaptive_depth
        self._levels = [torch.tensor(d, device=self.device) for d in range(self.shape.depth)]
        self._states: dict[int, LoopState] = {}
        self.compiled = bool(compile)
        self._first, self._next, self._select = self._eager_first, self._eager_next, self._eager_select
        self.warmup_s = 0.0
        if compile:
            backend = "inductor" if compile is True else compile
            self._first, self._next, self._select = (compile_step(f, self.device, backend)
                                                     for f in (self._eager_first, self._eager_next, self._eager_select))
            self.warm_up()

    # ---- the slots -----------------------------------------------------------------------------

    def _fit(self, need: int) -> None:
        """Slots for every row (their bucket) with ``need`` columns each (grown by doubling)."""
        rows = bucket(max((r.slot for r in self.rows.values()), default=0) + 1, ROW_BUCKETS)
        attn = self.head.midlayer.self_attn if self.eagle3 else self.head.layer.self_attn
        grown = grow_slots(self.cache, attn, 1, rows, need, self.dtype, self.device,
                           self.device.type == "cuda" and self.compiled)
        if grown is not None:
            self.cache, self.columns = grown

    def begin(self, rows) -> None:
        for r in rows:
            taken = {x.slot for x in self.rows.values()}
            slot = next(i for i in range(len(taken) + 1) if i not in taken)
            # features at columns 0..L-1, waiting for the tokens after them: the prompt's 1..L-1, then the root
            self.rows[r.slot] = _Row(slot, 0, [r.features], [r.prompt_ids[1:].to(self.device, non_blocking=True)])

    def update(self, accepted) -> None:
        for a in accepted:
            row = self.rows[a.slot]
            row.feats.append(a.features)
            row.tokens.append(a.tokens.to(self.device, non_blocking=True))

    def end(self, slots) -> None:
        for s in slots:
            self.rows.pop(s, None)
        if not self.rows:  # the next rows start in slots of their own bucket
            self.cache = self.columns = None

    def warm_up(self, rows: Sequence[int] = (1, 2)) -> float:
        """Run (and so compile) the loop for ``rows`` rows (one graph for 1, one for every count
        above: the rows are marked dynamic) on a dummy prompt; the seconds it took."""
        t0 = time.perf_counter()
        width = len(self.feature_layers)
        for r in rows:
            starts = [RowStart(-1 - i, torch.zeros(4, dtype=torch.long),
                               torch.zeros(4, width, self.head.config.verifier.hidden_size, dtype=self.embed.weight.dtype,
                                           device=self.device), None) for i in range(r)]
            self.begin(starts)
            self.propose([Request(s.slot, 0, Budget(self.shape.depth)) for s in starts])
            self.end([s.slot for s in starts])
        self.warmup_s += time.perf_counter() - t0
        return self.warmup_s

    # ---- a step --------------------------------------------------------------------------------

    def _run(self, hidden, tokens, positions, mask, cols) -> torch.Tensor:
        """The head over ``[R, k]`` entries written at ``cols`` (see :data:`RunFn`)."""
        self.cache.set_cols(cols)
        return self.head(hidden, self.embed(tokens).to(self.dtype), positions, mask, self.cache)

    def _logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head.logits(hidden) if self.eagle3 else self.lm_head(hidden.to(self.lm_head.weight.dtype))
        return torch.log_softmax(logits.float(), dim=-1)

    # the loop's three steps with this head (what ``compile`` compiles): the state's buffers as arguments

    def _eager_first(self, root_hidden, root_tok, *buffers) -> None:
        first_level(LoopState(*buffers), self._logprobs, root_hidden, root_tok, self.shape, self.vocab_map)

    def _eager_next(self, level, base, columns, *buffers) -> None:
        next_level(LoopState(*buffers), self._run, self._logprobs, level, base, columns, self.shape, self.vocab_map)

    def _eager_select(self, limits, caps, tables, priced, tok, par, dep, key) -> torch.Tensor:
        return select(tok, par, dep, key, limits, caps, tables, priced, self.shape.nodes)

    def _state(self, rows: int) -> LoopState:
        if rows not in self._states:
            state = LoopState.empty(rows, self.shape, self.head.config.verifier.hidden_size, self.dtype, self.device)
            if self.device.type == "cuda" and self.compiled:
                for t in state.tensors():
                    torch._dynamo.mark_static_address(t)
            self._states[rows] = state
        return self._states[rows]

    def _depth(self, slots: Sequence[int]) -> int:
        """How many levels to draft this step (see ``adaptive_depth``)."""
        if not self.adaptive_depth:
            return self.shape.depth
        return max(1, min(self.shape.depth, 1 + max(self.rows[s].kept_depth for s in slots)))

    def _catch_up(self, roots: dict[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed the drafting rows (``roots``: row -> root token) their unseen committed pairs and
        their root's pair, all slots in one pass; ``(root_hidden [R, h], base [R])``: the head's
        output at each row's root and the root's column (a row not drafting: its length)."""
        pairs = {}
        for s, root in roots.items():
            row = self.rows[s]
            feats = torch.cat(row.feats).to(self.dtype)
            feats = self.head.fuse(feats) if self.eagle3 else feats[:, 0]  # [k, h]
            pairs[s] = (feats, torch.cat(row.tokens + [torch.full((1,), root, dtype=torch.long, device=self.device)]))
        t = max(tok.numel() for _, tok in pairs.values())
        self._fit(max(r.length for r in self.rows.values()) + t + self.shape.slots)
        r_all = self.cache.shape[0]
        feats = torch.zeros(r_all, t, self.head.config.verifier.hidden_size, dtype=self.dtype, device=self.device)
        tokens = torch.zeros(r_all, t, dtype=torch.long, device=self.device)
        lengths, last = [0] * r_all, [0] * r_all
        for row in self.rows.values():
            lengths[row.slot] = row.length
        for s, (f, tok) in pairs.items():
            slot = self.rows[s].slot
            feats[slot, : tok.numel()] = f
            tokens[slot, : tok.numel()] = tok
            last[slot] = tok.numel() - 1
        host = torch.tensor([lengths, last], dtype=torch.long).to(self.device, non_blocking=True)
        positions = host[0][:, None] + torch.arange(t, device=self.device)
        out = self._run(feats, tokens, positions, causal_rows_mask(host[0], t, self.columns, self.dtype), positions)
        for s, (_, tok) in pairs.items():  # the root's pair is the tree's first slot: it waits, cut with the tree
            row = self.rows[s]
            row.length += tok.numel() - 1
            row.feats, row.tokens = [row.feats[-1][-1:]], []
        return out[torch.arange(r_all, device=self.device), host[1]], host[0] + host[1]

    def _limits(self, requests: Sequence[Request]) -> tuple[torch.Tensor, ...]:
        """``(root_tok, limits, caps, tables, priced)`` over all slots from the requests' roots and
        budgets (a slot without a request: depth limit 0)."""
        r_all, nodes = self.cache.shape[0], self.shape.nodes
        roots, limits, caps, priced = [0] * r_all, [0] * r_all, [1] * r_all, [0] * r_all
        tables = [cost_table(_flat, nodes, self.device)] * r_all
        for q in requests:
            slot = self.rows[q.slot].slot
            roots[slot], limits[slot] = q.root, min(q.budget.depth, self.shape.depth)
            caps[slot] = min(q.budget.nodes or nodes, nodes)
            if q.budget.cost is not None:
                tables[slot], priced[slot] = cost_table(q.budget.cost, nodes, self.device), 1
        host = torch.tensor([roots, limits, caps, priced], dtype=torch.long).to(self.device, non_blocking=True)
        return host[0], host[1], host[2], torch.stack(tables), host[3].bool()

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request]) -> list[Draft]:
        drafting = {q.slot for q in requests if q.budget.depth > 0 and (q.budget.nodes or 2) >= 2}
        if not drafting:
            return [root_only(q.root, self.device) for q in requests]
        root_hidden, base = self._catch_up({q.slot: q.root for q in requests if q.slot in drafting})
        root_tok, *limits = self._limits([q for q in requests if q.slot in drafting])
        r_all = root_hidden.shape[0]
        if r_all > 1:  # one graph for every row count above 1
            for t in (root_hidden, root_tok, base, *limits):
                torch._dynamo.maybe_mark_dynamic(t, 0)
        state = self._state(r_all)
        buffers = state.tensors()
        self._first(root_hidden, root_tok, *buffers)
        for level in self._levels[1 : self._depth(drafting)]:
            self._next(level, base, self.columns, *buffers)
        rows = self._select(*limits, state.tok, state.par, state.dep, state.key).tolist()  # the step's one read
        drafts = []
        for q in requests:
            if q.slot not in drafting:
                drafts.append(root_only(q.root, self.device))
                continue
            row = rows[self.rows[q.slot].slot]
            tokens, parents = host_tree(row, self.shape.nodes)
            self.rows[q.slot].kept_depth = max(row[2 + 3 * (self.shape.nodes - 1):][: row[0] - 1], default=0)
            drafts.append(host_draft(tokens, parents, self.device))
        return drafts


def _flat(n: int) -> float:
    """The table of a row without a cost curve (not used: its ``priced`` is false)."""
    return 1.0
