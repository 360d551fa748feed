"""The central property: speculative greedy decoding equals plain greedy decoding."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import VOCAB, hf_greedy
from infer import PromptLookupDrafter, generate, stream
from infer.core.errors import UserError
from infer.core.models import load_verifier, tiny_random_model
from infer.testing import OracleDrafter

N_NEW = 40


def _prompt(seed=0, n=12):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def test_oracle_drafter_accepts_everything(tiny_model):
    ids = _prompt()
    ref = hf_greedy(tiny_model, ids, N_NEW)
    res = generate(tiny_model, OracleDrafter(ref, ids.numel(), p_right=1.0), ids, max_new_tokens=N_NEW)
    assert res.token_ids == ref
    # chain of 4 drafts: every step emits 5 tokens, the last step is capped by max_new_tokens
    assert res.stats.accepted_hist[5] == res.stats.verify_steps - 1
    assert res.stats.mean_accepted >= 4.5


def test_wrong_drafter_accepts_nothing(tiny_model):
    ids = _prompt(1)
    ref = hf_greedy(tiny_model, ids, N_NEW)
    wrong = OracleDrafter(ref, ids.numel(), parents=[-1, 0, 0, 1, 2, 3], p_right=0.0)
    res = generate(tiny_model, wrong, ids, max_new_tokens=N_NEW)
    assert res.token_ids == ref
    assert res.stats.accepted_hist == [0, N_NEW - 1]
    assert res.stats.verify_steps == N_NEW - 1  # tau = 1 (+ the token of the prefill)


@st.composite
def random_drafts(draw):
    n = draw(st.integers(1, 10))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    return parents, draw(st.sampled_from([0.2, 0.5, 0.8])), draw(st.integers(0, 10_000))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(random_drafts())
def test_random_drafter_random_trees(tiny_model, case):
    parents, p_right, seed = case
    ids = _prompt(seed % 7)
    ref = hf_greedy(tiny_model, ids, 24)
    res = generate(tiny_model, OracleDrafter(ref, ids.numel(), parents, p_right=p_right, seed=seed), ids, max_new_tokens=24)
    assert res.token_ids == ref
    assert res.stats.new_tokens == 24


@pytest.mark.parametrize("init", [0.3, 0.02])
def test_prompt_lookup_drafter_is_lossless_and_accepts(init):
    model = tiny_random_model("llama", vocab_size=VOCAB, seed=1, initializer_range=init)
    ids = _prompt(2, 30)
    ids = torch.cat([ids, ids[:20]])  # a prompt that repeats itself
    ref = hf_greedy(model, ids, N_NEW)
    res = generate(model, PromptLookupDrafter(), ids, max_new_tokens=N_NEW)
    assert res.token_ids == ref
    if init == 0.02:  # a small-init random model loops; the n-gram drafter picks that up
        assert res.stats.mean_accepted > 3


def test_eos_inside_accepted_path_stops_where_plain_decoding_does(llama):
    ids = _prompt(4)
    full = hf_greedy(llama, ids, N_NEW)
    eos = next(t for t in full[3:] if t not in full[:3])  # a token first produced after index 3
    ref = hf_greedy(llama, ids, N_NEW, eos=eos)
    assert ref[-1] == eos and len(ref) < N_NEW
    res = generate(llama, OracleDrafter(full, ids.numel(), p_right=1.0), ids, max_new_tokens=N_NEW, eos_token_id=eos)
    assert res.token_ids == ref
    assert res.stats.finish_reason == "eos"


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_max_new_tokens_is_exact(llama, n):
    ids = _prompt(5)
    ref = hf_greedy(llama, ids, n)
    res = generate(llama, OracleDrafter(ref + [0] * 10, ids.numel(), p_right=1.0), ids, max_new_tokens=n)
    assert res.token_ids == ref and res.stats.finish_reason == "length"
    assert res.stats.verify_steps == (0 if n == 1 else -(-(n - 1) // 5))


def test_stop_strings_end_at_the_completing_token():
    lv = load_verifier("tiny-random:llama")
    tok = lv.tokenizer
    ids = torch.tensor(tok("hello world")["input_ids"])
    full = generate(lv.model, None, ids, max_new_tokens=30).token_ids
    text = tok.decode(full)
    stop = text[10:12]
    first = next(i for i in range(len(full)) if stop in tok.decode(full[: i + 1]))
    res = generate(lv.model, PromptLookupDrafter(), ids, max_new_tokens=30, stop=[stop], tokenizer=tok)
    assert res.token_ids == full[: first + 1]
    assert res.stats.finish_reason == "stop"
    with pytest.raises(UserError, match="tokenizer"):
        generate(lv.model, None, ids, max_new_tokens=3, stop=["x"])


def test_stream_yields_the_same_tokens_in_chunks(llama):
    ids = _prompt(6)
    ref = hf_greedy(llama, ids, 20)
    chunks = list(stream(llama, OracleDrafter(ref, ids.numel(), p_right=1.0), ids, max_new_tokens=20))
    assert [t for c in chunks for t in c.token_ids] == ref
    assert len(chunks) == 1 + chunks[-1].stats.verify_steps and max(len(c.token_ids) for c in chunks) == 5


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": -3}, "max_new_tokens"),
        ({"max_new_tokens": 4, "temperature": -1.0}, "temperature"),
        ({"max_new_tokens": 4, "temperature": float("nan")}, "temperature"),
        ({"max_new_tokens": 4, "temperature": 1e6}, "temperature"),
        ({"max_new_tokens": 4, "top_p": 0.0}, "top_p"),
        ({"max_new_tokens": 4, "top_p": 1.5}, "top_p"),
        ({"max_new_tokens": 4, "top_k": -1}, "top_k"),
        ({"max_new_tokens": 4, "acceptance": "fast"}, "acceptance"),
    ],
)
def test_bad_parameters_are_user_errors(llama, kwargs, match):
    with pytest.raises(UserError, match=match):
        generate(llama, None, _prompt(), **kwargs)


def test_bad_prompts_are_user_errors(llama):
    with pytest.raises(UserError, match="empty"):
        generate(llama, None, torch.tensor([], dtype=torch.long), max_new_tokens=3)
    with pytest.raises(UserError, match=r"\[0, 256\)"):
        generate(llama, None, torch.tensor([1, 999]), max_new_tokens=3)


def test_merged_drafts_share_common_paths():
    from infer.core.drafter import Draft
    from infer.core.tree import build_tree
    from infer.drafting.union import merge_drafts

    a = Draft(torch.tensor([7, 1, 2, 3]), build_tree([-1, 0, 1, 0]))  # 7 -> 1 -> 2, 7 -> 3
    b = Draft(torch.tensor([7, 1, 2, 5, 9]), build_tree([-1, 0, 1, 2, 0]))  # 7 -> 1 -> 2 -> 5, 7 -> 9
    m = merge_drafts([a, b])
    assert m.tokens.tolist() == [7, 1, 2, 3, 5, 9]
    assert m.tree.parents.tolist() == [-1, 0, 1, 0, 2, 0]
    with pytest.raises(ValueError, match="root"):
        merge_drafts([a, Draft(torch.tensor([8]), build_tree([-1]))])


@pytest.mark.parametrize("order", ["wrong-first", "oracle-first"])
def test_union_of_drafters_is_lossless_and_keeps_the_best(llama, order):
    from infer.drafting.union import UnionDrafter

    ids = _prompt(3)
    ref = hf_greedy(llama, ids, N_NEW)
    oracle = OracleDrafter(ref, ids.numel(), p_right=1.0)
    wrong = OracleDrafter(ref, ids.numel(), parents=[-1, 0, 0, 1], p_right=0.0)
    parts = [wrong, oracle] if order == "wrong-first" else [oracle, wrong]
    res = generate(llama, UnionDrafter(parts), ids, max_new_tokens=N_NEW)
    assert res.token_ids == ref
    assert res.stats.mean_accepted >= 4.5  # the oracle's chain of 4 is always in the union
    # root + the oracle's 4 + the wrong drafter's 2 distinct nodes (its two depth-1 siblings are the same token)
    assert res.stats.nodes_hist[7] == res.stats.verify_steps - 1


def test_union_merges_deterministic_drafts_when_sampling(llama):
    from infer.drafting.union import UnionDrafter

    ids = _prompt(4)
    ref = hf_greedy(llama, ids, N_NEW)
    wrong = OracleDrafter(ref, ids.numel(), parents=[-1, 0, 1, 2, 3, 4], p_right=0.0)
    union = UnionDrafter([PromptLookupDrafter(), wrong])
    res = generate(llama, union, ids, max_new_tokens=12, temperature=1.0, seed=0)
    assert len(res.token_ids) == 12
    assert max(n for n, k in enumerate(res.stats.nodes_hist) if k) >= 6  # the second drafter's chain is verified too


SHORT_PROMPT = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])


def test_tau_counts_only_the_verify_passes_tokens(llama):
    from infer import generate
    from infer.core.drafter import NoDrafter

    res = generate(llama, NoDrafter(), SHORT_PROMPT, max_new_tokens=20)
    assert res.stats.new_tokens == 20 and res.stats.verify_steps == 19
    assert res.stats.mean_accepted == 1.0  # was 20 / 19


def test_speculator_from_pretrained_takes_linear_and_draft_dtype():
    from infer import Speculator
    from infer.core.errors import UserError

    spec = Speculator.from_pretrained("tiny-random:llama", draft="pld", linear="onednn", draft_dtype="bf16")
    assert spec.engine.verifier.kernel == "onednn"
    assert Speculator.from_pretrained("tiny-random:llama", draft="none", linear="stock").engine.verifier.kernel == "stock"
    with pytest.raises(UserError, match="CPU kernel"):
        Speculator.from_pretrained("tiny-random:llama", draft="none", device="cuda", linear="onednn")
    with pytest.raises(UserError):
        Speculator.from_pretrained("tiny-random:llama", draft="none", linear="fast")
