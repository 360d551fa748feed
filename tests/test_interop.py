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
from heads import CheckpointError, Eagle3Head, HeadConfig, build_head, load_head
from heads.interop import detect_format, export_eagle3, export_medusa
from infer import generate
from infer.core.models import tiny_random_model
from infer.drafting.head_drafters import load_head_drafter
from infer.tools.cli import main


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
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]  # N = 6: 2, N//2, N-3 made distinct
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # SGLang adds one
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
def test_export_import_roundtrip_gives_identical_draft_logits(tmp_path, llama, deep_llama, head_type):
    llama = deep_llama if head_type == "eagle3" else llama  # EAGLE-3 exports need >= 3 verifier layers
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


def test_import_published_eagle3_layout(tmp_path, deep_llama):
    """yuhuili/EAGLE3-* / SpecForge style: model.-prefixed keys, no t2d, embed_tokens present."""
    llama = deep_llama
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


def test_export_cli(tmp_path, deep_llama, capsys):
    head = make_head(deep_llama, "eagle3")
    head.save_pretrained(tmp_path / "h")
    assert main(["export", "--draft", str(tmp_path / "h"), "--format", "eagle3", "--out", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "model.safetensors").is_file()
    for f in [tmp_path / "o", *(tmp_path / "o").iterdir()]:  # ordinary files: a server may run as another user
        assert f.stat().st_mode & 0o777 == (0o755 if f.is_dir() else 0o644), f
    assert main(["export", "--draft", str(tmp_path / "h"), "--format", "medusa", "--out", str(tmp_path / "o2")]) == 2
    assert "needs Medusa heads" in capsys.readouterr().err


def test_full_vocabulary_eagle3_export_has_no_d2t(tmp_path, deep_llama):
    """vLLM creates no draft_id_to_target_id parameter when draft_vocab_size == vocab_size and
    refuses an extra d2t tensor (the EAGLE repo deletes d2t/t2d then); importing maps it to identity."""
    head = make_head(deep_llama, "eagle3", seed=1)
    full = build_head(HeadConfig("eagle3", head.config.verifier, draft_vocab_size=VOCAB, aux_layers=head.config.aux_layers,
                                 layer_config=head.config.layer_config))
    full.load_state_dict({k: v for k, v in head.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}, strict=False)
    with torch.no_grad():
        full.lm_head.weight.normal_(0, 0.2)
    full.set_vocab(torch.arange(VOCAB))
    out = export_eagle3(full.eval(), tmp_path / "full", dtype=torch.float32)
    weights = load_file(str(out / "model.safetensors"))
    assert "d2t" not in weights and "t2d" not in weights
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == VOCAB
    back = load_head(out, verifier=deep_llama)
    assert torch.equal(back.d2t, torch.zeros(VOCAB, dtype=torch.long)) and back.t2d.all()
    with torch.no_grad():
        torch.testing.assert_close(draft_logits(back, deep_llama), draft_logits(full, deep_llama), rtol=0, atol=0)


def test_eagle3_export_refuses_repeated_or_out_of_range_layers(tmp_path, llama, deep_llama):
    """The engines capture each id once, at the input of decoder layers 0..N-1."""
    with pytest.raises(CheckpointError, match="at least 3 layers"):
        export_eagle3(make_head(llama, "eagle3"), tmp_path / "two")  # 2 layers: no three distinct inputs
    old = make_head(deep_llama, "eagle3")
    for aux in ((2, 3, 3), (2, 3, 6)):  # a head made with the old default; id N (after the final norm)
        old.config = HeadConfig.from_dict({**old.config.to_dict(), "aux_layers": list(aux)})
        with pytest.raises(CheckpointError, match="distinct"):
            export_eagle3(old, tmp_path / "old")
    assert not (tmp_path / "old").exists() and not (tmp_path / "two").exists()


def _speculators_layout(head, directory):
    """What the ``speculators`` converter writes: ``layers.0.*`` and a nested transformer_layer_config."""
    state = {k.replace("midlayer.", "layers.0.", 1): v for k, v in head.state_dict().items()}
    state["embed_tokens.weight"] = torch.zeros(VOCAB, 64)
    lc = head.config.layer_config
    nested = {k: lc[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                 "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size") if k in lc}
    nested.update(model_type="llama", num_hidden_layers=1, rope_theta=10000.0)
    directory.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "draft_vocab_size": 96,
        "norm_before_residual": False, "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": list(head.config.aux_layers), "transformer_layer_config": nested,
        "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "x"}},
    }))
    return directory


def test_import_speculators_eagle3_layout(tmp_path, deep_llama):
    head = make_head(deep_llama, "eagle3")
    d = _speculators_layout(head, tmp_path / "spec")
    imported = load_head(d, verifier=deep_llama)
    assert isinstance(imported, Eagle3Head) and imported.config.aux_layers == head.config.aux_layers
    assert imported.config.layer_config["intermediate_size"] == 128
    with torch.no_grad():
        torch.testing.assert_close(draft_logits(imported, deep_llama), draft_logits(head, deep_llama), rtol=0, atol=0)
    assert _engine_equal(deep_llama, load_head_drafter(str(d), deep_llama))
    assert detect_format({}, {"fc.weight", "layers.0.hidden_norm.weight"}) == "eagle3"
    assert detect_format({}, {"fc.weight", "layers.0.self_attn.q_proj.weight", "d2t"}) == "eagle3"
    assert detect_format({}, {"fc.weight", "layers.0.self_attn.q_proj.weight"}) == "eagle1"


def test_import_speculators_layout_by_fc_shape(tmp_path, deep_llama):
    """No hidden_norm, no d2t (full vocabulary): an fc reading 3x its output still means EAGLE-3."""
    state = {"fc.weight": torch.zeros(64, 192), "layers.0.self_attn.q_proj.weight": torch.zeros(64, 128)}
    assert detect_format({}, set(state), state) == "eagle3"


def test_shape_mismatch_is_a_checkpoint_error(tmp_path, deep_llama):
    head = make_head(deep_llama, "eagle3")
    d = _speculators_layout(head, tmp_path / "spec")
    w = load_file(str(d / "model.safetensors"))
    w["layers.0.mlp.gate_proj.weight"] = torch.zeros(100, 64)  # intermediate size 100, config says 128
    save_file(w, d / "model.safetensors")
    with pytest.raises(CheckpointError, match="size mismatch|do not fit"):
        load_head(d, verifier=deep_llama)
    head.save_pretrained(tmp_path / "own")
    w = load_file(str(tmp_path / "own" / "model.safetensors"))
    w["fc.weight"] = torch.zeros(64, 100)
    save_file(w, tmp_path / "own" / "model.safetensors")
    with pytest.raises(CheckpointError, match="size mismatch|does not match"):
        load_head(tmp_path / "own", verifier=deep_llama)


def medusa2_checkpoint(model, directory):
    """A Medusa-2 checkpoint: Medusa heads and a (random, non-zero) LoRA adapter for ``model``,
    declared in the head's config by its SHA-256, as training writes it."""
    import copy
    import dataclasses

    from peft import LoraConfig, get_peft_model

    from heads.io import adapter_digest

    torch.manual_seed(0)
    adapted = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    adapted.save_pretrained(str(directory / "adapter"))
    head = make_head(model, "medusa", own_lm_head=True)
    head.config = dataclasses.replace(head.config, adapter_sha256=adapter_digest(directory))
    head.save_pretrained(directory)
    return directory


def test_export_never_mixes_with_a_previous_export(tmp_path, llama, capsys):
    """An EAGLE export into a directory that held a Medusa-2 export kept its adapter/,
    and --draft merged it: the output left the verifier's. Now a non-empty --out is refused, and
    --force replaces it as a whole."""
    m2 = medusa2_checkpoint(llama, tmp_path / "m2")
    e3 = make_head(llama, "eagle3").save_pretrained(tmp_path / "e3")
    out = tmp_path / "out"
    assert main(["export", "--draft", str(m2), "--format", "specheads", "--out", str(out)]) == 0
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    capsys.readouterr()
    assert main(["export", "--draft", str(e3), "--format", "specheads", "--out", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err and {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert main(["export", "--draft", str(e3), "--format", "specheads", "--out", str(out), "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert not list(tmp_path.glob(".out.*"))  # no temporary directory left beside it
    model = tiny_random_model("llama", vocab_size=VOCAB, seed=1)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    assert _engine_equal(model, load_head_drafter(str(out), model))
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def test_a_head_changes_the_verifier_only_when_its_config_declares_it(tmp_path, llama):
    import shutil

    from infer.core.errors import UserError

    m2 = medusa2_checkpoint(llama, tmp_path / "m2")
    e3 = make_head(llama, "eagle3").save_pretrained(tmp_path / "e3")
    shutil.copytree(m2 / "adapter", e3 / "adapter")  # a leftover beside a head that declares none
    model = tiny_random_model("llama", vocab_size=VOCAB, seed=1)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UserError, match="not declared"):
        load_head_drafter(str(e3), model)
    (m2 / "adapter" / "adapter_model.safetensors").write_bytes((e3 / "adapter" / "adapter_model.safetensors").read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(UserError, match="SHA-256 differs"):
        load_head_drafter(str(m2), model)
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    shutil.copytree(e3 / "adapter", m2 / "adapter", dirs_exist_ok=True)  # the declared adapter: merged
    load_head_drafter(str(m2), model)
    assert not torch.equal(model.model.layers[0].self_attn.q_proj.weight, weights["model.layers.0.self_attn.q_proj.weight"])


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
def test_export_refuses_to_overwrite_a_config_without_force(tmp_path, deep_llama, capsys, fmt):
    from heads.interop import export_speculators

    head = make_head(deep_llama, "eagle3")
    export = export_eagle3 if fmt == "eagle3" else (lambda h, o, **kw: export_speculators(h, o, verifier="org/x", **kw))
    out = tmp_path / "o"
    out.mkdir()
    (out / "config.json").write_text('{"mine": 1}')
    (out / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match="not empty"):
        export(head, out)
    assert (out / "config.json").read_text() == '{"mine": 1}'
    export(head, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    head.save_pretrained(tmp_path / "h")
    capsys.readouterr()
    assert main(["export", "--draft", str(tmp_path / "h"), "--format", fmt, "--out", str(out), "--verifier", "org/x"]) == 2
    assert "not empty" in capsys.readouterr().err


def test_medusa_export_warns_about_vllm_versions_and_medusa2_adapters(tmp_path, llama, caplog, capsys):
    head = make_head(llama, "medusa", own_lm_head=True)
    with caplog.at_level("WARNING"):
        export_medusa(head, tmp_path / "m")
    assert "0.32" in caplog.text and "0.33" in caplog.text
    medusa2_checkpoint(llama, tmp_path / "m2")
    capsys.readouterr()
    assert main(["export", "--draft", str(tmp_path / "m2"), "--format", "medusa", "--out", str(tmp_path / "o")]) == 0
    err = capsys.readouterr().err
    assert "LoRA" in err and "adapter" in err and "lack" in err
