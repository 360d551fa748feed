"""Shared fixtures: tiny random verifiers of every supported family, and test drafters."""

from __future__ import annotations

import random

import pytest
import torch

from infer.drafters import Draft, Drafter, root_only
from infer.models import TINY_ARCHS, tiny_random_model
from infer.tree import build_tree

VOCAB = 256


@pytest.fixture(scope="session", params=TINY_ARCHS)
def tiny_model(request):
    """A 2-layer, hidden-64, vocab-256 random model of each supported family."""
    return tiny_random_model(request.param, vocab_size=VOCAB, seed=1)


@pytest.fixture(scope="session")
def llama():
    return tiny_random_model("llama", vocab_size=VOCAB, seed=1)


def hf_greedy(model, ids: torch.Tensor, n: int, eos=None) -> list[int]:
    """The reference: HF generate, greedy."""
    out = model.generate(
        ids.view(1, -1), attention_mask=torch.ones(1, ids.numel(), dtype=torch.long), max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=0,
        min_new_tokens=0 if eos is not None else n,
    )
    return out[0, ids.numel():].tolist()


class ReferenceDrafter(Drafter):
    """Drafts from a known continuation ``ref`` of the prompt (the verifier's greedy output).

    ``shape`` is a parent vector; each node at depth ``d`` gets ``ref[g + d]`` (``g``: index of
    the root in ``ref``) with probability ``p_right``, else a token guaranteed to be wrong when
    ``p_right == 0``, else a random token. ``p_right=1``: the oracle; ``p_right=0``: always wrong.
    """

    def __init__(self, ref: list[int], prompt_len: int, parents=None, p_right=1.0, seed=0, vocab=VOCAB):
        self.ref, self.prompt_len, self.p_right, self.vocab = ref, prompt_len, p_right, vocab
        self.parents = parents if parents is not None else [-1, 0, 1, 2, 3]
        self.rng = random.Random(seed)

    def begin(self, prompt_ids, features=None):
        self.committed = prompt_ids.numel()

    def update(self, tokens, features=None):
        self.committed += tokens.numel()

    def propose(self, root, *, tree=None, max_depth=8, generator=None):
        g = self.committed - self.prompt_len
        assert self.ref[g] == root or self.p_right < 1  # the oracle is always on track
        tree_ = build_tree(self.parents)
        keep = [i for i in range(tree_.num_nodes) if int(tree_.depths[i]) <= max_depth]
        if len(keep) < tree_.num_nodes:  # prune deep nodes: parents of kept nodes are kept
            index = {old: new for new, old in enumerate(keep)}
            tree_ = build_tree([-1] + [index[self.parents[i]] for i in keep[1:]])
        if tree_.num_nodes == 1:
            return root_only(root)
        tokens = [root]
        for i in range(1, tree_.num_nodes):
            d = int(tree_.depths[i])
            right = self.ref[g + d] if g + d < len(self.ref) else 0
            if self.rng.random() < self.p_right:
                tokens.append(right)
            elif self.p_right == 0:
                tokens.append((right + 1) % self.vocab)
            else:
                tokens.append(self.rng.randrange(self.vocab))
        return Draft(torch.tensor(tokens), tree_)
