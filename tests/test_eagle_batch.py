"""EAGLE drafting for all rows in one fixed-shape loop (:mod:`infer.drafting.eagle_batch`).

The batched loop grows the very trees the eager row-by-row drafter grows (with its pruning and
calibration off, which the loop does not do), alone and batched, with a fixed and a priced
budget; the engine's greedy output stays the verifier's; the loop reads nothing from the host
and the step reads once; compiled (Dynamo's graphs, slow), rows joining and leaving never
recompile and no graph holds a host-synchronising operation.
"""

import pytest
import torch

from conftest import host_syncs
from heads import HeadConfig, VerifierSpec, build_head
from heads.config import default_aux_layers
from infer import generate
from infer.core.diagnostics import HostReadCounter
from infer.core.drafter import Budget, Request, RowStart
from infer.core.engine import Engine, queue
from infer.core.models import tiny_random_model
from infer.core.schedule import VerifyCost
from infer.core.tree import DynamicTreeSpec
from infer.drafting.eagle_batch import BatchEagleDrafter, host_tree, select
from infer.drafting.head_drafters import EagleDrafter

SPEC = DynamicTreeSpec(depth=4, top_k=3, num_nodes=10)
CURVE = VerifyCost((1, 2, 4, 8, 16), (1.0, 1.001, 1.003, 1.008, 1.02))  # nearly flat: some of a random head's guesses pay


@pytest.fixture(scope="module")
def model():
    return tiny_random_model("llama", vocab_size=256, seed=1)


def _head(model, kind: str):
    aux = default_aux_layers(model.config.num_hidden_layers) if kind == "eagle3" else None
    extra = {"draft_vocab_size": 200, "aux_layers": aux} if kind == "eagle3" else {}
    cfg = HeadConfig(kind, VerifierSpec.of(model), layer_config=model.config.to_dict(), **extra)
    torch.manual_seed(0)
    return build_head(cfg)


def _prompts(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (length,), generator=g) for length in (16, 9, 23, 5)[:n]]


def _recorded(drafter):
    """The host form of every draft ``drafter`` proposes, step by step."""
    seen, propose = [], drafter.propose

    def recording(requests):
        drafts = propose(requests)
        seen.append([d.host if d.host else (tuple(d.tokens.tolist()), tuple(d.tree.parents.tolist())) for d in drafts])
        return drafts

    drafter.propose = recording
    return seen


@pytest.mark.parametrize("kind", ["eagle3", "eagle1"])
@pytest.mark.parametrize("budget", ["fixed", "curve"])
def test_the_batched_loop_grows_the_eager_drafters_trees(model, kind, budget):
    head = _head(model, kind)
    cost = CURVE if budget == "curve" else "fixed"
    for rows in (1, 3):
        prompts = _prompts(rows)
        refs = [generate(model, None, p, max_new_tokens=24).token_ids for p in prompts]
        trees = {}
        for name, d in (("eager", EagleDrafter(head, model, SPEC, adaptive=False, prune=False)),
                        ("batched", BatchEagleDrafter(head, model, SPEC, adaptive_depth=False))):
            trees[name] = _recorded(d)
            out = generate(model, d, prompts if rows > 1 else prompts[0], max_new_tokens=24, budget=cost)
            out = out if rows > 1 else [out]
            assert [o.token_ids for o in out] == refs, name
        assert len(trees["batched"]) > 3 and trees["batched"] == trees["eager"]
        sizes = {len(t[0]) for step in trees["batched"] for t in step}
        assert sizes != {SPEC.num_nodes} if budget == "curve" else max(sizes) == SPEC.num_nodes, sizes  # priced: cut


def test_a_rows_depth_and_node_limits_bound_its_tree(model):
    head = _head(model, "eagle3")
    d = BatchEagleDrafter(head, model, SPEC)
    feats = torch.randn(6, len(d.feature_layers), model.config.hidden_size)
    d.begin([RowStart(i, torch.arange(6), feats, None) for i in (7, 8, 9)])
    budgets = [Budget(2), Budget(4, nodes=4), Budget(0)]
    drafts = d.propose([Request(s, 3, b) for s, b in zip((7, 8, 9), budgets)])
    depth = [int(x.tree.depths.max()) for x in drafts]
    assert depth[0] == 2 and drafts[0].num_nodes == SPEC.num_nodes  # 3 + 9 candidates at depths 1..2
    assert drafts[1].num_nodes == 4 and drafts[2].num_nodes == 1
    assert all(x.host[0][0] == 3 for x in drafts)


def test_select_keeps_the_best_nodes_that_pay_and_names_their_parents():
    # candidates: root, a (p .9), b (p .5), a's child c (p .45), b's child e (p .05)
    key = torch.tensor([[0.0, 0.9, 0.5, 0.45, 0.05]]).log()
    tok = torch.tensor([[10, 11, 12, 13, 14]])
    par = torch.tensor([[-1, 0, 0, 1, 2]])
    dep = torch.tensor([[0, 1, 1, 2, 2]])
    one, yes, no = torch.ones(1, 6), torch.tensor([True]), torch.tensor([False])
    packed = select(tok, par, dep, key, torch.tensor([2]), torch.tensor([5]), one, no, 5)
    assert host_tree(packed[0].tolist(), 5) == ((10, 11, 12, 13, 14), (-1, 0, 0, 1, 2))
    steep = torch.tensor([[1.0, 1.0, 1.5, 3.0, 9.0, 20.0]])  # a node pays only if it adds more than its price
    packed = select(tok, par, dep, key, torch.tensor([2]), torch.tensor([5]), steep, yes, 5)
    assert host_tree(packed[0].tolist(), 5) == ((10, 11), (-1, 0))
    packed = select(tok, par, dep, key, torch.tensor([1]), torch.tensor([5]), one, no, 5)  # depth limit 1
    assert host_tree(packed[0].tolist(), 5) == ((10, 11, 12), (-1, 0, 0))


def test_the_loop_reads_nothing_and_a_step_reads_once(model):
    head = _head(model, "eagle3")
    d = BatchEagleDrafter(head, model, SPEC)
    feats = torch.randn(6, len(d.feature_layers), model.config.hidden_size)
    d.begin([RowStart(i, torch.arange(6), feats, None) for i in (0, 1)])
    requests = [Request(s, 3, Budget(4, cost=CURVE)) for s in (0, 1)]
    root_hidden, base = d._catch_up({q.slot: q.root for q in requests})
    root_tok, *limits = d._limits(requests)
    state = d._state(root_hidden.shape[0])
    with torch.inference_mode(), HostReadCounter() as loop:
        d._eager_first(root_hidden, root_tok, *state.tensors())
        for level in d._levels[1:]:
            d._eager_next(level, base, d.columns, *state.tensors())
        d._eager_select(*limits, state.tok, state.par, state.dep, state.key)
    assert loop.total == 0, loop.counts
    d.end([0, 1])
    d.begin([RowStart(i, torch.arange(6), feats, None) for i in (0, 1)])
    d.propose(requests)  # the first draft feeds the prompt: then a steady step
    d.update([torch_accepted(s, feats) for s in (0, 1)])
    with HostReadCounter() as step:
        d.propose(requests)
    reads = {k: v for k, v in step.counts.items() if k != "h2d"}  # copies to the device are not waits
    assert reads == {"tolist": 1}, step.counts


def torch_accepted(slot, feats):
    from infer.core.drafter import Accepted

    return Accepted(slot, torch.tensor([3, 4]), feats[:2])


def test_rows_join_and_leave_the_slots_with_outputs_unchanged(model):
    head = _head(model, "eagle3")
    prompts = _prompts(4)
    lengths = [30, 8, 20, 14]
    refs = [generate(model, None, p, max_new_tokens=n).token_ids for p, n in zip(prompts, lengths)]
    engine = Engine(model, BatchEagleDrafter(head, model, SPEC), max_rows=2)
    for p, n in zip(prompts, lengths):
        queue(engine, p, max_new_tokens=n)
    out: dict[int, list[int]] = {}
    while engine.busy:
        for c in engine.step().chunks:
            out.setdefault(c.index, []).extend(c.token_ids)
    assert [out[i] for i in range(4)] == refs


@pytest.mark.slow
def test_the_compiled_loop_never_recompiles_and_holds_no_host_wait(model):
    """Dynamo's graphs of the loop (a backend that keeps them, runs them as they are): six after
    warm-up (the start, one level replayed at every depth, the selection; for one row and for
    every count above), none more across a mixed run of 1 to 3 rows with rows joining and leaving
    and depths varying, no graph break, no host-synchronising operation in a graph."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    d = BatchEagleDrafter(_head(model, "eagle3"), model, SPEC, compile=keep)
    assert len(graphs) == 6 and d.warmup_s > 0  # start, a level, the selection: for one row and for more
    prompts = _prompts(4)
    refs = [generate(model, None, p, max_new_tokens=30).token_ids for p in prompts]
    with torch.compiler.set_stance("fail_on_recompile"):
        assert generate(model, d, prompts[0], max_new_tokens=30).token_ids == refs[0]
        assert [o.token_ids for o in generate(model, d, prompts[:3], max_new_tokens=30, budget=CURVE)] == refs[:3]
        engine = Engine(model, d, max_rows=3)
        for p in prompts:
            queue(engine, p, max_new_tokens=30)
        out: dict[int, list[int]] = {}
        while engine.busy:
            for c in engine.step().chunks:
                out.setdefault(c.index, []).extend(c.token_ids)
    assert [out[i] for i in range(4)] == refs
    assert len(graphs) == 6 and not counters["graph_break"]
    found = host_syncs(graphs)
    assert not found, found
