"""Drafts that never cost: the cost curve learned from the engine's own timings, calibration of a
head's confidences against what is accepted, and the pause when drafting does not pay."""

import torch

from conftest import hf_greedy
from heads import HeadConfig, VerifierSpec, build_head, default_aux_layers
from infer import generate
from infer.core.cost import OnlineCost, VerifyCost
from infer.core.models import tiny_random_model
from infer.core.tree import DynamicTreeSpec, build_tree, grow_dynamic_tree
from infer.drafting.gate import Gate, Gates
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
    gate = Gate.new("cpu")

    def losing_steps(n):  # n engine steps of a head whose every drafted step loses time
        drafted = []
        for _ in range(n):
            drafted.append(gate.should_draft())
            if drafted[-1]:
                gate.record(torch.tensor(0.5))
        return drafted

    first = losing_steps(60)
    assert first[0] and sum(first) <= 10
    losing_steps(500)
    assert sum(losing_steps(520)) <= 0.02 * 520  # it settles at one probe per 65 steps
    gate.record(torch.tensor(3.0))  # a probe that pays resumes drafting at once
    assert gate.should_draft() and gate.backoff == 1


def test_a_gate_carries_what_it_learnt_to_the_next_generation_and_forgets_by_halves():
    gate = Gate.new("cpu")
    for _ in range(200):  # a generation in which drafting never paid: pauses of 64 steps by its end
        if gate.should_draft():
            gate.record(0.5)
    nxt = gate.carried()
    drafted = [nxt.should_draft() for _ in range(33)]
    assert drafted == [False] * 32 + [True] and nxt.paused == 32  # paused half its pause, then probes
    short = gate.carried()
    for _ in range(6):  # generations too short to reach a probe: the pause halves each time
        short = short.carried()
    assert short.skip == 1 and short.should_draft() is False and short.should_draft() is True
    paying = Gate.new("cpu")
    paying.record(2.0)
    assert paying.carried().should_draft() and paying.carried().skip == 0


def test_gates_carry_the_sampled_gate_and_start_greedy_ones_fresh():
    gates = Gates()
    sampled = gates.select(sampled=True)
    assert gates.current is sampled and gates.select(sampled=True) is sampled  # one per generation
    sampled.ema, sampled.backoff = 0.5, 8
    greedy = gates.select(sampled=False)
    greedy.ema, greedy.backoff = 0.5, 8
    gates.begin()
    assert gates.select(sampled=False) is not greedy and gates.current.skip == 0  # greedy: fresh
    assert gates.select(sampled=True).skip == 4  # sampled: carried, its next pause halved


def test_only_sampled_generations_start_from_the_last_ones_gate():
    model = tiny_random_model("llama", vocab_size=256, seed=1)
    cfg = HeadConfig("eagle3", VerifierSpec.of(model), draft_vocab_size=200,
                     aux_layers=default_aux_layers(2), layer_config=model.config.to_dict())
    torch.manual_seed(0)
    drafter = EagleDrafter(build_head(cfg), model, DynamicTreeSpec(2, 2, 4), cost=OnlineCost(PRIOR))
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(3))

    def ended_paused(gate):  # how a generation whose drafts never paid ends (set, not timed: no flakiness)
        gate.ema, gate.backoff, gate.skip = 0.5, 16, 8

    generate(model, drafter, ids, max_new_tokens=20, temperature=1.0, seed=0)
    sampled = drafter.gates.current
    ended_paused(sampled)
    generate(model, drafter, ids, max_new_tokens=3)  # greedy: its own gate, fresh: its first proposal drafts
    greedy = drafter.gates.current
    assert greedy is not sampled and greedy.paused == 0
    ended_paused(greedy)
    generate(model, drafter, ids, max_new_tokens=3)  # greedy again: fresh again, whatever the last one learnt
    assert drafter.gates.current is not greedy and drafter.gates.current.paused == 0
    generate(model, drafter, ids, max_new_tokens=3, temperature=1.0, seed=1)  # sampled: starts paused
    # its pause of 16 halved at every generation since (two greedy ones, then this one): 2, one step gone
    assert drafter.gates.current.paused == 1 and drafter.gates.current.skip == 1 and drafter.gates.current.backoff == 2


def test_a_head_that_is_never_accepted_stops_running():
    model = tiny_random_model("llama", vocab_size=256, seed=1)
    cfg = HeadConfig("eagle3", VerifierSpec.of(model), draft_vocab_size=200,
                     aux_layers=default_aux_layers(2), layer_config=model.config.to_dict())
    torch.manual_seed(0)
    head = build_head(cfg)
    cost = OnlineCost(PRIOR)
    for _ in range(5):  # as if the engine had timed a few steps already
        cost.observe(1, 0.010)
    drafter = EagleDrafter(head, model, DynamicTreeSpec(4, 4, 16), cost=cost)
    passes = []
    head.register_forward_pre_hook(lambda m, a: passes.append(1))
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(3))
    res = generate(model, drafter, ids, max_new_tokens=60)
    assert res.token_ids == hf_greedy(model, ids, 60)
    assert res.stats.mean_accepted < 1.2  # a random head: nothing to gain
    assert len(passes) < 0.4 * res.stats.verify_steps, (len(passes), res.stats.verify_steps)
    state = drafter.state()  # what a benchmark row records: the pauses, the learnt curve
    assert state["paused_steps"] > 0.5 * res.stats.verify_steps and state["gate_gain"] < 1.0
    assert state["cost"]["seconds_per_token"] > 0 and state["cost"]["relative"][4] >= 1.0
    assert list(state["calibration"]) == ["greedy, depth 4"]
