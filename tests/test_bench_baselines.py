"""Fair baselines in every benchmark table: HF ``generate`` also runs on the
engine's own linear kernel (``vanilla[onednn]``), and ``make bench`` reads prompts shipped in
the repository (Spec-Bench, with its license note), never ``../shared``."""

import hashlib
import json
import re
from pathlib import Path

import torch

from infer.core import kernels
from infer.tools.cli import main
from infer.tools.prompts import MT_BENCH_GROUP, read_prompts

ROOT = Path(__file__).resolve().parent.parent


def test_bench_runs_hf_generate_on_the_engines_kernel(tmp_path, capsys, monkeypatch):
    calls = {"hf": 0}
    real = kernels.onednn_linear

    def counting(x, weight, bias=None):
        if weight.shape[1] == 64:  # the tiny verifier's hidden size: its own layers, not a probe
            calls["hf"] += 1
        return real(x, weight, bias)

    monkeypatch.setattr(kernels, "onednn_linear", counting)
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": p, "category": c}) for p, c in
                           [("count: 1 2 3 1 2 3 1 2", "a"), ("say hi hi hi hi", "b")]) + "\n")
    out = tmp_path / "r.json"
    code = main(["bench", "--verifier", "tiny-random:llama", "--prompts", str(f), "--max-new-tokens", "10",
                 "--draft", "pld", "--methods", "vanilla,spec", "--linear", "onednn,stock", "--out", str(out)])
    stdout = capsys.readouterr().out
    assert code == 0
    res = json.loads(out.read_text())
    assert list(res["methods"]) == ["vanilla", "vanilla[onednn]", "spec:pld", "spec:pld[stock]"]
    assert res["baselines"] == {"spec:pld": "vanilla[onednn]", "spec:pld[stock]": "vanilla"}
    hf_one = res["methods"]["vanilla[onednn]"]["overall"]
    assert hf_one["n"] == 2 and hf_one["identical"] == 2 and hf_one["tau"] == 1.0
    spec = res["methods"]["spec:pld"]["overall"]
    assert spec["speedup_same_kernel"] == spec["tokens_per_s"] / hf_one["tokens_per_s"]
    stock = res["methods"]["spec:pld[stock]"]["overall"]
    assert stock["speedup_same_kernel"] == stock["speedup"]  # on the stock kernel the baselines coincide
    assert "same-k." in stdout and "vanilla[onednn]" in stdout
    assert calls["hf"] > 0


def test_vanilla_on_onednn_really_runs_there(llama, monkeypatch):
    """HF generate inside the kernel's context routes the verifier's linears to oneDNN."""
    from infer.tools.bench import hf_generate

    seen = []
    real = kernels.onednn_linear
    monkeypatch.setattr(kernels, "onednn_linear", lambda x, w, b=None: seen.append(w.shape) or real(x, w, b))
    ids = torch.tensor([1, 2, 3, 4])
    plain = hf_generate(llama, ids, 6, [])
    assert not seen
    with kernels.kernel_context("onednn"):
        routed = hf_generate(llama, ids, 6, [])
    assert seen and routed == plain


def test_make_bench_reads_only_prompts_shipped_in_the_repo():
    recipe = (ROOT / "Makefile").read_text().split("\nbench:", 1)[1].split("\n\n", 1)[0]
    paths = re.findall(r"--prompts\s+(\S+)", recipe)
    assert paths and all(not p.startswith("..") and (ROOT / p).is_file() for p in paths), paths
    assert "../shared" not in (ROOT / "Makefile").read_text()


def test_the_shipped_spec_bench_is_spec_benchs_file_with_its_license():
    f = ROOT / "configs" / "prompts" / "spec_bench.jsonl"
    assert hashlib.sha256(f.read_bytes()).hexdigest() == "4b6d33e79484f9841c487ee87d1cf6aa8c6066f61d5d482ff09e5a007fafdf04"
    prompts = read_prompts(f, limit=10, group=MT_BENCH_GROUP)
    assert len(prompts) == 60 and len({p.category for p in prompts}) == 6
    note = (ROOT / "configs" / "prompts" / "README.md").read_text()
    assert "Apache-2.0" in note and "hemingkx/Spec-Bench" in note
    assert "Apache License" in (ROOT / "configs" / "prompts" / "LICENSE-Apache-2.0.txt").read_text()


def test_compare_times_sampling_against_sampling(capsys, monkeypatch):
    import json

    import infer.tools.bench
    from conftest import run_cli as run

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
