"""Prompt lookup, the cost model that sizes its drafts, and the union of drafters."""

import pytest
import torch

from infer.core.drafter import Budget, Draft, RowDrafter
from infer.core.schedule import DEFAULT_COST, VerifyCost, best_chain_depth, expected_tokens
from infer.core.tree import DynamicTreeSpec, build_tree
from infer.drafting.lookup import PromptLookupDrafter


def test_verify_cost_interpolates_and_extrapolates():
    c = VerifyCost((1, 4, 8), (1.0, 1.6, 2.0))
    assert c(1) == 1.0 and c(4) == 1.6 and abs(c(6) - 1.8) < 1e-9 and abs(c(12) - 2.4) < 1e-9
    assert VerifyCost.from_measurement({"relative": {"1": 1.0, "8": 2.0}})(8) == 2.0


def test_measured_cost_is_made_monotone_or_refused_when_it_is_noise():
    measured = {"seconds": {"1": 0.03, "4": 0.05, "8": 0.04, "16": 0.07}, "relative": {"1": 1.0, "4": 1.6, "8": 1.3, "16": 2.3}}
    c = VerifyCost.from_measurement(measured)
    assert c.relative == (1.0, 1.6, 1.6, 2.3)  # the dip at 8 nodes is noise: never cheaper than 4
    tiny = {"seconds": {"1": 4e-4, "8": 3e-4}, "relative": {"1": 1.0, "8": 0.75}}
    assert VerifyCost.from_measurement(tiny) is None  # sub-millisecond: overhead and noise
    flat = {"seconds": {"1": 0.03, "8": 0.0301, "32": 0.0302}, "relative": {"1": 1.0, "8": 1.003, "32": 1.007}}
    assert VerifyCost.from_measurement(flat)(32) == 1.007  # e.g. a GPU: big trees really are cheap


def test_best_depth_grows_with_acceptance():
    assert best_chain_depth(0.05, 8, DEFAULT_COST) == 0  # not worth a draft
    depths = [best_chain_depth(a, 10, DEFAULT_COST) for a in (0.3, 0.6, 0.9, 0.99)]
    assert depths == sorted(depths) and depths[-1] >= 8
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-9


def test_lookup_prefers_full_length_continuations():
    d = PromptLookupDrafter(max_ngram=2, min_ngram=1, adaptive=False, tree=DynamicTreeSpec(4, 2, 9))
    ctx = [5, 6, 7, 8, 9, 1, 5, 6, 7, 8, 2, 5]
    d.begin_row(torch.tensor(ctx), None)
    found = d.continuations(6, depth=4, branches=2)
    # "5 6" occurs twice; the older match has 4 tokens after it, the newer one too: newest first
    assert found[0] == (2, [7, 8, 2, 5]) and found[1] == (2, [7, 8, 9, 1])
    draft = d.propose_row(6, Budget(4))
    assert draft.tokens.tolist() == [6, 7, 8, 2, 5, 9, 1]  # a trie: the shared prefix 7 8 appears once
    assert draft.tree.parents.tolist() == [-1, 0, 1, 2, 3, 2, 5]


def test_lookup_tries_a_long_match_on_a_steep_cost_curve():
    """Before any draft was judged, a 3-gram match is drafted even where a 2-node pass costs 2x a
    one-token pass: with an even prior no chain paid on such a curve, so prompt lookup never
    drafted and never learnt that the answer copies its context."""
    steep = VerifyCost((1, 2, 4, 8, 16), (1.0, 2.0, 2.1, 2.3, 2.6))
    d = PromptLookupDrafter()
    d.begin_row(torch.tensor([*range(10, 40), 10, 11, 12]), None)  # ends with 10 11 12, seen at the start
    assert d.propose_row(13, Budget(8, cost=steep)).tokens.tolist()[:4] == [13, 14, 15, 16]
    d.begin_row(torch.tensor([*range(10, 40), 21]), None)  # a 1-gram match only: not worth a pass there
    assert d.propose_row(30, Budget(8, cost=steep)).tree.num_nodes == 1


def test_adaptive_lookup_stops_drafting_what_is_never_accepted():
    d = PromptLookupDrafter()
    d.begin_row(torch.tensor([1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]), None)
    sizes = []
    for _ in range(20):  # the verifier rejects every draft: only the root is ever committed
        draft = d.propose_row(4, Budget(8))
        sizes.append(draft.tree.num_nodes)
        d.update_row(draft.tokens[:1], None)
    assert sizes[0] > 1
    assert sum(n > 1 for n in sizes[-8:]) <= 1  # it has stopped paying for drafts


SHORT_PROMPT = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])


class DrawnDrafter(RowDrafter):
    """Reports the q its one child was drawn from."""

    def propose_row(self, root, budget, generator=None):
        q = torch.full((2, 256), 1 / 256)
        return Draft(torch.tensor([root, 7]), build_tree([-1, 0]), q)


def test_a_union_member_with_q_is_named_not_dropped_silently(llama):
    from infer import generate
    from infer.drafting.lookup import PromptLookupDrafter
    from infer.drafting.union import UnionDrafter

    union = UnionDrafter([PromptLookupDrafter(), DrawnDrafter()])
    with pytest.warns(UserWarning, match=r"member 1 \(DrawnDrafter\).*left out of the union"):
        generate(llama, union, SHORT_PROMPT, max_new_tokens=6, temperature=1.0, seed=0)
    first = UnionDrafter([DrawnDrafter(), PromptLookupDrafter()])
    with pytest.warns(UserWarning, match=r"member 0 \(DrawnDrafter\).*verified alone"):
        generate(llama, first, SHORT_PROMPT, max_new_tokens=6, temperature=1.0, seed=0)
