"""Distilled data and the runs that write it: the data names
its verifier and settings and a mismatch is refused; one writer per file or output directory;
children end with the command; bad files are one line naming the place and the limit; training
reads compressed files and directories of parts."""

import gzip
import json
import lzma
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import train.datafile as datafile
from train.data import load_records
from train.datafile import DataError, check_data_source, lock_dir, lock_file, scan_output
from train.distill import main as distill_main
from train.train_heads import main as train_main

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "tiny-cpu.yaml"
LLAMA = ["--verifier", "tiny-random:llama"]


# accelerate's process-wide state is reset after every test of this file (conftest)
pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


@pytest.fixture
def no_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a verifier was loaded before the inputs were checked")

    monkeypatch.setattr("infer.core.models.load_verifier", refuse)


def distil(out, *extra, prompts="synthetic:6"):
    return distill_main([*LLAMA, "--prompts", prompts, "--out", str(out), "--max-new-tokens", "6", "--batch-size", "6",
                         *extra])


def one_line(capsys, *needles, prefix="specheads: error: "):
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip() and not x.startswith("distill:")]  # progress bars aside
    assert len(lines) == 1 and lines[0].startswith(prefix) and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], err
    return lines[0]


def test_skip_distills_a_later_range_and_the_full_run_fills_in_the_rest(tmp_path):
    """--skip 4 --limit 2 distils prompts 4-5 only; the same file continued without them adds
    prompts 0-3 and leaves 4-5 alone (the resume skips ids already written)."""
    out = tmp_path / "d.jsonl"
    assert distil(out, "--skip", "4", "--limit", "2", prompts="synthetic:8") == 0
    ids = [json.loads(x)["id"] for x in out.read_text().splitlines()[1:]]
    assert ids == ["synthetic-4", "synthetic-5"]
    assert distil(out, "--limit", "6", prompts="synthetic:8") == 0
    ids = [json.loads(x)["id"] for x in out.read_text().splitlines()[1:]]
    assert sorted(ids) == [f"synthetic-{i}" for i in range(6)] and len(ids) == 6


def test_a_negative_skip_is_one_line(tmp_path, capsys, no_loading):
    assert distil(tmp_path / "d.jsonl", "--skip", "-1") == 2
    one_line(capsys, "--skip")


def test_sources_distils_one_kind_of_prompt_first(tmp_path, capsys):
    """--sources keeps the prompts of the named sources within --skip/--limit, in order; the
    file continued without it fills in the rest; a source not in the range is one line, before
    the verifier loads."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"{src}-{i}", "prompt": f"Repeat: {src} {i}"}) + "\n"
                               for i, src in enumerate(["chat", "math", "code", "chat", "math", "chat"])))
    out = tmp_path / "d.jsonl"
    assert distil(out, "--limit", "5", "--sources", "chat,code", prompts=str(prompts)) == 0
    ids = [json.loads(x)["id"] for x in out.read_text().splitlines()[1:]]
    assert ids == ["chat-0", "code-2", "chat-3"]
    assert distil(out, prompts=str(prompts)) == 0
    ids = [json.loads(x)["id"] for x in out.read_text().splitlines()[1:]]
    assert ids[:3] == ["chat-0", "code-2", "chat-3"] and sorted(ids[3:]) == ["chat-5", "math-1", "math-4"]
    capsys.readouterr()
    assert distil(out, "--limit", "2", "--sources", "code", prompts=str(prompts)) == 2  # code-2 lies past the range
    one_line(capsys, "--sources code", "chat, math")


def test_sources_refused_before_loading(tmp_path, capsys, no_loading):
    assert distil(tmp_path / "d.jsonl", "--sources", "chat") == 2
    one_line(capsys, "--sources chat", "synthetic")


@pytest.fixture(scope="module")
def llama_data(tmp_path_factory):
    """Data distilled from tiny-random:llama through the command (header first, 6 records)."""
    out = tmp_path_factory.mktemp("llama") / "d.jsonl"
    assert distil(out) == 0
    return out


def rows(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


# ------------------------------------------------------------------ 3: the data names its verifier


def test_the_header_records_verifier_and_settings(llama_data):
    head, *records = rows(llama_data)
    assert head["specheads_distill"] == 1
    assert head["verifier"]["model_type"] == "llama" and head["verifier"]["fingerprint"].startswith("s1-")
    assert head["settings"] == {"dtype": "float32", "max_new_tokens": 6, "temperature": 0.0, "seed": 0,
                                "max_prompt_tokens": 768, "max_conversation_tokens": 1536}
    assert len(records) == 6 and all("header" not in r and "id" in r for r in records)
    assert len(load_records(llama_data, 128)) == 6  # the header is no record


def test_appending_from_another_verifier_or_settings_is_refused(tmp_path, llama_data, capsys):
    out = tmp_path / "d.jsonl"
    out.write_bytes(llama_data.read_bytes())
    before = out.read_bytes()
    assert distill_main(["--verifier", "tiny-random:qwen2", "--prompts", "synthetic:8", "--out", str(out),
                         "--max-new-tokens", "6"]) == 2
    one_line(capsys, "distilled from verifier 'tiny-random:llama'", "qwen2", "another file")
    assert distil(out, "--temperature", "0.7", prompts="synthetic:8") == 2
    one_line(capsys, "other settings", "temperature 0.0 (now 0.7)")
    assert out.read_bytes() == before
    assert distil(out, "--seed", "5", prompts="synthetic:8") == 0  # greedy: the seed changes nothing
    ids = [r["id"] for r in rows(out)[1:]]  # batches are cut from prompts sorted by length: any order
    assert sorted(ids) == sorted(f"synthetic-{i}" for i in range(8)) and len(set(ids)) == 8  # each once


def test_training_refuses_data_of_another_verifier(tmp_path, llama_data, capsys):
    """A recipe's data: file, and output_dir's own distilled data (prompts=), both checked."""
    assert train_main(["--config", str(RECIPE), f"data={llama_data}", "prompts=", "verifier=tiny-random:qwen2",
                       f"output_dir={tmp_path / 'a'}", "max_steps=1"]) == 2
    one_line(capsys, "distilled from verifier 'tiny-random:llama'", "qwen2", prefix="train_heads: error: ")
    run = tmp_path / "b"
    run.mkdir()
    (run / "distilled.jsonl").write_bytes(llama_data.read_bytes())
    assert train_main(["--config", str(RECIPE), "prompts=synthetic:8", "verifier=tiny-random:qwen2",
                       f"output_dir={run}", "max_steps=1"]) == 2
    one_line(capsys, "distilled from verifier 'tiny-random:llama'", prefix="train_heads: error: ")
    assert not (run / "model.safetensors").exists()


def test_data_without_a_header(tmp_path, llama_data, capsys):
    """Older data: training reads it with a warning; distill refuses to append until the header is
    written (--write-header-only), then continues it."""
    old = tmp_path / "old.jsonl"
    old.write_text("".join(json.dumps(r) + "\n" for r in rows(llama_data)[1:4]))
    warnings = []
    check_data_source(old, warn=warnings.append)
    assert len(warnings) == 1 and "no header" in warnings[0]
    assert len(load_records(old, 128)) == 3
    before = old.read_bytes()
    assert distil(old) == 2
    one_line(capsys, "no header", "--write-header-only")
    assert old.read_bytes() == before
    assert distil(old, "--write-header-only") == 0
    assert rows(old)[0] == rows(llama_data)[0] and old.read_bytes().endswith(before)
    capsys.readouterr()
    assert distil(old) == 0  # continues: the 3 missing records, each once
    assert [r.get("id") for r in rows(old)] == [r.get("id") for r in rows(llama_data)]
    assert distil(old, "--write-header-only") == 2
    one_line(capsys, "already has a header")


# ------------------------------------------------------------------ 4: one writer


def test_a_second_run_into_a_locked_output_is_refused_at_once(tmp_path, llama_data, capsys, no_loading):
    out = tmp_path / "run"
    with lock_dir(out):
        assert train_main(["--check", "--config", str(RECIPE), f"output_dir={out}"]) == 2
        one_line(capsys, f"output_dir {out} is in use by another run (pid {os.getpid()})", prefix="train_heads: error: ")
        assert train_main(["--config", str(RECIPE), f"output_dir={out}"]) == 2
        one_line(capsys, "is in use by another run", prefix="train_heads: error: ")
    assert train_main(["--check", "--config", str(RECIPE), f"output_dir={out}"]) == 0
    d = tmp_path / "d.jsonl"
    with lock_file(d):
        assert distil(d) == 2
        one_line(capsys, f"--out {d} is in use by another run")
    assert not d.exists()


def test_a_lock_dies_with_its_process(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from train.datafile import lock_dir; "
                               "l = lock_dir(sys.argv[1]); print('locked', flush=True); time.sleep(60)", str(tmp_path)],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(DataError, match="in use by another run"):
            lock_dir(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    lock_dir(tmp_path).release()  # the kernel dropped it with the killed process


# ------------------------------------------------------------------ 5 and Ctrl-C: children


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _descendants(pid: int) -> list[int]:
    out = []
    for c in _children(pid):
        out += [c, *_descendants(c)]
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait(cond, timeout=120.0) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return True
        time.sleep(0.2)
    return False


def _launch(tmp_path, *args):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # SIGINT as a terminal's foreground job has it: a shell running the suite in the background
    # (CI may) hands its children SIGINT ignored, and Python then installs no KeyboardInterrupt handler
    return subprocess.Popen([sys.executable, "-P", "-m", "infer.tools.cli", *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _records(path: Path) -> int:
    return sum(1 for _ in path.open()) - 1 if path.exists() else 0


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and PR_SET_PDEATHSIG")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killing_distill_ends_its_child(tmp_path, sig):
    out = tmp_path / "d.jsonl"
    parent = _launch(tmp_path, "distill", *LLAMA, "--prompts", "synthetic:5000", "--out", str(out),
                     "--max-new-tokens", "16", "--batch-size", "2")
    try:
        assert _wait(lambda: _records(out) >= 2), parent.stderr.read() if parent.poll() is not None else "no records"
        kids = _descendants(parent.pid)
        assert kids and all(_alive(k) for k in kids)
        parent.send_signal(sig)
        parent.wait(30)
        assert _wait(lambda: not any(_alive(k) for k in kids), 30), "the distill child outlived its parent"
    finally:
        os.killpg(parent.pid, signal.SIGKILL) if parent.poll() is None else None
    for r in rows(out)[1:]:  # every line whole: a rerun takes each record once
        assert set(r) == {"id", "input_ids", "loss_mask"}


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and PR_SET_PDEATHSIG")
def test_killing_train_ends_accelerate_and_the_trainer(tmp_path):
    parent = _launch(tmp_path, "train", "--config", str(RECIPE), f"output_dir={tmp_path / 'run'}", "max_steps=100000",
                     "save_every=100000", "eval_every=100000")
    try:  # specheads -> accelerate -> python -m train.train_heads
        assert _wait(lambda: len(_descendants(parent.pid)) >= 2 and (tmp_path / "run" / "distilled.jsonl").exists())
        kids = _descendants(parent.pid)
        parent.kill()
        parent.wait(30)
        assert _wait(lambda: not any(_alive(k) for k in kids), 30), "accelerate or the trainer outlived the command"
    finally:
        os.killpg(parent.pid, signal.SIGKILL) if parent.poll() is None else None


def test_a_second_sigterm_during_the_clean_up_is_ignored():
    """The first SIGTERM stops distill as Ctrl-C does; one more while it cleans up (scanning a
    big output file to say how many records it holds) is ignored, not a traceback."""
    from train.distill import _stop_on_sigterm

    old = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        os.kill(os.getpid(), signal.SIGTERM)  # during the clean-up
        time.sleep(0.5)
    finally:
        signal.signal(signal.SIGTERM, old)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_during_distill_is_one_line_and_exit_130(tmp_path, sig):
    """Ctrl-C (SIGINT to the foreground group), or SIGTERM to the whole group (`kill` of every
    process of the command: the child then gets it twice, directly and forwarded), stops the
    distillation with one line and every record whole."""
    out = tmp_path / "d.jsonl"
    parent = _launch(tmp_path, "distill", *LLAMA, "--prompts", "synthetic:5000", "--out", str(out),
                     "--max-new-tokens", "16", "--batch-size", "2")
    try:
        assert _wait(lambda: _records(out) >= 2)
        os.killpg(parent.pid, sig)
        _, err = parent.communicate(timeout=60)
    finally:
        os.killpg(parent.pid, signal.SIGKILL) if parent.poll() is None else None
    assert parent.returncode in ((130,) if sig == signal.SIGINT else (130, -signal.SIGTERM, 128 + signal.SIGTERM)), err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.count("interrupted") == 1 and f"{out} holds" in err and "run the same command to continue" in err
    for r in rows(out)[1:]:
        assert set(r) == {"id", "input_ids", "loss_mask"}


# ------------------------------------------------------------------ 17: the working directory


@pytest.mark.slow
def test_a_heads_folder_in_the_working_directory_does_not_shadow_the_package(tmp_path, monkeypatch, capsys):
    (tmp_path / "heads").mkdir()
    (tmp_path / "heads" / "__init__.py").write_text("raise ImportError('the user’s own heads package')\n")
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "__init__.py").write_text("raise ImportError('the user’s own train package')\n")
    out = tmp_path / "d.jsonl"
    proc = _launch(tmp_path, "distill", *LLAMA, "--prompts", "synthetic:2", "--out", str(out), "--max-new-tokens", "4")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert _records(out) == 2
    # `specheads train` validates the recipe in a `python -m train.train_heads --check` child first
    import infer.tools.cli

    launched = []
    monkeypatch.setattr(infer.tools.cli, "_run", lambda cmd, **kw: launched.append(cmd) or 0)
    monkeypatch.chdir(tmp_path)
    assert infer.tools.cli.main(["train", "--config", str(RECIPE), f"output_dir={tmp_path / 'run'}"]) == 0, capsys.readouterr().err
    assert launched


# ------------------------------------------------------------------ 12, 15, 16: bad files


def test_a_lone_surrogate_in_a_prompt_is_refused_before_loading(tmp_path, capsys, no_loading):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "fine"}\n{"prompt": "bad \\ud800 here"}\n')
    out = tmp_path / "d.jsonl"
    assert distill_main([*LLAMA, "--prompts", str(prompts), "--out", str(out)]) == 2
    one_line(capsys, f"{prompts}:2:", "lone surrogate")
    assert sorted(os.listdir(tmp_path)) == ["p.jsonl"]  # nothing written, not even a lock


def test_a_corrupt_middle_line_names_the_line_before_loading(tmp_path, llama_data, capsys, no_loading):
    out = tmp_path / "d.jsonl"
    lines = llama_data.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:3]) + '{"id": "x", "input_ids": [1, 2\n' + "".join(lines[3:]))
    before = out.read_bytes()
    assert distil(out) == 2
    one_line(capsys, f"{out}:4: not a distilled record", "sed -i '4d'")
    assert out.read_bytes() == before


def test_a_torn_last_line_is_still_cut_and_the_run_continues(tmp_path, llama_data):
    out = tmp_path / "d.jsonl"
    out.write_bytes(llama_data.read_bytes()[:-25])  # killed mid-write
    scan = scan_output(out)
    assert scan.records == 5 and out.read_bytes().endswith(b"\n")


@pytest.mark.parametrize("where", ["/dev/full", "/dev/zero"])
def test_distill_out_a_device_is_refused_before_loading(where, capsys, no_loading):
    assert distill_main([*LLAMA, "--prompts", "synthetic:2", "--out", where]) == 2
    one_line(capsys, "not a regular file")


def test_size_limits_name_the_limit(tmp_path, monkeypatch, capsys, no_loading, llama_data):
    monkeypatch.setattr(datafile, "MAX_LINE_BYTES", 1000)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "%s"}\n' % ("x" * 2000))
    assert distill_main([*LLAMA, "--prompts", str(prompts), "--out", str(tmp_path / "d.jsonl")]) == 2
    one_line(capsys, f"{prompts}:1: a line longer than 1,000 bytes (the limit)")
    assert distill_main([*LLAMA, "--prompts", "/dev/zero", "--out", str(tmp_path / "d.jsonl")]) == 2
    one_line(capsys, "/dev/zero is not a regular file")
    monkeypatch.setattr(datafile, "MAX_DATA_BYTES", 2000)
    with pytest.raises(DataError, match="larger than 2,000 bytes \\(the limit\\)"):
        load_records(llama_data, 128)
    with pytest.raises(DataError, match="not a regular file"):
        load_records("/dev/zero", 128)
    assert train_main(["--config", str(RECIPE), "data=/dev/zero", "prompts=", f"output_dir={tmp_path / 'o'}"]) == 2
    one_line(capsys, "not a regular file", prefix="train_heads: error: ")


# ------------------------------------------------------------------ compressed data, parts


def test_compressed_files_and_directories_of_parts_read_the_same(tmp_path, llama_data):
    want = load_records(llama_data, 128)
    raw = llama_data.read_bytes()
    (tmp_path / "d.jsonl.xz").write_bytes(lzma.compress(raw))
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(raw))
    head, *lines = raw.decode().splitlines(keepends=True)
    parts = tmp_path / "parts"
    parts.mkdir()
    (parts / "part-000.jsonl.xz").write_bytes(lzma.compress((head + "".join(lines[:2])).encode()))
    (parts / "part-001.jsonl.gz").write_bytes(gzip.compress((head + "".join(lines[2:5])).encode()))
    (parts / "part-002.jsonl").write_text(head + "".join(lines[5:]))
    (parts / ".part-002.jsonl.lock").write_text("1")  # not a part
    (parts / "README.md").write_text("not a part")
    for path in (tmp_path / "d.jsonl.xz", tmp_path / "d.jsonl.gz", parts):
        got = load_records(path, 128)
        assert [(r.input_ids, r.loss_mask) for r in got] == [(r.input_ids, r.loss_mask) for r in want], path
    assert [p.name for p, _ in check_data_source(parts)] == ["part-000.jsonl.xz", "part-001.jsonl.gz", "part-002.jsonl"]
    # parts of two verifiers, a header in the middle, a broken archive: refused, naming the file
    other = json.loads(head)
    other["verifier"]["fingerprint"] = "s1-0000000000000000"
    (parts / "part-003.jsonl").write_text(json.dumps(other) + "\n" + lines[0])
    with pytest.raises(DataError, match="data parts disagree: .*part-000.jsonl.xz.*part-003.jsonl"):
        check_data_source(parts)
    (tmp_path / "cat.jsonl").write_text(raw.decode() + raw.decode())
    with pytest.raises(DataError, match=r"cat.jsonl:8: a header record after the first line"):
        load_records(tmp_path / "cat.jsonl", 128)
    (tmp_path / "bad.jsonl.xz").write_bytes(lzma.compress(raw)[:-40])
    with pytest.raises(DataError, match="bad.jsonl.xz is not a valid compressed file"):
        load_records(tmp_path / "bad.jsonl.xz", 128)


def test_training_on_a_directory_of_compressed_parts(tmp_path, llama_data):
    parts = tmp_path / "parts"
    parts.mkdir()
    head, *lines = llama_data.read_text().splitlines(keepends=True)
    for i in range(2):
        (parts / f"part-00{i}.jsonl.xz").write_bytes(lzma.compress((head + "".join(lines[3 * i: 3 * i + 3])).encode()))
    assert train_main(["--check", "--config", str(RECIPE), f"data={parts}", "prompts=", f"output_dir={tmp_path}"]) == 0
    assert train_main(["--config", str(RECIPE), f"data={parts}", "prompts=", f"output_dir={tmp_path / 'run'}",
                       "max_steps=2", "batch_size=2", "eval_fraction=0"]) == 0
    assert (tmp_path / "run" / "model.safetensors").is_file()


def test_a_glob_pattern_selects_one_series_of_parts(tmp_path, capsys, llama_data):
    """``data='dir/late-*.jsonl.xz'``: the parts of one series, in name order (how heads are
    compared on the late series' held-out split from the committed directory)."""
    head, *lines = llama_data.read_text().splitlines(keepends=True)
    parts = tmp_path / "parts"
    parts.mkdir()
    for name, chunk in [("early-000", lines[:2]), ("late-000", lines[2:4]), ("late-001", lines[4:])]:
        (parts / f"{name}.jsonl.xz").write_bytes(lzma.compress((head + "".join(chunk)).encode()))
    (parts / "late-notes.md").write_text("not a part")
    want = load_records(llama_data, 128)[2:]
    got = load_records(f"{parts}/late-*", 128)
    assert [(r.input_ids, r.loss_mask) for r in got] == [(r.input_ids, r.loss_mask) for r in want]
    assert [p.name for p, _ in check_data_source(f"{parts}/late-*")] == ["late-000.jsonl.xz", "late-001.jsonl.xz"]
    assert train_main(["--check", "--config", str(RECIPE), f"data={parts}/late-*.jsonl.xz", "prompts=",
                       f"output_dir={tmp_path / 'o'}"]) == 0
    for overrides, message in [
        ([f"data={parts}/none-*.jsonl.xz", "prompts="], "matches no *.jsonl, *.jsonl.gz or *.jsonl.xz file"),
        ([f"data={parts}/late-*", "prompts=synthetic:4"], "is a pattern, not a JSONL file"),
    ]:
        assert train_main(["--check", "--config", str(RECIPE), *overrides, f"output_dir={tmp_path / 'o'}"]) == 2
        one_line(capsys, message, prefix="train_heads: error: ")
    with pytest.raises(DataError, match="matches no"):
        load_records(f"{parts}/none-*", 128)
    with pytest.raises(DataError, match="matches the directory .*parts: give the directory itself"):
        load_records(f"{tmp_path}/par*", 128)  # a pattern of the directory, not of its files
    # ``**`` goes down directories; an existing name with glob characters is that file, not a pattern
    (parts / "deeper").mkdir()
    (parts / "late-001.jsonl.xz").rename(parts / "deeper" / "late-001.jsonl.xz")
    assert len(load_records(f"{parts}/**/late-*.jsonl.xz", 128)) == len(want)
    literal = tmp_path / "exp[1]" / "d.jsonl"
    literal.parent.mkdir()
    literal.write_text(llama_data.read_text())
    assert len(load_records(literal, 128)) == len(want) + 2
    assert train_main(["--check", "--config", str(RECIPE), f"data={literal}", "prompts=", f"output_dir={tmp_path / 'o'}"]) == 0
    # ... and a pattern inside such an existing directory looks in it
    assert len(load_records(f"{literal.parent}/d*.jsonl", 128)) == len(want) + 2


# ------------------------------------------------------------------ the rest of docs/refused-inputs.md


def test_more_refusals_each_one_line(tmp_path, monkeypatch, capsys, no_loading, llama_data):
    bad = tmp_path / "p.jsonl"
    bad.write_bytes(b'{"prompt": "ok"}\n{"prompt": "\xff\xfe"}\n')
    assert distill_main([*LLAMA, "--prompts", str(bad), "--out", str(tmp_path / "d.jsonl")]) == 2
    one_line(capsys, f"{bad}:2: not UTF-8 text")
    assert distill_main([*LLAMA, "--prompts", "synthetic:2", "--out", str(tmp_path / "d.jsonl.xz")]) == 2
    one_line(capsys, "distillation writes plain JSONL")
    monkeypatch.setattr(datafile, "MAX_PROMPT_FILE_BYTES", 10)
    bad.write_text('{"prompt": "a prompt longer than ten bytes"}\n')
    assert distill_main([*LLAMA, "--prompts", str(bad), "--out", str(tmp_path / "d.jsonl")]) == 2
    one_line(capsys, "larger than 10 bytes (the limit)")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="holds no \\*.jsonl"):
        load_records(empty, 128)
    notjson = tmp_path / "n.jsonl"
    notjson.write_text(llama_data.read_text().splitlines()[0] + "\n{not json\n")
    with pytest.raises(DataError, match="n.jsonl:2: not a distilled record"):
        load_records(notjson, 128)
    for overrides, message in [
        ([f"data={tmp_path}/x.jsonl.xz", "prompts=synthetic:4"], "is compressed: distillation appends plain JSONL"),
        (["data=/dev/zero", "prompts="], "data /dev/zero is not a regular file"),
    ]:
        assert train_main(["--check", "--config", str(RECIPE), *overrides, f"output_dir={tmp_path / 'o'}"]) == 2
        one_line(capsys, message, prefix="train_heads: error: ")
    assert train_main(["--check", "--config", "/dev/zero"]) == 2
    one_line(capsys, "config /dev/zero is not a regular file", prefix="train_heads: error: ")
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * (1 << 20) + "\n")
    assert train_main(["--check", "--config", str(big)]) == 2
    one_line(capsys, "larger than 1,048,576 bytes (the limit)", prefix="train_heads: error: ")


LAUNCHER_CTRL_C = r"""
import sys
sys.stderr.write("train_heads: interrupted: --resume continues from the last checkpoint\n")
sys.stderr.write('Traceback (most recent call last):\n  File "accelerate", line 6, in <module>\n    process.wait()\nKeyboardInterrupt\n')
sys.exit(1)
"""


def test_ctrl_c_under_the_launcher_is_the_programs_one_line(capfd):
    from infer.tools.cli import _run

    assert _run([sys.executable, "-c", LAUNCHER_CTRL_C], launcher=True) == 130
    assert capfd.readouterr().err == "train_heads: interrupted: --resume continues from the last checkpoint\n"


def test_write_header_refuses_a_file_another_process_holds_open(tmp_path, llama_data):
    old = tmp_path / "old.jsonl"
    old.write_text("".join(json.dumps(r) + "\n" for r in rows(llama_data)[1:3]))
    writer = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1], 'a'); print('open', flush=True); "
                               "time.sleep(60)", str(old)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "open"
        with pytest.raises(DataError, match=f"is open in process {writer.pid}: stop it first"):
            datafile.write_header(old, rows(llama_data)[0])
    finally:
        writer.kill()
        writer.wait()
    datafile.write_header(old, rows(llama_data)[0])
    assert rows(old)[0] == rows(llama_data)[0] and len(rows(old)) == 3
