"""The block drafter (DFlash-style): the head on every tiny family, one pass per step, lossless
greedy and exact sampling through the engine, training == inference, the reference DFlash
attention (speculators' own layer) reproduced by the unmodified HF layers, and the export fields
vLLM and SGLang validate."""

import json

import pytest
import torch

from conftest import VOCAB, forked_map, hf_greedy
from heads import HeadConfig, VerifierSpec, build_head, default_dflash_layers, load_head
from heads.dflash import DFlashHead
from infer import generate
from infer.core.drafter import Budget
from infer.core.models import tiny_random_model
from infer.drafting.block_drafter import BlockDrafter
from infer.drafting.lookup import PromptLookupDrafter
from infer.drafting.union import UnionDrafter


def make_dflash(model, seed=0, block_size=5, vocab=96, layers=2, aux=None):
    spec = VerifierSpec.of(model, model.config.model_type)
    cfg = HeadConfig("dflash", spec, num_layers=layers, draft_vocab_size=vocab, block_size=block_size, mask_token_id=7,
                     aux_layers=aux or default_dflash_layers(spec.num_layers, 5), layer_config=model.config.to_dict())
    torch.manual_seed(seed)
    head = build_head(cfg)
    with torch.no_grad():  # random, non-trivial weights
        for p in head.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.normal_(1, 0.1)
    head.set_vocab(torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(seed))[:vocab])
    return head.eval()


def features(model, ids: torch.Tensor, layers) -> torch.Tensor:
    """The verifier's hidden states at ``layers`` for ``ids``: ``[T, F, h]``."""
    with torch.no_grad():
        hs = model(ids[None], output_hidden_states=True).hidden_states
    return torch.stack([hs[i][0] for i in layers], dim=1)


def test_default_layers_follow_dflash_spread():
    assert default_dflash_layers(30, 5) == (2, 9, 15, 21, 28)  # layer outputs 1, 8, 14, 20, 27
    assert default_dflash_layers(36, 5) == (2, 10, 18, 26, 34)  # Qwen3-8B's published ids 1, 9, 17, 25, 33
    assert default_dflash_layers(2, 5) == (1, 2) and default_dflash_layers(1, 3) == (1,)
    for n in range(1, 41):
        ids = default_dflash_layers(n, 5)
        assert list(ids) == sorted(set(ids)) and 1 <= ids[0] and ids[-1] <= n


def test_save_load_roundtrip_and_bad_configs(tiny_model, tmp_path):
    head = make_dflash(tiny_model)
    assert isinstance(head, DFlashHead) and all(type(layer).__name__ == "Qwen3DecoderLayer" for layer in head.layers)
    head.save_pretrained(tmp_path / "h", steps=2)
    loaded = load_head(tmp_path / "h", verifier=tiny_model)
    for k, v in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    assert "block drafter" in (tmp_path / "h" / "README.md").read_text()
    cfg = head.config.to_dict()
    for bad, msg in (({"block_size": 1}, "block_size"), ({"mask_token_id": VOCAB}, "mask_token_id"),
                     ({"aux_layers": [2, 1]}, "ascending")):
        with pytest.raises(ValueError, match=msg):
            HeadConfig.from_dict({**cfg, **bad})


def test_block_drafter_is_lossless(tiny_model):
    """Random heads on every family: greedy equals HF's greedy, alone and in union with prompt
    lookup; sampling runs to the requested length."""
    head = make_dflash(tiny_model)
    ids = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(2))
    ref = hf_greedy(tiny_model, ids, 24)
    drafter = BlockDrafter(head, tiny_model)
    res = generate(tiny_model, drafter, ids, max_new_tokens=24)
    assert res.token_ids == ref
    assert max(n for n, k in enumerate(res.stats.nodes_hist) if k) == head.config.block_size  # root + 4 drafted
    union = UnionDrafter([BlockDrafter(head, tiny_model), PromptLookupDrafter(adaptive=False)])
    assert generate(tiny_model, union, ids, max_new_tokens=24).token_ids == ref
    assert generate(tiny_model, drafter, ids, max_new_tokens=24, temperature=1.0, seed=1).stats.new_tokens == 24


def test_incremental_context_equals_one_shot_and_training(llama):
    """The drafter's context cache, fed step by step, gives the same block logits as feeding the
    whole prefix at once, and as the training pass (every block at its anchor, one pass)."""
    from train.losses import dflash_blocks

    head = make_dflash(llama, block_size=4)
    ids = torch.randint(0, VOCAB, (14,), generator=torch.Generator().manual_seed(3))
    feats = features(llama, ids, head.config.aux_layers)
    a = 11  # the anchor: context 0..10, block starts with token 11
    one = BlockDrafter(head, llama)
    one.begin_row(ids[:a], feats[:a])
    steps = BlockDrafter(head, llama)
    steps.begin_row(ids[:5], feats[:5])
    steps.block_logits(int(ids[5]))  # a pass in between leaves only committed positions cached
    steps.update_row(ids[5:9], feats[5:9])
    steps.update_row(ids[9:a], feats[9:a])
    ref = one.block_logits(int(ids[a]))
    torch.testing.assert_close(steps.block_logits(int(ids[a])), ref, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        anchors = torch.tensor([[2, a]])  # another block in the same pass must not matter
        out = dflash_blocks(head, llama.get_input_embeddings(), feats[None], ids[None], anchors)
        train = head.logits(out[0, 1, 1:], head.lm_rows(llama.get_output_embeddings()))
    torch.testing.assert_close(train, ref, rtol=1e-4, atol=1e-4)


def test_hf_layers_reproduce_the_reference_dflash_attention(llama):
    """speculators' DFlash decoder layer (queries from the block; keys and values from the fused
    context and the block through the same k/v projections, k-norm and rotary) loaded with this
    head's weights gives the same block logits as the head's unmodified HF Qwen3 layers with the
    context in their KV cache."""
    sd = pytest.importorskip("speculators.models.dflash.model_definitions")
    from heads.dflash import draft_layers_config

    head = make_dflash(llama, block_size=5)
    ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(4))
    feats = features(llama, ids, head.config.aux_layers)
    drafter = BlockDrafter(head, llama)
    drafter.begin_row(ids, feats)
    ours = drafter.block_logits(5)
    cfg = draft_layers_config(head.config.layer_config, head.config.num_layers)
    cfg._attn_implementation = "eager"
    with torch.no_grad():
        ctx = head.fuse(feats)[None]  # [1, C, h]
        bs, c = head.config.block_size, ids.numel()
        block = torch.tensor([[5] + [head.config.mask_token_id] * (bs - 1)])
        x = llama.get_input_embeddings()(block)
        rope = head.rotary_emb(x, torch.arange(c + bs)[None])
        mask = torch.zeros(1, 1, bs, c + bs)
        for i, mine in enumerate(head.layers):
            layer = sd.Qwen3DFlashDecoderLayer(cfg, i)
            layer.load_state_dict(mine.state_dict())
            x = layer(target_hidden=ctx, hidden_states=x, attention_mask=mask, position_embeddings=rope)
        theirs = head.logits(x[0, 1:], head.lm_rows(llama.get_output_embeddings()))
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_one_head_pass_and_at_most_one_read_per_step(llama):
    from infer import stream
    from infer.core.diagnostics import HostReadCounter
    from infer.core.schedule import VerifyCost

    ids = torch.randint(0, VOCAB, (16,), generator=torch.Generator().manual_seed(0))
    # at the dispatch level: 2 for acceptance (its read back, the accepted tokens' copy) + the chain's
    # cut under a cost curve (one read of the block's probabilities): within "1 per drafted depth + 2"
    for cost, reads in ((None, 2), (VerifyCost((1, 8, 64), (1.0, 1.1, 1.5)), 3)):
        drafter = BlockDrafter(make_dflash(llama), llama)
        passes = []

        def counted(*a, head=drafter.head, passes=passes, **k):
            passes.append(1)
            return DFlashHead.forward(head, *a, **k)

        drafter.head.forward = counted
        per_step, last, steps = [], None, 0
        with HostReadCounter() as counter:
            for _ in stream(llama, drafter, ids, max_new_tokens=20, budget=cost or "fixed"):
                if last is not None:
                    per_step.append(counter.total - last)
                    steps += 1
                last = counter.total
        assert max(per_step) <= reads, per_step
        assert len(passes) <= steps + 1  # one block pass per verify step


V = 8
PROMPT = torch.tensor([1, 5, 2, 7, 3])


@pytest.mark.slow
def test_sampling_with_the_block_drafter_is_exact():
    """Vocabulary 8, the exact joint distribution of three sampled tokens against 2,500 samples
    drawn with a (random) block drafter whose chains the verifier accepts part of the time."""
    from test_sampling import chi_square_pvalue, exact_joint, tally

    m = tiny_random_model("llama", vocab_size=V, hidden_size=32, seed=3, initializer_range=0.5)
    head = make_dflash(m, seed=1, vocab=V, block_size=4)
    drafter = BlockDrafter(head, m)

    def draw(seed):  # 25 rows at once, row i seeded with seed + i
        return [(r.token_ids, r.stats.verify_steps < 2)
                for r in generate(m, drafter, [PROMPT] * 25, max_new_tokens=3, temperature=1.0, seed=seed)]

    samples = [s for batch in forked_map(draw, range(0, 2500, 25)) for s in batch]
    assert sum(a for _, a in samples) > 100  # drafts were accepted, so acceptance is exercised
    assert chi_square_pvalue(tally(ids for ids, _ in samples), exact_joint(m, 1.0, 0, 1.0)) > 1e-3


def test_export_has_the_fields_vllm_and_sglang_validate(tmp_path, llama):
    from safetensors.torch import load_file

    from heads.dflash_export import export_dflash
    from infer.tools.cli import main

    head = make_dflash(llama, aux=(1,))  # the output of layer 0 (a 2-layer verifier's last layer is not captured)
    head.save_pretrained(tmp_path / "h")
    assert main(["export", "--draft", str(tmp_path / "h"), "--format", "dflash", "--out", str(tmp_path / "x")]) == 0
    cfg = json.loads((tmp_path / "x" / "config.json").read_text())
    n, h = llama.config.num_hidden_layers, llama.config.hidden_size
    # vLLM: the registry maps DFlashDraftModel to its Qwen3 DFlash model; SGLang reads the same fields
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    dc = cfg["dflash_config"]
    assert dc["block_size"] == cfg["block_size"] == head.config.block_size  # SGLang: dflash_config first, then top level
    assert isinstance(dc["mask_token_id"], int) and 0 <= dc["mask_token_id"] < cfg["vocab_size"] == VOCAB
    assert all(0 <= i < n for i in dc["target_layer_ids"])  # SGLang's range check; it captures i + 1
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in dc["target_layer_ids"]] == list(head.config.aux_layers)
    assert cfg["num_target_layers"] == n and cfg["num_hidden_layers"] == head.config.num_layers
    assert set(cfg["layer_types"]) == {"full_attention"}  # non-causal everywhere (no sliding window)
    state = load_file(str(tmp_path / "x" / "model.safetensors"))
    assert state["fc.weight"].shape == (h, len(dc["target_layer_ids"]) * h)  # vLLM: fc input = aux layers x hidden
    assert state["fc.weight"].dtype == torch.bfloat16
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{name}.weight" for i in range(head.config.num_layers) for name in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
            "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
            "post_attention_layernorm")}
    assert set(state) == expected  # no embedding, no LM head: both engines use the target's
    from transformers import AutoConfig

    draft = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    assert draft.num_key_value_heads == llama.config.num_key_value_heads and draft.head_dim == h // llama.config.num_attention_heads
    far = make_dflash(llama)
    far.config = HeadConfig.from_dict({**far.config.to_dict(), "aux_layers": [1, n]})  # hidden_states[N]: after the final norm
    from heads import CheckpointError

    with pytest.raises(CheckpointError, match="capture only"):
        export_dflash(far, tmp_path / "y")


def test_a_block_drafter_that_is_never_accepted_stops_running(llama):
    """With the engine's online cost, the gate pauses a block drafter whose chains do not pay:
    the head stops running (a random head, before the gate: a pass every step, 0.82-0.91x HF
    greedy for the first trained block drafter on Spec-Bench); the output stays the verifier's."""
    from infer.core.schedule import OnlineCost, VerifyCost

    cost = OnlineCost(VerifyCost((1, 4, 16), (1.0, 1.5, 2.2)))
    for _ in range(5):  # as if the engine had timed a few steps already
        cost.observe(1, 0.010)
    drafter = BlockDrafter(make_dflash(llama), llama)
    passes = []
    drafter.head.register_forward_pre_hook(lambda m, a: passes.append(1))
    ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(3))
    res = generate(llama, drafter, ids, max_new_tokens=60, budget=cost)
    assert res.token_ids == hf_greedy(llama, ids, 60)
    assert res.stats.mean_accepted < 1.2  # a random head: nothing to gain
    assert len(passes) < 0.4 * res.stats.verify_steps, (len(passes), res.stats.verify_steps)
    union = UnionDrafter([BlockDrafter(make_dflash(llama), llama), PromptLookupDrafter(adaptive=False)])
    assert generate(llama, union, ids, max_new_tokens=60, budget=cost).token_ids == hf_greedy(llama, ids, 60)


def test_the_chain_host_form_is_the_drafted_chain(llama):
    """Under a cost curve the chain's tokens come to the host with its probabilities (one read),
    so merging it with prompt lookup reads nothing more."""
    from infer.core.schedule import VerifyCost

    drafter = BlockDrafter(make_dflash(llama), llama)
    ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(4))
    drafter.begin_row(ids, features(llama, ids, drafter.feature_layers))
    draft = drafter.propose_row(int(ids[-1]), Budget(8, cost=VerifyCost((1, 8), (1.0, 1.0))))  # free: the whole chain
    tokens, parents = draft.host
    assert list(tokens) == draft.tokens.tolist() and len(tokens) == drafter.block_size
    assert list(parents) == [-1, *range(len(tokens) - 1)]
