"""Drafters: what proposes the token tree that the verifier checks.

The interface, in the spirit of HF's ``CandidateGenerator``, has three methods:

* :meth:`Drafter.begin` - a new generation starts: the prompt and the verifier's features for it;
* :meth:`Drafter.propose` - draft a tree rooted at the newest token;
* :meth:`Drafter.update` - these tokens (root + accepted drafts) are now committed, with the
  verifier's features at each of them.

Drafters that need the verifier's hidden states list the layers in ``feature_layers``
(indices into HF's ``hidden_states`` tuple).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from .cost import DEFAULT_COST, VerifyCost, best_chain_depth, cost_summary
from .tree import DynamicTreeSpec, Tree, TreeSpec, tree_and_values


@dataclass(frozen=True)
class Draft:
    """A proposed tree.

    Attributes:
        tokens: ``[N]`` long; node 0 is the root token (already emitted, not yet verified).
        tree: topology of the ``N`` nodes.
        q: ``[N, V]`` or None: the distribution each node's token was drawn from given its earlier
            siblings (see :func:`infer.accept.sample_accept`); None for deterministic drafts.
        host: ``(tokens, parents)`` as host tuples when the drafter knows them without reading
            the device (then merging drafts reads nothing), else None.
    """

    tokens: torch.Tensor
    tree: Tree
    q: torch.Tensor | None = None
    host: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    def to(self, device) -> Draft:
        """The same draft on ``device`` (asynchronous copies; itself when already there)."""
        if self.tokens.device == torch.device(device):
            return self
        if self.host is not None and self.q is None:  # rebuilt on the host: one packed copy
            return host_draft(*self.host, device=device)
        q = self.q.to(device, non_blocking=True) if self.q is not None else None
        return Draft(self.tokens.to(device, non_blocking=True), self.tree.to(device), q, self.host)


def host_draft(tokens: Sequence[int], parents: Sequence[int], device=None) -> Draft:
    """A deterministic draft built on the host: tokens and parents travel to ``device`` as one
    packed copy with the tree (:func:`~infer.tree.build_tree`), and stay known on the host."""
    tokens, parents = tuple(int(t) for t in tokens), tuple(int(p) for p in parents)
    tree, values = tree_and_values(parents, tokens, device)
    return Draft(values, tree, host=(tokens, parents))


@lru_cache(maxsize=16)
def _single(device: str) -> Tree:
    """The one-node tree, made on ``device`` by factory functions (no copy)."""
    dev = torch.device(device)
    return Tree(torch.full((1,), -1, dtype=torch.long, device=dev), torch.zeros(1, dtype=torch.long, device=dev),
                torch.ones(1, 1, dtype=torch.bool, device=dev), 0, 0)


def root_only(root: int, device=None) -> Draft:
    """The trivial draft: just the root (one plain decoding step), on ``device``, made there
    without a copy from host memory."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    return Draft(torch.full((1,), int(root), dtype=torch.long, device=dev), _single(str(dev)), host=((int(root),), (-1,)))


class Drafter(ABC):
    """Base class of all drafters (see the module docstring for the protocol)."""

    feature_layers: tuple[int, ...] = ()
    tree: TreeSpec | None = None

    def begin(self, prompt_ids: torch.Tensor, features: torch.Tensor | None) -> None:
        """A generation starts. ``prompt_ids``: ``[L]``; ``features``: ``[L, F, H]`` or None."""

    @abstractmethod
    def propose(
        self, root: int, *, tree: TreeSpec | None, max_depth: int, generator: torch.Generator | None
    ) -> Draft:
        """Draft a tree of depth at most ``max_depth`` rooted at token ``root``.

        ``tree`` overrides the drafter's default shape; ``generator`` is given when sampling
        (drafters that draw children from their distribution use it and report ``q``).
        """

    def update(self, tokens: torch.Tensor, features: torch.Tensor | None) -> None:
        """``tokens`` ``[k]`` (root, then accepted drafts) entered the verifier's cache;
        ``features`` ``[k, F, H]`` are the verifier's hidden states there."""

    def state(self) -> dict:
        """What the drafter has learnt so far in this generation, for benchmark records (JSON;
        reads device values, so call it between generations, not in the decoding loop)."""
        return {}


class NoDrafter(Drafter):
    """Plain decoding through the speculative engine: every tree is just the root."""

    def propose(self, root, *, tree=None, max_depth=0, generator=None) -> Draft:
        return root_only(root)


def _trie_limits(spec: TreeSpec) -> tuple[int, int, int]:
    """(depth, num_nodes, branches) of a tree spec, for drafters that build their own trees."""
    if isinstance(spec, DynamicTreeSpec):
        return spec.depth, spec.num_nodes, spec.top_k
    firsts = [c[0] for c in spec.choices if len(c) == 1]
    return spec.depth, spec.num_nodes, max(firsts, default=0) + 1


class PromptLookupDrafter(Drafter):
    """Prompt-lookup (n-gram) drafting: find earlier occurrences of the context's last ``n``
    tokens (``n`` from ``max_ngram`` down to ``min_ngram``, most recent first) and propose what
    followed them. Up to ``branches`` distinct continuations are merged into a trie of at most
    ``num_nodes`` nodes and ``depth`` levels (taken from the tree spec: for a dynamic spec,
    ``top_k`` is the number of branches).

    With ``adaptive`` (the default), the depth is chosen each step from the acceptance rate seen
    so far for matches of the same length ``n`` and the verifier's ``cost`` curve: the depth that
    maximises expected tokens per unit of verify time (0: no draft, a plain step).
    """

    def __init__(
        self,
        max_ngram: int = 3,
        min_ngram: int = 1,
        tree: TreeSpec | None = None,
        *,
        adaptive: bool = True,
        cost: VerifyCost = DEFAULT_COST,
    ):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tree = tree or DynamicTreeSpec(depth=10, top_k=1, num_nodes=11)
        self.adaptive, self.cost = adaptive, cost
        self.max_hits = 64  # matches examined per n-gram length (the most recent ones)
        self._ctx = np.zeros(0, dtype=np.int64)
        self._len = 0
        self._last: tuple[int, int] | None = None  # (n-gram length, depth) of the last draft
        self._stats: dict[int, tuple[float, float]] = {}  # n -> (accepted, rejected) counts

    @staticmethod
    def prior(n: int) -> tuple[float, float]:
        """The (accepted, rejected) pseudo-counts an ``n``-gram match starts from: an acceptance
        of ``n / (n + 1)``, optimistic for long matches (Spec-Bench, greedy: 3-gram drafts were
        accepted at 0.67-0.98 per token, 1-gram ones at 0.36-0.47), worth one draft, so that the
        first draft's outcome outweighs it. A prior too low for the cost curve is never tried, so
        never learnt from: at an even 1:1 on a curve where a 2-node pass costs 1.7-2x a one-token
        pass no chain paid, and a RAG prompt that copies its context took 180 passes for 256
        tokens instead of 38."""
        return n / (n + 1), 1 / (n + 1)

    def _counts(self, n: int) -> tuple[float, float]:
        """(accepted, rejected) for ``n``-gram matches in this generation, the prior until judged."""
        return self._stats.get(n, self.prior(n))

    def acceptance(self, n: int) -> float:
        """Estimated per-token acceptance of drafts from ``n``-gram matches in this generation."""
        succ, fail = self._counts(n)
        return succ / (succ + fail)

    def state(self) -> dict:
        return {"acceptance": {n: round(self.acceptance(n), 3) for n in sorted(self._stats)},
                "cost": cost_summary(self.cost) if self.adaptive else None}

    def begin(self, prompt_ids, features=None) -> None:
        self._ctx = np.zeros(max(1024, 2 * len(prompt_ids)), dtype=np.int64)
        self._len = 0
        self._stats = {}
        self._last = None
        self._append(prompt_ids.tolist())

    def update(self, tokens, features=None) -> None:
        host = tokens.tolist()  # the engine hands over a host tensor: no device read
        if self._last is not None:
            n, depth, trie = self._last
            accepted, node = 0, 0  # how far the committed tokens follow this drafter's own trie
            for tok in host[1:]:
                node = trie.get((node, tok))
                if node is None:
                    break
                accepted += 1
            succ, fail = self._counts(n)
            self._stats[n] = (succ + accepted, fail + (accepted < depth))
            self._last = None
        self._append(host)

    def _append(self, toks: list[int]) -> None:
        end = self._len + len(toks)
        if end > len(self._ctx):
            self._ctx = np.concatenate([self._ctx, np.zeros(max(end, len(self._ctx)), dtype=np.int64)])
        self._ctx[self._len : end] = toks
        self._len = end

    def continuations(self, root: int, depth: int, branches: int) -> list[tuple[int, list[int]]]:
        """Distinct continuations of ``context + [root]``, best first, with their match length."""
        self._append([root])
        ctx, n_ctx = self._ctx, self._len
        self._len -= 1  # the root is committed later, through update()
        found: list[tuple[int, list[int]]] = []
        seen: set[tuple[int, ...]] = set()
        for n in range(min(self.max_ngram, n_ctx - 1), self.min_ngram - 1, -1):
            suffix = ctx[n_ctx - n : n_ctx]
            hits = ctx[: n_ctx - n] == suffix[0]
            for t in range(1, n):
                hits &= ctx[t : n_ctx - n + t] == suffix[t]
            # most recent first; a recent match near the end has a truncated continuation, so
            # full-length continuations go first, then the longest short ones
            full, short = [], []
            for j in np.flatnonzero(hits)[::-1][: self.max_hits]:
                cont = ctx[j + n : min(j + n + depth, n_ctx)].tolist()
                (full if len(cont) == depth else short).append(cont)
            short.sort(key=len, reverse=True)
            for cont in full + short:
                key = tuple(cont)
                if key not in seen:
                    seen.add(key)
                    found.append((n, cont))
                    if len(found) == branches:
                        return found
        return found

    def propose(self, root, *, tree=None, max_depth=8, generator=None) -> Draft:
        tokens, parents = self.propose_host(root, tree=tree, max_depth=max_depth)
        return host_draft(tokens, parents) if len(tokens) > 1 else root_only(root)

    def propose_host(self, root, *, tree=None, max_depth=8) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """:meth:`propose` on the host: the draft's ``(tokens, parents)`` (just the root when
        nothing is drafted), no tensor made; a union merges it without copying it first."""
        depth, budget, branches = _trie_limits(tree or self.tree)
        depth = min(depth, max_depth)
        nothing = ((int(root),), (-1,))
        if depth <= 0:
            return nothing
        found = self.continuations(root, depth, branches)
        if not found:
            return nothing
        n = found[0][0]
        if self.adaptive:
            depth = best_chain_depth(self.acceptance(n), depth, self.cost)
            if depth == 0:  # not worth drafting; drift back toward the prior so we try again later
                succ, fail = self._counts(n)
                self._stats[n] = (0.95 * succ + 0.05, 0.95 * fail + 0.05)
                return nothing
        tokens, parents, depths = [int(root)], [-1], [0]
        trie: dict[tuple[int, int], int] = {}
        for _, cont in found:
            cont = cont[:depth]
            node = 0
            for tok in cont:
                child = trie.get((node, tok))
                if child is None:
                    if len(tokens) >= budget:
                        break
                    child = len(tokens)
                    trie[(node, tok)] = child
                    tokens.append(tok)
                    parents.append(node)
                    depths.append(depths[node] + 1)
                node = child
        self._last = (n, max(depths), trie)
        return tuple(tokens), tuple(parents)


def merge_drafts(drafts: list[Draft], device=None) -> Draft:
    """The union of deterministic drafts with the same root, as one trie: a path drafted by
    several of them appears once. Nodes keep their order (parents before children). Built on
    the host from each draft's ``host`` form (a draft without one is read back), then placed on
    ``device`` (default: the first draft's) in one packed copy.

    ``drafts``: ``k`` drafts of ``[N_i]`` tokens -> a draft of ``<= 1 + sum(N_i - 1)`` tokens."""
    host = [d.host if d.host is not None else (d.tokens.tolist(), d.tree.parents.tolist()) for d in drafts]
    device = device if device is not None else drafts[0].tokens.device
    return host_draft(*merge_host(host), device)


def merge_host(drafts: list[tuple[Sequence[int], Sequence[int]]]) -> tuple[list[int], list[int]]:
    """:func:`merge_drafts` on host ``(tokens, parents)`` pairs; returns the merged pair."""
    root = drafts[0][0][0]
    if any(toks[0] != root for toks, _ in drafts):
        raise ValueError("drafts to merge must share their root token")
    tokens, parents = [root], [-1]
    trie: dict[tuple[int, int], int] = {}
    for toks, pars in drafts:
        where = [0] * len(toks)  # node of this draft -> merged node
        for i in range(1, len(toks)):
            key = (where[pars[i]], toks[i])
            if key not in trie:
                trie[key] = len(tokens)
                tokens.append(key[1])
                parents.append(key[0])
            where[i] = trie[key]
    return tokens, parents


class UnionDrafter(Drafter):
    """Several drafters at once (e.g. a trained head and prompt lookup): each step verifies the
    union of their trees, so each one's strength counts (the head for fresh text, prompt lookup
    for text copied from the context). Their drafts are deterministic, so the union is exact
    when sampling too. A member that reports a ``q`` (children drawn from it) cannot join a
    union, as exact tree rejection sampling needs one proposal distribution per node: when the
    first member reports one, its draft is verified alone; when a later one does, its draft is
    left out. Either is said once per union, with a ``UserWarning`` naming the member."""

    def __init__(self, drafters: list[Drafter]):
        if len(drafters) < 2:
            raise ValueError("a union needs at least two drafters")
        self.drafters = drafters
        self.tree = drafters[0].tree
        self.cost = next((d.cost for d in drafters if getattr(d, "cost", None) is not None), None)
        layers: list[int] = []
        for d in drafters:
            layers += [x for x in d.feature_layers if x not in layers]
        self.feature_layers = tuple(layers)
        self._warned: set[int] = set()

    def _warn_q(self, i: int, alone: bool) -> None:
        if i in self._warned:
            return
        self._warned.add(i)
        import warnings

        name = type(self.drafters[i]).__name__
        what = ("its draft is verified alone, without the other members'" if alone
                else "its draft is left out of the union")
        warnings.warn(f"union drafter: member {i} ({name}) drew its draft from a distribution q, which a union cannot "
                      f"verify exactly: {what} (give it deterministic drafts, e.g. top-k children, to combine it)",
                      UserWarning, stacklevel=3)

    def _features_for(self, d: Drafter, features):
        if features is None or not d.feature_layers:
            return None
        idx = [self.feature_layers.index(x) for x in d.feature_layers]
        if idx == list(range(idx[0], idx[0] + len(idx))):  # a slice: no index tensor to copy
            return features[:, idx[0] : idx[0] + len(idx)]
        index = torch.empty(len(idx), dtype=torch.long, device=features.device)
        for i, j in enumerate(idx):
            index[i] = j  # fills: no copy from host memory
        return features.index_select(1, index)

    def begin(self, prompt_ids, features) -> None:
        for d in self.drafters:
            d.begin(prompt_ids, self._features_for(d, features))

    def update(self, tokens, features) -> None:
        for d in self.drafters:
            d.update(tokens, self._features_for(d, features))

    def state(self) -> dict:
        return {"members": [d.state() for d in self.drafters]}

    def propose(self, root, *, tree=None, max_depth=8, generator=None) -> Draft:
        first = self.drafters[0].propose(root, tree=tree, max_depth=max_depth, generator=generator)
        if first.q is not None:
            self._warn_q(0, alone=True)
            return first
        device = first.tokens.device
        members = [(first, first.host)] if first.tree.num_nodes > 1 else []  # (draft or None, host form or None)
        for i, d in enumerate(self.drafters[1:], start=1):
            if hasattr(d, "propose_host"):  # drafted on the host: merged there, copied once
                form = d.propose_host(root, tree=None, max_depth=max_depth)
                if len(form[0]) > 1:
                    members.append((None, form))
                continue
            draft = d.propose(root, tree=None, max_depth=max_depth, generator=generator)
            if draft.q is not None:
                self._warn_q(i, alone=False)
            elif draft.tree.num_nodes > 1:
                members.append((draft, draft.host))
        if not members:
            return first
        if len(members) == 1:  # nothing to merge: no device read
            draft, form = members[0]
            return draft.to(device) if draft is not None else host_draft(*form, device)
        forms = [form if form is not None else (draft.tokens.tolist(), draft.tree.parents.tolist()) for draft, form in members]
        return host_draft(*merge_host(forms), device)


@dataclass
class Gate:
    """Whether drafting pays, per generation: an exponential moving average of each drafted
    step's gain (tokens it emitted over its cost in single-token verify passes, drafting
    included; 1.0 = as fast as not drafting). Below 1, drafting pauses for ``backoff`` steps and
    then probes once; every failed probe doubles the pause (up to ``max_backoff``: a head that
    never pays, e.g. when sampling from a broad distribution, costs one probe per 65 steps), a
    probe that pays resumes drafting. A sampled generation starts from the last one's gate
    (:class:`Gates`). Kept on the host from host-known counts: it reads nothing."""

    ema: float
    backoff: int = 1
    skip: int = 0
    max_backoff: int = 64
    alpha: float = 0.3
    paused: int = 0  # steps it paused drafting for (this generation)

    @classmethod
    def new(cls, device=None, start: float = 1.2) -> Gate:
        return cls(float(start))

    def should_draft(self) -> bool:
        if self.skip > 0:
            self.skip -= 1
            self.paused += 1
            return False
        return True

    def record(self, gain: float) -> None:
        """One drafted step's ``gain`` (a float; a 0-dim tensor is read): a probe after a pause
        counts on its own."""
        gain = float(gain)
        self.ema = gain if self.backoff > 1 else (1 - self.alpha) * self.ema + self.alpha * gain
        if self.ema > 1.0:
            self.backoff, self.skip = 1, 0
        else:
            self.skip = self.backoff
            self.backoff = min(2 * self.backoff, self.max_backoff)

    def carried(self) -> Gate:
        """The gate the next sampled generation starts from (:class:`Gates`): one still
        drafting where this one ended drafting; else one paused for half of this one's next pause,
        then probing (a head's value for one kind of generation seldom changes from one prompt to
        the next: at temperature 1.0, where it rarely pays, a fresh gate drafted ~10 of 256 steps
        to learn it again). Halving forgets: generations too short to probe shorten the pause."""
        if self.ema > 1.0:
            return Gate(self.ema)
        pause = max(1, self.backoff // 2)
        return Gate(self.ema, backoff=pause, skip=pause)

    def record_draft(self, accepted: int, nodes: int, seconds: float, cost) -> None:
        """One drafted step: ``accepted`` tokens of a ``nodes``-node draft that took ``seconds`` to
        draft, against ``cost`` (an online cost with ``seconds_per_token``)."""
        self.record((1.0 + accepted) / (cost(nodes) + seconds / cost.seconds_per_token))


class Gates:
    """A drafter's gates, one per kind of generation (``sampled`` or not), and ``current``, the one
    of the generation under way. At every :meth:`begin` the sampled gate is carried over
    (:meth:`Gate.carried`; at every generation, greedy ones too, so a pause not probed halves with
    each), as at a temperature where a head seldom pays it seldom pays on any prompt; greedy ones
    start fresh, as greedy acceptance depends on the prompt (code and copied text against free
    writing) and a pause carried over would hold the head back where it pays."""

    def __init__(self) -> None:
        self._by_kind: dict[bool, Gate] = {}
        self.current = Gate.new()

    def begin(self) -> None:
        """A new generation: its kind is not known until :meth:`select`."""
        self._by_kind = {True: self._by_kind[True].carried()} if True in self._by_kind else {}
        self.current = Gate.new()

    def select(self, sampled: bool) -> Gate:
        """Make the gate of this kind of generation ``current`` (a fresh one the first time)."""
        gate = self._by_kind.get(sampled)
        if gate is None:
            gate = self._by_kind[sampled] = Gate.new()
        self.current = gate
        return gate


def accepted_on_host(tokens: tuple[int, ...], parents: tuple[int, ...], committed: list[int]) -> int:
    """How many nodes of a draft (its host form: ``tokens``, ``parents``; node 0 the root) the
    ``committed`` tokens (its root, then what was accepted, by this draft or another drafter's)
    follow: no device read."""
    children = {(p, tok): i for i, (p, tok) in enumerate(zip(parents, tokens))}
    node, accepted = 0, 0
    for tok in committed[1:]:
        node = children.get((node, tok))
        if node is None:
            break
        accepted += 1
    return accepted
