"""The pure acceptance rules on hand-made trees (one row: a batch of one)."""

import torch

from infer.core.accept import greedy_rows, q_rows, read_back_rows, typical_rows
from infer.core.batch import TreeBatch, stack_drafts
from infer.core.drafter import Draft
from infer.core.tree import build_tree

#       0
#      / \
#     1   2
#     |   |
#     3   4
TREE = build_tree([-1, 0, 0, 1, 2])
TOKENS = torch.tensor([9, 1, 2, 3, 4])


def one_row(tokens=TOKENS, tree=TREE, q=None) -> TreeBatch:
    return stack_drafts([Draft(tokens, tree, q)], "cpu")


def accepted(trees, end_bonus):
    acc = read_back_rows(trees, *end_bonus).rows[0]
    return list(acc.node_ids), acc.bonus


def test_greedy_takes_the_longest_matching_path_and_the_bonus():
    trees = one_row()
    target = torch.tensor([[2, 7, 4, 0, 5]])  # root's argmax is 2 -> node 2; node 2's argmax 4 -> node 4
    assert accepted(trees, greedy_rows(trees, target)) == ([0, 2, 4], 5)
    assert accepted(trees, greedy_rows(trees, torch.tensor([[8, 0, 0, 0, 0]]))) == ([0], 8)


def _onehot_rows(tokens, v=10):
    return torch.nn.functional.one_hot(torch.tensor(tokens), v).float()[None]


def _uniforms(seed, n=5):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(1, n, generator=g, dtype=torch.float64), torch.rand(1, generator=g, dtype=torch.float64)


def test_sampling_with_a_certain_verifier_follows_it():
    # the verifier is sure: root -> 2, 2 -> 4, 4 -> 6; a deterministic draft (q all zero: one-hot)
    trees = one_row()
    p = _onehot_rows([2, 0, 4, 0, 6])
    assert accepted(trees, q_rows(trees, p, torch.zeros_like(p), *_uniforms(0))) == ([0, 2, 4], 6)


def test_sampling_rejects_a_candidate_the_verifier_never_picks():
    p = _onehot_rows([5, 0, 0, 0, 0])  # wants token 5 after the root: both children rejected
    q = torch.full((5, 10), 0.1)
    trees = one_row(q=q)
    for seed in range(20):
        assert accepted(trees, q_rows(trees, p, trees.q, *_uniforms(seed))) == ([0], 5)


def test_typical_acceptance_uses_the_entropy_threshold():
    trees = one_row()
    probs = torch.full((5, 10), 0.01)
    probs[0, 1] = 0.5  # confident root: child 1 (token 1) passes, child 2 (token 2) does not
    probs[1, 3] = 0.5  # node 1 -> token 3 passes
    probs = (probs / probs.sum(-1, keepdim=True))[None]
    u = _uniforms(0)[1]
    assert accepted(trees, typical_rows(trees, probs, u, posterior_threshold=0.09, posterior_alpha=0.3))[0] == [0, 1, 3]
    flat = torch.full((1, 5, 10), 0.1)  # high entropy: threshold 0.3 * exp(-ln 10) = 0.03 < 0.1: all pass
    assert accepted(trees, typical_rows(trees, flat, u))[0] in ([0, 1, 3], [0, 2, 4])
    assert accepted(trees, typical_rows(trees, flat, u, posterior_threshold=0.2, posterior_alpha=10))[0] == [0]


def test_rules_take_each_row_of_a_batch_on_its_own():
    """Two rows, padded to one size: each row's path and bonus are its own."""
    trees = stack_drafts([Draft(TOKENS, TREE), Draft(torch.tensor([7, 5]), build_tree([-1, 0]))], "cpu")
    target = torch.tensor([[2, 7, 4, 0, 5], [5, 6, 0, 0, 0]])
    acc = read_back_rows(trees, *greedy_rows(trees, target)).rows
    assert [list(a.node_ids) for a in acc] == [[0, 2, 4], [0, 1]] and [a.bonus for a in acc] == [5, 6]
    assert acc[1].tokens == (5, 6)
