import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from infer.core.errors import UserError
from infer.core.tree import (
    DynamicTreeSpec,
    StaticTreeSpec,
    build_tree,
    chain_spec,
    grow_dynamic_tree,
    list_tree_presets,
    load_tree_spec,
)


@st.composite
def parent_vectors(draw, max_nodes=24):
    n = draw(st.integers(1, max_nodes))
    return [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]


@given(parent_vectors())
def test_build_tree_invariants(parents):
    t = build_tree(parents)
    n = len(parents)
    assert t.num_nodes == n
    for i in range(n):
        anc, j = {i}, i
        while parents[j] >= 0:
            j = parents[j]
            anc.add(j)
        assert set(t.ancestor_mask[i].nonzero().flatten().tolist()) == anc
        assert int(t.depths[i]) == len(anc) - 1
    leaves = [i for i in range(n) if i not in parents]
    assert sorted(int(r[r >= 0][-1]) for r in t.paths) == leaves
    for row in t.paths:
        nodes = row[row >= 0].tolist()
        assert nodes[0] == 0 and all(parents[b] == a for a, b in zip(nodes, nodes[1:]))


@pytest.mark.parametrize("bad", [[], [0], [-1, 1], [-1, 0, 2], [-1, -1]])
def test_build_tree_rejects_bad_parents(bad):
    with pytest.raises(ValueError):
        build_tree(bad)


def test_static_spec_order_and_validation():
    spec = StaticTreeSpec(((1,), (0,), (0, 0), (1, 0), (0, 1)))
    nodes, parents = spec.ordered()
    assert nodes == [(), (0,), (1,), (0, 0), (0, 1), (1, 0)]
    assert parents == [-1, 0, 0, 1, 1, 2]
    assert spec.depth == 2 and spec.num_nodes == 6
    with pytest.raises(ValueError, match="no parent"):
        StaticTreeSpec(((0, 0),))
    assert chain_spec(3).ordered()[1] == [-1, 0, 1, 2]


def test_presets_load_and_inline_forms(tmp_path):
    names = list_tree_presets()
    assert {"chain-4", "pld-16", "medusa-16", "eagle2-32"} <= set(names)
    for name in names:
        load_tree_spec(name)
    assert load_tree_spec("chain:5").depth == 5
    assert load_tree_spec("dynamic:4,3,10") == DynamicTreeSpec(4, 3, 10)
    f = tmp_path / "t.json"
    f.write_text('{"type": "static", "choices": [[0], [1]], "extra": 1}')
    with pytest.raises(UserError, match="extra"):
        load_tree_spec(str(f))
    with pytest.raises(UserError, match="unknown tree"):
        load_tree_spec("no-such-tree")


def _fake_expand(vocab=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(vocab, vocab, generator=g).mul(3).log_softmax(-1)  # bigram draft

    def expand(ids, parents, toks):
        return table[toks]

    return expand, table


def test_dynamic_tree_is_eagle2_selection():
    expand, table = _fake_expand()
    spec = DynamicTreeSpec(depth=3, top_k=3, num_nodes=8)
    t = grow_dynamic_tree(expand, 5, spec)
    tree = build_tree(t.parents)
    assert t.tokens.numel() == 8
    # scores are cumulative log-probs along the path
    for i in range(1, 8):
        p = int(t.parents[i])
        assert torch.isclose(t.scores[i], t.scores[p] + table[t.tokens[p], t.tokens[i]])
    # depth 1 holds the draft's top children of the root, best first
    first = [i for i in range(8) if int(tree.depths[i]) == 1]
    assert t.tokens[first].tolist() == table[5].topk(len(first)).indices.tolist()
    # the kept nodes are the best-scoring candidates: no dropped depth-1 child beats a kept node
    dropped = table[5].topk(3).values[len(first):]
    assert all(float(d) <= float(t.scores[1:].min()) + 1e-6 for d in dropped)
    assert grow_dynamic_tree(expand, 5, spec, max_depth=1).parents.tolist() == [-1, 0, 0, 0]


def test_grown_tree_is_built_on_the_device_side_as_build_tree_would():
    expand, table = _fake_expand()
    for spec in (DynamicTreeSpec(3, 3, 8), DynamicTreeSpec(4, 2, 12), DynamicTreeSpec(2, 4, 3)):
        t = grow_dynamic_tree(expand, 2, spec)
        ref = build_tree(t.parents)
        assert torch.equal(t.tree.parents, ref.parents) and torch.equal(t.tree.depths, ref.depths)
        assert torch.equal(t.tree.ancestor_mask, ref.ancestor_mask)
        assert t.tree.max_depth == ref.max_depth and t.tree.width >= ref.width


def test_calibration_reorders_the_candidates():
    """A depth whose predictions came true less often than claimed counts for less: with depth 2
    scaled down, a second depth-1 sibling beats the best depth-2 grandchild."""
    table = torch.full((20, 20), -9.0)
    table[:, 1] = -0.1  # q = 0.90
    table[:, 2] = -1.0  # q = 0.37
    table = table.log_softmax(-1)
    expand = lambda ids, parents, toks: table[toks]  # noqa: E731
    spec = DynamicTreeSpec(depth=2, top_k=2, num_nodes=3)
    plain = grow_dynamic_tree(expand, 0, spec)
    assert plain.tree.depths.tolist() == [0, 1, 2]  # root -> 1 -> 1 (0.9 * 0.9 > 0.37)
    scaled = grow_dynamic_tree(expand, 0, spec, log_scale=torch.tensor([0.0, -1.5]))
    assert scaled.tree.depths.tolist() == [0, 1, 1]  # 0.9 * 0.9 * e^-1.5 < 0.37
    assert torch.equal(scaled.scores, plain.scores.new_tensor([0.0, table[0, 1], table[0, 2]]))


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 20), st.integers(0, 100))
def test_dynamic_tree_always_a_valid_tree(depth, k, n, seed):
    expand, _ = _fake_expand(seed=seed)
    t = grow_dynamic_tree(expand, 0, DynamicTreeSpec(depth, k, n))
    tree = build_tree(t.parents)  # raises if not topological
    assert tree.num_nodes <= n and tree.max_depth <= depth


def test_auto_budget_follows_the_verify_cost():
    from infer.core.schedule import VerifyCost
    from infer.core.tree import best_budget

    flat = VerifyCost((1, 64), (1.0, 1.0))
    steep = VerifyCost((1, 2, 64), (1.0, 3.0, 100.0))
    probs = [0.9, 0.8, 0.5, 0.3, 0.1]
    assert best_budget(probs, flat) == 6  # free nodes: keep all
    assert best_budget(probs, steep) == 1  # a second node triples the cost: draft nothing
    assert best_budget([], flat) == 1
    expand, _ = _fake_expand()
    spec = DynamicTreeSpec(depth=3, top_k=3, num_nodes=12)
    assert grow_dynamic_tree(expand, 5, spec, cost=flat).tokens.numel() == 12
    assert grow_dynamic_tree(expand, 5, spec, cost=steep).tokens.numel() == 1
    mid = VerifyCost((1, 4, 8, 16), (1.0, 1.55, 1.9, 2.2))
    n = grow_dynamic_tree(expand, 5, spec, cost=mid).tokens.numel()
    assert 1 <= n <= 12


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 6), st.integers(1, 4), st.integers(2, 24), st.integers(0, 1000), st.floats(0.3, 6.0),
       st.sampled_from(["fixed", "flat", "mid", "steep"]))
def test_pruned_drafting_gives_the_same_tree_with_fewer_passes(depth, k, n, seed, sharpness, cost_name):
    from infer.core.schedule import VerifyCost

    cost = {"fixed": None, "flat": VerifyCost((1, 64), (1.0, 1.05)), "mid": VerifyCost((1, 4, 8, 16, 32), (1.0, 1.55, 1.9, 2.2, 2.6)),
            "steep": VerifyCost((1, 2, 64), (1.0, 1.8, 40.0))}[cost_name]
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(20, 20, generator=g).mul(sharpness).log_softmax(-1)
    calls = {"full": 0, "pruned": 0}

    def counted(key):
        def expand(ids, parents, toks):
            calls[key] += 1
            return table[toks]
        return expand

    spec = DynamicTreeSpec(depth, k, n)
    full = grow_dynamic_tree(counted("full"), 3, spec, cost=cost, prune=False)
    pruned = grow_dynamic_tree(counted("pruned"), 3, spec, cost=cost)
    assert torch.equal(full.tokens, pruned.tokens) and torch.equal(full.parents, pruned.parents)
    assert calls["pruned"] <= calls["full"] == depth


def test_pruning_skips_depths_that_cannot_pay():
    from infer.core.schedule import VerifyCost

    table = torch.full((20, 20), -8.0)
    table[:, 0] = 0.0  # token 0 is certain; everything else is ~e^-8 (log-probs need not normalise here)
    spec = DynamicTreeSpec(depth=6, top_k=2, num_nodes=4)
    calls = []

    def expand(ids, parents, toks):
        calls.append(len(ids))
        return table[toks]

    t = grow_dynamic_tree(expand, 5, spec)
    assert t.tokens.tolist() == [5, 0, 0, 0]  # the certain chain fills the budget of 4...
    assert len(calls) == 3  # ...after three draft passes, so depths 4 to 6 are never drafted
    calls.clear()
    steep = VerifyCost((1, 2, 64), (1.0, 3.0, 100.0))
    table[:, 0] = -3.0  # p = 0.05: never worth a node at this cost
    assert grow_dynamic_tree(expand, 5, spec, cost=steep).tokens.numel() == 1 and len(calls) == 1
