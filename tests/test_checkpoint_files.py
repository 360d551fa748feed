"""Corrupt weight files: a truncated model.safetensors, or a pickle renamed to one, is refused
with one clear line (CheckpointError; exit 2 from the CLI), and nothing is ever unpickled."""

import os
import pickle

import pytest
import torch
from test_heads import make_head

from heads import CheckpointError, load_head
from infer.core.models import load_verifier
from infer.tools.cli import main


class _Payload:
    """Unpickling this creates ``MARKER`` (what a malicious pickle would do instead)."""

    def __reduce__(self):
        return (open, (os.environ["SPECHEADS_TEST_MARKER"], "w"))


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _pickle_in_place(path, marker, monkeypatch):
    monkeypatch.setenv("SPECHEADS_TEST_MARKER", str(marker))
    path.write_bytes(pickle.dumps({"fc.weight": _Payload()}))


@pytest.fixture(scope="module")
def tiny_llama():
    return load_verifier("tiny-random:llama").model


@pytest.mark.parametrize("damage", ["truncated", "pickle", "empty"])
@pytest.mark.parametrize("layout", ["specheads", "foreign"])
def test_corrupt_weights_are_refused_without_unpickling(tmp_path, tiny_llama, monkeypatch, damage, layout):
    d = tmp_path / "head"
    make_head(tiny_llama, "eagle1").save_pretrained(d)
    if layout == "foreign":  # an EAGLE-1 checkpoint as published: no specheads config.json
        (d / "config.json").unlink()
    weights = d / "model.safetensors"
    marker = tmp_path / "UNPICKLED"
    if damage == "truncated":
        _truncate(weights)
    elif damage == "pickle":
        _pickle_in_place(weights, marker, monkeypatch)
    else:
        weights.write_bytes(b"")
    with pytest.raises(CheckpointError, match="is not a valid safetensors file .*re-save or re-download it"):
        load_head(d, verifier=tiny_llama)
    assert not marker.exists()


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_cli_export_and_generate_refuse_a_corrupt_head(tmp_path, tiny_llama, capsys, monkeypatch):
    bad = tmp_path / "bad"
    make_head(tiny_llama, "eagle1").save_pretrained(bad)
    _truncate(bad / "model.safetensors")
    capsys.readouterr()
    assert main(["export", "--draft", str(bad), "--format", "eagle3", "--out", str(tmp_path / "x")]) == 2
    assert "not a valid safetensors file" in _one_line(capsys.readouterr().err)
    assert main(["generate", "--verifier", "tiny-random:llama", "--draft", str(bad), "--prompt", "hi"]) == 2
    assert "not a valid safetensors file" in _one_line(capsys.readouterr().err)
    marker = tmp_path / "UNPICKLED"
    _pickle_in_place(bad / "model.safetensors", marker, monkeypatch)
    assert main(["export", "--draft", str(bad), "--format", "specheads", "--out", str(tmp_path / "y")]) == 2
    assert "not a valid safetensors file" in _one_line(capsys.readouterr().err)
    assert not marker.exists()
    torch.save({"fc.weight": torch.zeros(1)}, bad / "model.safetensors")  # a torch.save zip under the name
    assert main(["generate", "--verifier", "tiny-random:llama", "--draft", str(bad), "--prompt", "hi"]) == 2
    assert "not a valid safetensors file" in _one_line(capsys.readouterr().err)
