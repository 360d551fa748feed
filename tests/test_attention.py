"""Grouped-query attention read in place (infer.core.attention): the same bits as transformers'
``sdpa``, on every family, and no copied key/value heads in a traced verify pass."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from conftest import VOCAB, hf_greedy, prefill_one, verify_one
from infer.core.attention import NAME, grouped_sdpa, use_grouped_attention
from infer.core.models import tiny_random_model
from infer.core.static import StaticVerifier
from infer.core.tree import build_tree
from infer.core.verifier import Verifier


class _Heads(torch.nn.Module):
    """What the attention functions read off an attention module."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


@pytest.mark.parametrize("nodes,columns", [(1, 40), (6, 40), (40, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_sdpa_is_transformers_sdpa_bit_for_bit(nodes, columns, dtype):
    """``[B, H, N, D]`` queries over ``[B, Hkv, C, D]`` keys with a tree-like mask: the same output."""
    g = torch.Generator().manual_seed(nodes)
    q = torch.randn(2, 6, nodes, 16, generator=g).to(dtype)
    k, v = (torch.randn(2, 2, columns, 16, generator=g).to(dtype) for _ in range(2))
    seen = torch.rand(2, 1, nodes, columns, generator=g) < 0.6
    seen[..., 0] = True
    mask = torch.where(seen, 0.0, torch.finfo(dtype).min).to(dtype)
    module = _Heads(3)
    ours, _ = grouped_sdpa(module, q, k, v, mask, scaling=0.25)
    theirs, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    assert ours.shape == (2, nodes, 6, 16)
    assert torch.equal(ours, theirs)


def test_a_pass_without_a_mask_is_transformers_own():
    """No mask (a causal prefill): transformers' function runs, its ``is_causal`` path included."""
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    ours, _ = grouped_sdpa(_Heads(2), q, k, v, None, is_causal=True)
    theirs, _ = sdpa_attention_forward(_Heads(2), q, k, v, None, is_causal=True)
    assert torch.equal(ours, theirs)


def test_every_family_runs_it_and_generates_what_it_generated(tiny_model):
    """Each family that runs ``sdpa`` switches (Gemma 2, soft-capped, runs eager attention and
    keeps it); greedy output of HF ``generate`` and the logits are unchanged by the switch, and a
    verify pass of the continuation accepts it."""
    model = tiny_random_model(tiny_model.config.model_type, vocab_size=VOCAB, seed=1)
    ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(3))
    before = hf_greedy(model, ids, 10)
    own = model.config._attn_implementation
    assert own in ("sdpa", "eager")
    with torch.inference_mode():
        ref = model(ids[None]).logits
    v = Verifier(model)
    assert model.config._attn_implementation == (NAME if own == "sdpa" else own)
    assert hf_greedy(model, ids, 10) == before
    with torch.inference_mode():
        assert torch.equal(model(ids[None]).logits, ref)
    prefill_one(v, ids)
    out = verify_one(v, torch.tensor(before[:4]), build_tree([-1, 0, 1, 2]))
    assert out.logits.argmax(-1)[:3].tolist() == before[1:4]


def test_a_model_on_another_attention_keeps_it():
    model = tiny_random_model("llama", vocab_size=VOCAB, seed=1)
    model.set_attn_implementation("eager")
    assert not use_grouped_attention(model)
    assert model.config._attn_implementation == "eager"


def test_a_traced_verify_pass_reads_the_shared_heads_in_place():
    """The static step as Dynamo traces it for the compiled path (a step of its own: a new code
    object, so that no graph another test cached answers for it), one node and three: no
    key/value head is copied (transformers' ``repeat_kv`` is an expand of a 5-D view, what it runs
    without the switch), and a tree's attention is SDPA with ``enable_gqa``."""
    model = tiny_random_model("llama", vocab_size=VOCAB, seed=1)
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    v = StaticVerifier(model)
    v._step = torch.compile(lambda *a: v._eager_step(*a), backend=keep)
    prefill_one(v, torch.arange(1, 9))
    verify_one(v, torch.tensor([3]), build_tree([-1]))
    verify_one(v, torch.tensor([3, 4, 5]), build_tree([-1, 0, 0]))
    assert len(graphs) == 2
    nodes = [n for gm in graphs for n in gm.graph.nodes]
    expands = [n for n in nodes if n.op == "call_method" and n.target == "expand" and len(n.args) == 6]
    assert not expands, [n.format_node() for n in expands]
    tree_sdpa = [n for n in graphs[1].graph.nodes if "scaled_dot_product_attention" in str(n.target)]
    assert len(tree_sdpa) == model.config.num_hidden_layers
    assert all(n.kwargs.get("enable_gqa") is True for n in tree_sdpa)
