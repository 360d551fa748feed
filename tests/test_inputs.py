"""Bad inputs are refused at once, in one line, before any work.

Argument errors must not wait for a model to load: the tests here make loading a verifier fail
loudly, so an argument that is only checked after loading fails the test.

``REFUSED`` is the table of refused command lines: each is run through the CLI and must end in
one line on stderr, exit status 2, no traceback, and no model weights built or loaded. The same
table generates the section "## generate, chat, bench and the API" of docs/refused-inputs.md:

    PYTHONPATH=. python tests/test_inputs.py --write docs/refused-inputs.md

and ``test_the_refused_inputs_document_lists_every_case`` keeps the document in step with it.
Behaviour that is not a one-line refusal (concurrent generations, stop strings, chat turns,
resumed benchmarks) has its own tests below.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from conftest import bench_stopped_at_prompt_two
from conftest import run_cli as run
from infer import SamplingParams, generate
from infer.core.errors import UserError
from infer.core.models import tiny_random_model
from infer.tools.cli import main

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

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "refused-inputs.md"
SECTION = "## generate, chat, bench and the API"
GiB = 2**30


def _head_config(**change) -> str:
    """A specheads EAGLE-3 head config.json with some fields changed (the file only: no weights)."""
    d = {"head_type": "eagle3", "verifier": {"name": "tiny", "model_type": "llama", "hidden_size": 64, "vocab_size": 258,
                                             "num_layers": 2, "fingerprint": "s1-0"},
         "num_heads": 4, "num_layers": 1, "own_lm_head": False, "draft_vocab_size": 32, "aux_layers": [0, 1, 2],
         "eagle1_input_norm": True, "layer_config": {}, "training": {}, "format": "specheads"}
    for key, value in change.items():
        if key.startswith("verifier."):
            d["verifier"][key.split(".", 1)[1]] = value
        else:
            d[key] = value
    return json.dumps(d)


def _model_config(**change) -> str:
    d = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 1024}
    return json.dumps({**d, **change})


@dataclass
class Refused:
    """One refused command line: ``argv`` (``{tmp}`` is a fresh directory holding ``files``;
    a ``->`` value makes a symbolic link), the input the document names, and a part of the message."""

    what: str
    argv: list[str]
    message: str
    files: dict[str, str] = field(default_factory=dict)


LONG = "word " * 200_000  # a ~1 MB prompt line: a million tokens for the tiny model's byte tokenizer

REFUSED: list[Refused] = [
    Refused("--tree chain:-3", ["generate", *TINY, "--prompt", "x", "--tree", "chain:-3"], "tree depth must be a positive integer"),
    Refused("--tree chain:0", ["generate", *TINY, "--prompt", "x", "--tree", "chain:0"], "tree depth must be a positive integer"),
    Refused("--tree dynamic:0,4,16", ["generate", *TINY, "--prompt", "x", "--tree", "dynamic:0,4,16"], "tree depth must be a positive integer"),
    Refused("--tree chain:100000", ["generate", *TINY, "--prompt", "x", "--tree", "chain:100000"], "tree depth 100000 is beyond the limit of 64"),
    Refused("--tree dynamic:100,100,10000 --tree-budget fixed", ["generate", *TINY, "--prompt", "x", "--tree", "dynamic:100,100,10000", "--tree-budget", "fixed"],
            "beyond the limit of 64"),
    Refused("--tree dynamic:8,8,5000", ["generate", *TINY, "--prompt", "x", "--tree", "dynamic:8,8,5000"], "tree nodes 5000 is beyond the limit of 1024"),
    Refused("--tree dynamic:32,16,256 (8,193 candidates)", ["generate", *TINY, "--prompt", "x", "--tree", "dynamic:32,16,256"],
            "candidates, beyond the limit of 8192"),
    Refused("a tree file with a rank of 1000", ["generate", *TINY, "--prompt", "x", "--tree", "{tmp}/t.json"], "ranks are below the limit of 64",
            {"t.json": '{"type": "static", "choices": [[1000]]}'}),
    Refused("a tree file with no choices", ["generate", *TINY, "--prompt", "x", "--tree", "{tmp}/t.json"], "at least one choice",
            {"t.json": '{"type": "static", "choices": []}'}),
    Refused("cost --nodes 1,100000", ["cost", *TINY, "--nodes", "1,100000"], "--nodes 100000 is beyond the limit of 1024"),
    Refused("--draft pld+pld with the default verifier", ["generate", "--prompt", "x", "--draft", "pld+pld"], "names a drafter twice"),
    Refused("bench --draft pld,pld+pld", ["bench", *TINY, "--prompts", "{tmp}/p.jsonl", "--out", "{tmp}/r.json", "--draft", "pld,pld+pld"],
            "names a drafter twice", {"p.jsonl": '{"prompt": "hi"}\n'}),
    Refused("bench --methods vanilla,bogus with the default verifier", ["bench", "--prompts", "{tmp}/p.jsonl", "--out", "{tmp}/r.json", "--methods", "vanilla,bogus"],
            "unknown bench methods ['bogus']", {"p.jsonl": '{"prompt": "hi"}\n'}),
    Refused("bench --temperature 1 with hf-pld", ["bench", *TINY, "--prompts", "{tmp}/p.jsonl", "--out", "{tmp}/r.json", "--temperature", "1"],
            "hf-pld is greedy only", {"p.jsonl": '{"prompt": "hi"}\n'}),
    Refused("--draft pld+/nonexistent", ["generate", *TINY, "--prompt", "x", "--draft", "pld+/nonexistent"], "draft /nonexistent: no such file or directory"),
    Refused("--draft a symbolic-link loop", ["generate", *TINY, "--prompt", "x", "--draft", "{tmp}/loop"], "a broken symbolic link or a symbolic-link loop",
            {"loop": "->loop"}),
    Refused("--draft a head whose config.json has num_layers 1e9", ["generate", *TINY, "--prompt", "x", "--draft", "{tmp}/head"],
            "num_layers must be a non-negative integer, not 1000000000.0", {"head/config.json": _head_config(num_layers=1e9)}),
    Refused("--draft a head whose config.json has num_heads 1000000000", ["generate", *TINY, "--prompt", "x", "--draft", "{tmp}/head"],
            "num_heads 1000000000 is beyond the limit of 64", {"head/config.json": _head_config(num_heads=10**9)}),
    Refused("--draft a head with aux_layers [0, 1, 99]", ["generate", *TINY, "--prompt", "x", "--draft", "{tmp}/head"],
            "aux_layers [0, 1, 99] are out of range", {"head/config.json": _head_config(aux_layers=[0, 1, 99])}),
    Refused("--draft a head with aux_layers [-5, -4, -3]", ["generate", *TINY, "--prompt", "x", "--draft", "{tmp}/head"],
            "aux_layers [-5, -4, -3] are out of range", {"head/config.json": _head_config(aux_layers=[-5, -4, -3])}),
    Refused('--draft a head whose config.json has hidden_size "64"', ["generate", *TINY, "--prompt", "x", "--draft", "{tmp}/head"],
            "verifier.hidden_size must be a positive integer, not '64'", {"head/config.json": _head_config(**{"verifier.hidden_size": "64"})}),
    Refused("--verifier /nonexistent", ["generate", "--verifier", "/nonexistent", "--prompt", "x"], "cannot load verifier /nonexistent: no such file or directory"),
    Refused("--verifier random:llama-3.1-8b (8 GiB available)", ["generate", "--verifier", "random:llama-3.1-8b", "--prompt", "x"],
            "needs about 29.9 GiB for its 8.03B parameters in float32 but cpu has 8.0 GiB available"),
    Refused("--verifier random:DIR, config.json with 100000000 layers", ["cost", "--verifier", "random:{tmp}/m"], "num_hidden_layers 100000000 is beyond the limit of 1024",
            {"m/config.json": _model_config(num_hidden_layers=10**8)}),
    Refused("--verifier random:DIR, config.json with num_hidden_layers 1e8", ["cost", "--verifier", "random:{tmp}/m"],
            "num_hidden_layers must be a positive integer, not 100000000.0", {"m/config.json": _model_config(num_hidden_layers=1e8)}),
    Refused("--verifier random:DIR, config.json with hidden_size -64", ["cost", "--verifier", "random:{tmp}/m"], "hidden_size must be a positive integer, not -64",
            {"m/config.json": _model_config(hidden_size=-64)}),
    Refused("--verifier random:DIR, a 200 GB-parameter config (8 GiB available)", ["cost", "--verifier", "random:{tmp}/m"], "GiB available",
            {"m/config.json": _model_config(hidden_size=16384, intermediate_size=65536, num_hidden_layers=200, num_attention_heads=128)}),
    Refused("bench --prompts X --out X", ["bench", *TINY, "--prompts", "{tmp}/p.jsonl", "--out", "{tmp}/p.jsonl"], "would overwrite that;",
            {"p.jsonl": '{"prompt": "hi"}\n'}),
    Refused("bench --out a link to the prompts", ["bench", *TINY, "--prompts", "{tmp}/p.jsonl", "--out", "{tmp}/link.json"], "would overwrite that;",
            {"p.jsonl": '{"prompt": "hi"}\n', "link.json": "->p.jsonl"}),
    Refused("bench --plot X where X is the prompts", ["bench", *TINY, "--prompts", "{tmp}/p.jsonl", "--out", "{tmp}/r.json", "--plot", "{tmp}/./p.jsonl"],
            "would overwrite that;", {"p.jsonl": '{"prompt": "hi"}\n'}),
    Refused("bench --plot X --out X", ["bench", *TINY, "--prompts", "{tmp}/p.jsonl", "--out", "{tmp}/r.json", "--plot", "{tmp}/r.json"],
            "--plot", {"p.jsonl": '{"prompt": "hi"}\n'}),
    Refused("bench --prompts /dev/zero", ["bench", *TINY, "--prompts", "/dev/zero", "--out", "{tmp}/r.json"], "a line longer than the limit of 16,777,216 characters"),
    Refused('bench, a prompt "\\ud800" (a lone surrogate)', ["bench", *TINY, "--prompts", "{tmp}/p.jsonl", "--out", "{tmp}/r.json"], "a lone surrogate",
            {"p.jsonl": '{"prompt": "a \\ud800 b"}\n'}),
    Refused("bench, a 1 MB prompt line", ["bench", *TINY, "--prompts", "{tmp}/p.jsonl", "--out", "{tmp}/r.json"],
            "prompt 2 of {tmp}/p.jsonl plus max_new_tokens is", {"p.jsonl": '{"prompt": "hi"}\n' + json.dumps({"prompt": LONG}) + "\n"}),
    Refused("generate, a 1 MB prompt", ["generate", *TINY, "--prompt", LONG], "the prompt plus max_new_tokens is"),
    Refused("generate --max-new-tokens 2000 (context 1024)", ["generate", *TINY, "--prompt", "x", "--max-new-tokens", "2000"], "context is 1024"),
]


def _materialise(case: Refused, tmp: Path) -> list[str]:
    for name, content in case.files.items():
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if content.startswith("->"):
            path.symlink_to(content[2:])
        else:
            path.write_text(content, encoding="utf-8", errors="surrogatepass")
    return [a.replace("{tmp}", str(tmp)) for a in case.argv]


def _refuse_weights(monkeypatch) -> None:
    """Building or loading any model weights fails (the refusals must come before them); the CPU
    has 8 GiB available, whatever this machine has."""
    import transformers

    def refuse(*a, **k):
        raise AssertionError("model weights were built or loaded before the input was refused")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)  # the default verifier's 18 s
    monkeypatch.setattr("infer.core.models.available_memory", lambda device: 8 * GiB)


def _run(argv, capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("case", REFUSED, ids=[c.what for c in REFUSED])
def test_refused_in_one_line_before_any_weights(case, tmp_path, capsys, monkeypatch):
    _refuse_weights(monkeypatch)
    before = None
    argv = _materialise(case, tmp_path)
    before = sorted(os.listdir(tmp_path))
    code, err = _run(argv, capsys)
    assert code == 2, err
    assert err.startswith("specheads: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert case.message.replace("{tmp}", str(tmp_path)) in err, err
    assert sorted(os.listdir(tmp_path)) == before  # nothing written, no stray temp file


def test_the_refused_inputs_document_lists_every_case():
    text = DOC.read_text(encoding="utf-8")
    assert SECTION in text, f"regenerate: {__doc__.split('PYTHONPATH=. ')[1].split(chr(10))[0]}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    for case in REFUSED:
        assert f"| {_md(case.what)} |" in section, f"{case.what!r} is not in {DOC.name}: regenerate it"


# ----------------------------------------------------------------------------------------------
# Behaviour that is not a one-line refusal
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def speculator():
    from infer import Speculator
    from infer.core.models import load_verifier
    from infer.drafting.lookup import PromptLookupDrafter

    lv = load_verifier("tiny-random:llama")
    return Speculator(lv.model, lv.tokenizer, PromptLookupDrafter())


def test_two_streams_of_one_speculator_are_refused_not_interleaved(speculator):
    """Two stream() generators consumed alternately used to give two wrong outputs."""
    from infer.core.errors import UserError
    from infer.speculator import BUSY

    alone = speculator.generate("count 1 2 3 1 2 3", max_new_tokens=12).token_ids
    first = speculator.stream("count 1 2 3 1 2 3", max_new_tokens=12)
    tokens = list(next(first).token_ids)
    with pytest.raises(UserError, match="already generating"):  # refused when called, before any work
        speculator.stream("something else entirely", max_new_tokens=12)
    for chunk in first:  # the first goes on undisturbed
        tokens += chunk.token_ids
    assert tokens == alone
    assert str(UserError(BUSY)).count("\n") == 0
    # once the first is done (or closed), the next generation runs
    third = speculator.stream("count 1 2 3 1 2 3", max_new_tokens=12)
    next(third)
    third.close()
    assert speculator.generate("count 1 2 3 1 2 3", max_new_tokens=12).token_ids == alone


def test_two_threads_on_one_speculator_get_their_own_output_or_a_clear_refusal(speculator):
    """Two threads calling generate failed 19 of 20 times with tensor-size errors."""
    from infer.core.errors import UserError

    prompts = ["count 1 2 3 1 2 3", "the cat sat on the mat the cat"]
    expected = {p: speculator.generate(p, max_new_tokens=16).token_ids for p in prompts}
    results, errors = [], []
    start = threading.Barrier(len(prompts) * 4)

    def worker(p):
        start.wait()
        try:
            results.append((p, speculator.generate(p, max_new_tokens=16).token_ids))
        except UserError as e:
            errors.append(str(e))
        except Exception as e:  # noqa: BLE001 - what used to happen: the test must see it
            errors.append(f"UNEXPECTED {type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(p,)) for p in prompts * 4]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(e.startswith("this Speculator is already generating") for e in errors), errors
    assert results and all(tokens == expected[p] for p, tokens in results)  # never a mixed-up output
    assert len(results) + len(errors) == len(threads)


def test_a_string_stop_is_one_stop_string(speculator):
    """Stop="abc" was split into the stop strings "a", "b", "c"."""
    from infer.core.engine import _Stopper
    from infer.core.errors import UserError

    full = speculator.generate("count 1 2 3 1 2 3", max_new_tokens=24, chat=False)
    first = next(c for c in full.text if c.strip())  # a character the output holds early
    stop = first + "\x00never"  # never completed: as one stop string it cannot end the output
    assert speculator.generate("count 1 2 3 1 2 3", max_new_tokens=24, chat=False, stop=stop).token_ids == full.token_ids
    assert speculator.generate("count 1 2 3 1 2 3", max_new_tokens=24, chat=False, stop=[first]).stats.finish_reason == "stop"
    assert _Stopper(8, None, "abc", speculator.tokenizer).stop == ["abc"]
    with pytest.raises(UserError, match="stop must be a string or a list of strings"):
        _Stopper(8, None, [1, 2], speculator.tokenizer)


@pytest.mark.parametrize("prompt, message", [("a \ud800 b", "lone surrogate"), ([], "the prompt is empty")])
def test_the_api_refuses_bad_prompts_in_one_line(speculator, prompt, message):
    """A lone surrogate (was a TypeError) and an empty id list ("not torch.float32")."""
    from infer import generate
    from infer.core.errors import UserError

    with pytest.raises(UserError, match=message):
        speculator.generate(prompt, max_new_tokens=4)
    if isinstance(prompt, list):
        with pytest.raises(UserError, match=message):
            generate(speculator.model, None, prompt, max_new_tokens=4)


def test_from_pretrained_checks_the_draft_before_loading(monkeypatch):
    """A bad draft spec fails before the verifier's load."""
    from infer import Speculator
    from infer.core.errors import UserError

    _refuse_weights(monkeypatch)
    monkeypatch.setattr("infer.speculator.load_verifier", lambda *a, **k: pytest.fail("the verifier loaded first"))
    for draft, message in [("pld+pld", "names a drafter twice"), ("pld+/nonexistent", "no such file or directory")]:
        with pytest.raises(UserError, match=message):
            Speculator.from_pretrained("default", draft=draft)


def test_a_relative_path_beside_its_directory_is_a_path_not_a_hub_id(tmp_path, monkeypatch):
    """``runs/typo`` next to a ``runs/`` directory is a missing path (it used to go to the Hub)."""
    from heads.io import is_hub_id
    from infer.core.errors import UserError
    from infer.drafting.loading import draft_parts

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    assert is_hub_id("some-org/head") and not is_hub_id("runs/typo")
    with pytest.raises(UserError, match="draft runs/typo: no such file or directory"):
        draft_parts("pld+runs/typo", None)


def test_run_bench_checks_every_prompt_against_the_context_before_any_method(speculator, monkeypatch):
    """HF's baseline ran a million tokens before the context check."""
    import infer.tools.bench as bench
    from infer.core.errors import UserError
    from infer.tools.prompts import BenchPrompt

    def refuse(*a, **k):
        raise AssertionError("a method ran before the prompts were checked")

    monkeypatch.setattr(bench, "hf_generate", refuse)
    prompts = [BenchPrompt("hi", "a"), BenchPrompt("word " * 300, "a")]
    with pytest.raises(UserError, match="prompt 2 plus max_new_tokens is"):
        bench.run_bench(speculator.model, speculator.tokenizer, speculator.drafter, prompts, max_new_tokens=800, progress=False)


def test_default_verifier_refuses_a_too_long_prompt_before_its_weights_load(tmp_path, capsys, monkeypatch):
    """With the default verifier a too-long bench prompt was refused
    only after the 25 s load of its weights; now after reading the GGUF's metadata and tokenizer."""
    import transformers

    def refuse(*a, **k):
        raise AssertionError("the default verifier's weights loaded before the prompt was refused")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n' + json.dumps({"prompt": "word " * 9000}) + "\n")
    code, err = _run(["bench", "--prompts", str(prompts), "--out", str(tmp_path / "r.json"), "--methods", "vanilla"], capsys)
    assert code == 2 and "prompt 2 of" in err and "context is 8192" in err and err.count("\n") == 1, err
    assert not (tmp_path / "r.json").exists()


def test_a_chat_turn_beyond_the_context_is_refused_and_the_session_goes_on():
    """History plus max_new_tokens beyond the context ended the whole session."""
    import io

    from infer.core.drafter import NoDrafter
    from infer.core.models import load_verifier
    from infer.tools.chat import ChatSession, run_chat

    lv = load_verifier("tiny-random:llama")  # context 1024
    session = ChatSession(lv.model, lv.tokenizer, NoDrafter(), gen_kwargs={"max_new_tokens": 8})
    out, err = io.StringIO(), io.StringIO()
    code = run_chat(session, io.StringIO("hello\n" + "x" * 1100 + "\nagain\n"), out, err)
    assert code == 0
    assert out.getvalue().count("assistant> ") == 2, out.getvalue()  # the first and the third turn
    assert "[not sent: the conversation with this message plus max_new_tokens is" in err.getvalue()
    assert "/reset" in err.getvalue() and err.getvalue().count("[tau ") == 2
    assert [m["content"] for m in session.messages if m["role"] == "user"] == ["hello", "again"]


def test_a_resumed_bench_with_another_grouping_is_refused(tmp_path, capsys, monkeypatch):
    """A resumed bench with --no-group-mt-bench changed reused the old results."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"write {i} {i} {i}", "category": c}) + "\n"
                               for i, c in enumerate(["writing", "coding", "writing"])))
    out = tmp_path / "r.json"
    argv = ["bench", *TINY, "--draft", "pld", "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "4",
            "--methods", "vanilla,spec", "--tree-budget", "fixed"]
    with bench_stopped_at_prompt_two(monkeypatch):
        assert _run(argv, capsys)[0] == 130
    code, err = _run([*argv, "--no-group-mt-bench"], capsys)
    assert code == 2 and "other settings" in err and err.count("\n") == 1, err
    assert _run(argv, capsys)[0] == 0  # the same command resumes
    assert {r["category"] for r in json.loads(out.read_text())["per_prompt"]} == {"mt_bench"}


def test_every_bench_option_that_changes_results_is_in_the_resume_fingerprint():
    from infer.tools.cli import BENCH_NOT_IN_FINGERPRINT, bench_fingerprint, build_parser

    args = build_parser().parse_args(["bench", "--prompts", "p.jsonl", "--out", "r.json"])
    fingerprint = bench_fingerprint(args)
    assert set(fingerprint) == set(vars(args)) - set(BENCH_NOT_IN_FINGERPRINT)
    assert {"group_mt_bench", "limit", "max_new_tokens", "draft", "tree", "temperature", "methods"} <= set(fingerprint)


# ----------------------------------------------------------------------------------------------
# The document
# ----------------------------------------------------------------------------------------------


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def generate_section() -> str:
    """Run every case of ``REFUSED`` and write its actual message into a Markdown table."""
    import argparse
    import tempfile

    class Capture:  # a minimal capsys
        def readouterr(self):
            return argparse.Namespace(out="", err=sys.stderr.getvalue())

    rows = []
    mp = pytest.MonkeyPatch()
    try:
        _refuse_weights(mp)
        for case in REFUSED:
            with tempfile.TemporaryDirectory() as tmp:
                argv = _materialise(case, Path(tmp))
                import io

                saved, sys.stderr = sys.stderr, io.StringIO()
                try:
                    code, err = _run(argv, Capture())
                finally:
                    sys.stderr = saved
                err = err.strip().replace(tmp, "DIR")
                if len(err) > 400:
                    err = err[:400] + "..."
                rows.append(f"| {_md(case.what)} | {code} | `{_md(err.removeprefix('specheads: error: '))}` |")
    finally:
        mp.undo()
    head = [SECTION, "",
            "Generated by `PYTHONPATH=. python tests/test_inputs.py --write docs/refused-inputs.md` from the case",
            "table `REFUSED` in `tests/test_inputs.py`, which the test suite runs: each is one line on stderr, exit",
            "status 2, before any model weights are built or loaded (the test makes that fail), nothing written. `DIR` is",
            "a temporary directory; the memory cases run as if 8 GiB were available. Not one-line refusals, tested there too:",
            "a second concurrent generation on one `Speculator` (a `UserError`), a chat turn beyond the context (refused,",
            "the session goes on), `stop=\"abc\"` (one stop string), a resumed bench with other options (refused), and",
            "with the default verifier a too-long prompt, refused after its GGUF metadata and tokenizer are read (~10 s),",
            "before its weights load.", "",
            "| input | exit | message |", "| --- | --- | --- |"]
    return "\n".join(head + rows) + "\n"


def write_section(path: Path) -> None:
    """Replace (or append) this file's section of ``path``, leaving other sections alone."""
    text = path.read_text(encoding="utf-8") if path.exists() else "# Refused inputs\n\n"
    section = generate_section()
    if SECTION in text:
        before, rest = text.split(SECTION, 1)
        after = rest.split("\n## ", 1)
        text = before + section + ("\n## " + after[1] if len(after) > 1 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write"]:
        write_section(Path(sys.argv[2]))
    else:
        print(generate_section())
