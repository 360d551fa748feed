"""A separate draft model (``--draft model:PATH``): greedy output equals the verifier's own greedy
output with an oracle draft model (the verifier itself: long acceptances) and a different random
one, as chains and as trees, one prompt or a batch, alone or in a union with prompt lookup; a
vocabulary mismatch is refused in one line before the draft's weights load; HF assisted
generation with the same kind of draft model equals plain greedy decoding."""

import pytest
import torch

from conftest import hf_greedy
from infer import UserError, generate, load_drafter
from infer.core.models import byte_tokenizer, tiny_random_model
from infer.core.tree import DynamicTreeSpec, chain_spec
from infer.drafting.draft_model import DraftModelDrafter
from infer.drafting.lookup import PromptLookupDrafter
from infer.drafting.union import UnionDrafter

PROMPTS = [torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5, 3]), torch.tensor([7, 7, 2]), torch.tensor([100, 20, 30, 40, 20, 30])]
N = 32


@pytest.fixture(scope="module")
def verifier():
    return tiny_random_model("llama", vocab_size=256, seed=1)


@pytest.fixture(scope="module")
def other():
    return tiny_random_model("llama", vocab_size=256, seed=7, num_layers=1)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, verifier):
    """The verifier saved as a plain HF directory (with a byte tokenizer of 258 tokens: its own vocab)."""
    path = tmp_path_factory.mktemp("draft") / "oracle"
    verifier.save_pretrained(path)
    return path


@pytest.mark.parametrize("tree", [None, chain_spec(3), DynamicTreeSpec(4, 2, 12)], ids=["chain", "chain3", "tree"])
def test_oracle_draft_model_is_exact_and_accepted(verifier, tree):
    res = generate(verifier, DraftModelDrafter(verifier, tree), PROMPTS[0], max_new_tokens=N)
    assert res.token_ids == hf_greedy(verifier, PROMPTS[0], N)
    assert res.stats.mean_accepted > 2.5  # the draft is the verifier: nearly every drafted token is accepted


@pytest.mark.parametrize("tree", [None, DynamicTreeSpec(3, 3, 10)], ids=["chain", "tree"])
def test_a_different_draft_model_is_exact(verifier, other, tree):
    for ids in PROMPTS:
        assert generate(verifier, DraftModelDrafter(other, tree), ids, max_new_tokens=N).token_ids == hf_greedy(verifier, ids, N)


@pytest.mark.parametrize("tree", [None, DynamicTreeSpec(3, 2, 8)], ids=["chain", "tree"])
def test_a_batch_gives_each_row_its_own_draft_state(verifier, other, tree):
    for draft in (verifier, other):
        results = generate(verifier, DraftModelDrafter(draft, tree), PROMPTS, max_new_tokens=N)
        assert [r.token_ids for r in results] == [hf_greedy(verifier, ids, N) for ids in PROMPTS]


def test_union_with_prompt_lookup_is_exact(verifier, other):
    repeat = torch.tensor([10, 11, 12, 13, 10, 11, 12, 13, 10, 11])
    for draft in (verifier, other):
        union = UnionDrafter([DraftModelDrafter(draft), PromptLookupDrafter()])
        assert union.drafters[0].deterministic  # a union verifies deterministic drafts
        for ids in (PROMPTS[0], repeat):
            assert generate(verifier, union, ids, max_new_tokens=N).token_ids == hf_greedy(verifier, ids, N)


def test_load_drafter_parses_model_specs(verifier, saved):
    d = load_drafter(f"model:{saved}", verifier)
    assert isinstance(d, DraftModelDrafter)
    res = generate(verifier, d, PROMPTS[0], max_new_tokens=N)
    assert res.token_ids == hf_greedy(verifier, PROMPTS[0], N) and res.stats.mean_accepted > 2.5
    u = load_drafter(f"model:{saved}+pld", verifier)
    assert isinstance(u, UnionDrafter) and isinstance(u.drafters[0], DraftModelDrafter)
    assert generate(verifier, u, PROMPTS[1], max_new_tokens=N).token_ids == hf_greedy(verifier, PROMPTS[1], N)
    t = load_drafter(f"model:{saved}", verifier, tree=DynamicTreeSpec(3, 2, 8))
    assert t.tree == DynamicTreeSpec(3, 2, 8)


def test_vocab_mismatch_is_one_line_before_the_weights(tmp_path, verifier):
    small = tiny_random_model("llama", vocab_size=200, seed=2)
    small.save_pretrained(tmp_path / "small")
    (tmp_path / "small" / "model.safetensors").write_bytes(b"not weights")  # never read: the check comes first
    with pytest.raises(UserError, match="vocab size 200 but the verifier has 256") as e:
        load_drafter(f"model:{tmp_path / 'small'}", verifier)
    assert "\n" not in str(e.value)


def test_token_mismatch_names_the_first_differing_token(tmp_path):
    tok = byte_tokenizer()
    v = tiny_random_model("llama", vocab_size=len(tok), seed=1)
    d = tiny_random_model("llama", vocab_size=len(tok), seed=2)
    d.save_pretrained(tmp_path / "d")
    other_tok = byte_tokenizer()
    other_tok.save_pretrained(tmp_path / "d")
    load_drafter(f"model:{tmp_path / 'd'}", v, tokenizer=tok)  # same tokens: accepted
    data = (tmp_path / "d" / "tokenizer.json").read_text()
    (tmp_path / "d" / "tokenizer.json").write_text(data.replace('"<|im_start|>"', '"<|start|>"'))
    with pytest.raises(UserError, match=r"token '<\|start\|>' at id 256 where the verifier has '<\|im_start\|>'"):
        load_drafter(f"model:{tmp_path / 'd'}", v, tokenizer=tok)


@pytest.mark.parametrize("spec, message", [("model:", "needs a directory"), ("model:/nonexistent/dir", "not a local directory")])
def test_bad_model_specs_are_refused_before_loading(spec, message):
    from infer.drafting.loading import draft_parts

    with pytest.raises(UserError, match=message):
        draft_parts(spec, None)


def test_static_trees_are_refused(verifier):
    from infer.core.tree import load_tree_spec

    with pytest.raises(UserError, match="chain"):
        generate(verifier, DraftModelDrafter(verifier, load_tree_spec("medusa-16")), PROMPTS[0], max_new_tokens=4)


def test_hf_assisted_generation_with_a_draft_model_equals_greedy(verifier, other):
    ids = PROMPTS[0].view(1, -1)
    plain = verifier.generate(ids, max_new_tokens=N, do_sample=False, pad_token_id=0)
    for draft in (verifier, other):
        assisted = verifier.generate(ids, assistant_model=draft, max_new_tokens=N, do_sample=False, pad_token_id=0)
        assert assisted.tolist() == plain.tolist()


def test_the_cache_follows_the_committed_tokens(verifier, other):
    """After every step the draft's cache holds exactly the committed tokens it has been fed,
    and those are a prefix of the generation (prompt + output)."""
    d = DraftModelDrafter(other, chain_spec(4))
    res = generate(verifier, d, PROMPTS[0], max_new_tokens=N)
    seq = PROMPTS[0].tolist() + res.token_ids
    assert d.cache.get_seq_length() <= d.length + 1
    assert d.length + len(d._pending) <= len(seq)


def test_export_draft_model_checks_and_copies(tmp_path, saved):
    from transformers import AutoModelForCausalLM

    from infer.tools.cli import export_draft_model

    out = export_draft_model(f"model:{saved}", str(tmp_path / "exported"))
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    AutoModelForCausalLM.from_pretrained(out)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no config.json"):
        export_draft_model(str(tmp_path / "empty"), str(tmp_path / "x"))
