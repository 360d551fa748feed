"""Bad inputs are refused at once, in one line, before any work (issue: review fixes).

Argument errors must not wait for a model to load: every test here makes loading a verifier
fail loudly, so an argument that is only checked after loading fails the test."""

import json
import os

import pytest
import torch

from conftest import bench_stopped_at_prompt_two
from conftest import run_cli as run
from infer import SamplingParams, generate
from infer.core.errors import UserError
from infer.core.models import tiny_random_model

TINY = ["--verifier", "tiny-random:llama"]


@pytest.fixture
def no_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a verifier was loaded before the arguments were checked")

    monkeypatch.setattr("infer.core.models.load_verifier", refuse)


def one_line_error(code, err, message):
    assert code == 2, err
    assert err.startswith("specheads: error:") and err.count("\n") == 1, err
    assert message in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", *TINY, "--prompt", "x", "--max-new-tokens", "-1"], "max_new_tokens"),
        (["generate", *TINY, "--prompt", "x", "--temperature", "-0.5"], "temperature"),
        (["generate", *TINY, "--prompt", "x", "--temperature", "nan"], "temperature"),
        (["generate", *TINY, "--prompt", "x", "--top-p", "0"], "top_p"),
        (["generate", *TINY, "--prompt", "x", "--seed", str(2**64)], "seed"),
        (["generate", *TINY, "--prompt", "x", "--seed", "-3"], "seed"),
        (["generate", *TINY, "--prompt", "x", "--device", "nonsense"], "unknown device"),
        (["generate", *TINY, "--prompt", "x", "--dtype", "int8"], "invalid choice"),
        (["generate", *TINY, "--prompt", "abc\udcff"], "not valid UTF-8"),
        (["chat", *TINY, "--temperature", "-1"], "temperature"),
        (["chat", *TINY, "--seed", str(2**70)], "seed"),
        (["bench", *TINY, "--prompts", "p.jsonl", "--out", "r.json", "--max-new-tokens", "0"], "max_new_tokens"),
        (["bench", *TINY, "--prompts", "p.jsonl", "--out", "r.json", "--temperature", "-1"], "temperature"),
        (["bench", *TINY, "--prompts", "p.jsonl", "--out", "r.json", "--seed", str(2**64)], "seed"),
        (["cost", *TINY, "--device", "cuda:7"], "device"),
    ],
)
def test_argument_errors_come_before_loading(argv, message, capsys, no_loading):
    if "--device" in argv and "cuda" in argv[argv.index("--device") + 1] and torch.cuda.device_count() > 7:
        pytest.skip("this machine has that GPU")
    one_line_error(*run(argv, capsys)[::2], message)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_one_line(capsys, no_loading):
    code, _, err = run(["generate", *TINY, "--prompt", "x", "--device", "cuda"], capsys)
    one_line_error(code, err, "no CUDA device")


def test_a_tree_file_holding_a_list_is_one_line(tmp_path, capsys, no_loading):
    f = tmp_path / "tree.json"
    f.write_text("[[0], [0, 0]]")
    code, _, err = run(["generate", *TINY, "--prompt", "x", "--tree", str(f)], capsys)
    one_line_error(code, err, "JSON object")


@pytest.fixture
def prompts(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"Repeat: one two {i} one two {i}", "category": c}) + "\n"
                         for i, c in enumerate(["a", "b", "a"])))
    return f


@pytest.mark.parametrize("out, plot, message", [
    ("/proc/specheads-x.json", None, "cannot write"),
    ("{tmp}/missing/dir/r.json", None, "does not exist"),
    ("{tmp}", None, "is a directory"),
    ("{tmp}/r.json", "/proc/specheads-x.png", "cannot write"),
])
def test_bench_output_paths_are_checked_before_the_run(tmp_path, prompts, capsys, no_loading, out, plot, message):
    out = out.format(tmp=tmp_path)
    argv = ["bench", *TINY, "--prompts", str(prompts), "--out", out] + (["--plot", plot] if plot else [])
    before = set(os.listdir(tmp_path))
    one_line_error(*run(argv, capsys)[::2], message)
    assert set(os.listdir(tmp_path)) == before  # nothing half-written, no stray temp file


def test_distill_out_a_directory_is_one_line(tmp_path, prompts, capsys):
    from train.distill import main as distill_main

    code = distill_main(["--verifier", "tiny-random:llama", "--prompts", str(prompts), "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "is a directory" in err and err.count("\n") == 1


def test_bench_keeps_each_prompt_and_resumes(tmp_path, prompts, capsys, monkeypatch):
    """A stopped benchmark keeps the prompts it measured; the same command measures only the rest."""
    out = tmp_path / "r.json"
    argv = ["bench", *TINY, "--draft", "pld", "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "8",
            "--methods", "vanilla,spec", "--tree-budget", "fixed"]
    with bench_stopped_at_prompt_two(monkeypatch):
        code, _, _ = run(argv, capsys)
    assert code == 130 and not out.exists()
    partial = tmp_path / "r.json.partial.jsonl"
    assert len(partial.read_text().splitlines()) == 2  # the fingerprint, then prompt 1
    other = [a if a != "8" else "9" for a in argv]  # other settings, same --out: refused, the progress kept
    code, _, err = run(other, capsys)
    one_line_error(code, err, "other settings")
    code, _, _ = run(argv, capsys)
    assert code == 0 and not partial.exists()
    rows = json.loads(out.read_text())["per_prompt"]
    assert len(rows) == 3 and rows[0]["prompt"].startswith("Repeat: one two 0")


def test_the_api_refuses_what_it_cannot_do():
    model = tiny_random_model("llama", vocab_size=256, seed=1)
    for ids, message in [
        (torch.zeros(1, 2, 5, dtype=torch.long), "shape"),
        (torch.tensor([1.0, 2.5]), "integer token ids"),
        (torch.tensor([True, False]), "integer token ids"),
        ("hello", "integer token ids"),
    ]:
        with pytest.raises(UserError, match=message):
            generate(model, None, ids, max_new_tokens=2)
    assert len(generate(model, None, torch.tensor([[1, 2, 3]]), max_new_tokens=2).token_ids) == 2
    rows = generate(model, None, torch.zeros(2, 5, dtype=torch.long), max_new_tokens=2)  # [B, L]: a batch
    assert [len(r.token_ids) for r in rows] == [2, 2]


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_new_tokens=True), "max_new_tokens"), (dict(max_new_tokens=2.0), "max_new_tokens"),
    (dict(temperature=float("inf")), "temperature"), (dict(top_k=1.5), "top_k"), (dict(seed=2**64), "seed"),
    (dict(acceptance="lossy"), "acceptance"),
])
def test_sampling_params_are_one_type_checked_once(kwargs, message):
    with pytest.raises(UserError, match=message):
        SamplingParams(**kwargs)
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1


@pytest.mark.parametrize("where, message", [("file", "is an existing file"), ("/proc/specheads-export", "cannot write")])
def test_export_out_is_checked_before_loading(tmp_path, capsys, monkeypatch, where, message):
    def refuse(*a, **k):
        raise AssertionError("the head was loaded before --out was checked")

    monkeypatch.setattr("heads.load_head", refuse)
    out = tmp_path / "exists.txt" if where == "file" else where
    if where == "file":
        out.write_text("x")
    code, _, err = run(["export", "--draft", str(tmp_path), "--format", "eagle3", "--out", str(out)], capsys)
    one_line_error(code, err, message)
