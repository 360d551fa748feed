"""Training user errors: the whole config is validated before any work (one line, exit 2), and
`specheads train` never shows accelerate's launcher traceback."""

import subprocess
import sys
from pathlib import Path

import pytest

from infer.tools.cli import _run, main
from train.config import ConfigError, load_config
from train.train_heads import main as train_main

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "tiny-cpu.yaml"


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"id": "0", "input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1]}\n')
    return path


#: (overrides, what the one-line message says); {tmp} is the test's temporary directory
BAD = [
    (["nonsense_key=1"], "unknown config key 'nonsense_key'"),
    (["max_steps=0"], "max_steps must be >= 1"),
    (["batch_size=abc"], "batch_size must be int"),
    (["lr=-1"], "lr must be > 0"),
    (["lr=0"], "lr must be > 0"),
    (["weight_decay=-0.1"], "weight_decay must be >= 0"),
    (["warmup_steps=-1"], "warmup_steps must be >= 0"),
    (["eval_fraction=1"], "eval_fraction must be in [0, 1)"),
    (["eval_fraction=-0.1"], "eval_fraction must be in [0, 1)"),
    (["ttt_decay=0"], "ttt_decay must be in (0, 1]"),
    (["ttt_decay=1.5"], "ttt_decay must be in (0, 1]"),
    (["medusa_decay=0"], "medusa_decay must be in (0, 1]"),
    (["draft_vocab_size=0"], "draft_vocab_size must be >= 1"),
    (["max_grad_norm=-1"], "max_grad_norm must be >= 0"),
    (["lora_r=0"], "lora_r must be >= 1"),
    (["lora_alpha=0"], "lora_alpha must be >= 1"),
    (["lora_dropout=1"], "lora_dropout must be in [0, 1)"),
    (["distill_max_new_tokens=0"], "distill_max_new_tokens must be >= 1"),
    (["distill_batch_size=0"], "distill_batch_size must be >= 1"),
    (["distill_temperature=-1"], "distill_temperature must be >= 0"),
    (["log_with=mlflow"], "log_with must be"),
    (["verifier="], "verifier must not be empty"),
    (["data={tmp}/missing.jsonl", "prompts="], "missing.jsonl does not exist"),
    (["prompts={tmp}/missing-prompts.jsonl"], "missing-prompts.jsonl does not exist"),
    (["prompts=synthetic:abc"], "synthetic:N"),
    (["output_dir={tmp}/a-file"], "is a file"),
    (["output_dir={tmp}/a-file/sub"], "cannot create"),
]


@pytest.mark.parametrize("overrides, message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_check_refuses_each_bad_value_in_one_line(tmp_path, data, capsys, overrides, message):
    (tmp_path / "a-file").write_text("x")
    base = [f"data={data}", "prompts=", f"output_dir={tmp_path / 'out'}"]
    overrides = [o.format(tmp=tmp_path) for o in overrides]
    assert train_main(["--check", "--config", str(RECIPE), *base, *overrides]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("train_heads: error: ") and message in err, err
    assert not (tmp_path / "out").exists()  # no work done


def test_check_accepts_good_configs(tmp_path, data, capsys):
    assert train_main(["--check", "--config", str(RECIPE), f"output_dir={tmp_path / 'new' / 'run'}"]) == 0
    assert train_main(["--check", "--config", str(RECIPE), f"data={data}", "prompts=", f"output_dir={tmp_path}"]) == 0
    assert train_main(["--check", "--config", str(RECIPE), f"data={tmp_path / 'made-by-distill.jsonl'}"]) == 0
    assert not (tmp_path / "new").exists()
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        load_config(path)  # the values of every shipped recipe pass (paths are checked at launch)


def test_missing_config_file(tmp_path, capsys):
    assert train_main(["--check", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "cannot read config" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["nonsense_key=1"], "unknown config key 'nonsense_key'"),
    (["max_steps=0"], "max_steps must be >= 1"),
    (["batch_size=abc"], "batch_size must be int"),
    (["lr=-1"], "lr must be > 0"),
    (["data=/nonexistent/d.jsonl", "prompts="], "does not exist"),
    (["--config", "/nonexistent/recipe.yaml"], "cannot read config"),
])
def test_specheads_train_refuses_before_launching(tmp_path, capsys, monkeypatch, args, message):
    """Checked in a child process (infer never imports train) before `accelerate launch`."""
    import infer.tools.cli

    launched = []
    monkeypatch.setattr(infer.tools.cli, "_run", lambda cmd, **kw: launched.append(cmd) or 0)
    config = [] if "--config" in args else ["--config", str(RECIPE)]
    assert main(["train", *config, *args, f"output_dir={tmp_path / 'o'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specheads: error: ") and message in err, err
    assert launched == []


FAKE_LAUNCHER = r"""
import sys
sys.stdout.write("1 process(es)\n")
sys.stderr.write("warming up\rstill warming\r\n")
sys.stderr.write("train_heads: error: data.jsonl holds fewer than 2 usable records\n")
sys.stderr.write('Traceback (most recent call last):\n  File "accelerate", line 6, in <module>\n    sys.exit(main())\n')
sys.stderr.write("subprocess.CalledProcessError: Command '['python', '-m', 'train.train_heads']' returned non-zero exit status 2.\n")
sys.exit(1)
"""

OWN_TRACEBACK = r"""
import sys
sys.stderr.write('Traceback (most recent call last):\n  File "x.py", line 1\nZeroDivisionError: division by zero\n')
sys.exit(3)
"""


def test_launcher_traceback_is_filtered_and_the_childs_status_returned(capfd):
    assert _run([sys.executable, "-c", FAKE_LAUNCHER], launcher=True) == 2
    out, err = capfd.readouterr()
    assert out == "1 process(es)\n"
    assert err == "warming up\rstill warming\r\ntrain_heads: error: data.jsonl holds fewer than 2 usable records\n"
    # a traceback that is not the launcher's (a real bug) is shown
    assert _run([sys.executable, "-c", OWN_TRACEBACK], launcher=True) == 3
    assert "ZeroDivisionError" in capfd.readouterr().err


@pytest.mark.slow
def test_specheads_train_error_after_launch_is_one_line(tmp_path, data):
    exe = Path(sys.executable).parent / "specheads"
    proc = subprocess.run([str(exe), "train", "--config", str(RECIPE), f"data={data}", "prompts=",
                           f"output_dir={tmp_path / 'o'}"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "CalledProcessError" not in proc.stderr, proc.stderr
    assert "train_heads: error:" in proc.stderr and "fewer than 2 usable records" in proc.stderr
