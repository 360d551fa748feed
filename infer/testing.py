"""Drafters with known behaviour, for testing an engine or a verifier: :class:`OracleDrafter`
drafts from a known continuation (all right, all wrong, or right with a probability). Used by
``specheads selfcheck`` and the test suite; import it to test a drafter or a model of your own."""

from __future__ import annotations

import torch

from .core.drafter import Budget, Draft, RowDrafter, root_only
from .core.tree import build_tree


def chain(d: int) -> list[int]:
    """The parents of a chain of ``d`` drafts after the root."""
    return [-1] + list(range(d))


class OracleDrafter(RowDrafter):
    """Drafts from a known continuation ``ref`` of the prompt (the verifier's own greedy output):
    every node at depth ``d`` gets ``ref[g + d]`` (``g``: the root's index in ``ref``) with
    probability ``p_right``, else a token it is not, on a fixed tree shape ``parents`` (default:
    a chain of 4 drafts), pruned to the depth the engine allows. ``p_right=1``: the oracle, which
    accepts a whole root-to-leaf path each step (tau is the tree's depth + 1); ``p_right=0``:
    always wrong (the token after the right one, so siblings share it). Used by ``specheads selfcheck`` and the test suite."""

    def __init__(self, ref: list[int], prompt_len: int, parents: list[int] | None = None, *, p_right: float = 1.0,
                 seed: int = 0, vocab: int = 256, device=None):
        self.ref, self.prompt_len, self.p_right, self.vocab = ref, prompt_len, p_right, vocab
        self.shape = build_tree(parents if parents is not None else chain(4))
        self.depths = self.shape.depths.tolist()
        self.device = device
        self.tree_on_device = self.shape.to(device) if device is not None else self.shape
        self.rng = torch.Generator().manual_seed(seed)

    def begin_row(self, prompt_ids, features=None, params=None):
        self.committed = prompt_ids.numel()

    def update_row(self, tokens, features=None):
        self.committed += tokens.numel()

    def propose_row(self, root: int, budget: Budget, generator=None) -> Draft:
        g = self.committed - self.prompt_len
        max_depth = budget.depth
        if max_depth < self.shape.max_depth:
            keep = [i for i, d in enumerate(self.depths) if d <= max_depth]
            if len(keep) == 1:
                return root_only(root, self.device)
            index = {old: new for new, old in enumerate(keep)}
            parents = self.shape.parents.tolist()
            tree_ = build_tree([-1] + [index[parents[i]] for i in keep[1:]], device=self.device)
        else:
            keep, tree_ = range(len(self.depths)), self.tree_on_device
        tokens = [root]
        for i in list(keep)[1:]:
            d = self.depths[i]
            right = self.ref[g + d] if g + d < len(self.ref) else 0
            if self.p_right <= 0:  # always wrong, the same way: siblings get the same token
                tokens.append((right + 1) % self.vocab)
                continue
            ok = self.p_right >= 1 or float(torch.rand((), generator=self.rng)) < self.p_right
            tokens.append(right if ok else (right + 1 + int(torch.randint(self.vocab - 1, (), generator=self.rng))) % self.vocab)
        return Draft(torch.tensor(tokens, dtype=torch.long, device=self.device), tree_)
