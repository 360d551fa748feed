"""Speculative sampling follows the verifier's own sampling distribution exactly.

On a vocabulary-8 model the exact joint distribution of the first three tokens is enumerated;
speculative samples drawn with drafters whose q is far from p must match it (chi-square), and a
deliberately wrong acceptance (one-hot q for children that were sampled from q) must fail it.
"""

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from conftest import forked_map
from infer import generate
from infer.core.accept import warp_probs
from infer.core.drafter import Draft, RowDrafter
from infer.core.models import tiny_random_model
from infer.core.tree import DynamicTreeSpec, build_tree, grow_dynamic_tree

V = 8
PROMPT = torch.tensor([1, 5, 2, 7, 3])
N_SAMPLES = 2500


@pytest.fixture(scope="module")
def small_vocab_model():
    return tiny_random_model("llama", vocab_size=V, hidden_size=32, seed=3, initializer_range=0.5)


def exact_joint(model, temperature, top_k, top_p) -> torch.Tensor:
    """P(t1, t2, t3) under plain sampling, ``[V, V, V]``."""
    t1, t2 = torch.meshgrid(torch.arange(V), torch.arange(V), indexing="ij")
    seqs = torch.cat([PROMPT.expand(V * V, -1), t1.reshape(-1, 1), t2.reshape(-1, 1)], dim=1)
    with torch.no_grad():
        logits = model(seqs).logits  # [V*V, L+2, V]
    p = warp_probs(logits[:, -3:], temperature, top_k, top_p)
    p1 = p[0, 0]  # [V]
    p2 = p[:, 1].reshape(V, V, V)[:, 0]  # p(t2 | t1): rows indexed by t1
    p3 = p[:, 2].reshape(V, V, V)  # p(t3 | t1, t2)
    return p1[:, None, None] * p2[:, :, None] * p3


class FixedQDrafter(RowDrafter):
    """Draws a two-branch tree of depth 2 from a fixed q (very unlike p), and reports q honestly.

    ``honest=False`` reports a uniform q instead of the one it drew from: the acceptance ratio
    p/q is then wrong and the output biased, which the test must catch. (Reporting no q at all is
    *not* wrong: a one-hot q is lossless for any candidate, only less often accepted.)"""

    def __init__(self, q, mode="without_replacement", honest=True):
        self.q, self.mode, self.honest = q, mode, honest
        self.tree = build_tree([-1, 0, 0, 1, 2])

    def propose_row(self, root, budget, generator=None):
        if self.mode == "dynamic":
            logq = self.q.log()
            t = grow_dynamic_tree(lambda ids, parents, toks: logq.expand(len(ids), -1), root,
                                  DynamicTreeSpec(depth=2, top_k=2, num_nodes=5))
            return Draft(t.tokens, t.tree)  # the draft's top tokens: deterministic, no q
        a = int(torch.multinomial(self.q, 1, generator=generator))
        if self.mode == "iid":
            b, qb = int(torch.multinomial(self.q, 1, generator=generator)), self.q
        else:
            qb = self.q.clone()
            qb[a] = 0
            qb /= qb.sum()
            b = int(torch.multinomial(qb, 1, generator=generator))
        c = int(torch.multinomial(self.q, 1, generator=generator))
        d = int(torch.multinomial(self.q, 1, generator=generator))
        q = torch.stack([self.q, self.q, qb, self.q, self.q])
        if not self.honest:
            q = torch.full_like(q, 1 / V)
        return Draft(torch.tensor([root, a, b, c, d]), self.tree, q)


def tally(samples, n_tokens: int = 3) -> torch.Tensor:
    """Counts ``[V] * n_tokens`` of sampled token sequences."""
    counts = torch.zeros([V] * n_tokens)
    for ids in samples:
        counts[tuple(ids)] += 1
    return counts


#: rows per batched generation in :func:`spec_counts` (with a fixed budget)
BATCH = 25


def spec_counts(model, drafter, temperature, top_k, top_p, budget="fixed", rows: int | None = None,
                workers: int | None = None) -> torch.Tensor:
    """Counts of ``N_SAMPLES`` speculative samples of three tokens. With a fixed budget the
    samples are drawn ``BATCH`` rows at a time (row ``i`` of a batch seeded with ``seed + i``:
    every row is its own generation, and batches are the engine's path too); a cost curve
    prices a batch's trees by the batch's verify cost, so there each sample is a batch of one
    (else most trees would shrink to their root and the test would sample plainly). ``rows``
    overrides the batch size; ``workers`` is :func:`forked_map`'s."""
    rows = rows or (BATCH if budget == "fixed" else 1)

    def draw(seed):
        res = generate(model, drafter, [PROMPT] * rows, max_new_tokens=3, temperature=temperature,
                       top_k=top_k, top_p=top_p, seed=seed, budget=budget)
        return [r.token_ids for r in res]

    return tally(ids for batch in forked_map(draw, range(0, N_SAMPLES, rows), workers) for ids in batch)


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = (probs * n).flatten().double()
    observed = counts.flatten().double()
    big = expected >= 5
    e = torch.cat([expected[big], expected[~big].sum().view(1)])
    o = torch.cat([observed[big], observed[~big].sum().view(1)])
    assert o[-1] <= 0 or e[-1] > 0, "samples where the exact distribution has no mass"
    keep = e > 0
    stat = ((o[keep] - e[keep]) ** 2 / e[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.double), stat / 2))


Q_FAR = torch.tensor([0.02, 0.02, 0.3, 0.02, 0.3, 0.02, 0.3, 0.02])


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode, temperature, top_k, top_p",
    [
        ("without_replacement", 1.0, 0, 1.0),
        ("iid", 0.8, 5, 0.9),
        ("dynamic", 1.0, 0, 1.0),
    ],
)
def test_speculative_sampling_matches_plain_sampling(small_vocab_model, mode, temperature, top_k, top_p):
    probs = exact_joint(small_vocab_model, temperature, top_k, top_p)
    counts = spec_counts(small_vocab_model, FixedQDrafter(Q_FAR, mode), temperature, top_k, top_p)
    assert chi_square_pvalue(counts, probs) > 1e-3
    assert counts[probs == 0].sum() == 0  # never a token that top-k/top-p excludes


@pytest.mark.slow
def test_plain_sampling_through_the_engine_matches(small_vocab_model):
    probs = exact_joint(small_vocab_model, 1.0, 0, 1.0)
    assert chi_square_pvalue(spec_counts(small_vocab_model, None, 1.0, 0, 1.0), probs) > 1e-3


@pytest.mark.slow
def test_the_chi_square_test_catches_a_wrong_q(small_vocab_model):
    probs = exact_joint(small_vocab_model, 1.0, 0, 1.0)
    counts = spec_counts(small_vocab_model, FixedQDrafter(Q_FAR, "iid", honest=False), 1.0, 0, 1.0)
    assert chi_square_pvalue(counts, probs) < 1e-6


def test_sampling_is_deterministic_under_a_seed(small_vocab_model):
    a = generate(small_vocab_model, FixedQDrafter(Q_FAR), PROMPT, max_new_tokens=12, temperature=1.0, seed=7)
    b = generate(small_vocab_model, FixedQDrafter(Q_FAR), PROMPT, max_new_tokens=12, temperature=1.0, seed=7)
    assert a.token_ids == b.token_ids


def test_warp_matches_hf_logits_processors():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    for t, k, p in [(1.0, 0, 1.0), (0.7, 10, 1.0), (1.3, 0, 0.8), (0.5, 7, 0.6)]:
        procs = LogitsProcessorList([TemperatureLogitsWarper(t)])
        if k:
            procs.append(TopKLogitsWarper(k))
        if p < 1:
            procs.append(TopPLogitsWarper(p))
        ref = procs(None, logits.clone()).softmax(-1)
        torch.testing.assert_close(warp_probs(logits, t, k, p), ref)


# --- the tree budget must not depend on the drafted tokens' values (issue: biased cost budget) --

P_STEP = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
Q_PEAKY = torch.tensor([0.02, 0.03, 0.05, 0.10, 0.20, 0.60])
STEP_COST = None  # built lazily: VerifyCost((1, 2, 3, 4, 8), (1, 1.25, 1.6, 2.2, 4.0))
N_STEP = 20_000


def _first_tokens(draft_fn, n=N_STEP, rows: int = 500) -> torch.Tensor:
    """Counts ``[6]`` of the first emitted token over ``n`` one-step verifications against a
    context-free verifier ``P_STEP`` (``rows`` drafts at a time, padded into one batch of trees)."""
    from infer.core.accept import q_rows, read_back_rows
    from infer.core.batch import stack_drafts

    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(len(P_STEP))
    for start in range(0, n, rows):  # ``rows`` independent draws verified as one batch
        b = min(rows, n - start)
        trees = stack_drafts([Draft(*draft_fn(g)) for _ in range(b)], "cpu")
        p = P_STEP.expand(b, trees.num_nodes, -1)
        q = trees.q if trees.q is not None else torch.zeros_like(p)
        u = torch.rand(b, trees.num_nodes, generator=g, dtype=torch.float64)
        end, bonus = q_rows(trees, p, q, u, torch.rand(b, generator=g, dtype=torch.float64))
        for row in read_back_rows(trees, end, bonus).rows:
            counts[row.tokens[0]] += 1
    return counts


def _step_cost():
    from infer.core.schedule import VerifyCost

    return VerifyCost((1, 2, 3, 4, 8), (1.0, 1.25, 1.6, 2.2, 4.0))


@pytest.mark.slow
def test_the_cost_budget_keeps_sampling_exact():
    """The project's own tree growth with the cost budget, one verify step, 20,000 draws: the
    first token follows p. The tree is the draft's top tokens, chosen whatever their values:
    a deterministic function of the draft, independent of the verifier's randomness."""
    logq = Q_PEAKY.log()
    spec = DynamicTreeSpec(depth=2, top_k=3, num_nodes=6)
    t = grow_dynamic_tree(lambda ids, parents, toks: logq.expand(len(ids), -1), 0, spec, cost=_step_cost())
    assert t.tree.num_nodes > 1  # the budget keeps some nodes: the test exercises acceptance
    counts = _first_tokens(lambda g: (t.tokens, t.tree, None))
    assert chi_square_pvalue(counts, P_STEP) > 1e-3


@pytest.mark.slow
def test_a_budget_chosen_from_drawn_tokens_is_caught():
    """Negative control: children *drawn* from q (Gumbel-top-k, with their real q), then as many
    kept as their drawn probabilities pay for, as the engine did before: the kept set depends on
    the drawn values, and the same test rejects it."""
    from infer.core.tree import best_budget

    cost = _step_cost()

    def biased(g):
        u = torch.rand(len(Q_PEAKY), generator=g).clamp_(1e-20, 1 - 1e-7)
        order = torch.topk(Q_PEAKY.log() - torch.log(-torch.log(u)), 3).indices.tolist()
        n = best_budget([float(Q_PEAKY[x]) for x in order], cost)
        kept = order[: n - 1]
        qs, q = [torch.zeros(len(Q_PEAKY))], Q_PEAKY.clone()
        for x in kept:  # drawn without replacement: each given the earlier siblings
            qs.append(q / q.sum())
            q = q.clone()
            q[x] = 0
        return torch.tensor([0] + kept), build_tree([-1] + [0] * len(kept)), torch.stack(qs)

    counts = _first_tokens(biased)
    assert chi_square_pvalue(counts, P_STEP) < 1e-6


@pytest.mark.slow
@pytest.mark.early
def test_eagle_drafter_sampling_with_the_cost_budget_is_exact(small_vocab_model):
    """The EAGLE drafter's real path (tree growth, calibration, the cost budget, the pause when
    drafting does not pay) on a tiny model, 8,000 three-token samples, against the exact joint."""
    from heads import HeadConfig, VerifierSpec, build_head
    from infer.core.schedule import VerifyCost
    from infer.drafting.head_drafters import EagleDrafter

    m = small_vocab_model
    cfg = HeadConfig("eagle3", VerifierSpec.of(m), draft_vocab_size=V, aux_layers=(0, 1, 2), layer_config=m.config.to_dict())
    torch.manual_seed(5)
    head = build_head(cfg)
    drafter = EagleDrafter(head, m, DynamicTreeSpec(depth=2, top_k=3, num_nodes=6))
    curve = VerifyCost((1, 2, 3, 4, 8), (1.0, 1.1, 1.3, 1.6, 2.5))
    probs = exact_joint(m, 1.0, 0, 1.0)

    def draw(seed):
        res = generate(m, drafter, PROMPT, max_new_tokens=3, temperature=1.0, seed=seed, budget=curve)
        return res.token_ids, [n for n, k in enumerate(res.stats.nodes_hist) if k]

    samples = forked_map(draw, range(8_000))
    sizes = {n for _, ns in samples for n in ns}
    assert len(sizes) > 1  # the budget varied from step to step
    assert chi_square_pvalue(tally(ids for ids, _ in samples), probs) > 1e-3


# --- depth 3: the union of a head and prompt lookup, pruning, the gate, an observed cost curve --

N_DEEP = 4_500


def exact_joint_n(model, n: int, temperature: float = 1.0) -> torch.Tensor:
    """P(t1 .. tn) under plain sampling, ``[V] * n``: every prefix of ``n - 1`` tokens in one batch."""
    prefixes = torch.cartesian_prod(*[torch.arange(V)] * (n - 1)).view(-1, n - 1)  # [V**(n-1), n-1]
    seqs = torch.cat([PROMPT.expand(len(prefixes), -1), prefixes], dim=1)
    with torch.no_grad():
        p = warp_probs(model(seqs).logits[:, PROMPT.numel() - 1:], temperature, 0, 1.0)  # [V**(n-1), n, V]
    joint = p[0, 0]
    for k in range(1, n):  # p(t_{k+1} | t_1..t_k) is the same for every continuation of that prefix
        cond = p[:, k].reshape(*[V] * (n - 1), V)[(slice(None),) * k + (0,) * (n - 1 - k)]  # [V] * (k + 1)
        joint = joint[..., None] * cond
    return joint


@pytest.mark.slow
@pytest.mark.early
def test_union_drafter_sampling_at_depth_3_is_exact(small_vocab_model, monkeypatch):
    """``auto``'s union (an EAGLE-3 head and prompt lookup) with depth-3 dynamic trees, pruning,
    the gate and an :class:`~infer.core.schedule.OnlineCost` that the engine feeds every verify step (its
    clock replaced by a fixed function of the node count, so that the machine's load cannot
    change which trees are drafted), 4,500 five-token samples against the exact joint of five
    tokens: the second step may verify three drafted levels. One long-lived engine per process
    (its schedule learns the drafter's cost, as an application's does). A row's gate starts at an
    average gain of 1.0 instead of 1.2, so that one losing step pauses the head: in five tokens
    the shipped start pauses only on rare samples, and the paused path must be sampled too."""
    from heads import HeadConfig, VerifierSpec, build_head
    from infer.core.engine import Engine
    from infer.core.params import SamplingParams
    from infer.core.schedule import Gate, OnlineCost, Schedule, VerifyCost
    from infer.drafting.head_drafters import EagleDrafter
    from infer.drafting.lookup import PromptLookupDrafter
    from infer.drafting.union import UnionDrafter

    monkeypatch.setattr(Schedule, "gate", lambda self, sampled: Gate(1.0))

    curve = VerifyCost((1, 2, 4, 8, 16), (1.0, 1.05, 1.15, 1.4, 2.0))

    class ClockedCost(OnlineCost):
        def observe(self, nodes, seconds):  # one token "takes" 1 s: drafting time is small beside it
            super().observe(nodes, curve(nodes))

    m = small_vocab_model
    cfg = HeadConfig("eagle3", VerifierSpec.of(m), draft_vocab_size=V, aux_layers=(0, 1, 2), layer_config=m.config.to_dict())
    torch.manual_seed(5)
    head = build_head(cfg)
    cost = ClockedCost(curve)
    eagle = EagleDrafter(head, m, DynamicTreeSpec(depth=3, top_k=3, num_nodes=10))
    engine = Engine(m, UnionDrafter([eagle, PromptLookupDrafter()]), budget=cost)
    probs = exact_joint_n(m, 5)
    assert probs.sum().item() == pytest.approx(1.0, abs=1e-5)

    def draw(seed):
        engine.add(PROMPT, SamplingParams(max_new_tokens=5, temperature=1.0, seed=seed))
        tokens, stats = [], None
        for chunk in engine.run():
            tokens += chunk.token_ids
            stats = chunk.stats
        paused = bool(engine.schedule._sampled_gate.paused)
        return tokens, paused, len(stats.nodes_hist) - 1, cost.seconds_per_token is not None

    samples = forked_map(draw, range(N_DEEP))  # each process's drafter and cost curve learn on their own
    paused = sum(s[1] for s in samples)
    deepest = max(s[2] for s in samples)
    learnt = [s[3] for s in samples]
    assert learnt[-1] and learnt[-2] and paused > 0  # both processes' curves took over; the gate paused at times
    assert deepest >= 4  # trees beyond one level were verified (root + 3 nodes at least)
    assert chi_square_pvalue(tally((s[0] for s in samples), 5), probs) > 1e-3


SHORT_PROMPT = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])


def test_unseeded_sampling_leaves_the_global_generator_alone(llama):
    from infer import generate

    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = generate(llama, None, SHORT_PROMPT, max_new_tokens=8, temperature=1.0)
    assert torch.equal(torch.get_rng_state(), state)  # torch.seed() reseeded it before
    b = generate(llama, None, SHORT_PROMPT, max_new_tokens=8, temperature=1.0)
    assert len(a.token_ids) == len(b.token_ids) == 8


def test_a_users_generator_is_used_and_advanced(llama):
    from infer import generate
    from infer.drafting.lookup import PromptLookupDrafter

    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    a = generate(llama, PromptLookupDrafter(), SHORT_PROMPT, max_new_tokens=12, temperature=1.0, generator=g1)
    b = generate(llama, PromptLookupDrafter(), SHORT_PROMPT, max_new_tokens=12, temperature=1.0, generator=g2)
    assert a.token_ids == b.token_ids and torch.equal(g1.get_state(), g2.get_state())
    assert not torch.equal(g1.get_state(), torch.Generator().manual_seed(9).get_state())


def test_a_generator_on_another_device_seeds_one_on_the_verifiers():
    from infer.core.engine import sampling_generator

    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(4)
    assert sampling_generator(cpu, None, g) is g  # already there
    fresh = sampling_generator(cpu, 5, None)
    assert torch.equal(fresh.get_state(), torch.Generator().manual_seed(5).get_state())
    if torch.cuda.is_available():  # the crash it fixed: a CPU generator with a CUDA verifier
        dev = torch.device("cuda")
        a = sampling_generator(dev, None, torch.Generator().manual_seed(4))
        b = sampling_generator(dev, None, torch.Generator().manual_seed(4))
        assert a.device.type == "cuda" and torch.equal(a.get_state(), b.get_state())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cpu_generator_with_a_cuda_verifier():
    from infer import generate
    from infer.core.models import tiny_random_model
    from infer.drafting.lookup import PromptLookupDrafter

    model = tiny_random_model("llama", vocab_size=256, seed=1).cuda()
    outs = [generate(model, PromptLookupDrafter(), SHORT_PROMPT, max_new_tokens=10, temperature=1.0,
                     generator=torch.Generator().manual_seed(2)).token_ids for _ in range(2)]
    assert outs[0] == outs[1] and len(outs[0]) == 10
