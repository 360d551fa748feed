"""Token trees as data, built by pure functions.

A tree of ``N`` nodes is stored in topological order: node 0 is the root (the last token the
verifier has not yet seen, whose own next-token distribution is known), and every node's parent
has a smaller index. Everything the engine needs (depths, the ancestor mask used as tree
attention mask, the root-to-leaf paths) is derived from the parent vector by :func:`build_tree`.

Tree *shapes* are described by a :class:`StaticTreeSpec` (Medusa-style "choices", fixed for every
step) or a :class:`DynamicTreeSpec` (EAGLE-2: grown each step from the draft's confidences);
presets of both live as JSON files in ``configs/trees/`` and load with :func:`load_tree_spec`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from .errors import UserError


@dataclass(frozen=True)
class Tree:
    """The topology of a draft tree. Its tensors live on one device (the verifier's, once
    drafted there); the two ints are known on the host, so nothing about a tree's shape ever
    needs a device read.

    Attributes:
        parents: ``[N]`` long; ``parents[0] == -1`` and ``parents[i] < i``.
        depths: ``[N]`` long; the root has depth 0.
        ancestor_mask: ``[N, N]`` bool; ``[i, j]`` is True when ``j`` is ``i`` or an ancestor of ``i``
            (row ``i`` is what node ``i`` may attend to inside the tree).
        max_depth: the deepest node's depth (host int).
        width: an upper bound on any node's number of children (host int).
    """

    parents: torch.Tensor
    depths: torch.Tensor
    ancestor_mask: torch.Tensor
    max_depth: int
    width: int

    @property
    def num_nodes(self) -> int:
        return int(self.parents.shape[0])

    @property
    def device(self) -> torch.device:
        return self.parents.device

    def to(self, device) -> Tree:
        """The same tree with its tensors on ``device`` (asynchronous copies)."""
        if self.parents.device == torch.device(device):
            return self
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return Tree(move(self.parents), move(self.depths), move(self.ancestor_mask), self.max_depth, self.width)

    def children(self) -> list[list[int]]:
        """Children of every node, in index order (the order in which siblings are tried).
        Reads the tree back to the host: for tests and tools, not the decoding loop."""
        kids: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for i, p in enumerate(self.parents.tolist()[1:], start=1):
            kids[p].append(i)
        return kids

    @property
    def paths(self) -> torch.Tensor:
        """``[L, D + 1]`` long: one row per leaf, the node indices from the root to that leaf,
        right-padded with -1 (Medusa's "retrieve indices"). Computed on the host."""
        anc = self.ancestor_mask.cpu()
        is_leaf = torch.ones(self.num_nodes, dtype=torch.bool)
        is_leaf[self.parents[1:].cpu()] = False
        rows = []
        for leaf in is_leaf.nonzero().flatten().tolist():
            path = anc[leaf].nonzero().flatten().tolist()  # ancestors in index order = root first
            rows.append(path + [-1] * (self.max_depth + 1 - len(path)))
        return torch.tensor(rows, dtype=torch.long)


def build_tree(parents: Sequence[int] | torch.Tensor, device=None) -> Tree:
    """Build a :class:`Tree` from a parent vector ``[N]`` (``-1`` for the root, node 0), given
    on the host (a tensor argument is read back). ``device``: where the tree's tensors go.

    Everything is derived on the host and the tree's tensors travel to ``device`` as one packed
    copy (one host-to-device transfer per tree).

    Raises ``ValueError`` unless node 0 is the only root and every parent precedes its child.
    """
    return tree_and_values(parents, (), device)[0]


def tree_and_values(parents: Sequence[int] | torch.Tensor, values: Sequence[int], device=None) -> tuple[Tree, torch.Tensor]:
    """:func:`build_tree`, and ``values [K]`` (host ints, e.g. the nodes' tokens) as a long tensor
    on ``device`` that travels in the same copy as the tree."""
    par = [int(p) for p in (parents.tolist() if isinstance(parents, torch.Tensor) else parents)]
    n = len(par)
    if n == 0 or par[0] != -1:
        raise ValueError("a tree needs node 0 as its root (parents[0] == -1)")
    for i in range(1, n):
        if not 0 <= par[i] < i:
            raise ValueError(f"node {i} has parent {par[i]}: parents must precede their children")
    depths = np.zeros(n, dtype=np.int64)
    kids = np.zeros(n, dtype=np.int64)
    anc = np.zeros((n, n), dtype=np.int64)
    anc[0, 0] = 1
    for i in range(1, n):
        p = par[i]
        depths[i] = depths[p] + 1
        kids[p] += 1
        anc[i] = anc[p]
        anc[i, i] = 1
    k = len(values)
    packed = np.concatenate([np.asarray(values, dtype=np.int64).reshape(k), np.asarray(par, dtype=np.int64), depths, anc.reshape(-1)])
    packed = torch.from_numpy(packed)
    if device is not None:
        packed = packed.to(device, non_blocking=True)
    tree = Tree(packed[k : k + n], packed[k + n : k + 2 * n], packed[k + 2 * n :].view(n, n).bool(), int(depths.max()), int(kids.max()))
    return tree, packed[:k]


# --------------------------------------------------------------------------------------------
# Tree shapes
# --------------------------------------------------------------------------------------------


#: Bounds on tree shapes a user can ask for (presets, JSON files, ``chain:D``, ``dynamic:D,K,N``):
#: beyond them a tree costs more memory than any verifier could use it for (an ``[N, N]``
#: ancestor mask per tree; a dynamic tree grows ``1 + D*K*K`` candidates and their mask first).
MAX_TREE_NODES = 1024
MAX_TREE_DEPTH = 64
MAX_TREE_TOP_K = 64
MAX_TREE_CANDIDATES = 8192
MAX_TREE_FILE_BYTES = 1 << 20


def check_tree_size(depth: int, nodes: int, top_k: int | None = None) -> None:
    """A ``ValueError`` naming the limit when a tree shape is empty or beyond the bounds above."""
    for name, value, limit in (("depth", depth, MAX_TREE_DEPTH), ("nodes", nodes, MAX_TREE_NODES),
                               ("top_k", top_k, MAX_TREE_TOP_K)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"tree {name} must be a positive integer, not {value!r}")
        if value > limit:
            raise ValueError(f"tree {name} {value} is beyond the limit of {limit}")
    if top_k is not None and 1 + depth * top_k * top_k > MAX_TREE_CANDIDATES:
        raise ValueError(f"a dynamic tree of depth {depth} and top_k {top_k} grows 1 + {depth}*{top_k}*{top_k} = "
                         f"{1 + depth * top_k * top_k} candidates, beyond the limit of {MAX_TREE_CANDIDATES}: "
                         f"lower its depth or top_k")


@dataclass(frozen=True)
class StaticTreeSpec:
    """A fixed tree shape, Medusa style.

    ``choices`` lists every non-root node as the path of sibling ranks leading to it: ``(0,)`` is
    the root's best child, ``(0, 1)`` that child's second-best child. Every prefix of a choice must
    itself be a choice.
    """

    choices: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not self.choices:
            raise ValueError("a static tree needs at least one choice (one draft node)")
        check_tree_size(max(len(c) for c in self.choices), len(self.choices) + 1)
        seen = set(self.choices)
        if len(seen) != len(self.choices):
            raise ValueError("tree choices contain duplicates")
        for c in self.choices:
            if not c or any(r < 0 for r in c):
                raise ValueError(f"bad tree choice {list(c)}: ranks are non-negative, paths non-empty")
            if max(c) >= MAX_TREE_TOP_K:
                raise ValueError(f"bad tree choice {list(c)}: ranks are below the limit of {MAX_TREE_TOP_K}")
            if len(c) > 1 and c[:-1] not in seen:
                raise ValueError(f"tree choice {list(c)} has no parent {list(c[:-1])}")

    @property
    def depth(self) -> int:
        return max((len(c) for c in self.choices), default=0)

    @property
    def num_nodes(self) -> int:
        return len(self.choices) + 1

    def ordered(self) -> tuple[list[tuple[int, ...]], list[int]]:
        """The choices in topological order (by depth, then ranks) and their parent vector.

        Returns ``(nodes, parents)``: ``nodes[0] == ()`` is the root; ``parents`` is ``[N]``.
        """
        nodes: list[tuple[int, ...]] = [()] + sorted(self.choices, key=lambda c: (len(c), c))
        index = {c: i for i, c in enumerate(nodes)}
        return nodes, [-1] + [index[c[:-1]] for c in nodes[1:]]


@dataclass(frozen=True)
class DynamicTreeSpec:
    """An EAGLE-2 dynamic tree: ``depth`` draft steps, ``top_k`` children per expanded node and
    ``top_k`` nodes expanded per depth, then the best ``num_nodes`` nodes (root included) kept."""

    depth: int = 6
    top_k: int = 8
    num_nodes: int = 32

    def __post_init__(self) -> None:
        check_tree_size(self.depth, self.num_nodes, self.top_k)


TreeSpec = StaticTreeSpec | DynamicTreeSpec


def chain_spec(depth: int) -> StaticTreeSpec:
    """A single chain of ``depth`` draft tokens (``1 <= depth <= MAX_TREE_DEPTH``: checked before
    the choices are built)."""
    check_tree_size(depth, depth + 1)
    return StaticTreeSpec(tuple(tuple([0] * d) for d in range(1, depth + 1)))


def tree_spec_from_dict(data: dict) -> TreeSpec:
    """Parse ``{"type": "static", "choices": [[0], [0, 0], ...]}`` or
    ``{"type": "dynamic", "depth": D, "top_k": K, "num_nodes": N}``; unknown keys are refused."""
    if not isinstance(data, dict):
        raise ValueError(f"a tree file holds one JSON object with a \"type\" key, not a {type(data).__name__}")
    kind = data.get("type")
    fields = {k: v for k, v in data.items() if k not in ("type", "description")}
    if kind == "static":
        extra = set(fields) - {"choices"}
        if extra or "choices" not in fields:
            raise ValueError(f"a static tree has exactly the key 'choices' (got {sorted(fields)})")
        return StaticTreeSpec(tuple(tuple(int(r) for r in c) for c in fields["choices"]))
    if kind == "dynamic":
        extra = set(fields) - {"depth", "top_k", "num_nodes"}
        if extra:
            raise ValueError(f"unknown dynamic tree keys: {sorted(extra)}")
        return DynamicTreeSpec(**{k: int(v) for k, v in fields.items()})
    raise ValueError(f"tree 'type' must be 'static' or 'dynamic', not {kind!r}")


def _preset_dir() -> Path:
    return Path(str(resources.files("infer") / "presets" / "trees"))


def list_tree_presets() -> list[str]:
    """Names of the shipped tree presets (``configs/trees/*.json``)."""
    return sorted(p.stem for p in _preset_dir().glob("*.json"))


def load_tree_spec(name_or_path: str) -> TreeSpec:
    """Load a tree shape from a preset name (see :func:`list_tree_presets`), a JSON file, or the
    inline forms ``chain:D`` and ``dynamic:D,K,N`` (depth, top-k, nodes)."""
    text = name_or_path.strip()
    try:
        if text.startswith("chain:"):
            return chain_spec(int(text.split(":", 1)[1]))
        if text.startswith("dynamic:"):
            d, k, n = (int(x) for x in text.split(":", 1)[1].split(","))
            return DynamicTreeSpec(d, k, n)
    except ValueError as e:
        raise UserError(f"bad tree {text!r}: use chain:DEPTH or dynamic:DEPTH,TOPK,NODES ({e})") from None
    path = Path(text)
    if not path.suffix:
        path = _preset_dir() / f"{text}.json"
    if not path.is_file():
        raise UserError(
            f"unknown tree {text!r}: give a JSON file, chain:D, dynamic:D,K,N or one of "
            f"{', '.join(list_tree_presets())}"
        )
    if path.stat().st_size > MAX_TREE_FILE_BYTES:
        raise UserError(f"tree file {path} is larger than the limit of {MAX_TREE_FILE_BYTES // 1024} KB: give a tree of "
                        f"at most {MAX_TREE_NODES} nodes")
    try:
        return tree_spec_from_dict(json.loads(path.read_text()))
    except (ValueError, TypeError, AttributeError) as e:
        raise UserError(f"tree file {path}: {e}") from None


# --------------------------------------------------------------------------------------------
# EAGLE-2 dynamic tree
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DynamicTree:
    """Result of :func:`grow_dynamic_tree`; every tensor is on the drafting device.

    Attributes:
        tokens: ``[N]`` long, node 0 is the root token.
        parents: ``[N]`` long, topological order.
        scores: ``[N]`` float, the draft's cumulative log-probability of each node (root: 0).
        keys: ``[N]`` float, the calibrated cumulative log-probability the nodes were chosen by
            (equal to ``scores`` without calibration).
        tree: the topology (:class:`Tree`) of the ``N`` nodes.
        host_tokens, host_parents: ``tokens`` and ``parents`` on the host (read with the budget).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    scores: torch.Tensor
    keys: torch.Tensor
    tree: Tree
    host_tokens: tuple[int, ...] | None = None
    host_parents: tuple[int, ...] | None = None


ExpandFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def at(t: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """``t[i]`` for a 0-dim index tensor ``i`` without reading it on the host (``t[i]`` itself
    calls ``item()`` inside ATen, a sync on a GPU): ``t.shape[1:]``, gathered on the device."""
    return t.index_select(0, i.reshape(1)).squeeze(0)


def cost_table(cost, n_max: int, device=None) -> torch.Tensor:
    """``[n_max + 1]`` float: ``cost(max(n, 1))`` for ``n = 0..n_max`` (a verify-cost curve as a
    tensor, for the budget computations on the drafting device). Written on the device with one
    fill per value (no copy from host memory), cached per curve."""
    values = tuple(float(cost(max(n, 1))) for n in range(n_max + 1))
    return _device_table(values, str(torch.device(device) if device is not None else "cpu"))


@lru_cache(maxsize=64)
def _device_table(values: tuple[float, ...], device: str) -> torch.Tensor:
    table = torch.empty(len(values), dtype=torch.float32, device=device)
    for i, v in enumerate(values):
        table[i] = v  # a fill with the value as its argument: no host-to-device copy
    return table


def _budget(path_probs: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """0-dim long ``n`` in ``1..L+1`` maximising ``(1 + sum(path_probs[:n - 1])) / table[n]``, for
    ``path_probs [L]`` sorted best first (the smallest ``n`` on ties)."""
    expected = torch.cat([path_probs.new_ones(1), 1.0 + path_probs.cumsum(0)])  # [L + 1]: n = 1..L+1
    return (expected / table[1 : path_probs.numel() + 2]).argmax() + 1


def best_budget(path_probs: Sequence[float], cost: Callable[[int], float]) -> int:
    """Node count (root included) maximising ``(1 + sum(path_probs[:n - 1])) / cost(n)``, for
    candidates sorted best first."""
    probs = torch.tensor(list(path_probs), dtype=torch.float32)
    return int(_budget(probs, cost_table(cost, probs.numel() + 1)))


def _deeper_can_pay(cand_keys: torch.Tensor, frontier_best: torch.Tensor, num_nodes: int,
                    table: torch.Tensor | None) -> torch.Tensor:
    """0-dim bool: whether a node with path log-probability ``<= frontier_best`` could still enter
    the tree chosen from candidates ``cand_keys [C]`` (root excluded) with at most ``num_nodes``
    nodes: by beating the ``num_nodes - 1``-th candidate (``table`` None: fixed budget), or by
    raising the best ``(1 + sum of path probabilities) / cost(n)`` (``table``: the cost curve)."""
    limit = num_nodes - 1
    if limit <= 0:
        return torch.zeros((), dtype=torch.bool, device=cand_keys.device)
    top = torch.sort(cand_keys, descending=True, stable=True).values[:limit]
    if table is None:  # compared in log space: exactly the order the final selection uses
        if top.numel() < limit:
            return torch.ones((), dtype=torch.bool, device=cand_keys.device)
        return top[-1] < frontier_best
    probs = torch.zeros(limit, device=top.device).index_copy_(0, torch.arange(top.numel(), device=top.device), top.exp())
    best = frontier_best.exp()
    expected = torch.cat([probs.new_ones(1), 1.0 + probs.cumsum(0)])  # n = 1..limit+1
    rates = expected / table[1 : limit + 2]
    nb = rates.argmax()  # n_best - 1
    displaces = (nb > 0) & (at(probs, (nb - 1).clamp(min=0)) < best)  # a deeper node could replace a chosen one
    extra = torch.maximum(probs, best).cumsum(0)  # [limit]: position j adds the node of budget j + 2
    base = torch.where(nb > 0, at(extra, (nb - 1).clamp(min=0)), extra.new_zeros(()))
    bound = at(expected, nb) + extra - base
    later = torch.arange(limit, device=top.device) >= nb
    return displaces | (later & (bound / table[2 : limit + 2] > at(rates, nb))).any()


def grow_dynamic_tree(
    expand: ExpandFn,
    root_token: int | torch.Tensor,
    spec: DynamicTreeSpec,
    *,
    max_depth: int | None = None,
    vocab_map: torch.Tensor | None = None,
    cost: Callable[[int], float] | None = None,
    prune: bool = True,
    log_scale: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> DynamicTree:
    """Grow an EAGLE-2 tree with tensor operations on the drafting device.

    ``expand(node_ids [k], parent_ids [k], tokens [k]) -> logprobs [k, Vd]`` gives the draft's
    next-token log-distribution after each of ``k`` frontier nodes (node ids index the candidates
    produced so far: 0 is the root, then in creation order; the root's parent is -1; one call per
    depth). When the draft has its own reduced vocabulary, ``vocab_map [Vd]`` maps its ids to the
    verifier's. At every depth the ``top_k`` frontier nodes with the best cumulative
    log-probability are expanded, each into its ``top_k`` most likely children; of those, the best
    ``top_k`` form the next frontier. Finally the best ``num_nodes - 1`` candidates overall are
    kept (a child never scores above its parent and ties go to the older node, so the kept set is
    a tree). Candidates are the draft's most likely tokens, not samples: the tree is a
    deterministic function of the draft, so both greedy and sampled verification are exact
    whatever it keeps.

    ``log_scale [depth]`` calibrates: a child at depth ``d + 1`` counts with conditional
    probability ``min(1, exp(log_scale[d]) * q)`` instead of the draft's ``q`` (the drafter
    measures how often its predictions come true).

    With ``cost`` (verify time of ``n`` nodes relative to one token, see :mod:`infer.core.schedule`), the
    node budget is chosen per step, up to ``num_nodes``: the ``n`` best nodes maximising
    ``(1 + sum of their path probabilities) / cost(n)``, the expected tokens per unit of verify
    time if the (calibrated) confidences are right.

    With ``prune``, the next depth is drafted only if one of its nodes could still be kept: once
    the nodes in hand fill the budget with scores at least the best frontier node's (or, with
    ``cost``, once even nodes that good would not raise the expected tokens per unit of time),
    deeper drafting cannot change the tree and is skipped. The result is the same tree, for fewer
    draft passes.

    Host reads: one per drafted depth, none per node, no copies: the pruning decision before each
    depth after the first, and the budget, which also brings the kept tree's tokens and parents to
    the host (read with the pruning decision that stops drafting, or after the last depth).
    """
    depth = spec.depth if max_depth is None else min(spec.depth, max_depth)
    if device is None:
        device = root_token.device if isinstance(root_token, torch.Tensor) else torch.device("cpu")
    c = _Candidates.new(root_token, 1 + depth * spec.top_k * spec.top_k, device)
    table = cost_table(cost, spec.num_nodes + 1, device) if cost is not None else None
    frontier = torch.zeros(1, dtype=torch.long, device=device)
    host = None  # the read-out, once read
    for d in range(depth):
        if prune and d > 0:
            # one read per depth: whether deeper nodes can still pay, together with the tree as
            # it stands (which is the result when they cannot)
            order, packed = c.selection(spec.num_nodes, table)
            can_pay = _deeper_can_pay(c.key[1 : c.m], c.key[frontier].max(), spec.num_nodes, table)
            got = torch.cat([can_pay.view(1).long(), packed]).tolist()
            if not got[0]:
                host = got[1:]
                break
        logp = expand(frontier, c.par[frontier], c.tok[frontier]).float()  # [k, Vd]
        frontier = c.expand(frontier, logp, d, spec.top_k, vocab_map, log_scale)
    if host is None:
        order, packed = c.selection(spec.num_nodes, table)
        if order.numel() == 0 and not isinstance(root_token, torch.Tensor):
            host = [1, int(root_token)]  # nothing drafted: nothing to read
        else:
            # the one read of the budget: the node count and the candidates' ids, tokens, parents
            # and depths, from which the host knows the whole tree (for merging, gating, its shape)
            host = packed.tolist()
    return c.kept_tree(order, host, spec.top_k)


@dataclass
class _Candidates:
    """The nodes an EAGLE-2 tree is chosen from, in preallocated buffers on the drafting device
    (``C`` = capacity): tokens, parents, depths, cumulative draft log-probabilities (``raw``),
    calibrated keys (what nodes are chosen by) and the ancestor mask; ``m`` of them exist (a host
    int: every size is known without reading the device). Node 0 is the root."""

    tok: torch.Tensor  # [C] long
    par: torch.Tensor  # [C] long, -1 at the root
    dep: torch.Tensor  # [C] long
    raw: torch.Tensor  # [C] float
    key: torch.Tensor  # [C] float
    anc: torch.Tensor  # [C, C] bool
    m: int = 1

    @classmethod
    def new(cls, root_token, capacity: int, device) -> _Candidates:
        tok = torch.zeros(capacity, dtype=torch.long, device=device)
        if isinstance(root_token, torch.Tensor):
            tok[0] = root_token.to(device, non_blocking=True).reshape(())
        else:
            tok[0] = int(root_token)  # a fill: no copy
        anc = torch.zeros(capacity, capacity, dtype=torch.bool, device=device)
        anc[0, 0] = True
        return cls(tok, torch.full((capacity,), -1, dtype=torch.long, device=device),
                   torch.zeros(capacity, dtype=torch.long, device=device), torch.zeros(capacity, device=device),
                   torch.zeros(capacity, device=device), anc)

    def expand(self, frontier: torch.Tensor, logp: torch.Tensor, d: int, k_max: int, vocab_map, log_scale) -> torch.Tensor:
        """Add the ``top_k`` best children of each ``frontier [k]`` node (``logp [k, Vd]``, at depth
        ``d``); returns the next frontier: the ``k_max`` best new nodes by key."""
        kids = min(k_max, logp.shape[-1])
        child_lp, child_tok = torch.topk(logp, kids, dim=-1)  # [k, kids], best first
        if vocab_map is not None:
            child_tok = vocab_map[child_tok]
        m, count = self.m, frontier.numel() * kids
        new = torch.arange(m, m + count, device=self.tok.device)
        parent = frontier.repeat_interleave(kids)
        self.tok[m : m + count] = child_tok.reshape(-1)
        self.par[m : m + count] = parent
        self.dep[m : m + count] = d + 1
        self.raw[m : m + count] = (self.raw[frontier][:, None] + child_lp).reshape(-1)
        step = child_lp if log_scale is None else (child_lp + log_scale[d]).clamp(max=0.0)
        self.key[m : m + count] = (self.key[frontier][:, None] + step).reshape(-1)
        self.anc[m : m + count] = self.anc[parent]
        self.anc[new, new] = True
        self.m += count
        return new[torch.sort(self.key[m : m + count], descending=True, stable=True).indices[:k_max]]

    def selection(self, num_nodes: int, table) -> tuple[torch.Tensor, torch.Tensor]:
        """The best nodes overall ``[L]`` (ties broken by creation order so parents come first),
        and the budget's read-out, packed: ``[n, root token, ids, tokens, parents, depths]``."""
        order = torch.sort(self.key[1 : self.m], descending=True, stable=True).indices[: num_nodes - 1] + 1
        size = order.numel()
        budget = _budget(self.key[order].exp(), table).view(1) if table is not None and size else order.new_full((1,), size + 1)
        return order, torch.cat([budget, self.tok[:1], order, self.tok[order], self.par[order], self.dep[order]])

    def kept_tree(self, order: torch.Tensor, host: list[int], k_max: int) -> DynamicTree:
        """The tree of the first ``host[0] - 1`` nodes of ``order`` (and the root), on the device and,
        from the read-out ``host``, on the host."""
        size = order.numel()
        n, root_tok = host[0], host[1]
        ids, toks, pars, deps = (host[2 + i * size : 2 + (i + 1) * size] for i in range(4))
        kept_h = sorted(range(n - 1), key=lambda j: (deps[j], ids[j]))  # topological: by depth, then creation
        index_h = {0: 0} | {ids[j]: i + 1 for i, j in enumerate(kept_h)}
        host_tokens = [root_tok] + [toks[j] for j in kept_h]
        host_parents = [-1] + [index_h[pars[j]] for j in kept_h]
        max_d = max((deps[j] for j in kept_h), default=0)
        kept = order[: n - 1]
        kept = kept[torch.argsort(self.dep[kept] * self.m + kept)]  # topological: by depth, then creation
        nodes = torch.cat([kept.new_zeros(1), kept])
        device = self.tok.device
        index = torch.zeros(self.m, dtype=torch.long, device=device).index_copy_(0, nodes, torch.arange(n, device=device))
        parents = torch.where(self.par[nodes] >= 0, index[self.par[nodes].clamp(min=0)], -1)
        tree = Tree(parents, self.dep[nodes], self.anc[nodes][:, nodes], max_depth=max_d, width=k_max if n > 1 else 0)
        return DynamicTree(tokens=self.tok[nodes], parents=parents, scores=self.raw[nodes], keys=self.key[nodes], tree=tree,
                           host_tokens=tuple(host_tokens), host_parents=tuple(host_parents))
