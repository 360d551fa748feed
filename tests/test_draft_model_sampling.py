"""Sampling with a separate draft model follows the verifier's own distribution exactly: the
sampled chain (tokens drawn from the draft's warped distribution and reported as q, with and
without a cost curve that stops chains early) and the top-k tree (deterministic), against the
exact joint distribution of the first three tokens (chi-square); a draft that reports a wrong q
must fail the same test."""

import pytest
import torch
from test_sampling import PROMPT, V, chi_square_pvalue, exact_joint, spec_counts

from infer import generate
from infer.core.drafter import Budget
from infer.core.models import tiny_random_model
from infer.core.schedule import VerifyCost
from infer.core.tree import DynamicTreeSpec, chain_spec
from infer.drafting.draft_model import DraftModelDrafter

STOPPING = VerifyCost((1, 2, 3, 4, 8), (1.0, 1.25, 1.6, 2.2, 4.0))


@pytest.fixture(scope="module")
def small_vocab_model():
    """The verifier of tests/test_sampling.py (vocabulary 8)."""
    return tiny_random_model("llama", vocab_size=V, hidden_size=32, seed=3, initializer_range=0.5)


@pytest.fixture(scope="module")
def draft():
    return tiny_random_model("llama", vocab_size=V, hidden_size=32, seed=11, initializer_range=0.5)


class WrongQ(DraftModelDrafter):
    """Reports a uniform q for tokens it drew from the draft's distribution."""

    def propose_row(self, root, budget, generator=None):
        d = super().propose_row(root, budget, generator)
        if d.q is not None:
            d.q = torch.full_like(d.q, 1.0 / V)
        return d


@pytest.mark.slow  # thousands of generations
@pytest.mark.parametrize("tree, cost, temperature, top_k, top_p", [
    (chain_spec(2), None, 1.0, 0, 1.0),
    (chain_spec(3), STOPPING, 0.8, 5, 0.9),
    (DynamicTreeSpec(2, 2, 5), None, 1.0, 0, 1.0),
], ids=["chain", "chain-cost-warped", "tree"])
def test_draft_model_sampling_matches_plain_sampling(small_vocab_model, draft, tree, cost, temperature, top_k, top_p):
    drafter = DraftModelDrafter(draft, tree)
    probs = exact_joint(small_vocab_model, temperature, top_k, top_p)
    counts = spec_counts(small_vocab_model, drafter, temperature, top_k, top_p, budget=cost or "fixed")
    assert chi_square_pvalue(counts, probs) > 1e-3
    assert counts[probs == 0].sum() == 0


def test_the_sampled_chain_reports_its_q(small_vocab_model, draft):
    d = DraftModelDrafter(draft, chain_spec(2))
    res = generate(small_vocab_model, d, PROMPT, max_new_tokens=3, temperature=1.0, seed=0)
    assert len(res.token_ids) == 3
    g = torch.Generator().manual_seed(0)
    d.begin_row(PROMPT)
    out = d.propose_row(2, Budget(2), g)
    assert out.q is not None and out.q.shape == (3, V)
    torch.testing.assert_close(out.q[1:].sum(-1), torch.ones(2))


@pytest.mark.slow  # thousands of generations
def test_a_wrong_q_is_caught(small_vocab_model, draft):
    probs = exact_joint(small_vocab_model, 1.0, 0, 1.0)
    counts = spec_counts(small_vocab_model, WrongQ(draft, chain_spec(2)), 1.0, 0, 1.0)
    assert chi_square_pvalue(counts, probs) < 1e-6
