"""Batched speculative generation: every row of a batch is its own generation.

Greedy: each row is token-identical to HF greedy and to the same prompt run alone, with oracle,
wrong, half-right and prompt-lookup drafters, on every tiny family, with prompts of very different
lengths in one batch (left padding, rows that accept different numbers of tokens and leave at
different steps). Sampling: each row follows the verifier's distribution exactly (chi-square).
Rows join a running batch (continuous batching) without changing anyone's output.
"""

from __future__ import annotations

import pytest
import torch

from conftest import VOCAB, forked_map, hf_greedy, prefill_one
from infer import generate, stream
from infer.core.batch import stack_drafts
from infer.core.drafter import Budget, NoDrafter, RowDrafter, host_draft
from infer.core.engine import Engine
from infer.core.params import SamplingParams
from infer.core.schedule import BatchCost, VerifyCost
from infer.core.verifier import Verifier
from infer.drafting.lookup import PromptLookupDrafter
from infer.testing import OracleDrafter

LENGTHS = (3, 17, 40, 9)


def prompts(lengths=LENGTHS, seed=0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


class PerPromptOracle(RowDrafter):
    """An :class:`OracleDrafter` per prompt: at :meth:`begin_row` it picks the continuation of the
    prompt it was given (so one drafter, copied per row, knows every row's continuation)."""

    def __init__(self, refs: dict[tuple[int, ...], list[int]], parents, p_right=1.0, seed=0):
        self.refs, self.parents, self.p_right, self.seed = refs, parents, p_right, seed
        self.inner = None

    def begin_row(self, prompt_ids, features=None, params=None):
        key = tuple(prompt_ids.tolist())
        self.inner = OracleDrafter(self.refs[key], len(key), self.parents, p_right=self.p_right, seed=self.seed)
        self.inner.begin_row(prompt_ids, features, params)

    def update_row(self, tokens, features=None):
        self.inner.update_row(tokens, features)

    def propose_row(self, root, budget, generator=None):
        return self.inner.propose_row(root, budget, generator)


TREE = [-1, 0, 1, 2, 0, 4, 1, 6, 0, 3]


@pytest.mark.parametrize("kind", ["oracle", "wrong", "half", "pld", "none"])
def test_batched_greedy_rows_equal_hf_greedy_and_single_rows(tiny_model, kind):
    ps = prompts()
    n_new = 24
    refs = [hf_greedy(tiny_model, p, n_new) for p in ps]
    by_prompt = {tuple(p.tolist()): r for p, r in zip(ps, refs)}
    make = {
        "oracle": lambda: PerPromptOracle(by_prompt, TREE),
        "wrong": lambda: PerPromptOracle(by_prompt, TREE, p_right=0.0),
        "half": lambda: PerPromptOracle(by_prompt, TREE, p_right=0.5, seed=3),
        "pld": lambda: PromptLookupDrafter(max_ngram=2, adaptive=False),
        "none": lambda: None,
    }[kind]
    out = generate(tiny_model, make(), ps, max_new_tokens=n_new)
    assert [r.token_ids for r in out] == refs
    alone = [generate(tiny_model, make(), p, max_new_tokens=n_new).token_ids for p in ps]
    assert alone == refs
    if kind == "oracle":  # the oracle's whole paths were accepted in the batch too
        assert all(r.stats.mean_accepted > 2.5 for r in out), [r.stats.mean_accepted for r in out]


@pytest.mark.parametrize("kind", ["oracle", "wrong", "half", "pld", "none"])
def test_a_seeded_sample_is_the_same_text_with_any_drafter_alone_and_batched(llama, kind):
    """A seed fixes the text: the sampled token at each position is a function of the seed, the
    position and the verifier's distribution there, whatever drafted (or not), the tree, the batch
    and the rows beside it (here a greedy row and rows of other seeds and settings)."""
    ps = prompts((5, 30, 12, 9))
    n_new = 24
    params = [SamplingParams(max_new_tokens=n_new, temperature=1.0, seed=1234),
              SamplingParams(max_new_tokens=n_new, temperature=0.7, top_p=0.9, seed=2**64 - 5),
              SamplingParams(max_new_tokens=n_new, temperature=1.3, top_k=40, seed=7),
              SamplingParams(max_new_tokens=n_new)]  # greedy, in the same batch
    refs = [generate(llama, None, p, params=q).token_ids for p, q in zip(ps, params)]
    assert refs[3] == hf_greedy(llama, ps[3], n_new)
    assert generate(llama, None, ps[0], params=params[0]).token_ids == refs[0]
    other_seed = generate(llama, None, ps[0], params=SamplingParams(max_new_tokens=n_new, temperature=1.0, seed=1235))
    assert other_seed.token_ids != refs[0]  # the seed is what fixes the text, not the prompt alone
    by_prompt = {tuple(p.tolist()): r for p, r in zip(ps, refs)}
    make = {
        "oracle": lambda: PerPromptOracle(by_prompt, TREE),
        "wrong": lambda: PerPromptOracle(by_prompt, TREE, p_right=0.0),
        "half": lambda: PerPromptOracle(by_prompt, [-1, 0, 1, 2, 3, 4], p_right=0.5, seed=3),
        "pld": lambda: PromptLookupDrafter(max_ngram=2, adaptive=False),
        "none": lambda: None,
    }[kind]
    alone = [generate(llama, make(), p, params=q) for p, q in zip(ps, params)]
    assert [r.token_ids for r in alone] == refs
    engine = Engine(llama, make(), max_rows=4)
    for p, q in zip(ps, params):
        engine.add(p, q)
    got = [[] for _ in ps]
    stats = [None] * len(ps)
    for chunk in engine.run():
        got[chunk.index].extend(chunk.token_ids)
        stats[chunk.index] = chunk.stats
    assert got == refs
    if kind == "oracle":  # the sampled paths were drafted and accepted whole, alone and in the batch
        assert all(r.stats.mean_accepted > 2.5 for r in alone), [r.stats.mean_accepted for r in alone]
        assert all(s.mean_accepted > 2.5 for s in stats), [s.mean_accepted for s in stats]


def test_rows_end_at_their_own_stop_conditions(llama):
    ps = prompts((5, 30, 12))
    refs = [hf_greedy(llama, p, 30) for p in ps]
    eos = refs[1][7]  # row 1 stops at its 8th token; the others go on unless they meet it too
    limits = [SamplingParams(max_new_tokens=n) for n in (30, 30, 11)]
    out = generate(llama, PromptLookupDrafter(adaptive=False), ps, params=limits, eos_token_id=eos)
    for r, ref, lim in zip(out, refs, (30, 30, 11)):
        want = ref[:lim]
        if eos in want:
            want = want[: want.index(eos) + 1]
        assert r.token_ids == want
        assert r.stats.finish_reason == ("eos" if want[-1] == eos else "length")


def test_a_batch_of_one_tensor_and_of_mixed_lists(llama):
    ps = prompts((6, 6, 6))
    stacked = torch.stack(ps)
    a = generate(llama, None, stacked, max_new_tokens=8)
    b = generate(llama, None, [p.tolist() for p in ps], max_new_tokens=8)
    assert [r.token_ids for r in a] == [r.token_ids for r in b] == [hf_greedy(llama, p, 8) for p in ps]


def test_rows_join_a_running_batch_without_changing_anyones_output(llama):
    ps = prompts((4, 25, 11, 33, 7))
    refs = [hf_greedy(llama, p, 20) for p in ps]
    by_prompt = {tuple(p.tolist()): r for p, r in zip(ps, refs)}
    engine = Engine(Verifier(llama), PerPromptOracle(by_prompt, TREE, p_right=0.7, seed=1), max_rows=3)
    got: dict[int, list[int]] = {}
    index = {}
    index[engine.add(ps[0], SamplingParams(max_new_tokens=20))] = 0
    index[engine.add(ps[1], SamplingParams(max_new_tokens=20))] = 1
    steps, sizes = 0, []
    while engine.busy:
        if steps == 3:  # two more arrive mid-way: one joins now, one waits for a free row (max_rows=3)
            index[engine.add(ps[2], SamplingParams(max_new_tokens=20))] = 2
            index[engine.add(ps[3], SamplingParams(max_new_tokens=20))] = 3
        if steps == 6:
            index[engine.add(ps[4], SamplingParams(max_new_tokens=20))] = 4
        for chunk in engine.step().chunks:
            got.setdefault(index[chunk.index], []).extend(chunk.token_ids)
        sizes.append(len(engine.rows))
        steps += 1
    assert [got[i] for i in range(5)] == refs
    assert max(sizes) == 3


def test_prompts_of_unlike_lengths_are_prefilled_in_passes_of_their_own():
    from infer.core.batch import prefill_groups

    assert prefill_groups([50, 52, 49, 51], pass_tokens=64) == [[2, 0, 3, 1]]  # alike: one pass
    # 14 short prompts and two long ones (Spec-Bench at 16 clients): the long ones in a pass of their own
    lengths = [44, 47, 53, 54, 56, 58, 64, 65, 66, 68, 73, 78, 81, 85, 210, 233]
    groups = [sorted(lengths[i] for i in g) for g in prefill_groups(lengths, pass_tokens=64)]
    assert groups[-1] == [210, 233] and sorted(x for g in groups for x in g) == lengths
    slots = sum(64 + len(g) * max(g) for g in groups)
    assert slots < 0.5 * (64 + 16 * 233), groups  # less than half the one padded pass
    assert prefill_groups([5, 900], pass_tokens=64) == [[0], [1]]
    assert prefill_groups([5, 40], pass_tokens=64) == [[0, 1]]  # a pass costs more than 35 padded slots
    assert prefill_groups([], pass_tokens=64) == []
    assert sorted(i for g in prefill_groups([7, 3, 9, 1, 30], pass_tokens=0) for i in g) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("kind", ["oracle", "none"])
def test_rows_prefilled_in_several_passes_equal_hf_greedy(llama, kind):
    """Every prompt in a pass of its own (a pass costs nothing): rows join in the passes' order
    (shortest first), and each row is still HF greedy, also when more join a running batch."""
    ps = prompts((3, 17, 40, 9, 25, 6))
    refs = [hf_greedy(llama, p, 16) for p in ps]
    by_prompt = {tuple(p.tolist()): r for p, r in zip(ps, refs)}
    drafter = PerPromptOracle(by_prompt, TREE, p_right=0.7, seed=2) if kind == "oracle" else None
    engine = Engine(Verifier(llama), drafter)
    engine.PREFILL_PASS_TOKENS = 0
    index = {engine.add(p, SamplingParams(max_new_tokens=16)): i for i, p in enumerate(ps[:4])}
    got: dict[int, list[int]] = {}
    steps = 0
    while engine.busy:
        if steps == 2:
            index.update({engine.add(p, SamplingParams(max_new_tokens=16)): 4 + i for i, p in enumerate(ps[4:])})
        if steps == 0:
            first = engine.step().chunks
            assert [len(ps[index[c.index]]) for c in first] == [3, 9, 17, 40]  # four passes, shortest first
            chunks = first
        else:
            chunks = engine.step().chunks
        for chunk in chunks:
            got.setdefault(index[chunk.index], []).extend(chunk.token_ids)
        steps += 1
    assert [got[i] for i in range(len(ps))] == refs


def test_a_cancelled_row_leaves_and_the_others_are_unchanged(llama):
    ps = prompts((8, 20, 14))
    refs = [hf_greedy(llama, p, 16) for p in ps]
    engine = Engine(Verifier(llama), PromptLookupDrafter(adaptive=False))
    ids = [engine.add(p, SamplingParams(max_new_tokens=16)) for p in ps]
    got = {i: [] for i in ids}
    steps = 0
    while engine.busy:
        if steps == 4:
            assert engine.cancel(ids[1])
        for c in engine.step().chunks:
            got[c.index].extend(c.token_ids)
        steps += 1
    assert got[ids[0]] == refs[0] and got[ids[2]] == refs[2]
    assert got[ids[1]] == refs[1][: len(got[ids[1]])] and len(got[ids[1]]) < 16
    assert not engine.cancel(ids[1])


def test_a_queued_generation_joins_at_the_step_after_a_full_batch_has_a_row_cancelled(llama):
    """``joins_next`` counts a cancelled row's place as free (the step drops it first), and reading
    it changes nothing (the queued generation's output is its greedy continuation)."""
    ps = prompts((6, 9, 7))
    engine = Engine(Verifier(llama), None, max_rows=2, join_wait=0)
    ids = [engine.add(p, SamplingParams(max_new_tokens=12)) for p in ps]
    kinds = []
    got = {i: [] for i in ids}
    while engine.busy:
        if len(kinds) == 3:
            assert engine.cancel(ids[0])
        joins = engine.joins_next
        assert engine.joins_next == joins  # reading it changes nothing
        kinds.append(joins)
        for c in engine.step().chunks:
            got[c.index].extend(c.token_ids)
    assert kinds[:5] == [True, False, False, True, False]  # the third joins in the first step after the cancel
    assert got[ids[2]] == hf_greedy(llama, ps[2], 12) and got[ids[1]] == hf_greedy(llama, ps[1], 12)


def test_stream_of_a_batch_names_each_chunk_by_prompt(llama):
    ps = prompts((5, 9))
    seen = {0: [], 1: []}
    for chunk in stream(llama, None, ps, max_new_tokens=6):
        seen[chunk.index].extend(chunk.token_ids)
    assert seen == {0: hf_greedy(llama, ps[0], 6), 1: hf_greedy(llama, ps[1], 6)}


def test_params_and_keyword_arguments_together_are_refused(llama):
    from infer import UserError

    with pytest.raises(UserError, match="not both"):
        stream(llama, None, prompts((4,))[0], params=SamplingParams(), max_new_tokens=3)
    with pytest.raises(UserError, match="one per prompt"):
        stream(llama, None, prompts((4, 5)), params=[SamplingParams()])


def test_batch_cost_shrinks_trees_as_the_batch_grows():
    base = VerifyCost((1, 4, 16, 64, 256), (1.0, 1.1, 1.6, 4.0, 15.0))
    assert BatchCost(base, 1)(8) == pytest.approx(base(8))
    # four nodes per row: 1.1x a plain step for one row, 2.5x for a batch of 16 (16 -> 64 rows)
    assert base(4) == pytest.approx(1.1) and BatchCost(base, 16)(4) == pytest.approx(4.0 / 1.6)
    pld = PromptLookupDrafter(max_ngram=2)
    pld.begin_row(torch.tensor([1, 2, 3, 4] * 6))
    pld.update_row(torch.tensor([1]))
    for acc, want in ((0.9, True), (0.9, False)):
        pld._stats = {2: (acc * 100, (1 - acc) * 100)}
        tokens, _ = pld.propose_host(2, Budget(8, cost=base if want else BatchCost(base, 64)))
        assert (len(tokens) > 1) == want, (acc, len(tokens))
    # a row drafting alone pays for every row padded to its tree: 1 + 4 x (1.1 - 1) at 4 rows of one node each
    assert BatchCost(base, 4, alone=True)(1) == 1.0
    assert BatchCost(base, 4, alone=True)(4) == pytest.approx(1 + 4 * (base(16) / base(4) - 1))
    pld._stats = {2: (90, 10)}
    sizes = {}
    for alone in (False, True):
        sizes[alone] = len(pld.propose_host(2, Budget(8, cost=BatchCost(base, 4, alone=alone)))[0])
    assert sizes[False] > sizes[True], sizes


def test_sync_points_per_step_of_a_batch_of_four_stay_bounded(llama):
    """At most 8 syncs per verify step for a batch of 4 (the acceptance's one read back, the
    batch's one draft copy, the accepted tokens handed to each row's drafter), counted at the
    dispatch level as the single-row tests do."""
    from infer.core.diagnostics import HostReadCounter

    ps = prompts((6, 15, 9, 22))
    for drafter in (NoDrafter(), PromptLookupDrafter(adaptive=False)):
        engine = Engine(Verifier(llama), drafter)
        for p in ps:
            engine.add(p, SamplingParams(max_new_tokens=12))
        engine.step()  # the admission (prefill) pass
        counts = []
        while len(engine.rows) == 4:
            with HostReadCounter() as reads:
                engine.step()
            counts.append(reads.total)
        assert counts and max(counts) <= 8, counts


def test_left_padded_prefill_equals_each_prompt_alone(tiny_model):
    ps = prompts((2, 31, 12))
    v = Verifier(tiny_model, feature_layers=(-1,))
    outs = v.add_rows(ps)
    for p, out in zip(ps, outs):
        alone = prefill_one(Verifier(tiny_model, feature_layers=(-1,)), p)
        torch.testing.assert_close(out.logits, alone.logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out.features, alone.features, atol=1e-4, rtol=1e-4)
    assert v.starts == [29, 0, 19] and v.ends == [31, 31, 31]


def test_rows_of_unlike_lengths_write_their_nodes_after_their_own_ends(llama):
    """Each row's nodes of a pass are written right after the row's own last entry: a plain step
    (and any step whose accepted path is the tree's first nodes) moves no cache entry at commit,
    a branch still moves, and every row's committed entries equal a plain forward of its tokens."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import DynamicCache

    class Moves(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func.__name__.startswith(("gather", "scatter"))
            return func(*args, **(kwargs or {}))

    ps = prompts((4, 12))
    seqs = [p.tolist() for p in ps]
    v = Verifier(llama)
    v.add_rows(ps)
    v.drop_rows([1])  # the long row alone, then the short one joins: ends apart, holes on the right
    v.add_rows([ps[0]])
    v.drop_rows([1, 0])
    steps = [  # per row (tokens, parents, accepted node ids)
        [((7,), (-1,), [0]), ((8,), (-1,), [0])],
        [((5, 6, 9), (-1, 0, 1), [0, 1, 2]), ((4, 3, 2), (-1, 0, 0), [0])],  # prefix paths: nothing moves
        [((1,), (-1,), [0]), ((2,), (-1,), [0])],
    ]
    for step in steps:
        trees = stack_drafts([host_draft(t, par) for t, par, _ in step], v.device)
        v.verify_rows(trees)
        ids = [acc for _, _, acc in step]
        paths = torch.tensor([acc + [0] * (3 - len(acc)) for acc in ids])
        with Moves() as m:
            v.commit_rows(paths, ids)
        assert m.n == 0
        seqs = [seq + [step[r][0][i] for i in ids[r]] for r, seq in enumerate(seqs)]
    assert v.ends[0] != v.ends[1]
    trees = stack_drafts([host_draft((3, 4, 5), (-1, 0, 0)), host_draft((6,), (-1,))], v.device)
    v.verify_rows(trees)
    with Moves() as m:
        v.commit_rows(torch.tensor([[0, 2], [0, 0]]), [[0, 2], [0]])  # a branch: its entry moves
    assert m.n > 0
    seqs = [seqs[0] + [3, 5], seqs[1] + [6]]
    for r, seq in enumerate(seqs):
        ref = DynamicCache()
        with torch.no_grad():
            llama(torch.tensor([seq]), past_key_values=ref, use_cache=True)
        a, e = v.starts[r], v.ends[r]
        assert e - a == len(seq)
        for ours, theirs in zip(v.cache.layers, ref.layers):
            torch.testing.assert_close(ours.keys[r : r + 1, :, a:e], theirs.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(ours.values[r : r + 1, :, a:e], theirs.values, atol=1e-5, rtol=1e-5)


def test_rows_leave_and_join_in_place(llama):
    """Rows leaving move the later rows down inside the cache's buffers (no new buffer, no copy
    of the rows before the gap); rows joining are copied once into a buffer the next pass
    appends to; either way every row keeps its entries."""
    ps = prompts((5, 9, 3, 7))
    v = Verifier(llama)
    v.add_rows(ps)
    layer = v.cache.layers[0]
    before = [layer.keys[r, :, v.starts[r] : v.ends[r]].clone() for r in range(4)]
    buf = layer._key_buf.data_ptr()
    v.drop_rows([0, 2, 3])
    assert layer.keys.data_ptr() == buf and layer._key_buf.data_ptr() == buf
    for r, old in zip(range(3), (before[0], before[2], before[3])):
        torch.testing.assert_close(layer.keys[r, :, v.starts[r] : v.ends[r]], old, rtol=0, atol=0)
    v.add_rows([prompts((12,), seed=1)[0]])
    assert layer._key_buf.data_ptr() != buf and layer.keys.data_ptr() == layer._key_buf.data_ptr()
    assert v.ends == [9, 9, 9, 12] and float(layer.keys[0, :, 9:].abs().sum()) == 0.0  # holes: zeros
    for r, old in zip(range(3), (before[0], before[2], before[3])):
        torch.testing.assert_close(layer.keys[r, :, v.starts[r] : v.ends[r]], old, rtol=0, atol=0)
    grown = layer._key_buf.data_ptr()
    trees = stack_drafts([host_draft((1,), (-1,))] * 4, v.device)
    v.verify_rows(trees)
    assert layer._key_buf.data_ptr() == grown  # the pass appended into it


# ---- sampling: exact per row ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dynamic", "without_replacement"])
def test_batched_sampling_follows_the_verifier_per_row(small_vocab_model, mode):
    """The chi-square test of the single-row path, on rows of batches: 6 rows of the test prompt
    and 2 longer filler rows per batch (padding, holes), every row seeded on its own.
    ``dynamic``: deterministic drafts (one batched acceptance); ``without_replacement``: drafts
    with q (each row accepted on its own)."""
    from test_sampling import PROMPT, Q_FAR, FixedQDrafter, chi_square_pvalue, exact_joint, tally

    temperature, top_k, top_p = 1.0, 0, 1.0
    drafter = FixedQDrafter(Q_FAR, mode=mode)
    filler = [torch.tensor([3, 1, 4, 1, 5, 2, 6, 5, 3]), torch.tensor([2, 7])]
    rows = 6

    def draw(seed):
        batch = [PROMPT] * rows + filler
        out = generate(small_vocab_model, drafter, batch, max_new_tokens=3, temperature=temperature, seed=seed * 16)
        return [r.token_ids for r in out[:rows]]

    samples = [s for chunk in forked_map(draw, range(2500 // rows + 1)) for s in chunk]
    counts = tally(samples)
    exact = exact_joint(small_vocab_model, temperature, top_k, top_p)
    assert chi_square_pvalue(counts, exact) > 1e-3


@pytest.fixture(scope="module")
def small_vocab_model():
    from infer.core.models import tiny_random_model

    return tiny_random_model("llama", vocab_size=8, hidden_size=32, seed=3, initializer_range=0.5)


def test_a_batch_stops_drafting_where_drafting_measures_slower():
    """A simulated batch of 16 whose plain step takes 0.2 s (80 tokens/s): when one row's draft adds
    more than it costs, every row drafts (as long as that is faster); when it does not, the batch
    decodes plainly and only probes one row now and then."""
    from infer.core.schedule import ALL, ONE, PLAIN, SpecPolicy

    def step(plan, gain, cost):
        drafted = 16 if plan == ALL else (1 if plan == ONE else 0)
        return drafted, 16 + drafted * gain, 0.2 + drafted * cost

    for gain, cost, pays in ((1.0, 0.03, False), (1.0, 0.002, True), (0.1, 0.01, False)):
        policy = SpecPolicy(first_pause=4, max_pause=32)
        plans = []
        for _ in range(400):
            plan = policy.plan(16)
            plans.append(plan)
            policy.record(16, *step(plan, gain, cost))
        late = plans[100:]
        if pays:
            assert all(p == ALL for p in late), late[:10]
        else:
            assert ALL not in late and PLAIN in late
            assert 0 < late.count(ONE) <= len(late) / 32 + 1, late.count(ONE)
    assert SpecPolicy().plan(1) == ALL  # a single row is left to its drafter's own gate


def test_a_larger_batch_waits_as_long_as_a_smaller_one_where_drafting_lost():
    """Once one row's draft has measured not to pay at 4 rows, a batch of 16 (which only adds rows
    to pad) waits as long as the batch of 4 waits before its first probe; with nothing measured
    at a smaller size, 16 rows probe right after their plain warm-up."""
    from infer.core.schedule import ONE, SpecPolicy

    def first_probe(policy, rows):
        for i in range(1000):
            plan = policy.plan(rows)
            drafted = 1 if plan == ONE else 0
            policy.record(rows, drafted, rows + drafted, 0.05 * rows + 0.1 * drafted)  # a draft never pays
            if plan == ONE:
                return i
        return None

    fresh = SpecPolicy(first_pause=4, max_pause=64)
    assert first_probe(fresh, 16) == fresh.warmup
    taught = SpecPolicy(first_pause=4, max_pause=64)
    for _ in range(200):
        first_probe(taught, 4)  # the batch of 4 probes, loses, and waits longer each time
    waited = taught._buckets[2].probe.pause
    assert waited == 64
    assert first_probe(taught, 16) == taught.warmup + waited
    assert first_probe(taught, 3) is not None  # the smaller batch still probes on its own schedule


def test_probes_cost_a_bounded_share_of_plain_decoding():
    """Where a probe is expensive (it pads every row to its tree: here it doubles the step), the
    probes that do not pay add at most about ``probe_share`` to the plain decoding time, from the
    start (a short burst of requests is all some batches see)."""
    from infer.core.schedule import ONE, SpecPolicy

    policy = SpecPolicy(probe_share=0.02)
    plain_s, extra_s = 0.1, 0.0
    for _ in range(100):
        plan = policy.plan(16)
        drafted = 1 if plan == ONE else 0
        seconds = 0.1 + 0.1 * drafted  # the probe row's 2 extra tokens cost a whole plain step: no gain
        policy.record(16, drafted, 16 + 2 * drafted, seconds)
        plain_s += 0.1
        extra_s += 0.1 * drafted
    assert extra_s / plain_s < 0.03, extra_s / plain_s


def test_what_paid_at_2_rows_is_measured_again_at_4():
    """Drafting that pays at 2 rows (one row's draft adds to 2 tokens a step) is not taken to pay at
    4, where it must add to 4: a batch of 4 warms up plainly and probes before any step where every
    row drafts, and where its probes lose, no such step comes."""
    from infer.core.schedule import ALL, ONE, PLAIN, SpecPolicy

    policy = SpecPolicy()
    for _ in range(50):  # 2 rows: a draft adds 2 tokens for 30% of a step
        plan = policy.plan(2)
        drafted = {ALL: 2, ONE: 1, PLAIN: 0}[plan]
        policy.record(2, drafted, 2 + 2 * drafted, 0.1 * (1 + 0.3 * drafted))
    assert plan == ALL
    plans = []
    for _ in range(50):  # 4 rows: a draft adds 1 token for 60% of a step (0.4x plain's rate)
        plan = policy.plan(4)
        plans.append(plan)
        drafted = {ALL: 4, ONE: 1, PLAIN: 0}[plan]
        policy.record(4, drafted, 4 + drafted, 0.1 * (1 + 0.6 * drafted))
    assert plans[: policy.warmup] == [PLAIN] * policy.warmup and ONE in plans and ALL not in plans, plans


def test_drafting_steps_are_compared_with_plain_steps_of_their_row_count():
    """A bucket holds several row counts: every row drafting at 4 rows must beat plain decoding at
    4 rows, not the mean of plain steps at 3 and 4 rows (which emit 3 and 4 tokens a step)."""
    from infer.core.schedule import SpecPolicy

    policy = SpecPolicy()
    for rows in (3, 4, 3, 4):
        policy.record(rows, 0, rows, 0.1)  # plain: 30 and 40 tokens/s
    for _ in range(4):
        policy.record(4, 4, 4.2, 0.11)  # every row drafting at 4 rows: 38 tokens/s, 0.95x plain there
    gain = policy.state()["<= 4 rows"]["all_rows_gain"]
    assert 0.9 < gain < 1.0, gain


def test_the_batch_policy_is_kept_with_the_engine(small_vocab_model):
    """What one batch measured carries over to the next batch on the same engine (as its cost
    curve does); an untimed engine drafts every row (nothing timed decides anything)."""
    from infer.core.engine import Engine
    from infer.core.schedule import AllDraft, OnlineCost, SpecPolicy
    from infer.drafting.lookup import PromptLookupDrafter

    model = small_vocab_model
    assert isinstance(Engine(model, PromptLookupDrafter()).policy, AllDraft)
    engine = Engine(model, PromptLookupDrafter(), budget=OnlineCost())
    policy = engine.policy
    assert isinstance(policy, SpecPolicy)
    for _ in range(2):
        for p in ([1, 2, 3, 1, 2], [4, 5, 6]):
            engine.add(p, SamplingParams(max_new_tokens=6))
        list(engine.run())
    assert engine.policy is policy and policy.state()  # the batches of 2 measured their plain steps


class ContextRecorder(RowDrafter):
    """Records what the engine hands it (tokens and layer-1 features) and, at every proposal, how
    much of the context it has seen; proposes a one-node chain of a token no model picks. Every
    row's copy is kept in ``by_prompt`` (shared), under its prompt."""

    feature_layers = (1,)

    def __init__(self):
        self.by_prompt = {}

    def spawn(self):
        new = type(self)()
        new.by_prompt = self.by_prompt
        return new

    def begin_row(self, prompt_ids, features=None, params=None):
        self.tokens, self.features, self.updates, self.seen_at_propose = list(prompt_ids.tolist()), [features[:, 0]], 0, []
        self.by_prompt[tuple(prompt_ids.tolist())] = self

    def update_row(self, tokens, features=None):
        self.tokens += tokens.tolist()
        self.features.append(features[:, 0])
        self.updates += 1

    def propose_row(self, root, budget, generator=None):
        self.seen_at_propose.append(len(self.tokens))
        return host_draft((root, 0), (-1, 0))


class Script:
    """A batch policy that decodes plainly for ``plain`` steps, then has every row draft."""

    def __init__(self, plain: int):
        self.plain, self.steps = plain, 0

    def plan(self, rows: int) -> int:
        self.steps += 1
        return 0 if self.steps <= self.plain else -1

    def quiet_steps(self, rows: int) -> int:
        return 0  # every row joins warm

    def record(self, *args) -> None:
        pass


def test_plain_steps_hand_their_context_to_the_drafter_at_once_before_it_drafts(llama):
    """Rows that decode plainly hold what they commit and give it to their drafter in one update
    (every ``HOLD_STEPS`` steps, and before the row drafts): the drafter then has the whole
    committed context, tokens and features exactly as a forward pass over it gives them."""
    ps, n = prompts((5, 12)), 50
    plain = Engine.HOLD_STEPS + 8
    engine = Engine(Verifier(llama), ContextRecorder(), max_rows=2, policy=Script(plain))
    for p in ps:
        engine.add(p, SamplingParams(max_new_tokens=n))
    rows = list(engine.rows) + list(engine.pending)
    got = {0: [], 1: []}
    while engine.busy:
        for chunk in engine.step().chunks:
            got[chunk.index] += chunk.token_ids
    for p, row in zip(ps, rows):
        d = engine.drafter.by_prompt[tuple(p.tolist())]
        assert got[row.index] == hf_greedy(llama, p, n)
        assert d.updates == 2 + len(d.seen_at_propose)  # one at HOLD_STEPS plain steps, one before the first draft, one per draft
        committed = p.numel() + plain  # prompt + one root per plain step, when the row first drafts
        assert d.seen_at_propose[0] == committed
        assert d.tokens[: committed] == p.tolist() + got[row.index][:plain]
        with torch.no_grad():
            ref = llama(torch.tensor(d.tokens)[None], output_hidden_states=True).hidden_states[1][0]
        torch.testing.assert_close(torch.cat(d.features), ref, atol=1e-4, rtol=1e-4)


class CostRecorder(ContextRecorder):
    """Records the prices of the budgets it proposes under."""

    def propose_row(self, root, budget, generator=None):
        self.costs = getattr(self, "costs", []) + [budget.cost]
        return super().propose_row(root, budget, generator)


class OneRow(Script):
    def plan(self, rows: int) -> int:
        return 1  # infer.core.schedule.ONE: one row drafts, in turn


def test_a_row_probing_alone_sizes_its_tree_for_the_rows_padded_to_it(llama):
    curve = VerifyCost((1, 4, 16, 64), (1.0, 1.1, 1.6, 4.0))
    engine = Engine(Verifier(llama), CostRecorder(), max_rows=4, budget=curve, policy=OneRow(0))
    for p in prompts():
        engine.add(p, SamplingParams(max_new_tokens=6))
    engine.step()  # the four join
    engine.step()
    probing = [d for d in engine.drafter.by_prompt.values() if getattr(d, "costs", None)]
    assert len(probing) == 1
    cost = probing[0].costs[0]
    assert isinstance(cost, BatchCost) and cost.alone and cost.rows == 4 and cost.base is curve


@pytest.mark.parametrize("wait, gap, passes", [(4, 3, 1), (0, 3, 2), (4, 6, 2)])
def test_queued_rows_wait_a_few_steps_for_a_row_about_to_end_and_join_in_one_pass(llama, wait, gap, passes):
    """Two running rows end ``gap`` steps apart (their token limits), two more wait: within
    ``join_wait`` steps of the second's end they join together, in one prefill pass; else the
    first joins at once. Outputs are the same either way, and ``joins_next`` tells each step's kind."""
    ps = prompts((5, 9, 7, 4))
    limits = (8, 8 + gap, 6, 6)
    engine = Engine(Verifier(llama), None, max_rows=2, join_wait=wait)
    prefills = []
    add_rows = engine.verifier.add_rows
    engine.verifier.add_rows = lambda rows, **kw: prefills.append(len(rows)) or add_rows(rows, **kw)
    index = {engine.add(p, SamplingParams(max_new_tokens=n)): i for i, (p, n) in enumerate(zip(ps[:2], limits))}
    got = {}
    while engine.busy:
        joins, passes_before = engine.joins_next, len(prefills)
        chunks = engine.step().chunks
        assert joins == (len(prefills) > passes_before)  # joins_next said what kind of step came
        for chunk in chunks:
            got.setdefault(index[chunk.index], []).extend(chunk.token_ids)
            if chunk.stats.finish_reason and len(index) < 4:  # a client whose request ended sends the next
                i = len(index)
                index[engine.add(ps[i], SamplingParams(max_new_tokens=limits[i]))] = i
    assert [got[i] for i in range(4)] == [hf_greedy(llama, p, n) for p, n in zip(ps, limits)]
    assert prefills[0] == 2 and len(prefills) - 1 == passes, prefills


class QuietFor(Script):
    """A batch policy that has one row (``plan`` 1) or every row (-1) draft at every step but says
    ``quiet`` steps of 2+ rows are plain."""

    def __init__(self, quiet: int, plan: int = 1):
        super().__init__(0)
        self.quiet, self.every = quiet, plan

    def plan(self, rows: int) -> int:
        return self.every if rows > 1 else -1  # infer.core.schedule.ONE / ALL

    def quiet_steps(self, rows: int) -> int:
        return self.quiet if rows > 1 else 0


@pytest.mark.parametrize("limit, cold, plan", [(6, True, 1), (12, False, 1), (6, True, -1)])
def test_rows_that_end_before_the_batch_would_let_them_draft_join_cold(llama, limit, cold, plan):
    """Rows that join a batch whose policy keeps the next ``quiet`` steps plain, and end within
    them, are prefilled without the drafter's features and never draft: probes go to the warm row
    already running. Rows that outlive the quiet steps join warm and take their turns. Outputs are
    HF's either way, and a cold row stays plain when every row is to draft."""
    ps = prompts((9, 5, 7))
    limits = (30, limit, limit)
    engine = Engine(Verifier(llama), ContextRecorder(), max_rows=3, policy=QuietFor(10, plan))
    passes = []
    add_rows = engine.verifier.add_rows
    engine.verifier.add_rows = lambda rows, **kw: passes.append((len(rows), kw["features"])) or add_rows(rows, **kw)
    got = {}
    first = engine.add(ps[0], SamplingParams(max_new_tokens=limits[0]))
    for _ in range(3):  # the first row runs alone (warm), then the others join
        for chunk in engine.step().chunks:
            got.setdefault(chunk.index, []).extend(chunk.token_ids)
    index = {first: 0} | {engine.add(p, SamplingParams(max_new_tokens=n)): i for i, (p, n) in enumerate(zip(ps[1:], limits[1:]), 1)}
    joined = list(engine.pending)
    while engine.busy:
        for chunk in engine.step().chunks:
            got.setdefault(chunk.index, []).extend(chunk.token_ids)
    assert [got[k] for k in sorted(index, key=index.get)] == [hf_greedy(llama, p, n) for p, n in zip(ps, limits)]
    assert passes[0] == (1, True) and all(f == (not cold) for _, f in passes[1:]), passes
    assert all(r.warm == (not cold) for r in joined)
    seen = engine.drafter.by_prompt
    for r in joined:
        assert (tuple(r.ids.tolist()) in seen) == (not cold)  # a cold row's drafter is never begun
    if not cold:
        assert all(seen[tuple(r.ids.tolist())].seen_at_propose for r in joined)  # the probes took every warm row in turn


def test_quiet_steps_are_the_plain_steps_before_the_next_probe():
    """``SpecPolicy.quiet_steps`` tells exactly how many coming steps :meth:`plan` makes plain:
    after a smaller batch found that one row's draft does not pay, after its own probes lost, and
    0 where a draft pays or a row is alone."""
    from infer.core.schedule import ALL, ONE, PLAIN, SpecPolicy

    def plans_until_probe(policy, rows):
        out = []
        while not out or out[-1] != ONE:
            out.append(policy.plan(rows))
            drafted = 1 if out[-1] == ONE else 0
            policy.record(rows, drafted, rows + drafted, 0.05 * rows + 0.1 * drafted)  # a draft never pays
        return out

    policy = SpecPolicy(first_pause=4, max_pause=64)
    for rows in (4, 16, 4, 16, 4, 16, 16):
        quiet = policy.quiet_steps(rows)
        plans = plans_until_probe(policy, rows)
        assert plans == [PLAIN] * quiet + [ONE], (rows, quiet, plans)
    assert policy.quiet_steps(16) >= 16  # after losing probes the pause has grown
    assert policy.quiet_steps(1) == 0 and policy.plan(1) == ALL
    pays = SpecPolicy()
    for _ in range(20):
        plan = pays.plan(4)
        drafted = {ALL: 4, ONE: 1}.get(plan, 0)
        pays.record(4, drafted, 4 + 3 * drafted, 0.2 + 0.001 * drafted)  # each draft adds 3 tokens almost free
    assert pays.quiet_steps(4) == 0 and pays.plan(4) == ALL


def test_typical_acceptance_at_temperature_0_is_greedy_from_its_first_token(llama):
    """Its first token comes from the seeded noise path, which must treat temperature 0 as the
    argmax (a division by the temperature gave NaN probabilities)."""
    p = prompts((7,))[0]
    out = generate(llama, None, p, max_new_tokens=8, temperature=0.0, acceptance="typical", seed=3)
    assert out.token_ids == hf_greedy(llama, p, 8)


def test_every_row_drafting_that_loses_pauses_before_it_is_tried_again():
    """One row's draft pays at 4 rows (a token for 10% of a step) but every row drafting loses (its
    padded trees cost more than they add: 0.91x plain): each try of it measures its warm-up
    steps, then the batch does not draft every row again until a pause that doubles has passed,
    so that in 200 steps few are lost to it (the step right after a losing try is not one)."""
    from infer.core.schedule import ALL, ONE, PLAIN, SpecPolicy

    policy = SpecPolicy(first_pause=4, max_pause=64)
    plans = []
    for _ in range(200):
        plan = policy.plan(4)
        plans.append(plan)
        drafted = {ALL: 4, ONE: 1, PLAIN: 0}[plan]
        extra = {ALL: 0.12, ONE: 0.01, PLAIN: 0.0}[plan]
        policy.record(4, drafted, 4 + drafted, 0.1 + extra)
    runs, run = [], 0
    for p in plans + [PLAIN]:
        if p == ALL:
            run += 1
        elif run:
            runs.append(run)
            run = 0
    assert runs and max(runs) == policy.warmup, runs  # a try lasts its warm-up, no step more
    assert len(runs) <= 6 and sum(runs) <= 12, runs  # pauses of 4, 8, 16, 32, 64 between tries
