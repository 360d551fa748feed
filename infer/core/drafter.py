"""The drafter interface: what proposes the token tree that the verifier checks.

The interface, in the spirit of HF's ``CandidateGenerator``:

* :meth:`Drafter.begin` - a new generation starts: the prompt and the verifier's features for it;
* :meth:`Drafter.propose` - draft a tree rooted at the newest token;
* :meth:`Drafter.update` - these tokens (root + accepted drafts) are now committed, with the
  verifier's features at each of them;
* :meth:`Drafter.observe_verify` - the engine timed a verify pass over so many rows (batch x
  tree nodes; drafters whose cost curve learns from it pass it on);
* :meth:`Drafter.spawn` - a drafter for one more concurrent generation (a batch row): the same
  weights and verify-cost curve, its own per-generation state;
* :meth:`Drafter.set_params` - the sampling parameters of the generation about to begin;
* :meth:`Drafter.set_cost` - the verify-cost curve to size trees by from now on (the engine
  gives each row the curve as seen from a batch of its size, see :class:`~infer.core.cost.BatchCost`).

Drafters that need the verifier's hidden states list the layers in ``feature_layers``
(indices into HF's ``hidden_states`` tuple). The drafters themselves live in
:mod:`infer.drafting`.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Sequence
from functools import lru_cache

import torch

from .tree import Tree, TreeSpec, tree_and_values


class Draft:
    """A proposed tree.

    Attributes:
        tokens: ``[N]`` long; node 0 is the root token (already emitted, not yet verified).
        tree: topology of the ``N`` nodes.
        q: ``[N, V]`` or None: the distribution each node's token was drawn from given its earlier
            siblings (see :func:`infer.core.accept.sample_accept`); None for deterministic drafts.
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


class Drafter(ABC):
    """Base class of all drafters (see the module docstring for the protocol)."""

    feature_layers: tuple[int, ...] = ()
    tree: TreeSpec | None = None
    #: the verify-cost curve that sizes this drafter's trees (a :class:`~infer.core.cost.VerifyCost`
    #: or a learning :class:`~infer.core.cost.OnlineCost`), or None
    cost = None

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

    def observe_verify(self, nodes: int, seconds: float) -> None:
        """The engine timed a verify pass over ``nodes`` tree nodes: ``seconds`` (host floats).
        A cost curve that learns (:class:`~infer.core.cost.OnlineCost`) takes it in; a plain
        callable curve learns nothing."""
        observe = getattr(self.cost, "observe", None)
        if observe is not None:
            observe(nodes, seconds)

    def spawn(self) -> Drafter:
        """A drafter for another generation running at the same time (a row of a batch): it shares
        what is heavy or learnt across generations (weights, the verify-cost curve) and has its own
        per-generation state. The default deep-copies the drafter and shares its ``cost``; drafters
        that hold weights override it."""
        return copy.deepcopy(self, memo={id(self.cost): self.cost})

    def set_params(self, params) -> None:
        """The sampling parameters (:class:`~infer.core.params.SamplingParams`) of the generation
        about to :meth:`begin`: a drafter that draws its tokens from a distribution warps it as the
        verifier's is warped (temperature, top-k, top-p). Others ignore them."""

    def set_cost(self, cost) -> None:
        """Size trees by ``cost`` from now on (a drafter that sizes none ignores it)."""
        if self.cost is not None:
            self.cost = cost

    def batch_policy(self, make):
        """Whether a batched step drafts, as measured with this drafter (what ``make()`` builds, a
        :class:`~infer.core.cost.SpecPolicy` in the engine): made at first use and kept, so that
        every batch this drafter drafts for starts from what the last one measured (as its cost
        curve does)."""
        if self.__dict__.get("_batch_policy") is None:
            self._batch_policy = make()
        return self._batch_policy

    def state(self) -> dict:
        """What the drafter has learnt so far in this generation, for benchmark records (JSON;
        reads device values, so call it between generations, not in the decoding loop)."""
        return {}


class NoDrafter(Drafter):
    """Plain decoding through the speculative engine: every tree is just the root."""

    def spawn(self) -> NoDrafter:
        return self  # stateless

    def propose(self, root, *, tree=None, max_depth=0, generator=None) -> Draft:
        return root_only(root)
