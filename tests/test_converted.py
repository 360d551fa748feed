"""The default verifier's conversion cache (infer/converted.py): the first load converts the GGUF
file and keeps the result, later loads read it and get the same model; a damaged or unwritable
cache falls back to the GGUF file."""

import logging

import pytest
import torch

import infer.core.models as models
from heads import VerifierSpec
from infer.core.converted import MARKER, cache_root, converted_dir, find_converted
from infer.core.models import byte_tokenizer, load_verifier, tiny_random_model


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """The default verifier replaced by a tiny llama behind a stand-in GGUF file; the list
    counts the GGUF loads."""
    gguf = tmp_path / "wheel" / "Fake.Q4_1.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF stand-in")
    loads = []

    def from_gguf(path, check):
        tok = byte_tokenizer()
        model = tiny_random_model("llama", vocab_size=len(tok), seed=3)
        model.generation_config.eos_token_id = tok.eos_token_id
        model.config._name_or_path = str(path.parent)  # as transformers names a GGUF load
        check(model.config, tok)
        loads.append(path)
        return model, tok

    monkeypatch.setattr(models, "default_verifier_file", lambda: gguf)
    monkeypatch.setattr(models, "_from_gguf", from_gguf)
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    return gguf, loads


def _same(a, b):
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert a.model.generation_config.eos_token_id == b.model.generation_config.eos_token_id
    msgs = [{"role": "user", "content": "Hi there, ünïcode!"}]
    assert a.tokenizer.apply_chat_template(msgs, add_generation_prompt=True) == b.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)


def test_the_first_load_converts_and_later_ones_read_the_conversion(fake_gguf):
    gguf, loads = fake_gguf
    first = load_verifier("default")
    assert len(loads) == 1 and find_converted(gguf) is not None
    assert "quantization_config" not in (converted_dir(gguf) / "config.json").read_text()
    second = load_verifier("default")
    assert len(loads) == 1  # read from the cache: the GGUF file was not loaded again
    _same(first, second)
    assert second.model.config._name_or_path == str(gguf.parent)  # named as the GGUF load names it
    assert VerifierSpec.of(second.model) == VerifierSpec.of(first.model)
    bf16 = load_verifier("default", dtype="bf16")
    assert len(loads) == 1 and bf16.model.dtype == torch.bfloat16
    assert torch.equal(bf16.model.lm_head.weight, first.model.lm_head.weight.to(torch.bfloat16))


def test_the_check_still_runs_before_the_cached_weights_load(fake_gguf):
    load_verifier("default")

    def refuse(config, tokenizer):
        raise models.UserError("prompt too long")

    with pytest.raises(models.UserError, match="prompt too long"):
        load_verifier("default", check=refuse)
    assert find_converted(fake_gguf[0]) is not None  # a refused input is not a damaged cache


def test_a_damaged_conversion_is_made_again(fake_gguf, caplog):
    gguf, loads = fake_gguf
    first = load_verifier("default")
    weights = converted_dir(gguf) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    with caplog.at_level(logging.WARNING):
        again = load_verifier("default")
    assert len(loads) == 2 and "cannot be read" in caplog.text
    _same(first, again)
    assert find_converted(gguf) is not None and load_verifier("default") and len(loads) == 2  # rewritten whole
    weights.unlink()  # a missing file: not a whole conversion, converted again without a warning
    load_verifier("default")
    assert len(loads) == 3 and find_converted(gguf) is not None  # replaced whole
    load_verifier("default")
    assert len(loads) == 3


def test_a_new_gguf_file_is_converted_again(fake_gguf):
    gguf, loads = fake_gguf
    load_verifier("default")
    gguf.write_bytes(b"GGUF stand-in, a newer wheel")
    assert find_converted(gguf) is None
    load_verifier("default")
    assert len(loads) == 2 and find_converted(gguf) is not None


def test_an_unwritable_or_disabled_cache_still_loads(fake_gguf, monkeypatch, tmp_path, caplog):
    gguf, loads = fake_gguf
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("SPECHEADS_CACHE", str(blocker / "cache"))
    with caplog.at_level(logging.WARNING):
        load_verifier("default")
    assert "cannot keep the converted default verifier" in caplog.text
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temporary folder left behind
    monkeypatch.setenv("SPECHEADS_CACHE", "")
    assert cache_root() is None
    load_verifier("default")
    load_verifier("default")
    assert len(loads) == 3


def test_a_conversion_without_its_marker_is_not_used(fake_gguf):
    gguf, loads = fake_gguf
    load_verifier("default")
    (converted_dir(gguf) / MARKER).unlink()  # as a writer killed before its last file leaves it
    assert find_converted(gguf) is None


@pytest.mark.slow
def test_the_real_default_verifier_reads_back_identical(tmp_path, monkeypatch):
    """The GGUF load against its conversion: the same logits, tokens, chat prompt and spec."""
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path / "cache"))
    gguf = models.default_verifier_file()
    first = load_verifier("default")
    assert find_converted(gguf) is not None
    second = load_verifier("default")
    _same(first, second)
    text = "def f(x):\n    return x ** 2  # ünïcödé 日本語 <|im_end|>"
    assert first.tokenizer(text)["input_ids"] == second.tokenizer(text)["input_ids"]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    assert first.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == \
        second.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert first.tokenizer.all_special_ids == second.tokenizer.all_special_ids
    ids = torch.tensor([first.tokenizer(text)["input_ids"]])
    with torch.no_grad():
        assert torch.equal(first.model(ids).logits, second.model(ids).logits)
    assert VerifierSpec.of(first.model) == VerifierSpec.of(second.model)


@pytest.mark.parametrize("tied", [True, False])
def test_model_directory_keeps_the_embedding_of_a_tied_model(tmp_path, tied):
    """A written model directory names a tied model's shared weight ``model.embed_tokens.weight``
    (vLLM skips ``lm_head.weight`` of a tied model: under that name alone its embedding stayed
    unset and it generated token 0 forever), records ``architectures`` (a GGUF load has none;
    vLLM picks its model class by it), and loads back to the same logits."""
    import json

    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from infer.core.converted import write_model_files

    tok = byte_tokenizer()
    model = tiny_random_model("llama", vocab_size=len(tok), seed=5, tie_word_embeddings=tied)
    model.config.architectures = None
    write_model_files(model, tok, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys
    assert ("lm_head.weight" in keys) is (not tied)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    back = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    x = torch.tensor([[3, 70, 101, 9, 44]])
    with torch.no_grad():
        assert torch.equal(back(x).logits, model(x).logits)
