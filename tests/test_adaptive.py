"""Drafts that never cost: the cost curve learned from the engine's own timings, calibration of a
head's confidences against what is accepted, and the pause when drafting does not pay."""

import pytest
import torch

from conftest import hf_greedy
from heads import HeadConfig, VerifierSpec, build_head, default_aux_layers
from infer.core.drafter import RowDrafter, host_draft
from infer.core.engine import Engine
from infer.core.models import tiny_random_model
from infer.core.params import SamplingParams
from infer.core.schedule import Backoff, DraftCost, DraftSeconds, Gate, OnlineCost, Price, Schedule, VerifyCost
from infer.core.tree import DynamicTreeSpec, build_tree, grow_dynamic_tree
from infer.drafting.head_drafters import Calibration, EagleDrafter

PRIOR = VerifyCost((1, 4, 16), (1.0, 1.5, 2.2))


def test_online_cost_follows_the_measured_times_not_outliers():
    cost = OnlineCost(PRIOR)
    assert cost(4) == 1.5 and cost.seconds_per_token is None  # the prior until measured
    for i in range(30):
        cost.observe(1, 0.010 if i % 10 else 0.500)  # every tenth pass: another process stole the CPU
        cost.observe(4, 0.030)
    assert abs(cost.seconds_per_token - 0.010) < 1e-9
    assert abs(cost(4) - 3.0) < 1e-6  # measured: 4 nodes cost 3x one token here, not the prior's 1.5x
    # unmeasured sizes follow the prior, scaled by the median measured/prior ratio (here 0.015 s)
    assert abs(cost(16) - 0.015 * 2.2 / 0.010) < 1e-6
    assert all(cost(n) <= cost(n + 1) for n in range(1, 20))


def test_calibration_learns_that_a_head_is_overconfident():
    cal = Calibration.new(3, "cpu")
    tokens = torch.tensor([5, 1, 2])  # root 5 -> 1 -> 2, each with q = 0.9
    scores = torch.tensor([0.0, 0.9, 0.81]).log()
    scores[0] = 0.0
    draft = type("D", (), {"tokens": tokens, "scores": scores, "tree": build_tree([-1, 0, 1])})()
    for _ in range(20):
        assert int(cal.record(draft, torch.tensor([5, 7]))) == 0  # the verifier wanted 7: nothing accepted
    scale = cal.log_scale().exp()
    assert scale[0] < 0.2 and scale[1] == 1.0  # depth 1 rescaled; depth 2 never observed
    cal.forget()
    assert cal.log_scale().exp()[0] > scale[0]  # older evidence fades
    assert int(cal.record(draft, torch.tensor([5, 1, 2]))) == 2


def test_calibrated_confidences_shrink_the_tree():
    table = torch.full((20, 20), -6.0)
    table[:, 3] = -0.05
    table = table.log_softmax(-1)
    spec = DynamicTreeSpec(depth=3, top_k=2, num_nodes=8)
    grow = lambda scale: grow_dynamic_tree(lambda i, p, t: table[t], 0, spec, cost=PRIOR, log_scale=scale)  # noqa: E731
    assert grow(None).tokens.numel() > grow(torch.tensor([-3.0, -3.0, -3.0])).tokens.numel() == 1


def test_gate_pauses_then_probes_with_growing_pauses():
    gate = Gate()

    def losing_steps(n):  # n engine steps of a head whose every drafted step loses time
        drafted = []
        for _ in range(n):
            drafted.append(gate.should_draft())
            if drafted[-1]:
                gate.record(0.5)
        return drafted

    first = losing_steps(60)
    assert first[0] and sum(first) <= 10
    losing_steps(500)
    assert sum(losing_steps(520)) <= 0.02 * 520  # it settles at one probe per 65 steps
    gate.record(3.0)  # a probe that pays resumes drafting at once
    assert gate.should_draft() and gate.backoff.pause == 1


def test_a_gate_carries_what_it_learnt_to_the_next_generation_and_forgets_by_halves():
    gate = Gate()
    for _ in range(200):  # a generation in which drafting never paid: pauses of 64 steps by its end
        if gate.should_draft():
            gate.record(0.5)
    nxt = gate.carried()
    drafted = [nxt.should_draft() for _ in range(33)]
    assert drafted == [False] * 32 + [True] and nxt.paused == 32  # paused half its pause, then probes
    short = gate.carried()
    for _ in range(6):  # generations too short to reach a probe: the pause halves each time
        short = short.carried()
    assert short.backoff.skip == 1 and short.should_draft() is False and short.should_draft() is True
    paying = Gate()
    paying.record(2.0)
    assert paying.carried().should_draft() and paying.carried().backoff.skip == 0


def test_backoff_doubles_to_its_most_and_resets_when_a_try_pays():
    b = Backoff(2, 16)
    waits = []
    for _ in range(5):
        b.failed()
        waits.append(b.skip)
        while b.waiting():
            pass
    assert waits == [2, 4, 8, 16, 16]
    b.paid()
    assert (b.pause, b.skip, b.waiting()) == (2, 0, False)
    b.hold(3)
    assert [b.waiting() for _ in range(4)] == [True, True, True, False]


def test_only_sampled_rows_start_from_the_last_ones_gate():
    schedule = Schedule(OnlineCost(PRIOR))
    sampled = schedule.gate(True)
    sampled.ema, sampled.backoff = 0.5, Backoff(1, 64, pause=16, skip=8)
    schedule.retire(sampled, True)
    greedy = schedule.gate(False)
    assert greedy.paused == 0 and greedy.backoff.skip == 0  # greedy: fresh
    greedy.ema, greedy.backoff = 0.5, Backoff(1, 64, pause=16, skip=8)
    schedule.retire(greedy, False)
    assert schedule.gate(False).backoff.skip == 0  # fresh again, whatever the last one learnt
    nxt = schedule.gate(True)  # sampled: carried, its pause halved
    assert nxt.backoff.skip == 8 and nxt.ema == 0.5


def test_a_head_that_is_never_accepted_stops_running():
    model = tiny_random_model("llama", vocab_size=256, seed=1)
    cfg = HeadConfig("eagle3", VerifierSpec.of(model), draft_vocab_size=200,
                     aux_layers=default_aux_layers(2), layer_config=model.config.to_dict())
    torch.manual_seed(0)
    head = build_head(cfg)
    cost = OnlineCost(PRIOR)
    for _ in range(5):  # as if the engine had timed a few steps already
        cost.observe(1, 0.010)
    drafter = EagleDrafter(head, model, DynamicTreeSpec(4, 4, 16))
    passes = []
    head.register_forward_pre_hook(lambda m, a: passes.append(1))
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(3))
    engine = Engine(model, drafter, budget=cost)
    engine.add(ids, SamplingParams(max_new_tokens=60))
    chunks = list(engine.run())
    stats = chunks[-1].stats
    assert [t for c in chunks for t in c.token_ids] == hf_greedy(model, ids, 60)
    assert stats.mean_accepted < 1.2  # a random head: nothing to gain
    assert len(passes) < 0.4 * stats.verify_steps, (len(passes), stats.verify_steps)
    state = engine.schedule.state()  # what a benchmark row records: the learnt curve and costs
    assert state["cost"]["seconds_per_token"] > 0 and state["cost"]["relative"][4] >= 1.0
    assert list(drafter.state()["calibration"]) == ["greedy, depth 4"]


class Clocked(OnlineCost):
    """A verify-cost curve whose clock is a fixed function of the node count (one token takes
    ``spt`` seconds): what the machine's load does to the timings cannot change a decision."""

    def __init__(self, prior, spt):
        super().__init__(prior)
        self.spt = spt
        for _ in range(4):
            super().observe(1, spt)

    def observe(self, nodes, seconds):
        super().observe(nodes, self.spt * self.prior(nodes))


class CostlyChain(RowDrafter):
    """A chain drafter whose every drafted token takes ``per_token`` seconds of a fake clock
    (``clock``, shared): what a draft model as costly as the verifier costs."""

    def __init__(self, clock, per_token):
        self.clock, self.per_token, self.proposed = clock, per_token, []

    def spawn(self):
        new = CostlyChain(self.clock, self.per_token)
        new.proposed = self.proposed
        return new

    def propose_row(self, root, budget, generator=None):
        self.proposed.append(budget.depth)
        depth = budget.depth if budget.cost is None else max(
            range(budget.depth + 1), key=lambda d: ((d + 1) / budget.cost(d + 1), -d))  # all accepted, at best
        self.clock[0] += self.per_token * max(depth, 1)
        return host_draft([root] + [1] * depth, list(range(-1, depth)))


def test_the_budget_refuses_drafts_that_cannot_pay_for_their_drafting(monkeypatch):
    """A drafter as costly per token as the verifier (a fake clock): after cautious one-node
    drafts have measured its cost (a row's first draft, which also feeds it the prompt, does not count), the budget finds that no draft can pay and no row is
    asked to draft for a long pause; a cheap drafter is given deep budgets."""
    import infer.core.engine as engine_module

    model = tiny_random_model("llama", vocab_size=256, seed=1)
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(3))
    spt = 0.05
    for per_token, drafts in ((spt, False), (0.01 * spt, True)):
        clock = [0.0]
        monkeypatch.setattr(engine_module.time, "perf_counter", lambda c=clock: c[0])
        drafter = CostlyChain(clock, per_token)
        engine = Engine(model, drafter, budget=Clocked(VerifyCost((1, 2, 4, 8), (1.0, 1.05, 1.15, 1.4)), spt))
        engine.add(ids, SamplingParams(max_new_tokens=120))
        list(engine.run())
        if drafts:  # asked for deep drafts (its wrong tokens then pause it at its row's gate, never refused)
            assert max(drafter.proposed) > 1 and engine.schedule.refusal.skip == 0
        else:
            assert drafter.proposed == [1, 1, 1]  # three one-node drafts (the first, with the prompt, is not a sample), then refused
            assert engine.schedule.refusal.skip > 100  # and not asked again for a long pause


def test_auto_measures_the_drafter_at_construction_so_a_costly_one_never_sees_a_real_prompt(monkeypatch):
    """``budget="auto"`` probes the drafter as it probes the verifier, before any generation joins
    (a fake clock; the verifier's probe replaced by its curve): a drafter as costly per token as
    the verifier is refused from the first real step on and is never given the real prompt (so a
    draft model never prefills it); the caller's generations are numbered from 0 still. A cheap
    drafter drafts deep at once."""
    import infer.core.engine as engine_module

    model = tiny_random_model("llama", vocab_size=256, seed=1)
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(3))
    spt = 0.05
    monkeypatch.setattr(engine_module, "probe_cost", lambda v: Clocked(VerifyCost((1, 2, 4, 8), (1.0, 1.05, 1.15, 1.4)), spt))
    for per_token, refused in ((spt, True), (0.01 * spt, False)):
        clock = [0.0]
        monkeypatch.setattr(engine_module.time, "perf_counter", lambda c=clock: c[0])
        drafter = CostlyChain(clock, per_token)
        seen = []
        begin = drafter.begin

        def watch(rows, begin=begin, seen=seen):
            seen.extend(r.prompt_ids.numel() for r in rows)
            return begin(rows)

        drafter.begin = watch
        engine = Engine(model, drafter, budget="auto")
        probed = len(drafter.proposed)
        assert probed >= 2 and seen == [32]  # the probe's random prompt only
        assert engine.add(ids, SamplingParams(max_new_tokens=60)) == 0
        list(engine.run())
        if refused:  # the real prompt joined cold: never fed to the drafter, whose refusal outlives it
            assert len(drafter.proposed) == probed and seen == [32]
        else:
            assert max(drafter.proposed[probed:]) > 1 and engine.schedule.refusal.skip == 0


def test_an_expensive_drafter_that_is_not_accepted_probes_seldom(monkeypatch):
    """A drafter at half the verifier's cost per token (a fake clock) whose drafts are never
    accepted: a draft could pay if it were, so it is not refused, but its row's gate pauses it, and
    a probe that loses holds the pause until the loss is 2% of the plain steps in between."""
    import infer.core.engine as engine_module

    model = tiny_random_model("llama", vocab_size=256, seed=1)
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(3))
    spt = 0.05
    clock = [0.0]
    monkeypatch.setattr(engine_module.time, "perf_counter", lambda: clock[0])
    drafter = CostlyChain(clock, 0.5 * spt)
    engine = Engine(model, drafter, budget=Clocked(VerifyCost((1, 2, 4, 8), (1.0, 1.05, 1.15, 1.4)), spt))
    engine.add(ids, SamplingParams(max_new_tokens=300))
    list(engine.run())
    assert engine.schedule.refusal.skip == 0  # never refused: a draft that is accepted would pay
    assert len(drafter.proposed) <= 9, drafter.proposed  # three to measure, then a few probes in 300 steps


def test_a_drafters_fixed_cost_is_priced_once_per_draft_not_per_node():
    """Drafting steps of unlike sizes, each 20 ms plus 1 ms per node (one outlier): the fit
    charges the 20 ms once per draft, so a 16-node tree is priced at 0.35 plain steps of drafting
    (100 ms each), not at 15 times the average per node of small ones; where every step drafted
    alike (the one-node drafts that measure a drafter first), every second counts per node."""
    cost = DraftCost()
    for n in (1, 1, 4, 8, 15, 2, 15, 3):
        cost.observe(n, 0.020 + 0.001 * n)
    cost.observe(2, 0.5)  # a pause of the machine's
    fit = cost.seconds
    assert fit.fixed == pytest.approx(0.020) and fit.per_node == pytest.approx(0.001)
    price = Price(VerifyCost((1, 16), (1.0, 1.0)), fit.per_node / 0.1, fit.fixed / 0.1)
    assert price(1) == 1.0 and price(16) == pytest.approx(1.0 + 0.2 + 0.15)
    alike = DraftCost()
    for _ in range(3):
        alike.observe(1, 0.021)
    assert alike.seconds == DraftSeconds(0.0, 0.021)
    assert alike.seconds is alike.seconds  # fitted once between two observations
    alike.observe(9, 0.029)
    assert alike.seconds.per_node == pytest.approx(0.001)  # and again after one


class PaysForNothing(RowDrafter):
    """A head that spends ``seconds`` of a fake clock on every proposal and then finds that no
    tree pays: it proposes the root alone."""

    def __init__(self, clock, seconds, proposed=None):
        self.clock, self.seconds, self.proposed = clock, seconds, [] if proposed is None else proposed

    def spawn(self):
        return PaysForNothing(self.clock, self.seconds, self.proposed)

    def propose_row(self, root, budget, generator=None):
        self.proposed.append(budget.depth)
        self.clock[0] += self.seconds
        return host_draft([root], [-1])


def test_a_drafter_that_pays_to_propose_nothing_is_paused(monkeypatch):
    """A proposal that costs 30% of a plain step and drafts nothing is judged at that cost: the
    row's gate pauses the drafter (a few proposals in 150 steps, not one per step)."""
    import infer.core.engine as engine_module

    model = tiny_random_model("llama", vocab_size=256, seed=1)
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(3))
    spt, clock = 0.05, [0.0]
    monkeypatch.setattr(engine_module.time, "perf_counter", lambda: clock[0])
    drafter = PaysForNothing(clock, 0.3 * spt)
    engine = Engine(model, drafter, budget=Clocked(VerifyCost((1, 2, 4, 8), (1.0, 1.05, 1.15, 1.4)), spt))
    engine.add(ids, SamplingParams(max_new_tokens=150))
    list(engine.run())
    assert len(drafter.proposed) <= 15, len(drafter.proposed)


def test_a_union_pauses_the_member_whose_drafts_the_other_outdraws(monkeypatch):
    """A union of an oracle (free, always right) and a costly head that is always wrong (a fake
    clock): the row's draft pays, thanks to the oracle, so the row's gate keeps drafting, but the
    head's own gate in the union pauses it; the output is the verifier's."""
    import infer.core.engine as engine_module
    import infer.drafting.union as union_module
    from infer.drafting.union import UnionDrafter
    from infer.testing import OracleDrafter

    model = tiny_random_model("llama", vocab_size=256, seed=1)
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(3))
    ref = hf_greedy(model, ids, 120)
    spt, clock = 0.05, [0.0]
    for module in (engine_module, union_module):
        monkeypatch.setattr(module.time, "perf_counter", lambda: clock[0])
    head = CostlyChain(clock, 0.2 * spt)
    union = UnionDrafter([OracleDrafter(ref, ids.numel()), head])
    engine = Engine(model, union, budget=Clocked(VerifyCost((1, 2, 4, 8), (1.0, 1.05, 1.15, 1.4)), spt))
    engine.add(ids, SamplingParams(max_new_tokens=120))
    out = [t for chunk in engine.run() for t in chunk.token_ids]
    assert out == ref
    assert len(head.proposed) <= 10, len(head.proposed)


class CostlyOracle(CostlyChain):
    """A chain drafter that is always right (it knows the verifier's greedy continuation ``ref``
    of a prompt of ``prompt_len`` tokens), at ``per_token`` seconds of a fake clock per token."""

    def __init__(self, clock, per_token, ref, prompt_len):
        super().__init__(clock, per_token)
        self.ref, self.prompt_len = ref, prompt_len

    def spawn(self):
        new = CostlyOracle(self.clock, self.per_token, self.ref, self.prompt_len)
        new.proposed = self.proposed
        return new

    def begin_row(self, prompt_ids, features=None, params=None):
        self.done = prompt_ids.numel() - self.prompt_len  # tokens of ``ref`` committed

    def update_row(self, tokens, features=None):
        self.done += tokens.numel()

    def propose_row(self, root, budget, generator=None):
        draft = super().propose_row(root, budget, generator)
        depth = len(draft.host[0]) - 1
        return host_draft([root] + self.ref[self.done + 1 : self.done + 1 + depth], list(range(-1, depth)))


def test_a_generation_too_short_to_draft_does_not_refuse_the_next(monkeypatch):
    """Where a two-node pass costs nearly two plain steps (an eager one-row verifier on a CPU), a
    one-token draft cannot pay but a deeper one can: a generation of 3 tokens (a warm-up) drafts
    nothing, and the next, long one drafts deep (the refusal, hundreds of steps, is for a drafter
    whose every draft loses, not for a row near its end)."""
    import infer.core.engine as engine_module

    model = tiny_random_model("llama", vocab_size=256, seed=1)
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(3))
    ref = hf_greedy(model, ids, 80)
    spt, clock = 0.05, [0.0]
    monkeypatch.setattr(engine_module.time, "perf_counter", lambda: clock[0])
    drafter = CostlyOracle(clock, 0.01 * spt, ref, ids.numel())
    engine = Engine(model, drafter, budget=Clocked(VerifyCost((1, 2, 4, 8), (1.0, 1.95, 2.0, 2.1)), spt))
    for n in (40, 3):
        engine.add(ids, SamplingParams(max_new_tokens=n))
        list(engine.run())
    before = len(drafter.proposed)
    engine.add(ids, SamplingParams(max_new_tokens=40))
    out = [t for chunk in engine.run() for t in chunk.token_ids]
    assert out == ref[:40]
    assert engine.schedule.refusal.skip == 0 and max(drafter.proposed[before:], default=0) > 1, drafter.proposed[before:]


def test_a_cheap_drafters_lost_probe_is_bounded_by_the_doubling_pause_alone():
    """Where a two-node pass costs 1.9 plain steps, a head's lost probe (drafting: 5% of a plain
    step) pauses its row for the gate's doubled pause only, not until the 0.9 steps it lost are 2%
    of the steps in between (45); a draft model's lost probe (drafting: 2 plain steps) is held."""
    for draft_steps, held in ((0.05, False), (2.0, True)):
        schedule = Schedule(Clocked(VerifyCost((1, 2, 4, 8), (1.0, 1.9, 2.0, 2.1)), 0.05))
        schedule._view = schedule.cost
        gate = Gate()
        for _ in range(4):  # lost drafts: the gate pauses, then every probe after a pause loses too
            while gate.backoff.skip:
                gate.should_draft()
            schedule.judge(gate, 2, 0, draft_steps * 0.05)
        if held:
            assert gate.backoff.skip >= (1.9 + draft_steps - 1.0) / 0.02, gate.backoff
        else:  # three lost probes after the first loss: pauses of 1, 2, 4, then 8
            assert gate.backoff.skip <= 8, gate.backoff
