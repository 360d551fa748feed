"""The pure acceptance rules on hand-made trees."""

import torch

from infer.core.accept import greedy_accept, sample_accept, typical_accept
from infer.core.tree import build_tree

#       0
#      / \
#     1   2
#     |   |
#     3   4
TREE = build_tree([-1, 0, 0, 1, 2])
TOKENS = torch.tensor([9, 1, 2, 3, 4])


def test_greedy_takes_the_longest_matching_path_and_the_bonus():
    target = torch.tensor([2, 7, 4, 0, 5])  # root's argmax is 2 -> node 2; node 2's argmax 4 -> node 4
    acc = greedy_accept(TOKENS, TREE, target)
    assert acc.nodes.tolist() == [0, 2, 4] and acc.bonus == 5
    acc = greedy_accept(TOKENS, TREE, torch.tensor([8, 0, 0, 0, 0]))
    assert acc.nodes.tolist() == [0] and acc.bonus == 8


def _onehot_rows(tokens, v=10):
    return torch.nn.functional.one_hot(torch.tensor(tokens), v).float()


def test_sampling_with_a_certain_verifier_follows_it():
    # the verifier is sure: root -> 2, 2 -> 4, 4 -> 6
    p = _onehot_rows([2, 0, 4, 0, 6])
    acc = sample_accept(TOKENS, TREE, p, None, torch.Generator().manual_seed(0))
    assert acc.nodes.tolist() == [0, 2, 4] and acc.bonus == 6


def test_sampling_rejects_a_candidate_the_verifier_never_picks():
    p = _onehot_rows([5, 0, 0, 0, 0])  # wants token 5 after the root: both children rejected
    q = torch.full((5, 10), 0.1)
    for seed in range(20):
        acc = sample_accept(TOKENS, TREE, p, q, torch.Generator().manual_seed(seed))
        assert acc.nodes.tolist() == [0] and acc.bonus == 5


def test_typical_acceptance_uses_the_entropy_threshold():
    probs = torch.full((5, 10), 0.01)
    probs[0, 1] = 0.5  # confident root: child 1 (token 1) passes, child 2 (token 2) does not
    probs[1, 3] = 0.5  # node 1 -> token 3 passes
    probs = probs / probs.sum(-1, keepdim=True)
    acc = typical_accept(TOKENS, TREE, probs, posterior_threshold=0.09, posterior_alpha=0.3,
                         generator=torch.Generator().manual_seed(0))
    assert acc.nodes.tolist() == [0, 1, 3]
    flat = torch.full((5, 10), 0.1)  # high entropy: threshold 0.3 * exp(-ln 10) = 0.03 < 0.1: all pass
    assert typical_accept(TOKENS, TREE, flat).nodes.tolist() in ([0, 1, 3], [0, 2, 4])
    assert typical_accept(TOKENS, TREE, flat, posterior_threshold=0.2, posterior_alpha=10).nodes.tolist() == [0]
