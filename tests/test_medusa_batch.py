"""Medusa drafting for all rows of a step in one pass (:class:`infer.drafting.head_drafters.MedusaDrafter`).

Each row's tree holds, at the node of sibling ranks ``(r1, ..., rd)``, head ``d - 1``'s ``rd``-th
most likely token at that row's newest feature, cut to the row's depth and node budget; the
engine's greedy output stays the verifier's, alone and batched, with rows joining and leaving;
a step reads nothing from the device; compiled (Dynamo's graphs, slow), one graph for one row and
one for more, none more across a mixed run, and no host-synchronising operation in either.
"""

import pytest
import torch

from conftest import host_syncs
from heads import HeadConfig, VerifierSpec, build_head
from infer import generate
from infer.core.diagnostics import HostReadCounter
from infer.core.drafter import Accepted, Budget, Request, RowStart
from infer.core.engine import Engine, queue
from infer.core.models import tiny_random_model
from infer.core.tree import StaticTreeSpec, load_tree_spec
from infer.drafting.head_drafters import MedusaDrafter

SPEC = StaticTreeSpec(((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))


@pytest.fixture(scope="module")
def model():
    return tiny_random_model("llama", vocab_size=256, seed=1)


def _head(model):
    cfg = HeadConfig("medusa", VerifierSpec.of(model), num_heads=3, num_layers=1, layer_config=model.config.to_dict())
    torch.manual_seed(0)
    head = build_head(cfg)
    with torch.no_grad():  # random, non-trivial weights (Medusa starts as the identity)
        for p in head.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.normal_(1, 0.1)
    return head.eval()


def _prompts(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (length,), generator=g) for length in (16, 9, 23, 5)[:n]]


def _features(model, rows: int) -> torch.Tensor:
    return torch.randn(rows, 3, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(rows))


def test_every_rows_tree_is_its_heads_ranked_tokens_cut_to_its_budget(model):
    head = _head(model)
    d = MedusaDrafter(head, model, SPEC)
    feats = _features(model, 3)
    d.begin([RowStart(s, torch.arange(3), feats[s], None) for s in range(3)])
    budgets = [Budget(3), Budget(1), Budget(3, nodes=5)]
    drafts = d.propose([Request(s, 7 + s, b) for s, b in enumerate(budgets)])
    nodes, parents = SPEC.ordered()
    with torch.no_grad():
        logits = head(feats[:, -1, 0], model.get_output_embeddings())  # [K, R, V]
    for s, (draft, n) in enumerate(zip(drafts, (8, 4, 5))):
        want = [7 + s] + [int(logits[len(c) - 1, s].topk(3).indices[c[-1]]) for c in nodes[1:n]]
        assert draft.tokens.tolist() == want and draft.tree.parents.tolist() == parents[:n]
    assert d.propose([Request(0, 1, Budget(0))])[0].tokens.tolist() == [1]  # no depth: the root alone


def test_greedy_output_is_the_verifiers_alone_batched_and_as_rows_come_and_go(model):
    d = MedusaDrafter(_head(model), model, load_tree_spec("medusa-16"))
    prompts = _prompts(4)
    lengths = [30, 8, 20, 14]
    refs = [generate(model, None, p, max_new_tokens=n).token_ids for p, n in zip(prompts, lengths)]
    assert generate(model, d, prompts[0], max_new_tokens=30).token_ids == refs[0]
    engine = Engine(model, d, max_rows=2)
    for p, n in zip(prompts, lengths):
        queue(engine, p, max_new_tokens=n)
    out: dict[int, list[int]] = {}
    while engine.busy:
        for c in engine.step().chunks:
            out.setdefault(c.index, []).extend(c.token_ids)
    assert [out[i] for i in range(4)] == refs and not d.feats  # every row ended


def test_a_step_reads_nothing_from_the_device(model):
    d = MedusaDrafter(_head(model), model, SPEC)
    feats = _features(model, 2)
    d.begin([RowStart(s, torch.arange(3), feats[s], None) for s in range(2)])
    d.update([Accepted(s, torch.tensor([3, 4]), feats[s, :2]) for s in range(2)])
    with HostReadCounter() as step:
        d.propose([Request(s, 3, Budget(3)) for s in range(2)])
    assert {k: v for k, v in step.counts.items() if k != "h2d"} == {}, step.counts  # copies to the device are not waits


@pytest.mark.slow
def test_the_compiled_fill_never_recompiles_and_holds_no_host_wait(model):
    """Dynamo's graphs of the fill (a backend that keeps them, runs them as they are): two after
    warm-up (one row; every count above), none more across a mixed run of 1 to 3 rows with rows
    joining and leaving, no graph break, no host-synchronising operation in a graph."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    head = _head(model)
    d = MedusaDrafter(head, model, load_tree_spec("medusa-16"), compile=keep)
    assert len(graphs) == 2 and d.warmup_s > 0
    eager = MedusaDrafter(head, model, load_tree_spec("medusa-16"))
    prompts = _prompts(4)
    refs = [generate(model, None, p, max_new_tokens=30).token_ids for p in prompts]
    with torch.compiler.set_stance("fail_on_recompile"):
        assert generate(model, d, prompts[0], max_new_tokens=30).token_ids == refs[0]
        feats = _features(model, 3)
        for drafter in (d, eager):
            drafter.begin([RowStart(s, torch.arange(3), feats[s], None) for s in range(3)])
        requests = [Request(s, 5, Budget(3)) for s in range(3)]
        assert ([x.tokens.tolist() for x in d.propose(requests)] == [x.tokens.tolist() for x in eager.propose(requests)])
        d.end([0, 1, 2])
        engine = Engine(model, d, max_rows=3)
        for p in prompts:
            queue(engine, p, max_new_tokens=30)
        out: dict[int, list[int]] = {}
        while engine.busy:
            for c in engine.step().chunks:
                out.setdefault(c.index, []).extend(c.token_ids)
    assert [out[i] for i in range(4)] == refs
    assert len(graphs) == 2 and not counters["graph_break"]
    found = host_syncs(graphs)
    assert not found, found
