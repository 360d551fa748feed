"""Draft heads on tiny random verifiers of every family: shapes, checkpoints, verifier checks,
and lossless decoding through the engine."""

import json

import pytest
import torch

from conftest import VOCAB, hf_greedy
from heads import (
    CheckpointError,
    HeadConfig,
    HeadMismatchError,
    VerifierSpec,
    build_head,
    default_aux_layers,
    load_head,
)
from heads.masks import causal_mask
from infer import generate
from infer.core.errors import UserError
from infer.core.models import tiny_random_model
from infer.drafting.head_drafters import EagleDrafter, MedusaDrafter, load_head_drafter

HEAD_TYPES = ("medusa", "eagle1", "eagle3")


def make_head(model, head_type, seed=0, **kw):
    spec = VerifierSpec.of(model, model.config.model_type)
    cfg = HeadConfig(
        head_type, spec, num_heads=3, num_layers=2,
        draft_vocab_size=96 if head_type == "eagle3" else 0,
        aux_layers=default_aux_layers(spec.num_layers) if head_type == "eagle3" else (),
        layer_config=model.config.to_dict(), **kw,
    )
    torch.manual_seed(seed)
    head = build_head(cfg)
    with torch.no_grad():  # random, non-trivial weights (Medusa starts as the identity)
        for p in head.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.normal_(1, 0.1)
    if head_type == "eagle3":
        head.set_vocab(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:96])
    return head.eval()


def draft_logits(head, model, T=7):
    """Deterministic draft logits of a head on random verifier features."""
    g = torch.Generator().manual_seed(0)
    h = model.config.hidden_size
    if head.config.head_type == "medusa":
        return head(torch.randn(T, h, generator=g), model.get_output_embeddings())
    feats = torch.randn(1, T, 3, h, generator=g)
    tokens = torch.randint(0, VOCAB, (1, T), generator=g)
    embeds = model.get_input_embeddings()(tokens)
    pos = torch.arange(T)[None]
    mask = causal_mask(T, 0, 1, torch.float32, "cpu")
    if head.config.head_type == "eagle3":
        return head.logits(head(head.fuse(feats), embeds, pos, mask))
    return model.get_output_embeddings()(head(feats[:, :, 0], embeds, pos, mask))


@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_shapes_and_save_load_roundtrip(tiny_model, head_type, tmp_path):
    head = make_head(tiny_model, head_type)
    with torch.no_grad():
        out = draft_logits(head, tiny_model)
    expected = {"medusa": (3, 7, VOCAB), "eagle1": (1, 7, VOCAB), "eagle3": (1, 7, 96)}[head_type]
    assert tuple(out.shape) == expected and torch.isfinite(out).all()
    head.save_pretrained(tmp_path / "ckpt", steps=3)
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert files == ["README.md", "config.json", "model.safetensors"]
    loaded = load_head(tmp_path / "ckpt", verifier=tiny_model)
    assert loaded.config.training["steps"] == 3
    with torch.no_grad():
        torch.testing.assert_close(draft_logits(loaded, tiny_model), out, rtol=0, atol=0)
    if head_type == "eagle3":
        assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)
        assert loaded.target_ids(torch.arange(96)).tolist() == sorted(loaded.t2d.nonzero().flatten().tolist())


@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_heads_are_lossless_through_the_engine(tiny_model, head_type):
    head = make_head(tiny_model, head_type)
    ids = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(2))
    ref = hf_greedy(tiny_model, ids, 24)
    drafter = MedusaDrafter(head, tiny_model) if head_type == "medusa" else EagleDrafter(head, tiny_model)
    res = generate(tiny_model, drafter, ids, max_new_tokens=24)
    assert res.token_ids == ref
    sampled = generate(tiny_model, drafter, ids, max_new_tokens=24, temperature=1.0, seed=1)
    assert sampled.stats.new_tokens == 24


def test_loading_for_another_verifier_fails_clearly(tmp_path, llama):
    head = make_head(llama, "eagle1")
    head.save_pretrained(tmp_path / "h")
    other_weights = tiny_random_model("llama", vocab_size=VOCAB, seed=99)
    with pytest.raises(HeadMismatchError, match="fingerprint"):
        load_head(tmp_path / "h", verifier=other_weights)
    bigger = tiny_random_model("llama", vocab_size=VOCAB, hidden_size=32)
    with pytest.raises(HeadMismatchError, match="hidden_size 64"):
        load_head(tmp_path / "h", verifier=bigger)
    other_vocab = tiny_random_model("llama", vocab_size=200)
    with pytest.raises(UserError, match="vocab_size 256"):
        load_head_drafter(str(tmp_path / "h"), other_vocab)


def test_bad_checkpoints_are_refused(tmp_path, llama):
    d = tmp_path / "x"
    d.mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_head(d)
    make_head(llama, "medusa").save_pretrained(d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "bogus": 1}))
    with pytest.raises(CheckpointError, match="unknown keys in head config: bogus"):
        load_head(d)
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(CheckpointError, match="only safetensors"):
        load_head(d)
    with pytest.raises(CheckpointError, match="no draft head"):
        load_head(tmp_path / "missing")


def test_save_is_atomic_and_replaces(tmp_path, llama):
    head = make_head(llama, "medusa")
    head.save_pretrained(tmp_path / "h")
    head2 = make_head(llama, "medusa", seed=5)
    head2.save_pretrained(tmp_path / "h")
    with torch.no_grad():
        torch.testing.assert_close(draft_logits(load_head(tmp_path / "h"), llama), draft_logits(head2, llama))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h"]  # no temp or old directories left


def test_bf16_checkpoint_halves_the_file_and_loads_as_float32(tmp_path, llama, capsys):
    from safetensors.torch import load_file

    from infer.tools.cli import main

    head = make_head(llama, "eagle3")
    head.save_pretrained(tmp_path / "fp32")
    assert main(["export", "--draft", str(tmp_path / "fp32"), "--format", "specheads", "--dtype", "bf16", "--out", str(tmp_path / "bf16")]) == 0
    big, small = (tmp_path / d / "model.safetensors" for d in ("fp32", "bf16"))
    assert small.stat().st_size < 0.6 * big.stat().st_size
    stored = load_file(str(small))
    assert stored["fc.weight"].dtype == torch.bfloat16 and stored["d2t"].dtype == torch.long  # ints untouched
    loaded = load_head(tmp_path / "bf16", verifier=llama)
    assert loaded.fc.weight.dtype == torch.float32
    torch.testing.assert_close(loaded.fc.weight, head.fc.weight.to(torch.bfloat16).float(), rtol=0, atol=0)
    assert torch.equal(loaded.t2d, head.t2d)


def test_medusa_has_independent_residual_blocks(llama):
    head = make_head(llama, "medusa")
    blocks = [b for seq in head.blocks for b in seq]
    assert len({id(b.linear.weight) for b in blocks}) == len(blocks) == 6  # Medusa's shared-weights bug avoided


def test_hub_roundtrip_without_network(tmp_path, llama, monkeypatch):
    """push_to_hub uploads the saved folder; from_pretrained(repo_id) reads a Hub snapshot."""
    import huggingface_hub

    calls = {}

    class FakeApi:
        def __init__(self, token=None):
            calls["token"] = token

        def create_repo(self, repo_id, private=False, exist_ok=False):
            calls["repo"] = (repo_id, private, exist_ok)
            return f"https://hub.example/{repo_id}"

        def upload_folder(self, folder_path, repo_id, commit_message):
            from pathlib import Path

            calls["files"] = sorted(p.name for p in Path(folder_path).iterdir())
            (tmp_path / "hub").mkdir()
            for p in Path(folder_path).iterdir():
                (tmp_path / "hub" / p.name).write_bytes(p.read_bytes())

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    head = make_head(llama, "eagle3")
    url = head.push_to_hub("me/tiny-eagle3", token="t0k")
    assert url.endswith("me/tiny-eagle3") and calls["repo"] == ("me/tiny-eagle3", False, True)
    assert calls["files"] == ["README.md", "config.json", "model.safetensors"]
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, allow_patterns: str(tmp_path / "hub"))
    monkeypatch.setattr("heads.io.hub_access", lambda repo_id, what: False)  # a reachable Hub (none is reachable here)
    loaded = load_head("me/tiny-eagle3", verifier=llama)
    with torch.no_grad():
        torch.testing.assert_close(draft_logits(loaded, llama), draft_logits(head, llama))


def test_auto_draft_picks_the_shipped_heads_of_this_verifier(tmp_path, monkeypatch, llama):
    import heads.io
    from infer.drafting.loading import load_drafter
    from infer.drafting.lookup import PromptLookupDrafter
    from infer.drafting.union import UnionDrafter

    other = tiny_random_model("qwen2")
    make_head(llama, "eagle3").save_pretrained(tmp_path / "for-llama")
    make_head(other, "eagle3").save_pretrained(tmp_path / "for-qwen")
    monkeypatch.setattr(heads.io, "PRETRAINED_DIR", tmp_path)
    assert heads.io.pretrained_names() == ["for-llama", "for-qwen"]
    assert heads.io.pretrained_for(llama) == ["for-llama"]
    d = load_drafter("auto", llama, tree=None)
    assert isinstance(d, UnionDrafter) and isinstance(d.drafters[0], EagleDrafter) and isinstance(d.drafters[1], PromptLookupDrafter)
    assert isinstance(load_drafter("auto", tiny_random_model("mistral"), tree=None), PromptLookupDrafter)
    with pytest.raises(UserError, match="trained for"):
        load_drafter("for-qwen", llama, tree=None)  # a shipped head by name, wrong verifier
    from infer.core.tree import load_tree_spec

    static = load_drafter("auto", llama, tree=load_tree_spec("chain-4"))  # a static tree: not for EAGLE
    assert static.drafters[0].tree != load_tree_spec("chain-4") and static.drafters[1].tree == load_tree_spec("chain-4")
    dynamic = load_drafter("auto", llama, tree=load_tree_spec("eagle2-32"))
    assert dynamic.drafters[0].tree == load_tree_spec("eagle2-32")


def test_default_aux_layers_are_distinct_inputs_of_decoder_layers():
    """vLLM and SGLang capture each id once, at the input of decoder layer 0..N-1 (HF
    ``hidden_states[N]`` is after the final norm): three distinct ids below N whenever N >= 3."""
    for n in range(3, 41):
        aux = default_aux_layers(n)
        assert list(aux) == sorted(set(aux)) and len(aux) == 3 and 0 <= aux[0] and aux[-1] < n, (n, aux)
        if n >= 7:
            assert aux == (2, n // 2, n - 3)  # EAGLE-3's own choice where it is already distinct
    assert default_aux_layers(6) == (2, 3, 4) and default_aux_layers(3) == (0, 1, 2)
    assert len(default_aux_layers(2)) == len(default_aux_layers(1)) == 3  # internal use only (export refuses)


def test_shipped_head_keeps_its_recorded_aux_layers():
    import heads.io

    head = load_head(heads.io.PRETRAINED_DIR / "default")
    assert head.config.aux_layers == (2, 15, 27)


def test_head_follows_the_verifiers_dtype_unless_told(tmp_path):
    from safetensors.torch import load_file

    bf16 = tiny_random_model("llama", vocab_size=VOCAB, seed=1).to(torch.bfloat16)
    fp32 = tiny_random_model("llama", vocab_size=VOCAB, seed=1).to(torch.bfloat16).float()  # same weights
    head = make_head(bf16, "eagle3")
    head.save_pretrained(tmp_path / "h", weights_dtype=torch.bfloat16)
    assert load_file(str(tmp_path / "h" / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16
    on_bf16 = load_head(tmp_path / "h", verifier=bf16)
    assert on_bf16.fc.weight.dtype == torch.bfloat16 and on_bf16.midlayer.input_layernorm.weight.dtype == torch.bfloat16
    assert on_bf16.d2t.dtype == torch.long and on_bf16.t2d.dtype == torch.bool
    assert all(b.dtype == torch.bfloat16 for b in on_bf16.buffers() if b.is_floating_point())  # rotary inv_freq too
    on_fp32 = load_head(tmp_path / "h", verifier=fp32)
    assert on_fp32.fc.weight.dtype == torch.float32 and on_fp32.d2t.dtype == torch.long
    assert load_head(tmp_path / "h").fc.weight.dtype == torch.float32  # no verifier: float32 on the CPU
    forced = load_head(tmp_path / "h", verifier=bf16, dtype=torch.float32, device="cpu")
    assert forced.fc.weight.dtype == torch.float32 and forced.fc.weight.device.type == "cpu"
    via_class = type(head).from_pretrained(tmp_path / "h", verifier=bf16)
    assert via_class.fc.weight.dtype == torch.bfloat16
