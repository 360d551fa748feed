"""Several drafters at once: the union of their (deterministic) trees, verified in one pass."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..core.drafter import Draft, Drafter, host_draft


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
        for d in drafters:  # members that can draft either way (a draft model) are asked for deterministic drafts
            if hasattr(d, "deterministic"):
                d.deterministic = True
        self.tree = drafters[0].tree
        self.cost = next((d.cost for d in drafters if d.cost is not None), None)
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

    def spawn(self) -> UnionDrafter:
        return UnionDrafter([d.spawn() for d in self.drafters])

    def set_params(self, params) -> None:
        for d in self.drafters:
            d.set_params(params)

    def set_cost(self, cost) -> None:
        for d in self.drafters:
            d.set_cost(cost)
        self.cost = cost if self.cost is not None else None

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
