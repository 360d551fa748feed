"""The drafter interface: what proposes the token trees that the verifier checks.

The engine owns scheduling; a drafter proposes. In the spirit of HF's ``CandidateGenerator``, the
engine calls, for all the rows of a step at once:

* :meth:`Drafter.begin` - rows join: each row's prompt, the verifier's features there and its
  sampling parameters (:class:`RowStart`);
* :meth:`Drafter.propose` - one tree per drafting row, rooted at its newest token, within the
  :class:`Budget` the engine gives it (:class:`Request`);
* :meth:`Drafter.update` - what each row committed since (its root, then what was accepted),
  with the verifier's features there (:class:`Accepted`);
* :meth:`Drafter.end` - rows left.

Nothing else crosses: the engine times the proposals and prices the next budgets by them
(:mod:`infer.core.schedule`). A head can draft every row of a step in one batched computation;
drafters written one row at a time subclass :class:`RowDrafter`, which keeps one copy per row.

Drafters that need the verifier's hidden states list the layers in ``feature_layers``
(indices into HF's ``hidden_states`` tuple). The drafters themselves live in
:mod:`infer.drafting`.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from .tree import Tree, TreeSpec, tree_and_values


class Draft:
    """A proposed tree.

    Attributes:
        tokens: ``[N]`` long; node 0 is the root token (already emitted, not yet verified).
        tree: topology of the ``N`` nodes.
        q: ``[N, V]`` or None: the distribution each node's token was drawn from given its earlier
            siblings (see :func:`infer.core.accept.q_rows`); None for deterministic drafts.
        host: ``(tokens, parents)`` as host tuples when the drafter knows them without reading
            the device (then merging drafts reads nothing), else None.

    A draft made on the host (:func:`host_draft`) makes its tensors only when they are first
    asked for (one packed copy to ``device``): a batch of such drafts is copied as one
    (:func:`~infer.core.batch.stack_drafts`) and its rows' own tensors are never made.
    """

    __slots__ = ("_tokens", "_tree", "q", "host", "_device")

    def __init__(self, tokens: torch.Tensor | None, tree: Tree | None, q: torch.Tensor | None = None,
                 host: tuple[tuple[int, ...], tuple[int, ...]] | None = None, *, device=None):
        if (tokens is None or tree is None) and host is None:
            raise ValueError("a draft needs its tensors or its host form")
        self._tokens, self._tree, self.q, self.host, self._device = tokens, tree, q, host, device

    def _make(self) -> None:
        tree, values = tree_and_values(self.host[1], self.host[0], self._device)
        self._tokens, self._tree = values, tree

    @property
    def tokens(self) -> torch.Tensor:
        if self._tokens is None:
            self._make()
        return self._tokens

    @property
    def tree(self) -> Tree:
        if self._tree is None:
            self._make()
        return self._tree

    @property
    def made(self) -> bool:
        """Whether the draft's tensors exist (a host draft makes them when first asked)."""
        return self._tokens is not None

    @property
    def num_nodes(self) -> int:
        """``N``, known on the host."""
        return len(self.host[0]) if self.host is not None else self.tree.num_nodes

    @property
    def device(self) -> torch.device:
        if self._tokens is not None:
            return self._tokens.device
        return torch.device(self._device) if self._device is not None else torch.device("cpu")

    def to(self, device) -> Draft:
        """The same draft on ``device`` (asynchronous copies; itself when already there)."""
        if self.device == torch.device(device):
            return self
        if self.host is not None and self.q is None:  # rebuilt on the host: one packed copy, when asked for
            return Draft(None, None, host=self.host, device=device)
        q = self.q.to(device, non_blocking=True) if self.q is not None else None
        return Draft(self.tokens.to(device, non_blocking=True), self.tree.to(device), q, self.host)


def host_draft(tokens: Sequence[int], parents: Sequence[int], device=None) -> Draft:
    """A deterministic draft built on the host: tokens and parents travel to ``device`` as one
    packed copy with the tree (:func:`~infer.core.tree.build_tree`) when its tensors are first
    used, and stay known on the host."""
    tokens, parents = tuple(int(t) for t in tokens), tuple(int(p) for p in parents)
    if len(tokens) != len(parents):
        raise ValueError(f"a draft of {len(tokens)} tokens needs as many parents, not {len(parents)}")
    if not parents or parents[0] != -1 or any(not 0 <= p < i for i, p in enumerate(parents) if i):
        raise ValueError("a draft's parents need node 0 as the root (-1) and every parent before its child")
    return Draft(None, None, host=(tokens, parents), device=device)


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


@dataclass(frozen=True)
class Budget:
    """What the engine allows one row's draft this step.

    ``depth``: the deepest node (the row's token limit leaves no more); ``nodes``: the most nodes,
    root included (None: the drafter's tree); ``cost``: the price of a draft of ``n`` nodes in
    plain steps of this row, drafting included (:class:`~infer.core.schedule.Price`), that a
    drafter maximises expected tokens per unit of (None: no sizing, the tree as it is)."""

    depth: int
    nodes: int | None = None
    cost: Callable[[int], float] | None = None


@dataclass(frozen=True)
class RowStart:
    """A row joins: ``prompt_ids [L]`` (host), the verifier's ``features [L, F, H]`` there (or
    None) and its :class:`~infer.core.params.SamplingParams`."""

    slot: int
    prompt_ids: torch.Tensor
    features: torch.Tensor | None
    params: object


@dataclass(frozen=True)
class Request:
    """Draft for row ``slot`` a tree rooted at token ``root`` within ``budget``; ``generator`` is
    given when the row samples (drafters that draw children use it and report ``q``)."""

    slot: int
    root: int
    budget: Budget
    generator: torch.Generator | None = None


@dataclass(frozen=True)
class Accepted:
    """Row ``slot`` committed ``tokens [k]`` (a host tensor: its root, then the accepted drafts);
    ``features [k, F, H]``: the verifier's hidden states there (or None)."""

    slot: int
    tokens: torch.Tensor
    features: torch.Tensor | None


class Drafter(ABC):
    """Base class of all drafters (see the module docstring for the protocol)."""

    feature_layers: tuple[int, ...] = ()
    tree: TreeSpec | None = None

    @abstractmethod
    def begin(self, rows: Sequence[RowStart]) -> None:
        """These rows join."""

    @abstractmethod
    def propose(self, requests: Sequence[Request]) -> list[Draft]:
        """One draft per request, in order (a row whose draft is just its root decodes plainly)."""

    @abstractmethod
    def update(self, accepted: Sequence[Accepted]) -> None:
        """What these rows committed since they last drafted or joined."""

    def end(self, slots: Sequence[int]) -> None:
        """These rows left."""

    def state(self) -> dict:
        """What the drafter has learnt so far, for benchmark records (JSON; reads device values,
        so call it between generations, not in the decoding loop)."""
        return {}


class RowDrafter(Drafter):
    """A drafter written for one row at a time: every joining row gets its own copy
    (:meth:`spawn`, sharing the weights), and the engine's batched calls go to those copies in
    turn. Subclasses implement :meth:`begin_row`, :meth:`propose_row` and :meth:`update_row`."""

    def _row_copies(self) -> dict[int, RowDrafter]:
        rows = self.__dict__.get("_rows")
        if rows is None:
            rows = self._rows = {}
        return rows

    def row(self, slot: int) -> RowDrafter:
        """Row ``slot``'s copy (for tests and inspection)."""
        return self._row_copies()[slot]

    def spawn(self) -> RowDrafter:
        """A copy for one more row: what is heavy or learnt across rows is shared, per-row state is
        its own. The default deep-copies the drafter; drafters that hold weights override it."""
        return copy.deepcopy(self, memo={id(self._row_copies()): {}})

    def begin(self, rows: Sequence[RowStart]) -> None:
        copies = self._row_copies()
        for r in rows:
            copies[r.slot] = self.spawn()
            copies[r.slot].begin_row(r.prompt_ids, r.features, r.params)

    def propose(self, requests: Sequence[Request]) -> list[Draft]:
        copies = self._row_copies()
        return [copies[q.slot].propose_row(q.root, q.budget, q.generator) for q in requests]

    def update(self, accepted: Sequence[Accepted]) -> None:
        copies = self._row_copies()
        for a in accepted:
            copies[a.slot].update_row(a.tokens, a.features)

    def end(self, slots: Sequence[int]) -> None:
        copies = self._row_copies()
        for s in slots:
            copies.pop(s, None)

    def begin_row(self, prompt_ids: torch.Tensor, features: torch.Tensor | None, params) -> None:
        """This copy's row starts. ``prompt_ids``: ``[L]``; ``features``: ``[L, F, H]`` or None."""

    @abstractmethod
    def propose_row(self, root: int, budget: Budget, generator: torch.Generator | None) -> Draft:
        """Draft a tree rooted at token ``root`` within ``budget`` (depth at most ``budget.depth``)."""

    def update_row(self, tokens: torch.Tensor, features: torch.Tensor | None) -> None:
        """``tokens`` ``[k]`` (root, then accepted drafts) entered the verifier's cache;
        ``features`` ``[k, F, H]`` are the verifier's hidden states there."""


class NoDrafter(Drafter):
    """Plain decoding through the speculative engine: every tree is just the root."""

    def begin(self, rows) -> None:
        pass

    def propose(self, requests) -> list[Draft]:
        return [root_only(q.root) for q in requests]

    def update(self, accepted) -> None:
        pass


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
