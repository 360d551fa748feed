"""The block drafter for all rows of a step in one fixed-shape pass (:mod:`infer.drafting.block_batch`).

The batched pass drafts the chains the row-by-row drafter drafts (rows of unlike lengths, fixed
and priced budgets); the engine's greedy output stays the verifier's, alone and batched, with
rows joining and leaving; a step reads nothing without a price and once with one; compiled
(Dynamo's graphs, slow), one graph for one row and one for more, none more across a mixed run,
and no host-synchronising operation in either.
"""

import pytest
import torch

from conftest import host_syncs
from heads import HeadConfig, VerifierSpec, build_head, default_dflash_layers
from infer import generate
from infer.core.diagnostics import HostReadCounter
from infer.core.drafter import Accepted, Budget, Request, RowStart
from infer.core.engine import Engine, queue
from infer.core.models import tiny_random_model
from infer.core.schedule import VerifyCost
from infer.drafting.block_batch import BatchBlockDrafter
from infer.drafting.block_drafter import BlockDrafter

CURVE = VerifyCost((1, 2, 4, 8), (1.0, 1.001, 1.003, 1.008))  # nearly flat: a cut that keeps a few tokens


@pytest.fixture(scope="module")
def model():
    return tiny_random_model("llama", vocab_size=256, seed=1)


def _head(model):
    spec = VerifierSpec.of(model, model.config.model_type)
    cfg = HeadConfig("dflash", spec, num_layers=2, draft_vocab_size=96, block_size=5, mask_token_id=7,
                     aux_layers=default_dflash_layers(spec.num_layers, 5), layer_config=model.config.to_dict())
    torch.manual_seed(0)
    head = build_head(cfg)
    with torch.no_grad():  # random, non-trivial weights
        for p in head.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.normal_(1, 0.1)
    head.set_vocab(torch.randperm(256, generator=torch.Generator().manual_seed(0))[:96])
    return head.eval()


def _prompts(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (length,), generator=g) for length in (16, 9, 23, 5)[:n]]


def _feats(d, n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, len(d.feature_layers), 64, generator=torch.Generator().manual_seed(seed))


def _tokens(drafts) -> list[list[int]]:
    return [x.tokens.tolist() for x in drafts]


def test_the_batched_pass_drafts_the_row_drafters_chains(model):
    head = _head(model)
    batch, rows = BatchBlockDrafter(head, model), BlockDrafter(head, model)
    starts = [RowStart(s, torch.arange(n), _feats(batch, n, s), None) for s, n in enumerate((12, 5, 20))]
    for d in (batch, rows):
        d.begin(starts)
    for budgets in ([Budget(4), Budget(2), Budget(4, nodes=3)], [Budget(4, cost=CURVE)] * 3):
        requests = [Request(s, 9 + s, b) for s, b in enumerate(budgets)]
        assert _tokens(batch.propose(requests)) == _tokens(rows.propose(requests))
        told = [Accepted(s, torch.tensor([9 + s, 4][: 1 + s % 2]), _feats(batch, 1 + s % 2, 10 + s)) for s in range(3)]
        for d in (batch, rows):
            d.update(told)
    assert batch.propose([Request(0, 1, Budget(0))])[0].tokens.tolist() == [1]  # no depth: the root alone


def test_greedy_output_is_the_verifiers_alone_batched_and_as_rows_come_and_go(model):
    d = BatchBlockDrafter(_head(model), model)
    prompts = _prompts(4)
    lengths = [30, 8, 20, 14]
    full = [generate(model, None, p, max_new_tokens=30).token_ids for p in prompts]  # greedy: prefixes agree
    refs = [r[:n] for r, n in zip(full, lengths)]
    assert generate(model, d, prompts[0], max_new_tokens=30).token_ids == full[0]
    assert [o.token_ids for o in generate(model, d, prompts[:3], max_new_tokens=20, budget=CURVE)] == [r[:20] for r in full[:3]]
    engine = Engine(model, d, max_rows=2)
    for p, n in zip(prompts, lengths):
        queue(engine, p, max_new_tokens=n)
    out: dict[int, list[int]] = {}
    while engine.busy:
        for c in engine.step().chunks:
            out.setdefault(c.index, []).extend(c.token_ids)
    assert [out[i] for i in range(4)] == refs and not d.rows  # every row ended


def test_a_step_reads_nothing_without_a_price_and_once_with_one(model):
    for cost, want in ((None, {}), (CURVE, {"tolist": 1})):
        d = BatchBlockDrafter(_head(model), model)
        d.begin([RowStart(s, torch.arange(6), _feats(d, 6, s), None) for s in range(2)])
        requests = [Request(s, 3, Budget(4, cost=cost)) for s in range(2)]
        d.propose(requests)  # the first block feeds the prompt: then a steady step
        d.update([Accepted(s, torch.tensor([3, 4]), _feats(d, 2, 5 + s)) for s in range(2)])
        with HostReadCounter() as step:
            d.propose(requests)
        assert {k: v for k, v in step.counts.items() if k != "h2d"} == want, step.counts  # copies to the device are not waits


@pytest.mark.slow
def test_the_compiled_pass_never_recompiles_and_holds_no_host_wait(model):
    """Dynamo's graphs of the block pass (a backend that keeps them, runs them as they are): two
    after warm-up (one row; every count above), none more across a mixed run of 1 to 3 rows with
    rows joining and leaving and the slots growing, no graph break, no host-synchronising
    operation in a graph."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    d = BatchBlockDrafter(_head(model), model, compile=keep)
    assert len(graphs) == 2 and d.warmup_s > 0
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
    assert len(graphs) == 2 and not counters["graph_break"]
    found = host_syncs(graphs)
    assert not found, found
