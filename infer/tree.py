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
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from .errors import UserError


@dataclass(frozen=True)
class Tree:
    """The topology of a draft tree.

    Attributes:
        parents: ``[N]`` long; ``parents[0] == -1`` and ``parents[i] < i``.
        depths: ``[N]`` long; the root has depth 0.
        ancestor_mask: ``[N, N]`` bool; ``[i, j]`` is True when ``j`` is ``i`` or an ancestor of ``i``
            (row ``i`` is what node ``i`` may attend to inside the tree).
        paths: ``[L, D + 1]`` long; one row per leaf, the node indices from the root to that leaf,
            right-padded with -1 (Medusa's "retrieve indices").
    """

    parents: torch.Tensor
    depths: torch.Tensor
    ancestor_mask: torch.Tensor
    paths: torch.Tensor

    @property
    def num_nodes(self) -> int:
        return int(self.parents.shape[0])

    @property
    def depth(self) -> int:
        return int(self.depths.max())

    def children(self) -> list[list[int]]:
        """Children of every node, in index order (the order in which siblings are tried)."""
        kids: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for i, p in enumerate(self.parents.tolist()[1:], start=1):
            kids[p].append(i)
        return kids


def build_tree(parents: Sequence[int] | torch.Tensor) -> Tree:
    """Build a :class:`Tree` from a parent vector ``[N]`` (``-1`` for the root, node 0).

    Raises ``ValueError`` unless node 0 is the only root and every parent precedes its child.
    """
    par = [int(p) for p in (parents.tolist() if isinstance(parents, torch.Tensor) else parents)]
    n = len(par)
    if n == 0 or par[0] != -1:
        raise ValueError("a tree needs node 0 as its root (parents[0] == -1)")
    for i in range(1, n):
        if not 0 <= par[i] < i:
            raise ValueError(f"node {i} has parent {par[i]}: parents must precede their children")
    depths = [0] * n
    anc = torch.zeros(n, n, dtype=torch.bool)
    anc[0, 0] = True
    is_leaf = [True] * n
    for i in range(1, n):
        p = par[i]
        depths[i] = depths[p] + 1
        anc[i] = anc[p]
        anc[i, i] = True
        is_leaf[p] = False
    max_depth = max(depths)
    rows = []
    for leaf in (i for i in range(n) if is_leaf[i]):
        path = anc[leaf].nonzero().flatten().tolist()  # ancestors in index order = root first
        rows.append(path + [-1] * (max_depth + 1 - len(path)))
    return Tree(
        parents=torch.tensor(par, dtype=torch.long),
        depths=torch.tensor(depths, dtype=torch.long),
        ancestor_mask=anc,
        paths=torch.tensor(rows, dtype=torch.long),
    )


def chain_parents(n: int) -> list[int]:
    """Parent vector of a chain of ``n`` nodes (root included)."""
    return [-1] + list(range(n - 1))


# --------------------------------------------------------------------------------------------
# Tree shapes
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StaticTreeSpec:
    """A fixed tree shape, Medusa style.

    ``choices`` lists every non-root node as the path of sibling ranks leading to it: ``(0,)`` is
    the root's best child, ``(0, 1)`` that child's second-best child. Every prefix of a choice must
    itself be a choice.
    """

    choices: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        seen = set(self.choices)
        if len(seen) != len(self.choices):
            raise ValueError("tree choices contain duplicates")
        for c in self.choices:
            if not c or any(r < 0 for r in c):
                raise ValueError(f"bad tree choice {list(c)}: ranks are non-negative, paths non-empty")
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
        if self.depth < 1 or self.top_k < 1 or self.num_nodes < 1:
            raise ValueError("dynamic tree depth, top_k and num_nodes must be >= 1")


TreeSpec = StaticTreeSpec | DynamicTreeSpec


def chain_spec(depth: int) -> StaticTreeSpec:
    """A single chain of ``depth`` draft tokens."""
    return StaticTreeSpec(tuple(tuple([0] * d) for d in range(1, depth + 1)))


def tree_spec_from_dict(data: dict) -> TreeSpec:
    """Parse ``{"type": "static", "choices": [[0], [0, 0], ...]}`` or
    ``{"type": "dynamic", "depth": D, "top_k": K, "num_nodes": N}``; unknown keys are refused."""
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
    try:
        return tree_spec_from_dict(json.loads(path.read_text()))
    except (ValueError, TypeError, AttributeError) as e:
        raise UserError(f"tree file {path}: {e}") from None


# --------------------------------------------------------------------------------------------
# EAGLE-2 dynamic tree
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DynamicTree:
    """Result of :func:`grow_dynamic_tree`.

    Attributes:
        tokens: ``[N]`` long, node 0 is the root token.
        parents: ``[N]`` long, topological order.
        scores: ``[N]`` float, cumulative draft log-probability of each node (root: 0).
        q: ``[N, V]`` float or None: the distribution each node's token was drawn from, given its
            earlier siblings (only when grown with a generator, i.e. for sampling).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    scores: torch.Tensor
    q: torch.Tensor | None


ExpandFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def grow_dynamic_tree(
    expand: ExpandFn,
    root_token: int,
    spec: DynamicTreeSpec,
    *,
    max_depth: int | None = None,
    generator: torch.Generator | None = None,
    vocab_map: torch.Tensor | None = None,
    vocab_size: int | None = None,
    cost: Callable[[int], float] | None = None,
    prune: bool = True,
) -> DynamicTree:
    """Grow an EAGLE-2 tree.

    ``expand(node_ids [k], parent_ids [k], tokens [k]) -> logprobs [k, Vd]`` gives the draft's
    next-token log-distribution after each of ``k`` frontier nodes (node ids index the candidates
    produced so far: 0 is the root, then in creation order; the root's parent is -1). When the
    draft has its own reduced vocabulary, ``vocab_map [Vd]`` maps its ids to the verifier's and
    ``vocab_size`` is the verifier's vocabulary (``q`` is returned over it). At every depth the
    ``top_k`` frontier nodes with
    the best cumulative log-probability are expanded, each into ``top_k`` children; of those,
    the best ``top_k`` form the next frontier. Finally the best ``num_nodes - 1`` candidates
    overall are kept (a child never scores above its parent, so the kept set is a tree).

    With a ``generator`` (sampling), children are drawn without replacement from the draft
    distribution (Gumbel-top-k) instead of taken greedily, and each kept node records ``q``: the
    distribution it was drawn from given its earlier siblings, as lossless acceptance needs.

    With ``cost`` (verify time of ``n`` nodes relative to one token, see :mod:`infer.cost`), the
    node budget is chosen per step, up to ``num_nodes``: the ``n`` best nodes maximising
    ``(1 + sum of their path probabilities) / cost(n)``, the expected tokens per unit of verify
    time if the draft's confidences are calibrated (a node is accepted with its path probability).

    With ``prune`` (greedy only), the next depth is drafted only if one of its nodes could still
    be kept: a child never scores above its parent, so once the nodes in hand fill the budget
    with scores at least the best frontier node's (or, with ``cost``, once even nodes that good
    would not raise the expected tokens per unit of time), deeper drafting cannot change the
    tree and is skipped. The result is the same tree, for fewer draft passes.
    """
    depth = spec.depth if max_depth is None else min(spec.depth, max_depth)
    device = None
    cand_tok: list[int] = [root_token]
    cand_par: list[int] = [-1]
    cand_score: list[float] = [0.0]
    cand_key: list[float] = [0.0]  # selection key: score, or Gumbel-perturbed score when sampling
    cand_q: list[torch.Tensor | None] = [None]
    frontier = [0]
    for d in range(depth):
        if prune and generator is None and d > 0:
            best_frontier = max(cand_score[i] for i in frontier)
            if not deeper_nodes_can_pay(sorted(cand_score[1:], reverse=True), best_frontier, spec.num_nodes, cost):
                break
        ids = torch.tensor(frontier, dtype=torch.long)
        toks = torch.tensor([cand_tok[i] for i in frontier], dtype=torch.long)
        pars = torch.tensor([cand_par[i] for i in frontier], dtype=torch.long)
        logp = expand(ids, pars, toks).float()  # [k, Vd]
        device = logp.device
        base = torch.tensor([cand_key[i] for i in frontier], device=device)[:, None]
        k = min(spec.top_k, logp.shape[-1])
        if generator is None:
            child_key, child_tok = torch.topk(logp, k, dim=-1)
            child_logp = child_key
        else:
            u = torch.rand(logp.shape, generator=generator, device=device).clamp_(1e-20, 1 - 1e-7)
            perturbed = logp - torch.log(-torch.log(u))
            child_key, child_tok = torch.topk(perturbed, k, dim=-1)
            child_logp = logp.gather(-1, child_tok)
        cum_key = base + child_key
        cum_score = torch.tensor([cand_score[i] for i in frontier], device=device)[:, None] + child_logp
        if vocab_map is not None:
            child_tok = vocab_map.to(child_tok.device)[child_tok]
        new_ids = []
        for r, parent in enumerate(frontier):
            probs = None
            if generator is not None:
                probs = logp[r].exp()
                if vocab_map is not None:
                    probs = torch.zeros(vocab_size, device=device).index_copy_(0, vocab_map.to(device), probs)
            taken = []
            for c in range(k):
                tok = int(child_tok[r, c])
                cand_tok.append(tok)
                cand_par.append(parent)
                cand_score.append(float(cum_score[r, c]))
                cand_key.append(float(cum_key[r, c]))
                if probs is not None:
                    q = probs.clone()
                    if taken:
                        q[taken] = 0
                    cand_q.append(q / q.sum())
                    taken.append(tok)
                else:
                    cand_q.append(None)
                new_ids.append(len(cand_tok) - 1)
        new_ids.sort(key=lambda i: -cand_key[i])
        frontier = new_ids[: spec.top_k]
    # keep the best nodes overall; ties broken by creation order so parents come first
    order = sorted(range(1, len(cand_tok)), key=lambda i: (-cand_key[i], i))
    budget = spec.num_nodes
    if cost is not None:
        budget = best_budget([math.exp(cand_score[i]) for i in order[: spec.num_nodes - 1]], cost)
    keep = set(order[: budget - 1])
    keep = {i for i in keep if _ancestors_kept(i, cand_par, keep)}
    kept = [0] + sorted(keep, key=lambda i: (_depth(i, cand_par), i))
    index = {c: j for j, c in enumerate(kept)}
    qs = None
    if generator is not None and len(kept) > 1:
        vocab = cand_q[kept[1]].shape[-1]
        qs = torch.stack([torch.zeros(vocab, device=device)] + [cand_q[i] for i in kept[1:]])
    return DynamicTree(
        tokens=torch.tensor([cand_tok[i] for i in kept], dtype=torch.long),
        parents=torch.tensor([-1] + [index[cand_par[i]] for i in kept[1:]], dtype=torch.long),
        scores=torch.tensor([cand_score[i] for i in kept]),
        q=qs,
    )


def best_budget(path_probs: Sequence[float], cost: Callable[[int], float]) -> int:
    """Node count (root included) maximising ``(1 + sum(path_probs[:n - 1])) / cost(n)``, for
    candidates sorted best first."""
    best_n, best_rate, expected = 1, 1.0 / cost(1), 1.0
    for n, p in enumerate(path_probs, start=2):
        expected += p
        rate = expected / cost(n)
        if rate > best_rate:
            best_n, best_rate = n, rate
    return best_n


def deeper_nodes_can_pay(path_logprobs: Sequence[float], frontier_best: float, num_nodes: int,
                         cost: Callable[[int], float] | None) -> bool:
    """Whether a node with path log-probability ``<= frontier_best`` could still enter the tree
    chosen from candidates ``path_logprobs`` (sorted best first, root excluded) with at most
    ``num_nodes`` nodes: by beating the ``num_nodes - 1``-th candidate (fixed budget), or, with
    ``cost``, by raising the best ``(1 + sum of path probabilities) / cost(n)``."""
    if num_nodes <= 1:
        return False
    if cost is None:  # compared in log space: exactly the order the final selection uses
        top = path_logprobs[: num_nodes - 1]
        return len(top) < num_nodes - 1 or top[-1] < frontier_best
    top = [math.exp(x) for x in path_logprobs[: num_nodes - 1]]
    frontier_best = math.exp(frontier_best)
    n_best = best_budget(top, cost)
    if n_best > 1 and top[n_best - 2] < frontier_best:
        return True  # a deeper node could displace one of the chosen nodes
    expected = 1.0 + sum(top[: n_best - 1])
    rate = expected / cost(n_best)
    rest = top[n_best - 1 :]
    bound = expected
    for n in range(n_best + 1, num_nodes + 1):
        j = n - n_best - 1
        bound += max(frontier_best, rest[j] if j < len(rest) else 0.0)
        if bound / cost(n) > rate:
            return True
    return False


def _ancestors_kept(i: int, parents: list[int], keep: set[int]) -> bool:
    p = parents[i]
    while p > 0:
        if p not in keep:
            return False
        p = parents[p]
    return True


def _depth(i: int, parents: list[int]) -> int:
    d = 0
    while parents[i] >= 0:
        i = parents[i]
        d += 1
    return d
