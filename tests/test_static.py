"""The static-shape verify step (:mod:`infer.core.static`), eager and compiled.

Static shapes: greedy output is HF's on every family, alone and batched with rows joining and
leaving, with oracle, wrong and random drafters; the shapes a pass runs at stay within the
buckets. Compiled (``torch.compile``: Dynamo's graphs on every family and on one small model
at 1 to 4 rows, Inductor on that model's one-row graphs, since Inductor's code generation is what
costs minutes):
the same outputs, no recompilation after warm-up across a long mixed run
(``torch.compiler.set_stance("fail_on_recompile")``), no graph break, no host-synchronising
operation inside a graph, at most two host reads per step, exact sampling (chi-square), and
prepacked linears in the Inductor graphs.
"""

import json

import pytest
import torch

from conftest import VOCAB, hf_greedy, host_syncs
from infer import generate
from infer.core.engine import Engine, queue
from infer.core.errors import UserError
from infer.core.models import tiny_random_model
from infer.core.static import (
    NODE_BUCKETS,
    StaticVerifier,
    artifacts_cached,
    bucket,
    capacity_for,
    read_verdict,
    resolve_compile,
    static_for,
    step_inputs,
    write_verdict,
)
from infer.core.verifier import Verifier
from infer.testing import OracleDrafter, chain

V8 = 8


def _prompts(n: int, lengths=(12, 5, 30, 9)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(1, VOCAB, (lengths[i % len(lengths)],), generator=g) for i in range(n)]


def _noise_drafter(vocab: int = VOCAB, seed: int = 0) -> OracleDrafter:
    """Drafts random tokens on a tree of 6 nodes, for rows of any prompt (its "reference" is noise)."""
    noise = torch.randint(0, vocab, (4096,), generator=torch.Generator().manual_seed(seed)).tolist()
    return OracleDrafter(noise, 0, [-1, 0, 0, 1, 2, 1], vocab=vocab)


def _drafters(ref: list[int], prompt_len: int, vocab: int = VOCAB) -> dict:
    return {
        "oracle": OracleDrafter(ref, prompt_len, chain(4), vocab=vocab),
        "wrong": OracleDrafter(ref, prompt_len, chain(3), p_right=0.0, vocab=vocab),
        "random": OracleDrafter(ref, prompt_len, [-1, 0, 0, 1, 2, 1], p_right=0.5, seed=3, vocab=vocab),
    }


# ---- the pure pieces ---------------------------------------------------------------------------


def test_sizes_are_padded_to_their_buckets():
    assert [bucket(n) for n in (1, 2, 3, 5, 9, 17, 33, 64, 65, 130)] == [1, 2, 4, 8, 16, 32, 64, 64, 128, 192]
    assert [capacity_for(n) for n in (1, 256, 257, 600, 1500)] == [256, 256, 512, 1024, 2048]


def test_the_step_mask_shows_each_row_its_prefix_and_its_ancestors_only():
    anc = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool).repeat(2, 1, 1)
    depths = torch.tensor([[0, 1, 1]] * 2)
    starts, ends = torch.tensor([0, 2]), torch.tensor([3, 4])
    mask, positions, cols = step_inputs(anc, depths, starts, ends, 8, torch.float32)
    seen = mask[:, 0] == 0  # [R, N, C]
    assert seen[0, 2].tolist() == [1, 1, 1, 1, 0, 1, 0, 0]  # prefix 0..2, root at 3, itself at 5
    assert seen[1, 1].tolist() == [0, 0, 1, 1, 1, 1, 0, 0]  # prefix 2..3, root at 4, itself at 5
    assert positions.tolist() == [[3, 4, 4], [2, 3, 3]]
    assert cols.tolist() == [[3, 4, 5], [4, 5, 6]]


# ---- static shapes, eager: every family ----------------------------------------------------------


def test_static_step_greedy_equals_hf_on_every_family(tiny_model):
    ids = _prompts(1)[0]
    ref = hf_greedy(tiny_model, ids, 30)
    v = StaticVerifier(tiny_model)
    assert generate(v, None, ids, max_new_tokens=30).token_ids == ref
    for name, d in _drafters(ref, ids.numel()).items():
        assert generate(v, d, ids, max_new_tokens=30).token_ids == ref, name
    prompts = _prompts(3)
    refs = [hf_greedy(tiny_model, p, 20) for p in prompts]
    outs = generate(v, _noise_drafter(), prompts, max_new_tokens=20)
    assert [o.token_ids for o in outs] == refs


def test_rows_join_and_leave_the_slots_without_changing_anyones_output(llama):
    prompts = _prompts(6)
    limits = [5, 30, 12, 30, 8, 20]
    refs = [hf_greedy(llama, p, n) for p, n in zip(prompts, limits)]
    v = StaticVerifier(llama)
    engine = Engine(v, _noise_drafter(), max_rows=3)
    for p, n in zip(prompts, limits):
        queue(engine, p, max_new_tokens=n)
    out: dict[int, list[int]] = {}
    shapes = set()
    while engine.busy:
        for c in engine.step().chunks:
            out.setdefault(c.index, []).extend(c.token_ids)
        if v.slots is not None:
            shapes.add(v.slots.shape[0])
            assert v.slots.shape[0] == bucket(max(v.rows, 1), (1, 2, 4, 8))
    assert [out[i] for i in range(6)] == refs
    assert shapes <= {1, 2, 4}
    assert set(k[1] for k in v._buffers) <= set(NODE_BUCKETS)  # every pass ran at a bucketed node count


def test_the_capacity_grows_by_buckets_never_per_step(llama):
    ids = _prompts(1, lengths=(200,))[0]
    ref = hf_greedy(llama, ids, 120)
    v = StaticVerifier(llama)
    caps = []
    engine = Engine(v, OracleDrafter(ref, ids.numel()))
    queue(engine, ids, max_new_tokens=120)
    tokens = []
    while engine.busy:
        tokens += [t for c in engine.step().chunks for t in c.token_ids]
        if v.slots is not None:
            caps.append(v.slots.shape[1])
    assert tokens == ref
    assert sorted(set(caps)) == [512]  # 200 + 120 + a tree: one capacity from the prefill on


# ---- --compile auto / on / off -------------------------------------------------------------------


def test_auto_compiles_on_a_cpu_only_where_this_machine_measured_it_faster(llama, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    assert not artifacts_cached("cpu")  # frozen, prepacked weights: Inductor cannot keep a CPU step's graphs
    monkeypatch.setattr("infer.core.static.artifacts_cached", lambda device: True)  # as where it could
    assert resolve_compile("off", llama) == (False, "off")
    assert resolve_compile("on", llama) == (True, "on")
    on, why = resolve_compile("auto", llama)
    assert not on and "not measured" in why
    write_verdict(llama, {"faster": True, "speedup": 1.2})
    assert resolve_compile("auto", llama) == (True, "auto: measured 1.20x")
    write_verdict(llama, {"faster": False, "speedup": 0.9})
    assert resolve_compile("auto", llama)[0] is False
    assert read_verdict(llama)["speedup"] == 0.9
    assert json.loads((tmp_path / "compile.json").read_text())  # one file, whole
    monkeypatch.setattr("infer.core.static.artifacts_cached", lambda device: False)
    write_verdict(llama, {"faster": True, "speedup": 1.2})
    assert resolve_compile("auto", llama)[0] is False  # nothing kept across processes: never worth it


def test_a_bad_compile_choice_is_one_line_before_any_work(llama):
    with pytest.raises(UserError, match="compile must be one of auto, on, off"):
        Engine(llama, None, compile="yes")


def test_the_stats_say_which_step_ran(llama, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    ids = _prompts(1)[0]
    assert generate(llama, None, ids, max_new_tokens=3).stats.step_path == "eager"
    assert generate(StaticVerifier(llama), None, ids, max_new_tokens=3).stats.step_path == "static"
    assert static_for(Verifier(llama), "auto").path.reason.startswith("auto: compiled afresh in every process")


# ---- compiled: Dynamo on every family -------------------------------------------------------------


@pytest.mark.slow
def test_compiled_step_greedy_equals_hf_on_every_family(tiny_model):
    """The one-row graphs of each family (one node, and more); the batched graphs are the Inductor tests'."""
    ids = _prompts(1)[0]
    ref = hf_greedy(tiny_model, ids, 24)
    torch._dynamo.reset()
    v = StaticVerifier(tiny_model, compile="eager")
    v.warm_up(1)
    with torch.compiler.set_stance("fail_on_recompile"):
        for name, d in _drafters(ref, ids.numel()).items():
            assert generate(v, d, ids, max_new_tokens=24).token_ids == ref, name


# ---- compiled: one small model, every property ----------------------------------------------------


def _small_model():
    return tiny_random_model("llama", vocab_size=V8, hidden_size=32, seed=3, initializer_range=0.5)


@pytest.fixture(scope="module")
def traced():
    """A vocabulary-8 model's static verifier compiled by Dynamo with a backend that keeps the FX
    graphs it is handed (what Inductor would compile) and runs them as they are, warmed up for up
    to 4 rows: the graphs, the guards and the recompilations are Dynamo's whatever the backend."""
    model = _small_model()
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    v = StaticVerifier(model, compile=keep)
    v.warm_up(4)
    return model, v, graphs


@pytest.fixture(scope="module")
def inductor():
    """The same model's static verifier compiled by Inductor (as ``--compile on`` does on a CPU),
    warmed up for one row (its two graphs: Inductor's code generation is what costs CI time)."""
    model = _small_model()
    v = StaticVerifier(model, compile=True)  # its graphs join the traced ones' (no reset: both stay cached)
    v.warm_up(1)
    return model, v


@pytest.mark.slow
def test_compiled_greedy_equals_hf_alone_and_batched_with_no_recompilation(traced, inductor):
    model, v, graphs = traced
    unique = torch._dynamo.utils.counters["stats"]
    warm = unique["unique_graphs"]
    assert warm == 4 + 2  # rows 1 and more than 1 by nodes 1 and more than 1, and Inductor's one-row pair
    prompts = [torch.tensor(p) for p in ([1, 5, 2, 7, 3], [4, 4, 1], [2, 6, 3, 3, 1, 7, 5, 0, 2], [6, 1])]
    refs = [hf_greedy(model, p, 40) for p in prompts]
    with torch.compiler.set_stance("fail_on_recompile"):  # a long mixed run: any recompilation raises
        for compiled in (v, inductor[1]):
            for name, d in _drafters(refs[0], prompts[0].numel(), V8).items():
                assert generate(compiled, d, prompts[0], max_new_tokens=40).token_ids == refs[0], name
        engine = Engine(v, _noise_drafter(V8), max_rows=3)
        for p, n in zip(prompts * 2, [40, 10, 40, 25] * 2):
            queue(engine, p, max_new_tokens=n)
        out: dict[int, list[int]] = {}
        while engine.busy:
            for c in engine.step().chunks:
                out.setdefault(c.index, []).extend(c.token_ids)
    expect = [r[:n] for r, n in zip(refs * 2, [40, 10, 40, 25] * 2)]
    assert [out[i] for i in range(8)] == expect
    assert unique["unique_graphs"] == warm
    assert not torch._dynamo.utils.counters["graph_break"]


@pytest.mark.slow
def test_no_compiled_graph_holds_an_operation_that_makes_the_host_wait(traced):
    """Inside a graph the dispatch-level counter cannot look (it turns Dynamo off), so the graphs
    Dynamo hands the compiler are read: no ``item``/``nonzero``/``tolist``-like operation, and no
    graph break (a break is where Dynamo hands a host read back to Python)."""
    _, _, graphs = traced
    found = host_syncs(graphs)
    assert len(graphs) >= 4 and not found, found
    assert not torch._dynamo.utils.counters["graph_break"]


@pytest.mark.slow
def test_a_compiled_step_reads_the_host_at_most_twice(traced):
    """Counted with the dispatch-level counter around whole steps: under it Dynamo is off and the
    compiled function runs as the eager code it was traced from, so the count bounds what the
    compiled step reads (the graphs read nothing, see the test above). A plain step: the
    acceptance's one read back and the roots' copy to the device. A drafting step of a drafter
    that drafts on the host: at most two reads (the draft's own copies to the device are the
    drafter's, counted apart). A step at which a row leaves also copies the kept slots' order and
    their ends to the device."""
    from infer.core.diagnostics import HostReadCounter

    _, v, _ = traced
    ids = torch.tensor([1, 5, 2, 7, 3])
    for drafter, limit in ((None, 2), (OracleDrafter([1] * 40, ids.numel(), chain(3), vocab=V8), 2)):
        engine = Engine(v, drafter, max_rows=2)
        queue(engine, ids, max_new_tokens=30)
        queue(engine, ids[:3], max_new_tokens=20)
        engine.step()  # the join
        counts, leaving = [], []
        while engine.busy:
            rows = len(engine.rows)
            with HostReadCounter() as c:
                engine.step()
            n = c.total - (c.counts.get("h2d", 0) if drafter is not None else 0)
            (counts if len(engine.rows) == rows else leaving).append(n)
        assert counts and max(counts) <= limit, counts
        assert leaving and max(leaving) <= limit + 2, leaving  # a row leaving: the slots' new order, and ends


@pytest.mark.slow
def test_compiled_sampling_matches_plain_sampling(inductor):
    from test_sampling import PROMPT, Q_FAR, FixedQDrafter, chi_square_pvalue, exact_joint, spec_counts

    model, v = inductor
    probs = exact_joint(model, 1.0, 0, 1.0)
    with torch.compiler.set_stance("fail_on_recompile"):
        # one row at a time (the fixture compiled the one-row graphs alone), in this process with
        # its thread count (Dynamo's guards hold the count the graphs were compiled with)
        for drafter in (None, FixedQDrafter(Q_FAR, "iid")):
            counts = spec_counts(v, drafter, 1.0, 0, 1.0, rows=1, workers=1)
            assert chi_square_pvalue(counts, probs) > 1e-3
    assert PROMPT.numel() == 5


def test_the_inductor_step_multiplies_by_prepacked_weights_not_stock_mm():
    """On a CPU :func:`compile_step` freezes the weights into its graphs, so that Inductor
    prepacks the linears (MKL or oneDNN): profiled, a compiled pass runs no ``aten::mm``. Without
    the weights frozen (Dynamo traces them as inputs unless Inductor's global ``freezing`` is set
    when it traces), every linear stays a stock ``mm``, which measured 1.3x slower on the 2-core
    EPYC. A step of its own (a new code object: the shared fixtures' graphs are not disturbed)."""
    from torch.profiler import profile

    from infer.core.static import compile_step

    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(32, 64, bias=False), torch.nn.Linear(64, 32, bias=False)).eval()

    def step(x):
        return layers(x)

    compiled = compile_step(step, torch.device("cpu"))
    x = torch.randn(1, 3, 32)
    with torch.inference_mode():
        compiled(x)
        with profile() as prof:
            y = compiled(x)
        assert torch.allclose(y, layers(x), atol=1e-5)
    names = {e.key for e in prof.key_averages()}
    assert "aten::mm" not in names and "aten::addmm" not in names, sorted(names)
    assert any("linear" in n for n in names), sorted(names)


class _Held:
    """A step that reads its module off ``self``, as the verifier's step reads its model: every
    instance shares one code object, so Dynamo's cache holds their graphs side by side."""

    def __init__(self, layers):
        self.layers = layers

    def step(self, x):
        return self.layers(x)


def test_a_model_of_the_same_shapes_gets_a_compiled_graph_of_its_own():
    """The compiled step skips Dynamo's guards on the modules' hooks and attributes, and keeps
    those on the weights: frozen into the graph, another model's weights (same shapes, same code)
    must not run through the first model's graph."""
    from infer.core.static import compile_step

    x = torch.randn(1, 3, 32)
    for seed in (0, 1):
        torch.manual_seed(seed)
        layers = torch.nn.Sequential(torch.nn.Linear(32, 64, bias=False), torch.nn.Linear(64, 32, bias=False)).eval()
        compiled = compile_step(_Held(layers).step, torch.device("cpu"))
        with torch.inference_mode():
            assert torch.allclose(compiled(x), layers(x), atol=1e-5), seed


def test_the_guards_skipped_are_the_modules_hooks_attributes_and_types():
    from types import SimpleNamespace

    from infer.core.static import module_guards_kept

    def entry(kind, in_module):
        source = SimpleNamespace(is_unspecialized_nn_module=lambda: in_module)
        return SimpleNamespace(guard_type=kind, orig_guard=SimpleNamespace(source=source))

    entries = [entry("EMPTY_NN_MODULE_HOOKS_DICT", True), entry("CONSTANT_MATCH", True), entry("TYPE_MATCH", True),
               entry("TENSOR_MATCH", True), entry("ID_MATCH", True), entry("CONSTANT_MATCH", False),
               entry("TENSOR_MATCH", False)]
    assert module_guards_kept(entries) == [False, False, False, True, True, True, True]
