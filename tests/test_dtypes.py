"""Dtypes: --dtype on the CLI, heads following their verifier, real-shape random verifiers built
in place, and what bf16 gives (fp32 stays the exactness reference)."""

import json

import pytest
import torch
from test_heads import make_head

from conftest import hf_greedy
from infer import generate
from infer.core.models import load_verifier, random_config, resolve_dtype, tiny_random_model
from infer.drafting.head_drafters import EagleDrafter, draft_dtype, load_head_drafter
from infer.tools.cli import main


@pytest.mark.parametrize("head_type", ["medusa", "eagle1", "eagle3"])
def test_bf16_runs_end_to_end_for_every_head_type(tmp_path, capsys, head_type):
    verifier = load_verifier("tiny-random:llama", dtype="bf16")
    assert verifier.model.dtype == torch.bfloat16
    make_head(tiny_random_model("llama", vocab_size=len(verifier.tokenizer), initializer_range=0.1), head_type).save_pretrained(tmp_path / "h")
    argv = ["generate", "--verifier", "tiny-random:llama", "--dtype", "bf16", "--draft", str(tmp_path / "h"),
            "--prompt", "Repeat: one two one two", "--max-new-tokens", "12", "--json"]
    if head_type == "medusa":
        argv += ["--tree", "chain:3"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 12


def test_heads_follow_the_verifier_and_may_draft_in_bf16(tmp_path):
    fp32 = tiny_random_model("llama", vocab_size=256, seed=1)
    bf16 = tiny_random_model("llama", vocab_size=256, seed=1).to(torch.bfloat16)
    make_head(fp32, "eagle3").save_pretrained(tmp_path / "h", weights_dtype=torch.bfloat16)
    assert load_head_drafter(str(tmp_path / "h"), bf16).head.fc.weight.dtype == torch.bfloat16
    d = load_head_drafter(str(tmp_path / "h"), fp32, dtype="fp32")
    assert d.head.fc.weight.dtype == torch.float32 and d.head.d2t.dtype == torch.long
    assert draft_dtype(bf16) == torch.bfloat16 and draft_dtype(fp32, "fp16") == torch.float16
    assert draft_dtype(fp32) in (torch.float32, torch.bfloat16)  # bf16 where the CPU has native bf16
    # a bf16 head on a float32 verifier: the output is still the verifier's own greedy output
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(0))
    drafter = EagleDrafter(make_head(fp32, "eagle3"), fp32, dtype=torch.bfloat16)
    assert generate(fp32, drafter, ids, max_new_tokens=24).token_ids == hf_greedy(fp32, ids, 24)


def test_random_presets_are_real_shapes_built_in_the_target_dtype():
    cfg = random_config("llama-3.1-8b")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.vocab_size) == (4096, 32, 8, 128256)
    assert random_config("qwen3-8b").num_hidden_layers == 36
    lv = load_verifier("random:smollm2-135m", dtype="bf16")
    params = list(lv.model.parameters())
    assert all(p.dtype == torch.bfloat16 for p in params) and sum(p.numel() for p in params) == 134_515_008
    assert lv.tokenizer is not None  # its vocabulary (49152) holds the byte tokenizer
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda"), "float16") == torch.float16
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16


def test_bf16_greedy_mostly_matches_and_fp32_always(tmp_path):
    """fp32 is exact; bf16 tree passes batch rows differently from one-token steps, so near-ties
    can flip: measured, not asserted to be 100%."""
    from infer.tools.selfcheck import part_identity

    res = part_identity(torch.device("cpu"), small=True)
    assert res["fp32_all_identical"] is True
    assert res["bf16_identical_share"] >= 0.5


def test_fingerprints_survive_dtype_changes_and_old_heads_still_load(tmp_path):
    from heads import load_head
    from heads.config import legacy_fingerprint, weights_fingerprint

    m = tiny_random_model("llama", vocab_size=256, seed=1)
    prints = {weights_fingerprint(m.to(dt)) for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float32)}
    assert len(prints) == 1 and weights_fingerprint(tiny_random_model("llama", vocab_size=256, seed=2)) not in prints
    m = m.float()
    head = make_head(m, "eagle3")
    old = json.loads(json.dumps(head.config.to_dict()))
    old["verifier"]["fingerprint"] = legacy_fingerprint(m)  # as heads saved before s1- fingerprints
    head.save_pretrained(tmp_path / "h")
    (tmp_path / "h" / "config.json").write_text(json.dumps(old))
    assert load_head(tmp_path / "h", verifier=m).config.verifier.fingerprint == old["verifier"]["fingerprint"]
