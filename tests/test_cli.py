"""The command line: outputs, and one-line errors with exit status 2 for every bad input."""

import json
import os
import subprocess
import sys

import pytest

from infer.tools.cli import main

TINY = ["--verifier", "tiny-random:llama"]


def run(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_json_greedy_matches_plain_decoding(capsys):
    code, out, _ = run(["generate", *TINY, "--prompt", "hello world", "--max-new-tokens", "12", "--json"], capsys)
    assert code == 0
    spec = json.loads(out)
    assert set(spec) == {"text", "token_ids", "stats"}
    assert 1 <= len(spec["token_ids"]) <= 12
    assert {"new_tokens", "verify_steps", "mean_accepted", "accepted_hist", "prefill_s", "decode_s"} <= set(spec["stats"])
    code, out, _ = run(["generate", *TINY, "--draft", "none", "--prompt", "hello world", "--max-new-tokens", "12", "--json"], capsys)
    assert json.loads(out)["token_ids"] == spec["token_ids"]


def test_generate_streams_text_and_reports_stats(capsys):
    code, out, err = run(["generate", *TINY, "--prompt", "hi", "--max-new-tokens", "6", "--tree", "pld-10",
                          "--temperature", "0.7", "--top-p", "0.9", "--seed", "3"], capsys)
    assert code == 0 and out.endswith("\n") and "tau" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--verifier", "no-such-model", "--prompt", "x"], "unknown verifier"),
        (["generate", *TINY, "--prompt", "   "], "prompt is empty"),
        (["generate", *TINY, "--prompt", "x", "--temperature", "-1"], "temperature"),
        (["generate", *TINY, "--prompt", "x", "--temperature", "1e9"], "temperature"),
        (["generate", *TINY, "--prompt", "x", "--top-p", "2"], "top_p"),
        (["generate", *TINY, "--prompt", "x", "--top-k", "-5"], "top_k"),
        (["generate", *TINY, "--prompt", "x", "--max-new-tokens", "0"], "max_new_tokens"),
        (["generate", *TINY, "--prompt", "x", "--max-new-tokens", "many"], "invalid int"),
        (["generate", *TINY, "--prompt", "x", "--draft", "medusa-from-nowhere"], "unknown draft"),
        (["generate", *TINY, "--prompt", "x", "--tree", "nope"], "unknown tree"),
        (["generate", *TINY, "--prompt", "x", "--max-new-tokens", "5000"], "context"),
        (["generate", "--verifier", "tiny-random:rwkv", "--prompt", "x"], "unknown tiny-random architecture"),
        (["generate", *TINY], "--prompt"),
        (["cost", *TINY, "--nodes", "1,a"], "--nodes"),
        (["bench", *TINY, "--prompts", "/no/such/file.jsonl", "--out", "r.json"], "cannot read prompt file"),
        (["frobnicate"], "invalid choice"),
        (["generate", *TINY, "--draft", "pld+none", "--prompt", "x"], "cannot be combined"),
        (["bench", *TINY, "--prompts", "p.jsonl", "--methods", ",", "--out", "r.json"], "--methods is empty"),
        (["generate", *TINY, "--draft", "pld+nosuch", "--prompt", "x"], "unknown draft 'nosuch'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    code, out, err = run(argv, capsys)
    assert code == 2
    assert err.startswith("specheads: error:") and err.count("\n") == 1 and message in err
    assert "Traceback" not in err


def test_bad_prompt_files_name_the_line(tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n{"prompt": "ok", \n')
    code, _, err = run(["bench", *TINY, "--prompts", str(f), "--out", str(tmp_path / "r.json")], capsys)
    assert code == 2 and f"{f}:2: not valid JSON" in err
    f.write_text('{"prompt": "ok"}\n\n{"turns": []}\n')
    code, _, err = run(["bench", *TINY, "--prompts", str(f), "--out", str(tmp_path / "r.json")], capsys)
    assert code == 2 and f"{f}:3:" in err
    f.write_text("")
    code, _, err = run(["bench", *TINY, "--prompts", str(f), "--out", str(tmp_path / "r.json")], capsys)
    assert code == 2 and "no prompts" in err
    assert not (tmp_path / "r.json").exists()


def _console(*args, env=None):
    exe = os.path.join(os.path.dirname(sys.executable), "specheads")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


@pytest.mark.slow
@pytest.mark.parametrize("env, message", [
    ({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set"),
    ({"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}, "cannot be reached"),  # nothing listens on port 9
])
def test_unreachable_hub_id_is_a_one_line_error(env, message):
    """Offline, a Hub id that is not cached fails at once in one line (no minute of retry lines)."""
    proc = _console("generate", "--verifier", "some-org/not-cached-model", "--prompt", "x", env=env)
    assert proc.returncode == 2
    assert proc.stderr.startswith("specheads: error: verifier 'some-org/not-cached-model' is not in the local Hugging "
                                  "Face cache") and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr


def test_bench_writes_results_and_plot(tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    rows = [{"turns": ["say hello hello hello", "second turn"], "category": "a"},
            {"prompt": "count: 1 2 3 1 2 3 1 2", "category": "b"},
            {"prompt": "another one", "category": "b"}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    code, stdout, _ = run(["bench", *TINY, "--prompts", str(f), "--limit", "1", "--max-new-tokens", "16",
                           "--out", str(out), "--plot", str(png)], capsys)
    assert code == 0
    res = json.loads(out.read_text())
    assert set(res["methods"]) == {"vanilla", "hf-pld", "spec"}
    spec = res["methods"]["spec"]
    assert spec["overall"]["n"] == 2 and set(spec["categories"]) == {"a", "b"}  # --limit 1 per category
    assert spec["overall"]["identical"] == 2 and res["methods"]["hf-pld"]["overall"]["identical"] == 2
    for key in ("tokens_per_s", "tau", "speedup"):
        assert spec["overall"][key] > 0
    assert res["methods"]["vanilla"]["overall"]["tau"] == pytest.approx(1.0, abs=1e-9)  # N - 1 tokens in N - 1 passes
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert "spec" in stdout and "identical" in stdout


@pytest.mark.slow
def test_console_script_exit_code():
    proc = _console("generate", "--verifier", "tiny-random:llama", "--prompt", "x", "--top-p", "0")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("specheads: error: top_p")


def test_prompt_files_may_hold_unicode_line_separators(tmp_path):
    from infer.tools.prompts import read_prompts
    from train.data import load_prompts

    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "one\u2028two", "category": "x"}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert [p.text for p in read_prompts(f)] == ["one\u2028two"]
    assert [p.text for p in load_prompts(str(f))] == ["one\u2028two"]


@pytest.mark.slow
def test_chat_streams_replies_with_a_status_line():
    proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "specheads"), "chat", "--verifier",
                           "tiny-random:llama", "--max-new-tokens", "8"], input="hello\n/reset\nagain\n/exit\n",
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    assert proc.stdout.count("assistant> ") == 2
    assert proc.stderr.count("[tau ") == 2 and "tokens/s" in proc.stderr and "[new conversation]" in proc.stderr


def test_ctrl_c_stops_a_reply_not_the_chat(capsys):
    from infer.core.drafter import NoDrafter, root_only
    from infer.core.models import load_verifier
    from infer.tools.chat import ChatSession

    class Interrupting(NoDrafter):
        calls = 0

        def propose(self, requests):
            self.calls += 1
            if self.calls == 3:
                raise KeyboardInterrupt
            return [root_only(q.root) for q in requests]

    lv = load_verifier("tiny-random:llama")
    session = ChatSession(lv.model, lv.tokenizer, Interrupting(), gen_kwargs={"max_new_tokens": 50})
    session.reset()
    status = session.reply("hi")
    out = capsys.readouterr().out
    assert out.rstrip().endswith("[stopped]") and "3 tokens" in status  # prefill token + 2 steps
    assert [m["role"] for m in session.messages] == ["user", "assistant"]
    assert session.reply("go on").startswith("[tau ")  # the session goes on
    assert [m["role"] for m in session.messages] == ["user", "assistant", "user", "assistant"]


def test_bench_compares_several_drafts_and_reports_efficiency(tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": p, "category": c}) for p, c in
                           [("count: 1 2 3 1 2 3 1 2", "a"), ("say hi hi hi hi", "b")]) + "\n")
    out = tmp_path / "r.json"
    code, stdout, _ = run(["bench", *TINY, "--prompts", str(f), "--max-new-tokens", "12", "--draft", "pld,none,pld@chain:2",
                           "--methods", "vanilla,spec", "--verify-cost", "--tree-budget", "fixed", "--out", str(out)], capsys)
    assert code == 0
    res = json.loads(out.read_text())
    assert set(res["methods"]) == {"vanilla", "spec:pld", "spec:none", "spec:pld@chain:2"}
    def most_nodes(m):
        return max(len(r[m]["nodes_hist"]) - 1 for r in res["per_prompt"])

    # its own tree: at most 2 drafted tokens per pass, where the default prompt-lookup tree drafts more
    assert res["methods"]["spec:pld@chain:2"]["overall"]["identical"] == 2
    assert most_nodes("spec:pld@chain:2") == 3 < most_nodes("spec:pld")
    plain = res["methods"]["spec:none"]["overall"]
    assert plain["identical"] == 2 and plain["tau"] == pytest.approx(1.0, abs=1e-9) and plain["mean_tree_nodes"] == 1.0
    assert plain["ideal_speedup"] == pytest.approx(1.0)  # one node per pass: nothing to gain
    # each speculative row records what its drafter learnt (prompt lookup: acceptance per n-gram length)
    assert all("acceptance" in r["spec:pld"]["drafter"] and r["spec:none"]["drafter"] == {} for r in res["per_prompt"])
    pld = res["methods"]["spec:pld"]["overall"]
    assert pld["identical"] == 2 and pld["mean_tree_nodes"] > 1 and pld["efficiency"] == pytest.approx(pld["speedup"] / pld["ideal_speedup"])
    assert "spec:pld" in stdout and "effic." in stdout


def test_bench_drafts_take_a_tree_each():
    from infer.core.errors import UserError
    from infer.tools.cli import bench_drafts

    assert bench_drafts("runs/a+pld, runs/a+pld@dynamic:7,4,16,pld@chain:4,default") == [
        ("runs/a+pld", None), ("runs/a+pld", "dynamic:7,4,16"), ("pld", "chain:4"), ("default", None)]
    with pytest.raises(UserError):
        bench_drafts(" , ")


def test_bench_samples_at_temperature_one(tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "count: 1 2 3 1 2 3 1 2"}) + "\n")
    out = tmp_path / "r.json"
    args = ["bench", *TINY, "--prompts", str(f), "--max-new-tokens", "12", "--temperature", "1.0", "--out", str(out)]
    code, _, err = run(args, capsys)
    assert code == 2 and "hf-pld" in err  # greedy-only baseline refused with a clear message
    code, _, _ = run([*args, "--methods", "vanilla,spec"], capsys)
    assert code == 0
    res = json.loads(out.read_text())
    assert "identical" not in res["methods"]["spec"]["overall"]  # sampled outputs are not compared
    assert res["methods"]["spec"]["overall"]["tokens"] > 0 and res["config"]["temperature"] == 1.0
