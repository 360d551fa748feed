"""The decoding loop reads the device a constant number of times per step, however big the tree.

Counted with :class:`infer.diagnostics.HostReadCounter` on CPU (on a GPU each of these reads
drains the kernel queue); the count per verify step must not grow with the tree's node count,
and only by a small constant per drafted depth.
"""

import pytest
import torch

from heads import HeadConfig, VerifierSpec, build_head, default_aux_layers
from infer import generate, stream
from infer.cost import VerifyCost
from infer.diagnostics import HostReadCounter
from infer.head_drafters import EagleDrafter
from infer.models import tiny_random_model
from infer.tree import DynamicTreeSpec


@pytest.fixture(scope="module")
def model():
    return tiny_random_model("llama", vocab_size=256, seed=1)


@pytest.fixture(scope="module")
def head(model):
    cfg = HeadConfig("eagle3", VerifierSpec.of(model), draft_vocab_size=200,
                     aux_layers=default_aux_layers(model.config.num_hidden_layers), layer_config=model.config.to_dict())
    torch.manual_seed(0)
    return build_head(cfg)


def _reads_per_step(model, drafter, n_new=20, **kwargs) -> list[int]:
    """Host reads between consecutive chunks (one verify step each, with the next draft)."""
    ids = torch.randint(0, 256, (16,), generator=torch.Generator().manual_seed(0))
    per_step = []
    with HostReadCounter() as counter:
        last = None
        for _ in stream(model, drafter, ids, max_new_tokens=n_new, **kwargs):
            if last is not None:
                per_step.append(counter.total - last)
            last = counter.total
    return per_step


def test_the_counter_sees_the_reads_that_sync():
    t = torch.arange(6)
    with HostReadCounter() as c:
        t.tolist(), int(t[0]), bool(t[1]), t[t > 2], t.nonzero(), t[: t[2]]
        t.cpu(), t.to("cpu"), t + 1, t.sum()  # copies within the CPU and plain ops are not reads
    assert c.counts == {"tolist": 1, "__int__": 1, "__bool__": 1, "__getitem__[bool]": 1, "nonzero": 1, "__getitem__[slice]": 1}


@pytest.mark.parametrize("greedy", [True, False])
def test_reads_per_step_do_not_grow_with_the_tree(model, head, greedy):
    counts = {}
    for nodes in (16, 64):
        drafter = EagleDrafter(head, model, DynamicTreeSpec(depth=4, top_k=8, num_nodes=nodes), adaptive=False, prune=False)
        kwargs = {} if greedy else {"temperature": 1.0, "seed": 0}
        ids = torch.randint(0, 256, (16,), generator=torch.Generator().manual_seed(0))
        assert generate(model, drafter, ids, max_new_tokens=4, **kwargs).stats.verify_steps >= 1
        per_step = _reads_per_step(model, drafter, **kwargs)
        counts[nodes] = per_step
        # the tree's deepest node (one read) and the acceptance's one read back
        assert max(per_step) <= 2, per_step
    assert max(counts[16]) == max(counts[64])


def test_pruning_and_the_cost_budget_add_at_most_one_read_per_depth(model, head):
    for depth in (2, 5):
        cost = VerifyCost((1, 8, 64), (1.0, 1.1, 1.5))
        drafter = EagleDrafter(head, model, DynamicTreeSpec(depth=depth, top_k=4, num_nodes=32), cost=cost)
        per_step = _reads_per_step(model, drafter)
        # budget + acceptance + one pruning decision per depth after the first
        assert max(per_step) <= 2 + (depth - 1), (depth, per_step)
