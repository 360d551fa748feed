"""The verifier adapter: tree-masked logits equal sequential logits; compaction is exact."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from conftest import VOCAB, commit_one, hf_greedy, prefill_one, row_length, verify_one
from infer import generate
from infer.core.errors import UserError
from infer.core.models import tiny_random_model
from infer.core.tree import build_tree
from infer.core.verifier import ReservedCache, ReservedLayer, Verifier
from infer.testing import OracleDrafter


@st.composite
def trees(draw):
    n = draw(st.integers(1, 12))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))
    prefix = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10))
    return parents, tokens, prefix


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(trees())
def test_tree_logits_equal_sequential_logits(tiny_model, case):
    parents, tokens, prefix = case
    layers = (1, -1)
    v = Verifier(tiny_model, feature_layers=layers)
    prefill_one(v, torch.tensor(prefix))
    tree = build_tree(parents)
    out = verify_one(v, torch.tensor(tokens), tree)
    for i in range(tree.num_nodes):
        path = tree.ancestor_mask[i].nonzero().flatten().tolist()
        seq = torch.tensor(prefix + [tokens[j] for j in path])[None]
        with torch.no_grad():
            ref = tiny_model(seq, output_hidden_states=True)
        torch.testing.assert_close(out.logits[i], ref.logits[0, -1], atol=1e-4, rtol=1e-4)
        for f, layer in enumerate(layers):
            torch.testing.assert_close(out.features[i, f], ref.hidden_states[layer][0, -1], atol=1e-4, rtol=1e-4)


def test_prefill_features_are_the_selected_hidden_states(tiny_model):
    """Rows of unlike lengths prefilled in one left-padded pass get, at every prompt position, the
    hidden states HF returns for that prompt alone (transformers may keep only the selected layers)."""
    layers = (0, 1, -1)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in (7, 3, 11)]
    outs = Verifier(tiny_model, feature_layers=layers).add_rows(prompts)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = tiny_model(prompt[None], output_hidden_states=True)
        assert out.features.shape == (prompt.numel(), len(layers), tiny_model.config.hidden_size)
        for f, layer in enumerate(layers):
            torch.testing.assert_close(out.features[:, f], ref.hidden_states[layer][0], atol=1e-4, rtol=1e-4)


def test_cache_after_many_steps_equals_plain_forward(tiny_model):
    prompt = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(3))
    ref = hf_greedy(tiny_model, prompt, 48)
    parents = [-1, 0, 1, 2, 0, 4, 1, 6, 0]
    v = Verifier(tiny_model)
    res = generate(v, OracleDrafter(ref, 9, parents, p_right=0.6, seed=1), prompt, max_new_tokens=48)
    assert res.token_ids == ref
    assert res.stats.verify_steps > 8 and max(i for i, c in enumerate(res.stats.accepted_hist) if c) > 1
    committed = torch.cat([prompt, torch.tensor(ref[:-1])])  # the last token never entered the cache
    assert row_length(v) == committed.numel()
    plain = DynamicCache()
    with torch.no_grad():
        tiny_model(committed[None], past_key_values=plain, use_cache=True)
    assert len(v.cache.layers) == len(plain.layers)
    for ours, theirs in zip(v.cache.layers, plain.layers):
        torch.testing.assert_close(ours.keys, theirs.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.values, theirs.values, atol=1e-5, rtol=1e-5)


def test_commit_moves_entries_in_place(llama):
    v = Verifier(llama)
    prefill_one(v, torch.arange(5))
    verify_one(v, torch.tensor([1, 2, 3, 4]), build_tree([-1, 0, 0, 2]))
    before = v.cache.layers[0].keys
    commit_one(v, torch.tensor([0, 2, 3]))
    assert row_length(v) == 8
    assert v.cache.layers[0].keys.shape[2] == 8
    assert v.cache.layers[0].keys.data_ptr() == before.data_ptr()  # a view of the same storage


def test_reserved_layer_appends_in_place_and_keeps_dynamic_layer_semantics():
    g = torch.Generator().manual_seed(0)
    kv = lambda n: (torch.randn(1, 2, n, 4, generator=g), torch.randn(1, 2, n, 4, generator=g))  # noqa: E731
    ours, ref = ReservedLayer(), DynamicCache().layer_class_to_replicate()
    k, v = kv(5)
    ours.update(k, v), ref.update(k, v)
    storage = ours.keys.data_ptr()
    for n in (1, 3, 1):  # appends land in the reserved buffer: no reallocation
        k, v = kv(n)
        ours.update(k, v), ref.update(k, v)
    assert ours.keys.data_ptr() == storage and ours.get_seq_length() == 10
    ours.crop(-4), ref.crop(-4)  # a crop is a shorter view; the next update writes over the cut
    k, v = kv(2)
    ours.update(k, v), ref.update(k, v)
    assert ours.keys.data_ptr() == storage
    ours.batch_select_indices(torch.tensor([0])), ref.batch_select_indices(torch.tensor([0]))  # keys replaced
    k, v = kv(300)  # and beyond the reserve: copied into a fresh, larger buffer
    ours.update(k, v), ref.update(k, v)
    assert ours.keys.data_ptr() != storage
    torch.testing.assert_close(ours.keys, ref.keys, rtol=0, atol=0)
    torch.testing.assert_close(ours.values, ref.values, rtol=0, atol=0)


def test_reserved_cache_gives_the_logits_of_a_dynamic_cache(tiny_model):
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))
    ours, ref = ReservedCache(), DynamicCache()
    with torch.no_grad():
        for lo, hi in ((0, 7), (7, 8), (8, 12)):
            a = tiny_model(ids[:, lo:hi], past_key_values=ours, use_cache=True).logits
            b = tiny_model(ids[:, lo:hi], past_key_values=ref, use_cache=True).logits
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert all(isinstance(layer, ReservedLayer) for layer in ours.layers)


def test_sliding_window_and_context_are_refused_before_work():
    g2 = tiny_random_model("gemma2", vocab_size=VOCAB)
    v = Verifier(g2)
    v.check_fits(512)
    with pytest.raises(UserError, match="sliding window of 512"):
        v.check_fits(513)
    llama = tiny_random_model("llama", vocab_size=VOCAB)
    with pytest.raises(UserError, match="context is 1024"):
        generate(llama, None, torch.zeros(1000, dtype=torch.long), max_new_tokens=25)
