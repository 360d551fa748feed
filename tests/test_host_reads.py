"""The decoding loop syncs with the device a small constant number of times per verify step.

Counted with :class:`infer.core.diagnostics.HostReadCounter` at the dispatch level on CPU, the CPU
standing in for a GPU (every tensor is a device tensor; every tensor made from host data is a
host-to-device copy). Per verify step, with every shipped drafter, greedy and sampled: at most
one sync per drafted depth plus two for the acceptance (its read back, and the accepted tokens
handed to the drafter), and the same count for a 16- and a 64-node tree.
"""

from collections import Counter
from typing import NamedTuple

import numpy as np
import pytest
import torch

from heads import HeadConfig, VerifierSpec, build_head, default_aux_layers
from infer import stream
from infer.core.diagnostics import HostReadCounter
from infer.core.drafter import NoDrafter
from infer.core.models import tiny_random_model
from infer.core.tree import DynamicTreeSpec, at
from infer.drafting.head_drafters import EagleDrafter
from infer.drafting.lookup import PromptLookupDrafter
from infer.drafting.union import UnionDrafter

MODES = [{}, {"temperature": 1.0, "seed": 0}]


@pytest.fixture(scope="module")
def model():
    return tiny_random_model("llama", vocab_size=256, seed=1)


@pytest.fixture(scope="module")
def head(model):
    cfg = HeadConfig("eagle3", VerifierSpec.of(model), draft_vocab_size=200,
                     aux_layers=default_aux_layers(model.config.num_hidden_layers), layer_config=model.config.to_dict())
    torch.manual_seed(0)
    return build_head(cfg)


def _prompt(repeat: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if repeat:  # text that repeats itself, so that prompt lookup finds matches and drafts
        return torch.randint(0, 256, (6,), generator=g).repeat(4)
    return torch.randint(0, 256, (16,), generator=g)


class _Watch:
    """Per verify step: the syncs, the head passes (drafted depths) and whether prompt lookup drafted."""

    def __init__(self, drafter):
        self.passes = 0
        self.pld_drafted = 0
        members = drafter.drafters if isinstance(drafter, UnionDrafter) else [drafter]
        watch = self
        for d in members:  # counted in a subclass: every row's copy of the drafter counts too
            if isinstance(d, EagleDrafter):
                class CountedEagle(type(d)):
                    def _run(self, *a):
                        watch.passes += 1
                        return super()._run(*a)

                d.__class__ = CountedEagle
            elif isinstance(d, PromptLookupDrafter):
                class WatchedLookup(type(d)):
                    def propose_host(self, *a, **kw):
                        tokens, parents = super().propose_host(*a, **kw)
                        watch.pld_drafted += len(tokens) > 1
                        return tokens, parents

                d.__class__ = WatchedLookup


def per_step(model, drafter, ids, n_new=24, **kwargs) -> list[tuple[int, int]]:
    """``(syncs, allowed)`` for every verify step: ``allowed`` = drafted depths (head passes, plus
    one when prompt lookup drafted) + 2."""
    watch = _Watch(drafter)
    rows = []
    with HostReadCounter() as counter:
        last = None
        for _ in stream(model, drafter, ids, max_new_tokens=n_new, **kwargs):
            now = (counter.total, watch.passes, watch.pld_drafted, Counter(counter.counts))
            if last is not None:
                rows.append(Step(now[0] - last[0], (now[1] - last[1]) + (now[2] - last[2]) + 2, dict(now[3] - last[3])))
            last = now
    assert rows, "no verify step ran"
    return rows


class Step(NamedTuple):
    syncs: int
    allowed: int
    kinds: dict


def assert_bounded(rows):
    assert all(r.syncs <= r.allowed for r in rows), [r for r in rows if r.syncs > r.allowed][:3]


# ---- the counter sees what syncs, and only that ----------------------------------------------


def test_the_counter_sees_every_kind_of_host_read():
    t, i = torch.arange(6), torch.tensor(2)
    with HostReadCounter() as c:
        t[i], t[:i], int(t[1]), bool(t[1]), float(t[1]), t[2].item()  # 0-dim reads inside ATen and out
        t.tolist(), t.numpy()
        t.nonzero(), torch.where(t > 2), t[t > 2], t.masked_select(t > 2), t.unique(), t.repeat_interleave(t)
    assert c.counts == {"item": 6, "tolist": 1, "numpy": 1, "nonzero": 2, "index(bool)": 1, "masked_select": 1,
                        "unique": 1, "repeat_interleave": 1}, c.counts


def test_the_counter_sees_tensors_made_from_host_data():
    t = torch.arange(6)
    with HostReadCounter() as c:
        torch.tensor([1, 2, 3]), torch.as_tensor([4, 5]), torch.from_numpy(np.arange(3)), t[[1, 2]]
    assert c.counts == {"h2d": 4}, c.counts


def test_what_does_not_sync_is_not_counted():
    t, i = torch.arange(6), torch.tensor(2)
    with HostReadCounter() as c:
        t + 1, t.sum(), t.max(), at(t, i), t[i.view(1)], t.index_select(0, i.view(1)), t[1:3], t[2]
        torch.full((), 3), torch.zeros(3), torch.arange(4), t.repeat_interleave(2), torch.where(t > 2, t, 0)
        t[0] = 5  # a Python number written into a tensor: a fill, no copy
        host = torch.tensor([7, 8])  # one copy ...
        host.tolist()  # ... and reading back what is still in host memory waits for nothing
    assert c.counts == {"h2d": 1}, c.counts


def test_on_a_real_device_only_crossings_count():
    """With a non-CPU device (meta stands in for CUDA here): reads of CPU tensors are free, moves
    to the device and ``torch.tensor(..., device=...)`` are copies."""
    t = torch.arange(4)
    with HostReadCounter(device="meta") as c:
        t.tolist(), int(t[0]), torch.tensor([1, 2])  # all on the host
        t.to("meta"), torch.tensor([1, 2], device="meta"), torch.zeros(3, device="meta")
    assert c.counts == {"h2d": 2}, c.counts


# ---- the decoding loop -----------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", MODES, ids=["greedy", "sampling"])
def test_head_syncs_do_not_grow_with_the_tree(model, head, kwargs):
    """All depths drafted (no pruning): the budget read, the acceptance, the hand-over: 3 syncs
    per drafted step, for 16 nodes as for 64."""
    counts = {}
    for nodes in (16, 64):
        drafter = EagleDrafter(head, model, DynamicTreeSpec(depth=4, top_k=8, num_nodes=nodes), adaptive=False, prune=False)
        rows = per_step(model, drafter, _prompt(), **kwargs)
        assert_bounded(rows)
        counts[nodes] = sorted({s for s, allowed, _ in rows if allowed > 2})  # drafted steps (the last one drafts nothing)
    assert counts[16] == counts[64] == [3], counts


@pytest.mark.parametrize("kwargs", MODES, ids=["greedy", "sampling"])
def test_head_with_pruning_and_a_cost_budget(model, head, kwargs):
    from infer.core.schedule import VerifyCost

    for depth in (2, 5):
        cost = VerifyCost((1, 8, 64), (1.0, 1.1, 1.5))
        rows = per_step(model, EagleDrafter(head, model, DynamicTreeSpec(depth=depth, top_k=4, num_nodes=32)),
                        _prompt(), budget=cost, **kwargs)
        assert_bounded(rows)
        assert max(r.syncs for r in rows) <= depth + 2


@pytest.mark.parametrize("kwargs", MODES, ids=["greedy", "sampling"])
def test_prompt_lookup_and_plain_steps(model, kwargs):
    rows = per_step(model, PromptLookupDrafter(), _prompt(repeat=True), **kwargs)
    assert_bounded(rows)
    assert max(r.syncs for r in rows) <= 3
    assert max(r.syncs for r in per_step(model, NoDrafter(), _prompt(), **kwargs)) <= 2  # a plain step: read back, root


@pytest.mark.parametrize("kwargs", MODES, ids=["greedy", "sampling"])
def test_the_union_auto_builds(model, head, kwargs, tmp_path, monkeypatch):
    """``--draft auto`` for a verifier with a shipped head: the head and prompt lookup, merged
    on the host from what each drafter already knows there."""
    import heads.io
    from infer.drafting.loading import load_drafter

    head.save_pretrained(tmp_path / "tiny")
    monkeypatch.setattr(heads.io, "PRETRAINED_DIR", tmp_path)
    drafter = load_drafter("auto", model)
    assert isinstance(drafter, UnionDrafter)
    rows = per_step(model, drafter, _prompt(repeat=True), **kwargs)
    assert_bounded(rows)
    depth = drafter.drafters[0].tree.depth
    assert max(r.syncs for r in rows) <= depth + 3


class _FlipCost:
    """A flat verify-cost curve (every tree is worth drafting in full) whose one-token time the
    test turns: tiny at first (the head's drafting time outweighs everything: drafting pauses),
    then huge, with trees cheaper than a token (the next try pays and drafting resumes)."""

    def __init__(self):
        self.seconds_per_token, self.value = 1e-9, 1.0

    def __call__(self, n: int) -> float:
        return self.value


@pytest.mark.parametrize("kwargs", MODES, ids=["greedy", "sampling"])
def test_the_gate_pausing_and_resuming_adds_no_sync(model, head, kwargs):
    from infer.core.engine import Engine, queue
    from infer.core.schedule import Backoff

    cost = _FlipCost()
    head_drafter = EagleDrafter(head, model, DynamicTreeSpec(depth=3, top_k=4, num_nodes=16))
    drafter = UnionDrafter([head_drafter, PromptLookupDrafter()])
    engine = Engine(model, drafter, budget=cost)
    engine.schedule.refusal = Backoff(4, 8)  # the pause after a refusal, short enough to end in this test
    engine.schedule.probe_share = float("inf")  # and a losing probe's: no longer than the gate's own
    queue(engine, _prompt(repeat=True), max_new_tokens=60, **kwargs)
    watch = _Watch(drafter)
    rows, passes_after_flip = [], None
    with HostReadCounter() as counter:
        last = None
        for step, _ in enumerate(engine.run()):
            now = (counter.total, watch.passes, watch.pld_drafted)
            if last is not None:
                rows.append(Step(now[0] - last[0], (now[1] - last[1]) + (now[2] - last[2]) + 2, {"passes": now[1] - last[1]}))
            last = now
            if step == 12:
                paused = sum(r.allowed == 2 for r in rows)  # steps where nothing drafted
                cost.seconds_per_token, cost.value, passes_after_flip = 1e9, 0.5, watch.passes
    assert paused > 0, "drafting never paused"
    assert watch.passes > passes_after_flip, "drafting never resumed"
    # a one-pass head step is a one-node draft that measures the drafter's cost: its node budget
    # and its merge with prompt lookup's draft take one read more; and the first draft priced
    # after the flip writes its price's cost table (cached per price from then on)
    over = [r for r in rows if r.syncs > r.allowed + (r.kinds["passes"] == 1)]
    assert len(over) <= 1 and all(r.syncs == r.allowed + 1 for r in over), over


def test_selfcheck_counts_cuda_sync_warnings_and_restores_the_mode(monkeypatch):
    """``specheads selfcheck`` on CUDA runs the decoding loop under
    ``torch.cuda.set_sync_debug_mode("warn")`` (here a stand-in records the mode calls)."""
    import warnings

    from infer.tools.selfcheck import cuda_sync_warnings

    modes = ["error"]
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: modes[-1])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def loop():
        assert modes[-1] == "warn"
        for _ in range(3):
            warnings.warn("called a synchronizing CUDA operation", stacklevel=1)
        warnings.warn("something else", stacklevel=1)
        return "done"

    assert cuda_sync_warnings(loop) == (3, "done")
    assert modes[-1] == "error"  # restored

    def fails():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        cuda_sync_warnings(fails)
    assert modes[-1] == "error"
