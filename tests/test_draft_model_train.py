"""``head_type: draft_model``: a tiny run trains only the draft model (the verifier stays as it
was), resumes from its checkpoints, and writes a plain HF model directory that
``AutoModelForCausalLM`` loads without specheads and that HF assisted generation and
``--draft model:DIR`` use with output identical to plain greedy decoding."""

from pathlib import Path

import pytest
import torch

from conftest import hf_greedy
from infer import generate, load_drafter
from infer.core.models import load_verifier
from train.config import ConfigError, load_config
from train.data import distill, load_prompts
from train.train_heads import train

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "tiny-cpu.yaml"

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "distilled.jsonl"
    lv = load_verifier("tiny-random:llama")
    distill(lv.model, lv.tokenizer, load_prompts("synthetic:32"), path, max_new_tokens=24, batch_size=16, progress=False)
    return path


def config(tmp_path, distilled, **over):
    over = {"head_type": "draft_model", "data": str(distilled), "prompts": "", "output_dir": str(tmp_path / "run"),
            "max_steps": 4, "save_every": 2, "eval_every": 4, "eval_batches": 1, "batch_size": 4, "lr": 3e-3,
            "draft_layers": 1, **over}
    return load_config(RECIPE, [f"{k}={v}" for k, v in over.items()])


def test_training_changes_only_the_draft_model_and_saves_a_plain_hf_model(tmp_path, distilled):
    from transformers import AutoModelForCausalLM

    verifier = load_verifier("tiny-random:llama").model
    before = {k: v.clone() for k, v in verifier.state_dict().items()}
    result = train(config(tmp_path, distilled))
    assert result["step"] == 4
    after = result["verifier"].state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the frozen verifier is untouched
    draft = result["head"]
    layer = "model.layers.0.mlp.down_proj.weight"  # started as the verifier's first layer (draft_init_layers), then trained
    assert not torch.equal(draft.state_dict()[layer], verifier.state_dict()[layer])
    out = tmp_path / "run"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "training.json"):
        assert (out / name).is_file(), name
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()  # transformers alone
    assert loaded.config.model_type == verifier.config.model_type
    assert loaded.config.num_hidden_layers == 1
    assert torch.equal(loaded.get_input_embeddings().weight, verifier.get_input_embeddings().weight)  # frozen copy
    ids = torch.tensor([[5, 17, 99, 3, 42, 7]])
    plain = verifier.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
    assisted = verifier.generate(ids, assistant_model=loaded, max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert assisted.tolist() == plain.tolist()
    lv = load_verifier("tiny-random:llama")
    drafter = load_drafter(f"model:{out}", lv.model, tokenizer=lv.tokenizer)
    res = generate(lv.model, drafter, ids[0], max_new_tokens=24)
    assert res.token_ids == hf_greedy(lv.model, ids[0], 24)


def test_the_draft_model_learns_and_resume_continues(tmp_path, distilled):
    first = train(config(tmp_path, distilled, max_steps=4, interrupt_after=2))
    assert first["interrupted"] and first["step"] == 2
    assert (tmp_path / "run" / "checkpoints" / "step_2").is_dir()
    resumed = train(config(tmp_path, distilled, max_steps=4, resume=True))
    assert resumed["step"] == 4 and [h["step"] for h in resumed["history"]] == [1, 2, 3, 4]
    # its own verifier's first layer copied: the draft starts close to the verifier, and training keeps it there
    assert resumed["history"][-1]["acc_1"] > 0.1


def test_draft_model_config_is_checked():
    with pytest.raises(ConfigError, match="init_from"):
        load_config(RECIPE, ["head_type=draft_model", "init_from=heads/pretrained/default"])
    with pytest.raises(ConfigError, match="draft_layers"):
        load_config(RECIPE, ["head_type=draft_model", "draft_layers=0"])
