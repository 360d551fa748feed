"""The verifier's CPU linear kernel (infer.core.kernels): oneDNN computes what F.linear computes, only
float32 CPU inference calls are routed, the engine stays exact on it for every family, and
``auto`` picks by measurement (stock on GPUs, half precision and toy models)."""

import pytest
import torch
import torch.nn.functional as F

from conftest import VOCAB, commit_one, hf_greedy, prefill_one, verify_one
from infer import generate
from infer.core import kernels
from infer.core.errors import UserError
from infer.core.models import tiny_random_model
from infer.core.tree import build_tree
from infer.core.verifier import Verifier
from infer.testing import OracleDrafter
from infer.tools.cli import bench_kernels

pytestmark = pytest.mark.skipif(not kernels.onednn_available(), reason="this PyTorch build has no oneDNN float32 linear")


@pytest.mark.parametrize("shape", [(1, 64), (3, 64), (2, 5, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_matches_f_linear(shape, bias):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(*shape, generator=g), torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    ours = kernels.onednn_linear(x, w, b)
    assert ours.shape == (*shape[:-1], 96)
    torch.testing.assert_close(ours, F.linear(x, w, b), atol=1e-5, rtol=1e-5)


@pytest.fixture
def onednn_rows(monkeypatch):
    """The row count of every product routed to oneDNN, in order."""
    rows = []
    real = kernels.onednn_linear
    monkeypatch.setattr(kernels, "onednn_linear", lambda *a: rows.append(a[0].numel() // a[0].shape[-1]) or real(*a))
    return rows


def test_mode_routes_only_float32_cpu_inference(monkeypatch):
    calls = []
    real = kernels.onednn_linear
    monkeypatch.setattr(kernels, "onednn_linear", lambda *a: calls.append(a[0].dtype) or real(*a))
    lin = torch.nn.Linear(8, 4)
    half = torch.nn.Linear(8, 4).to(torch.bfloat16)
    x = torch.randn(3, 8)
    with kernels.OneDNNLinear():
        with torch.inference_mode():
            routed = lin(x)
            half(x.to(torch.bfloat16))  # PyTorch's own bf16 path already is oneDNN
        trained = lin(x)  # autograd on: left to the stock kernel
    assert calls == [torch.float32]
    assert trained.requires_grad
    torch.testing.assert_close(routed, trained.detach(), atol=1e-6, rtol=1e-6)


def test_tree_logits_on_onednn_equal_stock_sequential_logits(tiny_model):
    """Every family: the tree pass on oneDNN matches plain HF forwards on the stock kernel."""
    prefix, tokens, parents = [3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5], [-1, 0, 0, 1, 1, 3]
    v = Verifier(tiny_model, feature_layers=(-1,), linear="onednn")
    assert v.kernel == "onednn"
    prefill_one(v, torch.tensor(prefix))
    tree = build_tree(parents)
    out = verify_one(v, torch.tensor(tokens), tree)
    for i in range(tree.num_nodes):
        path = tree.ancestor_mask[i].nonzero().flatten().tolist()
        with torch.no_grad():
            ref = tiny_model(torch.tensor(prefix + [tokens[j] for j in path])[None], output_hidden_states=True)
        torch.testing.assert_close(out.logits[i], ref.logits[0, -1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out.features[i, 0], ref.hidden_states[-1][0, -1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("linear", ["onednn", "hybrid"])
@pytest.mark.parametrize("p_right", [1.0, 0.0, 0.5])  # oracle, always wrong, random
def test_speculative_greedy_on_the_onednn_kernels_equals_vanilla_greedy(tiny_model, p_right, linear):
    prompt = torch.randint(0, VOCAB, (7,), generator=torch.Generator().manual_seed(11))
    ref = hf_greedy(tiny_model, prompt, 40)
    drafter = OracleDrafter(ref, 7, [-1, 0, 1, 0, 3, 1], p_right=p_right, seed=2)
    res = generate(Verifier(tiny_model, linear=linear), drafter, prompt, max_new_tokens=40)
    assert res.token_ids == ref
    if p_right == 1.0:
        assert res.stats.mean_accepted > 2
    if p_right == 0.0:
        assert res.stats.accepted_hist[1] == res.stats.verify_steps  # every step: the bonus token only


def test_auto_keeps_stock_for_toy_half_precision_and_gpu_models(llama, monkeypatch):
    monkeypatch.setattr(kernels, "measure_linear", lambda w: pytest.fail("toy models are not timed"))
    assert Verifier(llama).kernel == "stock"  # output projection of 256 x 64 weights
    assert kernels.linear_kernel(tiny_random_model("llama", vocab_size=VOCAB).to(torch.bfloat16)) == "stock"
    assert kernels.linear_kernel(llama, "stock") == "stock"
    assert kernels.linear_kernel(llama, "onednn") == "onednn"
    assert kernels.linear_kernel(llama, "hybrid") == "hybrid"
    with pytest.raises(UserError, match="linear kernel must be one of auto, stock, onednn, hybrid"):
        kernels.linear_kernel(llama, "mkl")


def _times(one, four, eight):
    return {1: one, 4: four, 8: eight}


FASTER_ON_ONEDNN = {"stock": _times(0.011, 0.018, 0.020), "onednn": _times(0.005, 0.006, 0.007)}


def _forwards(stock, onednn):
    """Whole-forward seconds for 1, 2 and 8 tokens per kernel (:func:`kernels.measure_forwards`)."""
    return {"stock": dict(zip((1, 2, 8), stock)), "onednn": dict(zip((1, 2, 8), onednn))}


@pytest.mark.parametrize("measured,forwards,expected", [
    (FASTER_ON_ONEDNN, _forwards((0.080, 0.090, 0.100), (0.070, 0.075, 0.080)), "onednn"),
    # the 2-core AVX2 EPYC CPU: oneDNN wins the output projection and tree passes, a one-token forward is slower on it
    (FASTER_ON_ONEDNN, _forwards((0.067, 0.120, 0.110), (0.078, 0.080, 0.085)), "hybrid"),
    # a Xeon with AMX: oneDNN wins the output projection, every whole forward is slower on it
    (FASTER_ON_ONEDNN, _forwards((0.031, 0.034, 0.058), (0.050, 0.061, 0.068)), "stock"),
    # faster on 8 tokens, slower on 2: the tree-sized forwards are judged summed
    (FASTER_ON_ONEDNN, _forwards((0.031, 0.034, 0.070), (0.030, 0.061, 0.060)), "stock"),
    ({"stock": _times(0.006, 0.007, 0.008), "onednn": _times(0.006, 0.007, 0.007)}, None, "stock"),  # not clearly faster
    ({"stock": _times(0.006, 0.018, 0.020), "onednn": _times(0.012, 0.030, 0.040)}, None, "stock")])
def test_auto_measures_once_per_model_and_keeps_onednn_only_where_clearly_faster(monkeypatch, measured, forwards, expected):
    big = tiny_random_model("llama", vocab_size=16384, hidden_size=64, num_layers=1)  # 1M output weights
    probes, timed = [], []
    monkeypatch.setattr(kernels, "measure_linear", lambda w: probes.append(w.shape) or measured)
    monkeypatch.setattr(kernels, "measure_forwards", lambda m: timed.append(m) or forwards or pytest.fail("not needed"))
    assert Verifier(big).kernel == expected
    assert Verifier(big).kernel == expected
    assert probes == [(16384, 64)]
    assert timed == ([big] if forwards else [])  # the forwards are timed only where oneDNN won the products


def test_measure_forwards_times_each_token_count_on_both_kernels(llama, onednn_rows):
    out = kernels.measure_forwards(llama, rows=(1, 3), repeats=1)
    assert set(out) == {"stock", "onednn"}
    assert all(set(t) == {1, 3} and min(t.values()) > 0 for t in out.values())
    assert 3 in onednn_rows  # the oneDNN timing really ran the 3-token forward there


def test_hybrid_verifier_runs_one_token_passes_and_long_prompts_with_no_mode_and_tree_passes_on_onednn(tiny_model, onednn_rows):
    rows = onednn_rows
    v = Verifier(tiny_model, linear="hybrid")
    prefill_one(v, torch.tensor([3, 1, 4]))
    assert 3 in rows and 1 not in rows  # the prompt's products on oneDNN
    rows.clear()
    verify_one(v, torch.tensor([5]), build_tree([-1]))
    assert rows == []
    commit_one(v, torch.tensor([0]), [0])
    verify_one(v, torch.tensor([5, 9, 2]), build_tree([-1, 0, 0]))
    assert 3 in rows and 1 not in rows
    rows.clear()
    prefill_one(v, torch.arange(kernels.HYBRID_MAX_ROWS + 1))  # a long prompt: the stock kernel, faster there
    assert rows == []


def test_measure_linear_times_both_kernels():
    out = kernels.measure_linear(torch.randn(32, 16), rows=(1, 2), repeats=1)
    assert set(out) == {"stock", "onednn"}
    assert all(set(t) == {1, 2} and min(t.values()) > 0 for t in out.values())


def test_hybrid_routes_only_products_of_two_or_more_rows(onednn_rows):
    rows = onednn_rows
    lin = torch.nn.Linear(8, 4)
    with torch.inference_mode():
        xs = [torch.randn(*shape) for shape in [(1, 8), (1, 1, 8), (8,), (2, 8), (1, 5, 8)]]
        with kernels.kernel_context("hybrid"):
            got = [lin(x) for x in xs]
        for x, y in zip(xs, got):
            torch.testing.assert_close(y, F.linear(x, lin.weight, lin.bias), atol=1e-6, rtol=1e-6)
    assert rows == [2, 5]  # one-row products (decoding, a paused draft) stay on the stock kernel


def test_bench_kernel_list_is_checked():
    assert bench_kernels("auto, stock") == ["auto", "stock"]
    for bad in ("", "auto,auto", "auto,mkl"):
        with pytest.raises(UserError, match="--linear"):
            bench_kernels(bad)


def test_onednn_on_a_gpu_is_refused_before_loading(capsys):
    from conftest import run_cli as run

    code, _, err = run(["generate", "--verifier", "tiny-random:llama", "--prompt", "hi", "--device", "cuda",
                        "--linear", "onednn"], capsys)
    assert code == 2 and "onednn is a CPU kernel" in err and "Traceback" not in err
    code, _, err = run(["bench", "--verifier", "tiny-random:llama", "--prompts", "x.jsonl", "--out", "/tmp/never.json",
                        "--device", "cuda:0", "--linear", "auto,onednn"], capsys)
    assert code == 2 and "onednn is a CPU kernel" in err


def test_onednn_kernel_for_a_model_off_the_cpu_is_refused(llama):
    from infer.core.errors import UserError
    from infer.core.kernels import linear_kernel
    from infer.core.models import tiny_random_model

    meta = tiny_random_model("llama", vocab_size=256, seed=1).to("meta")
    with pytest.raises(UserError, match="CPU kernel"):
        linear_kernel(meta, "onednn")
    assert linear_kernel(meta, "auto") == "stock"
