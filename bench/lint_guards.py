"""Grep-style guards that ``make lint`` runs beside ruff.

    python bench/lint_guards.py

1. No work-history markers in any tracked file or file name: the rules and scanners of
   ``tests/test_history_markers.py``, imported from there, not copied.
2. In what ships (the Python modules of ``heads/``, ``infer/`` and ``train/``, and ``configs/``): no
   path of a particular machine (``/work/...``, ``/root/...``) and no ``TODO stub``.

Prints ``path:line: what`` for every hit and exits 1 when there is one; exits 0 otherwise.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT / "tests"))
from test_history_markers import marker_hits, read_text, scan_name, tracked_files  # noqa: E402

#: what the shipped code must not hold, and what to call it in the report
FORBIDDEN = [
    (re.compile(r"(?<![\w.~-])/(?:work|root)/"), "a path of a particular machine"),
    (re.compile(r"\bTODO stub\b", re.IGNORECASE), "a stub"),
]


def shipped(path: str) -> bool:
    """Whether ``path`` (relative to the root) ships: code of the packages and the recipes. The
    data builders and notes under ``train/data/`` record where their sources were read, and do
    not ship."""
    if path.startswith(("heads/", "infer/", "configs/")):
        return True
    return path.startswith("train/") and path.count("/") == 1


def forbidden_hits(root: Path, paths: list[str]) -> list[str]:
    """``path:line: what`` for every forbidden pattern in the shipped text files among ``paths``."""
    hits = []
    for rel in paths:
        if not shipped(rel):
            continue
        text = read_text(root / rel)
        if text is None:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            hits += [f"{rel}:{n}: {what}: {m.group(0)}" for pattern, what in FORBIDDEN for m in pattern.finditer(line)]
    return hits


def main(root: Path = ROOT) -> int:
    paths = tracked_files(root)
    hits = [f"{h} (a work-history marker)" for h in marker_hits(root, paths)]
    hits += [f"{p}: {scan_name(p)} (a work-period number in a file name)" for p in paths if scan_name(p)]
    hits += forbidden_hits(root, paths)
    for line in hits:
        print(line)
    if hits:
        print(f"lint_guards: {len(hits)} hits (name the date, machine, commit or version instead of a work period; "
              "no machine paths or stubs in what ships)", file=sys.stderr)
        return 1
    print("lint_guards: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
