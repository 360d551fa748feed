"""Fixes found by reading the code, each pinned by a test that failed before:
sampling never reseeds the global generators and takes a generator on any device; tau does
not count the prefill's token; a oneDNN kernel on a GPU is refused; ``--compare`` times
sampling against sampling; a union member that reports ``q`` is named in a warning;
``Speculator.from_pretrained`` takes ``linear`` and ``draft_dtype``."""

import json

import pytest
import torch

from conftest import run_cli as run
from infer import generate
from infer.core.drafter import Draft, Drafter, NoDrafter
from infer.core.engine import sampling_generator
from infer.core.errors import UserError
from infer.core.tree import build_tree
from infer.drafting.lookup import PromptLookupDrafter
from infer.drafting.union import UnionDrafter

PROMPT = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])


def test_unseeded_sampling_leaves_the_global_generator_alone(llama):
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = generate(llama, None, PROMPT, max_new_tokens=8, temperature=1.0)
    assert torch.equal(torch.get_rng_state(), state)  # torch.seed() reseeded it before
    b = generate(llama, None, PROMPT, max_new_tokens=8, temperature=1.0)
    assert len(a.token_ids) == len(b.token_ids) == 8


def test_a_users_generator_is_used_and_advanced(llama):
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    a = generate(llama, PromptLookupDrafter(), PROMPT, max_new_tokens=12, temperature=1.0, generator=g1)
    b = generate(llama, PromptLookupDrafter(), PROMPT, max_new_tokens=12, temperature=1.0, generator=g2)
    assert a.token_ids == b.token_ids and torch.equal(g1.get_state(), g2.get_state())
    assert not torch.equal(g1.get_state(), torch.Generator().manual_seed(9).get_state())


def test_a_generator_on_another_device_seeds_one_on_the_verifiers():
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run by make gpu-check's pytest line)")
def test_cpu_generator_with_a_cuda_verifier():
    from infer.core.models import tiny_random_model

    model = tiny_random_model("llama", vocab_size=256, seed=1).cuda()
    outs = [generate(model, PromptLookupDrafter(), PROMPT, max_new_tokens=10, temperature=1.0,
                     generator=torch.Generator().manual_seed(2)).token_ids for _ in range(2)]
    assert outs[0] == outs[1] and len(outs[0]) == 10


def test_tau_counts_only_the_verify_passes_tokens(llama):
    res = generate(llama, NoDrafter(), PROMPT, max_new_tokens=20)
    assert res.stats.new_tokens == 20 and res.stats.verify_steps == 19
    assert res.stats.mean_accepted == 1.0  # was 20 / 19


def test_onednn_on_a_gpu_is_refused_before_loading(capsys):
    code, _, err = run(["generate", "--verifier", "tiny-random:llama", "--prompt", "hi", "--device", "cuda",
                        "--linear", "onednn"], capsys)
    assert code == 2 and "onednn is a CPU kernel" in err and "Traceback" not in err
    code, _, err = run(["bench", "--verifier", "tiny-random:llama", "--prompts", "x.jsonl", "--out", "/tmp/never.json",
                        "--device", "cuda:0", "--linear", "auto,onednn"], capsys)
    assert code == 2 and "onednn is a CPU kernel" in err


def test_onednn_kernel_for_a_model_off_the_cpu_is_refused(llama):
    from infer.core.kernels import linear_kernel
    from infer.core.models import tiny_random_model

    meta = tiny_random_model("llama", vocab_size=256, seed=1).to("meta")
    with pytest.raises(UserError, match="CPU kernel"):
        linear_kernel(meta, "onednn")
    assert linear_kernel(meta, "auto") == "stock"


def test_compare_times_sampling_against_sampling(capsys, monkeypatch):
    import infer.tools.bench

    calls = []
    real = infer.tools.bench.hf_generate

    def spy(model, ids, n, eos, **kw):
        calls.append(kw)
        return real(model, ids, n, eos, **kw)

    monkeypatch.setattr(infer.tools.bench, "hf_generate", spy)
    state = torch.get_rng_state()
    code, out, _ = run(["generate", "--verifier", "tiny-random:llama", "--prompt", "hello", "--max-new-tokens", "6",
                        "--temperature", "0.7", "--top-k", "20", "--seed", "3", "--compare", "--json"], capsys)
    assert code == 0
    assert calls and all(kw == {"do_sample": True, "temperature": 0.7, "top_p": 1.0, "top_k": 20} for kw in calls)
    report = json.loads(out.strip().splitlines()[-1])["compare"]
    assert report["plain"] == "sampling"
    assert torch.equal(torch.get_rng_state(), state)  # HF's sampling ran on a forked generator
    calls.clear()
    code, out, _ = run(["generate", "--verifier", "tiny-random:llama", "--prompt", "hello", "--max-new-tokens", "6",
                        "--compare", "--json"], capsys)
    assert code == 0 and calls and all(kw == {} for kw in calls)
    assert json.loads(out.strip().splitlines()[-1])["compare"]["output_vs_plain"] == "identical"


class DrawnDrafter(Drafter):
    """Reports the q its one child was drawn from."""

    def propose(self, root, *, tree=None, max_depth=8, generator=None):
        q = torch.full((2, 256), 1 / 256)
        return Draft(torch.tensor([root, 7]), build_tree([-1, 0]), q)


def test_a_union_member_with_q_is_named_not_dropped_silently(llama):
    union = UnionDrafter([PromptLookupDrafter(), DrawnDrafter()])
    with pytest.warns(UserWarning, match=r"member 1 \(DrawnDrafter\).*left out of the union"):
        generate(llama, union, PROMPT, max_new_tokens=6, temperature=1.0, seed=0)
    first = UnionDrafter([DrawnDrafter(), PromptLookupDrafter()])
    with pytest.warns(UserWarning, match=r"member 0 \(DrawnDrafter\).*verified alone"):
        generate(llama, first, PROMPT, max_new_tokens=6, temperature=1.0, seed=0)


def test_speculator_from_pretrained_takes_linear_and_draft_dtype():
    from infer import Speculator

    spec = Speculator.from_pretrained("tiny-random:llama", draft="pld", linear="onednn", draft_dtype="bf16")
    assert spec._verifier.kernel == "onednn"
    assert Speculator.from_pretrained("tiny-random:llama", draft="none", linear="stock")._verifier.kernel == "stock"
    with pytest.raises(UserError, match="CPU kernel"):
        Speculator.from_pretrained("tiny-random:llama", draft="none", device="cuda", linear="onednn")
    with pytest.raises(UserError):
        Speculator.from_pretrained("tiny-random:llama", draft="none", linear="fast")
