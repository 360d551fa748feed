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
* the loop over depths (:func:`draft_loop`) is a function of fixed-shape tensors with no host
  read and no branch on a value: every depth is drafted (no early stop), a row's depth and node
  limits are masks and a cost table, not branches, and its output, every row's tree packed
  into one long tensor, is the step's one read. ``compile=True`` compiles it (Inductor on a
  CPU, CUDA graphs on CUDA) once per rows bucket.

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
from ..core.static import ROW_BUCKETS, SlotCache, bucket, capacity_for, compile_step, slot_cache
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
    def packed(self) -> int:
        """Columns of :func:`draft_loop`'s output: kept count, root token, 4 x (nodes - 1)."""
        return 2 + 4 * (self.nodes - 1)


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


@dataclass
class _Candidates:
    """The candidates of every row, grown level by level as lists of ``[R, k]`` pieces (joined
    once at the end): tokens, parents (candidate ids), depths, cumulative log-probabilities."""

    tok: list[torch.Tensor]
    par: list[torch.Tensor]
    dep: list[torch.Tensor]
    key: list[torch.Tensor]
    count: int = 1

    def add(self, tok, par, dep, key) -> torch.Tensor:
        """Append ``[R, k]`` candidates; their ids ``[k]``."""
        ids = torch.arange(self.count, self.count + tok.shape[1], device=tok.device)
        self.tok.append(tok)
        self.par.append(par)
        self.dep.append(dep)
        self.key.append(key)
        self.count += tok.shape[1]
        return ids

    def joined(self) -> tuple[torch.Tensor, ...]:
        return tuple(torch.cat(x, 1) for x in (self.tok, self.par, self.dep, self.key))


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


def draft_loop(run: RunFn, logprobs: Callable[[torch.Tensor], torch.Tensor], root_hidden: torch.Tensor,
               root_tok: torch.Tensor, base: torch.Tensor, limits: torch.Tensor, caps: torch.Tensor,
               tables: torch.Tensor, priced: torch.Tensor, columns: torch.Tensor, shape: LoopShape, vocab_map: torch.Tensor | None) -> torch.Tensor:
    """Every row's EAGLE-2 tree, fixed shapes throughout, no host read.

    ``root_hidden [R, h]``: the head's output at each row's root (its pair already in the cache
    at column ``base[r]``, which is also its position); ``root_tok [R]``; ``logprobs(hidden [R,
    k, h]) -> [R, k, Vd]`` float; ``vocab_map [Vd]`` maps draft ids to the verifier's (or None);
    ``limits``, ``caps``, ``tables``, ``priced``: as :func:`select`; ``columns [C]``: the cache's columns
    ``0..C-1`` (a tensor, so that one graph serves every capacity). Level ``d`` runs the head once on the
    ``width`` frontier nodes of every row (their parents' outputs and their tokens, at position
    ``base + d``, written at the tree's next slots). Returns :func:`select`'s packed trees."""
    r, k_max, dev = root_tok.shape[0], shape.width, root_tok.device
    s_all = shape.slots
    eye = torch.eye(s_all, dtype=torch.bool, device=dev)
    anc = eye[:1].expand(r, 1, s_all)  # [R, slots so far, S]: each slot's ancestors among the slots
    hidden = root_hidden[:, None]  # [R, slots so far, h]
    zeros = torch.zeros(r, 1, dtype=torch.long, device=dev)
    cands = _Candidates([root_tok[:, None]], [zeros - 1], [zeros], [zeros.float()])
    f_ids, f_key, f_slot = zeros, zeros.float(), zeros  # the frontier: candidate ids, keys, slots
    f_tok = root_tok[:, None]
    logp = logprobs(hidden)
    for d in range(shape.depth):
        if d > 0:  # the head on the frontier, in the slots after the last level's
            new = torch.arange(1 + (d - 1) * k_max, 1 + d * k_max, device=dev)  # [k]
            parents_anc = anc.gather(1, f_slot[:, :, None].expand(r, k_max, s_all)) | eye[new][None]
            anc = torch.cat([anc, parents_anc], 1)
            h_in = hidden.gather(1, f_slot[:, :, None].expand(r, k_max, hidden.shape[-1]))
            positions = (base + d)[:, None].expand(r, k_max)
            out = run(h_in, f_tok, positions, tree_mask(parents_anc, base, columns, h_in.dtype), base[:, None] + new)
            hidden = torch.cat([hidden, out], 1)
            logp = logprobs(out)
            f_slot = new[None].expand(r, k_max)
        kid_lp, kid_tok = logp.topk(k_max, dim=-1)  # [R, k, K]
        if vocab_map is not None:
            kid_tok = vocab_map[kid_tok]
        k = kid_lp.shape[1]
        keys = (f_key[:, :, None] + kid_lp).reshape(r, k * k_max)
        ids = cands.add(kid_tok.reshape(r, -1), f_ids[:, :, None].expand(r, k, k_max).reshape(r, -1),
                        torch.full((r, k * k_max), d + 1, dtype=torch.long, device=dev), keys)
        if d + 1 < shape.depth:  # the next frontier: the best new nodes
            pick = torch.sort(keys, dim=1, descending=True, stable=True).indices[:, :k_max]  # [R, K]
            f_ids, f_key = ids[pick], keys.gather(1, pick)
            f_tok = kid_tok.reshape(r, -1).gather(1, pick)
            f_slot = f_slot.gather(1, pick // k_max)  # the parent's slot: refined to the node's own above
    return select(*cands.joined(), limits, caps, tables, priced, shape.nodes)


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


class BatchEagleDrafter(Drafter):
    """EAGLE-1 / EAGLE-3 drafting for all rows at once (see the module docstring).

    Args:
        head: an :class:`~heads.Eagle1Head` or :class:`~heads.Eagle3Head`.
        verifier_model: the verifier (its embeddings, and EAGLE-1's LM head).
        tree: a :class:`~infer.core.tree.DynamicTreeSpec` (default ``dynamic:5,4,16``).
        dtype: what the head computes in (default: the verifier's).
        compile: ``False`` (the loop eagerly), ``True`` (Inductor on a CPU, CUDA graphs on
            CUDA) or a ``torch.compile`` backend (tests).
    """

    def __init__(self, head: DraftHead, verifier_model, tree: DynamicTreeSpec | None = None, *,
                 dtype: torch.dtype | None = None, compile=False):
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
        self.compiled = bool(compile)
        self._loop = self._eager_loop
        self.warmup_s = 0.0
        if compile:
            self._loop = compile_step(self._eager_loop, self.device, "inductor" if compile is True else compile)
            self.warm_up()

    # ---- the slots -----------------------------------------------------------------------------

    def _fit(self, need: int) -> None:
        """Slots for every row (their bucket) with ``need`` columns each (grown by doubling)."""
        rows = bucket(max((r.slot for r in self.rows.values()), default=0) + 1, ROW_BUCKETS)
        old = self.cache
        if old is not None and old.shape[0] >= rows and old.shape[1] >= need:
            return
        attn = self.head.midlayer.self_attn if self.eagle3 else self.head.layer.self_attn
        like = torch.empty(1, attn.k_proj.out_features // attn.head_dim, 1, attn.head_dim, dtype=self.dtype, device=self.device)
        cap = capacity_for(max(need, old.shape[1] if old is not None else 0))
        self.cache = slot_cache([like], max(rows, old.shape[0] if old is not None else 0), cap,
                                self.device.type == "cuda" and self.compiled)
        self.columns = torch.arange(cap, device=self.device)
        torch._dynamo.maybe_mark_dynamic(self.columns, 0)
        if old is not None:
            with torch.inference_mode():
                for a, b in zip(old.layers, self.cache.layers):
                    b.keys[: a.keys.shape[0], :, : a.keys.shape[2]].copy_(a.keys)
                    b.values[: a.values.shape[0], :, : a.values.shape[2]].copy_(a.values)

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

    def _eager_loop(self, root_hidden, root_tok, limits, caps, tables, priced, base, columns) -> torch.Tensor:
        """:func:`draft_loop` with this head (what ``compile`` compiles)."""
        return draft_loop(self._run, self._logprobs, root_hidden, root_tok, base, limits, caps, tables, priced,
                          columns, self.shape, self.vocab_map)

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
        args = (root_hidden, *self._limits([q for q in requests if q.slot in drafting]), base)
        if args[0].shape[0] > 1:  # one graph for every row count above 1
            for t in args:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        rows = self._loop(*args, self.columns).tolist()  # the step's one read
        return [host_draft(*host_tree(rows[self.rows[q.slot].slot], self.shape.nodes), self.device)
                if q.slot in drafting else root_only(q.root, self.device) for q in requests]


def _flat(n: int) -> float:
    """The table of a row without a cost curve (not used: its ``priced`` is false)."""
    return 1.0
