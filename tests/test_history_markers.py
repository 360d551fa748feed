"""The tree speaks of itself only: no work-history markers in any tracked file.

A run is named by its date, machine and commit, a head by its version (v3j), a behaviour by what
it is; the words "session" or "issue" followed by a number (with or without "#"), or a keyword
argument named "issue", name the work that produced a change, not the change, and mean nothing to a
reader of the tree.
Results files are named by date and machine, not by the work period that made them.

``scan_text`` and ``scan_name`` are pure functions on strings, tested on planted markers below;
``test_no_marker_in_tracked_files`` and ``test_no_marker_in_file_names`` run them over
``git ls-files``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: a work-history marker in text: session(s) or issue(s), then an optional " ", "_" or "-" and "#",
#: then digits; or the keyword argument named issue (case-insensitive)
MARKER = re.compile(r"\b(sessions?|issues?)[ _-]?#?[0-9]+|\bissue=", re.IGNORECASE)
#: a work-period number in a file name: "bench-s32-unseen.json", "notes_session4.md", "s7.png"
NAME_MARKER = re.compile(r"(?:^|[-_.])s(?:ession)?[-_]?[0-9]+(?=[-_.]|$)", re.IGNORECASE)
MAX_BYTES = 5 * 1024 * 1024
SKIP_SUFFIXES = (".safetensors",)


def scan_text(text: str) -> list[tuple[int, str]]:
    """Markers in ``text``: ``[(line number from 1, matched text)]`` in reading order."""
    return [(n, m.group(0)) for n, line in enumerate(text.splitlines(), 1) for m in MARKER.finditer(line)]


def scan_name(path: str) -> str | None:
    """The first work-period number in a component of ``path`` (``docs/bench-s32-t1.json`` ->
    ``-s32``), or None."""
    for part in path.split("/"):
        m = NAME_MARKER.search(part)
        if m:
            return m.group(0)
    return None


def tracked_files(root: Path) -> list[str]:
    """Paths of the files git tracks under ``root``, relative to it."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    return [p for p in out.decode("utf-8").split("\0") if p]


def read_text(path: Path) -> str | None:
    """The file's text, or None for what is not scanned: model weights, files over 5 MB, binary
    files (a NUL byte or bytes that are not UTF-8), and a path that is gone from the work tree."""
    if path.suffix in SKIP_SUFFIXES or not path.is_file() or path.stat().st_size > MAX_BYTES:
        return None
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def marker_hits(root: Path, paths: list[str]) -> list[str]:
    """``path:line: marker`` for every marker in the text files among ``paths``."""
    hits = []
    for rel in paths:
        text = read_text(root / rel)
        if text is not None:
            hits += [f"{rel}:{n}: {found}" for n, found in scan_text(text)]
    return hits


# ------------------------------------------------------------------ the scanners, on planted markers

@pytest.mark.parametrize("text", [
    "as measured in sess" + "ion 12", "Sess" + "ions 20-32 trained it", "see iss" + "ue 21", "Iss" + "ue #22, point 3",
    "the iss" + "ue-21 table", "iss" + "ue_9", "Refused(..., iss" + "ue='12')", "SESS" + "ION 3",
])
def test_scan_text_finds_a_planted_marker(text):
    found = scan_text("a clean first line\n" + text + "\n")
    assert found and found[0][0] == 2


@pytest.mark.parametrize("text", [
    "", "the session goes on", "a chat session ended", "issues and fixes", "an issue with sessions",
    "v3j, shipped 2026-12-04 on a 2-core Xeon (commit 84dfa71)", "session_id = 7", "tissue 12", "subsession",
])
def test_scan_text_passes_clean_text(text):
    assert scan_text(text) == []


def test_scan_text_numbers_every_line():
    text = "one\nsess" + "ion 4 and iss" + "ue 5\nthree\niss" + "ue=7\n"
    assert scan_text(text) == [(2, "sess" + "ion 4"), (2, "iss" + "ue 5"), (4, "iss" + "ue=")]


@pytest.mark.parametrize("name, found", [
    ("docs/bench-s32-specbench.json", "-s32"), ("docs/s7.png", "s7"), ("notes_session4.md", "_session4"),
    ("docs/bench-2026-12-04-epyc-specbench.json", None), ("configs/eagle3-default-v3-cpu.yaml", None),
    ("configs/accelerate/deepspeed-zero2.yaml", None), ("heads/pretrained/default/model.safetensors", None),
    ("tests/test_sampling.py", None), ("docs/s32/readme.md", "s32"),
])
def test_scan_name(name, found):
    assert scan_name(name) == found


def test_marker_hits_on_a_planted_file(tmp_path):
    """A copy of a tracked file with a marker planted in it is reported as path:line."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    assert marker_hits(tmp_path, ["pyproject.toml"]) == []
    with open(tmp_path / "pyproject.toml", "a", encoding="utf-8") as f:
        f.write("# measured in sess" + "ion 31\n")
    n = len((tmp_path / "pyproject.toml").read_text(encoding="utf-8").splitlines())
    assert marker_hits(tmp_path, ["pyproject.toml"]) == [f"pyproject.toml:{n}: sess" + "ion 31"]


def test_read_text_skips_weights_binary_and_large_files(tmp_path):
    marker = "sess" + "ion 1\n"
    (tmp_path / "w.safetensors").write_text(marker)
    (tmp_path / "b.bin").write_bytes(b"\0" + marker.encode())
    (tmp_path / "x.bin").write_bytes(b"\xff\xfe" + marker.encode())
    (tmp_path / "big.txt").write_text(marker * (MAX_BYTES // len(marker) + 1))
    (tmp_path / "ok.md").write_text(marker)
    names = ["w.safetensors", "b.bin", "x.bin", "big.txt", "ok.md", "gone.md"]
    assert marker_hits(tmp_path, names) == ["ok.md:1: sess" + "ion 1"]


# ------------------------------------------------------------------ the tree itself

def _tracked() -> list[str]:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    return tracked_files(ROOT)


def test_no_marker_in_tracked_files():
    hits = marker_hits(ROOT, _tracked())
    assert not hits, f"{len(hits)} work-history markers (name the date, machine, commit or version instead):\n" + "\n".join(hits)


def test_no_marker_in_file_names():
    hits = [p for p in _tracked() if scan_name(p)]
    assert not hits, "file names with a work-period number (name them by date and machine):\n" + "\n".join(hits)
