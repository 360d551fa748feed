"""Export for vLLM / SGLang and import of published checkpoints.

The expected layouts are written down here from the engines' loaders (read, not copied):

vLLM ``models/llama_eagle3.py`` + ``transformers_utils/configs/eagle.py`` and SGLang
``models/llama_eagle3.py``:
  * ``architectures`` is ``["LlamaForCausalLMEagle3"]`` (SGLang needs that exact name; vLLM maps it
    to its Eagle3 Llama class), ``model_type`` ``llama``, one layer, ``tie_word_embeddings`` false
    (SGLang would tie lm_head to the embedding), ``draft_vocab_size`` present (SGLang reads it
    directly), no ``bias: true`` (vLLM would add an o_proj bias, SGLang an fc bias).
  * weight names are unprefixed (vLLM prefixes ``model.`` itself and maps ``midlayer.`` to
    ``layers.0.``): ``fc.weight [h, 3h]`` (no bias), ``midlayer.self_attn.{q,k,v}_proj.weight`` with
    2h inputs, ``o_proj``, ``mlp.{gate,up,down}_proj``, ``input_layernorm``, ``hidden_norm``,
    ``post_attention_layernorm``, ``norm.weight``, ``lm_head.weight [draft_vocab, h]``, ``d2t`` int64
    offsets (target = draft + d2t[draft]; both engines add them), ``t2d`` bool (both skip it); no
    ``embed_tokens`` (shared with the target).
  * ``norm_before_residual`` false: the residual is the un-normed fused hidden state (the only
    behaviour SGLang implements).
  * aux layers: vLLM reads the top-level ``eagle_aux_hidden_state_layer_ids`` and captures the
    input of decoder layer i; SGLang reads only ``eagle_config.eagle_aux_hidden_state_layer_ids``
    and captures id + 1. Defaults in both: 2, N // 2, N - 3.

vLLM ``models/medusa.py`` + ``configs/medusa.py``: ``model_type`` ``medusa``,
``architectures`` ``["MedusaModel"]``, ``num_heads``, ``num_hidden_layers``, ``hidden_size``,
``vocab_size`` (its default, 32001, is wrong for anything else), no ``num_attention_heads`` (it would
be renamed to num_heads), ``blocks.{h}.layers.{l}.weight`` ``[h, h]`` and ``.bias`` when
``medusa_fc_bias``, ``lm_heads.{h}.weight [V, h]`` (``original_lm_head``: one shared
``lm_heads.0.weight``).
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_heads import draft_logits, make_head

from conftest import VOCAB, hf_greedy
from heads import CheckpointError, load_head
from heads.interop import export_eagle3, export_medusa
from infer import generate
from infer.cli import main
from infer.head_drafters import load_head_drafter
from infer.models import tiny_random_model


def expected_eagle3_keys(h, inter, heads, kv_heads, head_dim, vd, v):
    return {
        "fc.weight": ((h, 3 * h), torch.bfloat16),
        "midlayer.self_attn.q_proj.weight": ((heads * head_dim, 2 * h), torch.bfloat16),
        "midlayer.self_attn.k_proj.weight": ((kv_heads * head_dim, 2 * h), torch.bfloat16),
        "midlayer.self_attn.v_proj.weight": ((kv_heads * head_dim, 2 * h), torch.bfloat16),
        "midlayer.self_attn.o_proj.weight": ((h, heads * head_dim), torch.bfloat16),
        "midlayer.mlp.gate_proj.weight": ((inter, h), torch.bfloat16),
        "midlayer.mlp.up_proj.weight": ((inter, h), torch.bfloat16),
        "midlayer.mlp.down_proj.weight": ((h, inter), torch.bfloat16),
        "midlayer.input_layernorm.weight": ((h,), torch.bfloat16),
        "midlayer.hidden_norm.weight": ((h,), torch.bfloat16),
        "midlayer.post_attention_layernorm.weight": ((h,), torch.bfloat16),
        "norm.weight": ((h,), torch.bfloat16),
        "lm_head.weight": ((vd, h), torch.bfloat16),
        "d2t": ((vd,), torch.int64),
        "t2d": ((v,), torch.bool),
    }


@pytest.fixture(scope="module")
def deep_llama():
    return tiny_random_model("llama", vocab_size=VOCAB, num_layers=6, seed=4)


def test_eagle3_export_follows_the_engines_rules(tmp_path, deep_llama):
    head = make_head(deep_llama, "eagle3")
    out = export_eagle3(head, tmp_path / "e3")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    assert cfg["vocab_size"] == VOCAB and cfg["draft_vocab_size"] == 96 and cfg.get("bias") is not True
    assert cfg["norm_before_residual"] is False
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 3, 3]  # N = 6: inputs of layers 2, N//2, N-3
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 2]  # SGLang adds one
    assert cfg["max_position_embeddings"] >= deep_llama.config.max_position_embeddings
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "hidden_act", "rope_theta"):
        assert key in cfg
    weights = load_file(str(out / "model.safetensors"))
    expected = expected_eagle3_keys(64, 128, 4, 2, 16, 96, VOCAB)
    assert set(weights) == set(expected)  # unprefixed, no embed_tokens, no fc.bias
    for k, (shape, dtype) in expected.items():
        assert tuple(weights[k].shape) == shape and weights[k].dtype == dtype, k
    targets = torch.arange(96) + weights["d2t"]
    assert targets.min() >= 0 and targets.max() < VOCAB and weights["t2d"][targets].all() and weights["t2d"].sum() == 96


def test_medusa_export_follows_vllm_rules(tmp_path, llama):
    head = make_head(llama, "medusa")
    out = export_medusa(head, tmp_path / "m", llama)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "medusa" and cfg["architectures"] == ["MedusaModel"]
    assert (cfg["num_heads"], cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (3, 2, 64, VOCAB)
    assert cfg["medusa_fc_bias"] is True and cfg["original_lm_head"] is True and "num_attention_heads" not in cfg
    weights = load_file(str(out / "model.safetensors"))
    expected = {f"blocks.{h}.layers.{ly}.{p}" for h in range(3) for ly in range(2) for p in ("weight", "bias")}
    assert set(weights) == expected | {"lm_heads.0.weight"}
    assert weights["blocks.0.layers.0.weight"].shape == (64, 64) and weights["lm_heads.0.weight"].shape == (VOCAB, 64)
    own = make_head(llama, "medusa", own_lm_head=True)
    weights = load_file(str(export_medusa(own, tmp_path / "m2") / "model.safetensors"))
    assert {f"lm_heads.{h}.weight" for h in range(3)} <= set(weights)


@pytest.mark.parametrize("head_type", ["eagle3", "medusa"])
def test_export_import_roundtrip_gives_identical_draft_logits(tmp_path, llama, head_type):
    head = make_head(llama, head_type)
    if head_type == "eagle3":
        export_eagle3(head, tmp_path / "x", dtype=torch.float32)
    else:
        export_medusa(head, tmp_path / "x", llama, dtype=torch.float32)
    back = load_head(tmp_path / "x", verifier=llama)
    with torch.no_grad():
        torch.testing.assert_close(draft_logits(back, llama), draft_logits(head, llama), rtol=0, atol=0)


def _engine_equal(model, drafter):
    ids = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(3))
    return generate(model, drafter, ids, max_new_tokens=20).token_ids == hf_greedy(model, ids, 20)


def test_import_published_eagle3_layout(tmp_path, llama):
    """yuhuili/EAGLE3-* / SpecForge style: model.-prefixed keys, no t2d, embed_tokens present."""
    head = make_head(llama, "eagle3")
    src = export_eagle3(head, tmp_path / "src", dtype=torch.float32)
    w = load_file(str(src / "model.safetensors"))
    w = {f"model.{k}" if k != "lm_head.weight" else k: v for k, v in w.items() if k != "t2d"}
    w["model.embed_tokens.weight"] = torch.zeros(VOCAB, 64)
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("eagle_aux_hidden_state_layer_ids")  # only the SGLang-style nested ids
    d = tmp_path / "pub"
    d.mkdir()
    save_file(w, d / "model.safetensors")
    (d / "config.json").write_text(json.dumps(cfg))
    imported = load_head(d, verifier=llama)
    assert imported.config.aux_layers == head.config.aux_layers
    with torch.no_grad():
        torch.testing.assert_close(draft_logits(imported, llama), draft_logits(head, llama))
    assert _engine_equal(llama, load_head_drafter(str(d), llama))


def test_import_eagle1_layout(tmp_path, llama):
    head = make_head(llama, "eagle1")
    w = {k.replace("layer.", "layers.0.", 1): v for k, v in head.state_dict().items()
         if k not in ("fc.bias", "layer.input_layernorm.weight")}
    w["embed_tokens.weight"] = torch.zeros(VOCAB, 64)
    d = tmp_path / "e1"
    d.mkdir()
    save_file(w, d / "model.safetensors")
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1, "hidden_size": 64}))
    imported = load_head(d, verifier=llama)
    assert isinstance(imported.layer.input_layernorm, torch.nn.Identity) and not imported.fc.bias.any()
    assert _engine_equal(llama, load_head_drafter(str(d), llama))
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(CheckpointError, match="safetensors only. Convert it once"):
        load_head(d, verifier=llama)


def test_import_fasterdecoding_medusa_trusts_the_weights(tmp_path, llama, caplog):
    g = torch.Generator().manual_seed(0)
    w = {}
    for h in range(2):
        w[f"{h}.0.linear.weight"] = torch.randn(64, 64, generator=g) * 0.1
        w[f"{h}.0.linear.bias"] = torch.randn(64, generator=g) * 0.1
        w[f"{h}.1.weight"] = torch.randn(VOCAB, 64, generator=g)
    d = tmp_path / "fd"
    d.mkdir()
    save_file(w, d / "medusa_lm_head.safetensors")
    (d / "config.json").write_text(json.dumps({"medusa_num_heads": 5, "medusa_num_layers": 1, "base_model_name_or_path": "x"}))
    with caplog.at_level("WARNING"):
        imported = load_head(d, verifier=llama)
    assert imported.config.num_heads == 2 and "medusa_num_heads=5" in caplog.text
    feats = torch.randn(3, 64, generator=g)
    with torch.no_grad():
        ref = torch.stack([w[f"{h}.1.weight"] @ (feats + torch.nn.functional.silu(feats @ w[f"{h}.0.linear.weight"].T + w[f"{h}.0.linear.bias"])).T for h in range(2)]).transpose(1, 2)
        torch.testing.assert_close(imported(feats), ref, atol=1e-4, rtol=1e-4)
    assert _engine_equal(llama, load_head_drafter(str(d), llama))


def test_non_llama_verifiers_are_refused_for_eagle3_export(tmp_path):
    gemma = tiny_random_model("gemma", vocab_size=VOCAB)
    with pytest.raises(CheckpointError, match="only on llama, qwen2, qwen3, mistral"):
        export_eagle3(make_head(gemma, "eagle3"), tmp_path / "g")


def test_export_cli(tmp_path, llama, capsys):
    head = make_head(llama, "eagle3")
    head.save_pretrained(tmp_path / "h")
    assert main(["export", "--draft", str(tmp_path / "h"), "--format", "eagle3", "--out", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "model.safetensors").is_file()
    assert main(["export", "--draft", str(tmp_path / "h"), "--format", "medusa", "--out", str(tmp_path / "o2")]) == 2
    assert "needs Medusa heads" in capsys.readouterr().err
