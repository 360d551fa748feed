"""Several drafters at once: the union of their (deterministic) trees, verified in one pass."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ..core.drafter import Accepted, Draft, Drafter, Request, RowStart, accepted_on_host, host_draft
from ..core.schedule import Gate, draft_gain


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


@dataclass(frozen=True)
class _Asked:
    """What one member proposed for a row: its draft's host form (None: not known on the host,
    not judged), the row's verify curve and the member's share of the proposal's seconds."""

    member: int
    host: tuple | None
    verify: object
    seconds: float


class UnionDrafter(Drafter):
    """Several drafters at once (e.g. a trained head and prompt lookup): each step verifies the
    union of their trees, so each one's strength counts (the head for fresh text, prompt lookup
    for text copied from the context). Every member drafts all the step's rows within the same
    budgets; their drafts are deterministic, so the union is exact when sampling too. A member
    that reports a ``q`` (children drawn from it) cannot join a union, as exact tree rejection
    sampling needs one proposal distribution per node: when the first member reports one, its
    draft is verified alone; when a later one does, its draft is left out. Either is said once
    per union, with a ``UserWarning`` naming the member.

    The engine prices and gates a row's whole proposal; which member of it paid, only the union
    knows. So where the budget is priced (:class:`~infer.core.schedule.Price`), each member has a
    :class:`~infer.core.schedule.Gate` per row, judged as the engine judges a row
    (:func:`~infer.core.schedule.draft_gain`) on the nodes of its own draft that were accepted and
    its own drafting time: a head whose drafts prompt lookup outdraws (or whose trees the price
    cuts to the root) pauses at that row instead of paying a pass every step."""

    def __init__(self, drafters: list[Drafter]):
        if len(drafters) < 2:
            raise ValueError("a union needs at least two drafters")
        self.drafters = drafters
        for d in drafters:  # members that can draft either way (a draft model) are asked for deterministic drafts
            if hasattr(d, "deterministic"):
                d.deterministic = True
        self.tree = drafters[0].tree
        layers: list[int] = []
        for d in drafters:
            layers += [x for x in d.feature_layers if x not in layers]
        self.feature_layers = tuple(layers)
        self._warned: set[int] = set()
        self.gates: dict[tuple[int, int], Gate] = {}  # (row, member) -> its gate
        self._asked: dict[int, list[_Asked]] = {}  # row -> what its members proposed at its last draft

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

    def begin(self, rows: Sequence[RowStart]) -> None:
        for d in self.drafters:
            d.begin([replace(r, features=self._features_for(d, r.features)) for r in rows])

    def update(self, accepted: Sequence[Accepted]) -> None:
        for a in accepted:
            self._judge(a)
        for d in self.drafters:
            d.update([replace(a, features=self._features_for(d, a.features)) for a in accepted])

    def end(self, slots: Sequence[int]) -> None:
        for d in self.drafters:
            d.end(slots)
        for s in slots:
            self._asked.pop(s, None)
        self.gates = {k: g for k, g in self.gates.items() if k[0] not in slots}

    def _judge(self, a: Accepted) -> None:
        """Each member's gate at row ``a.slot`` on what its last draft there earned."""
        asked = self._asked.pop(a.slot, [])
        committed = a.tokens.tolist() if asked else []
        for m in asked:
            accepted = accepted_on_host(*m.host, committed) if m.host is not None else None
            gain = None if accepted is None else draft_gain(m.verify, len(m.host[0]), accepted, m.seconds)
            if gain is not None:
                self.gates.setdefault((a.slot, m.member), Gate()).record(gain)

    def _asks(self, q: Request, member: int) -> bool:
        """Whether ``member`` drafts for ``q`` (its gate there lets it; an unpriced budget: always)."""
        if getattr(q.budget.cost, "verify", None) is None:
            return True
        return self.gates.setdefault((q.slot, member), Gate()).should_draft()

    def state(self) -> dict:
        return {"members": [d.state() for d in self.drafters]}

    def propose(self, requests: Sequence[Request]) -> list[Draft]:
        by_member = []  # per member, per request: its draft, or None where its gate kept it out
        for i, d in enumerate(self.drafters):
            asked = [self._asks(q, i) for q in requests]
            t0 = time.perf_counter()
            drafts = iter(d.propose([q for q, a in zip(requests, asked) if a]) if any(asked) else [])
            share = (time.perf_counter() - t0) / max(sum(asked), 1)
            mine = [next(drafts) if a else None for a in asked]
            for q, draft in zip(requests, mine):
                verify = getattr(q.budget.cost, "verify", None)
                if draft is not None and verify is not None:
                    self._asked.setdefault(q.slot, []).append(_Asked(i, draft.host, verify, share))
            by_member.append(mine)
        return [self._merge(q.root, [drafts[j] for drafts in by_member]) for j, q in enumerate(requests)]

    def _merge(self, root: int, drafts: list[Draft | None]) -> Draft:
        """One row's union of its members' drafts (None: a member its gate kept out; the first
        member's alone when it carries ``q``), on the device of the first that drafted."""
        made = [d for d in drafts if d is not None]
        if not made:
            return host_draft((root,), (-1,))
        first = drafts[0]
        if first is not None and first.q is not None:
            self._warn_q(0, alone=True)
            return first
        members = []
        for i, draft in enumerate(drafts):
            if draft is None:
                continue
            if draft.q is not None:
                self._warn_q(i, alone=False)
            elif draft.num_nodes > 1:
                members.append(draft)
        if not members:
            return made[0]
        if len(members) == 1:  # nothing to merge: no device read
            return members[0].to(made[0].device)
        return merge_drafts(members, made[0].device)
