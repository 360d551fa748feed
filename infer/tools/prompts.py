"""Prompt files: JSONL lines with ``"prompt"`` (a string) or ``"turns"`` (a list of user turns),
optionally ``"category"`` and ``"id"``. Spec-Bench's question file works as is. Used by the
benchmark and by self-distillation (``train``), so it lives apart from both.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import UserError


@dataclass(frozen=True)
class BenchPrompt:
    """One prompt: its first user turn (``text``), its category, and every user turn."""

    text: str
    category: str
    turns: tuple[str, ...] = field(default=())
    id: str | None = None


#: Spec-Bench reports MT-bench's eight categories as one; ``group`` in :func:`read_prompts` does too.
MT_BENCH_GROUP = {c: "mt_bench" for c in ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")}


#: Bounds on what a prompt file may make us read into memory (``/dev/zero`` is a file too).
MAX_PROMPT_FILE_BYTES = 256 << 20
MAX_PROMPT_LINE_CHARS = 16 << 20


def check_text(text: str, what: str) -> None:
    """A :class:`UserError` when ``text`` holds a lone surrogate (valid JSON, not valid Unicode)."""
    from ..core.text import check_text as check

    check(text, what)


def read_lines(path: Path, what: str) -> list[str]:
    """The lines of a UTF-8 text file split on ``\\n`` only (JSON strings may hold U+2028), read
    with bounds: at most :data:`MAX_PROMPT_FILE_BYTES` in all and :data:`MAX_PROMPT_LINE_CHARS`
    per line, else a one-line :class:`UserError` naming the limit (nothing beyond it is read)."""
    lines: list[str] = []
    total = 0
    try:
        with open(path, encoding="utf-8", newline="\n") as f:
            while line := f.readline(MAX_PROMPT_LINE_CHARS + 1):
                if len(line.rstrip("\n")) > MAX_PROMPT_LINE_CHARS:
                    raise UserError(f"{path}:{len(lines) + 1}: a line longer than the limit of {MAX_PROMPT_LINE_CHARS:,} "
                                    f"characters: is this a JSONL {what}?")
                total += len(line)
                if total > MAX_PROMPT_FILE_BYTES:
                    raise UserError(f"{what} {path} is larger than the limit of {MAX_PROMPT_FILE_BYTES >> 20} MB: split it")
                lines.append(line.rstrip("\n").removesuffix("\r"))
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {what} {path}: {e.strerror if isinstance(e, OSError) else e}") from None
    return lines


def read_prompts(path: str | Path, limit: int | None = None, group: dict[str, str] | None = None) -> list[BenchPrompt]:
    """Read a JSONL prompt file: each line has ``"prompt"`` (string) or ``"turns"`` (list of user
    turns; the first is the prompt's ``text``), and optionally ``"category"`` (renamed through
    ``group`` when listed there) and ``"id"``. ``limit``: at most that many prompts per category
    (the first ones). Bad lines are a one-line :class:`UserError` naming the line."""
    path = Path(path)
    lines = read_lines(path, "prompt file")
    prompts: list[BenchPrompt] = []
    per_cat: dict[str, int] = defaultdict(int)
    for no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{no}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise UserError(f"{path}:{no}: each line must be a JSON object")
        text = row.get("prompt")
        if text is None and isinstance(row.get("turns"), list) and row["turns"]:
            text = row["turns"][0]
        if not isinstance(text, str) or not text.strip():
            raise UserError(f"{path}:{no}: needs a non-empty \"prompt\" string or a \"turns\" list")
        turns = tuple(row["turns"]) if isinstance(row.get("turns"), list) and row.get("prompt") is None else (text,)
        if not all(isinstance(t, str) and t.strip() for t in turns):
            raise UserError(f"{path}:{no}: every entry of \"turns\" must be a non-empty string")
        for t in turns:
            check_text(t, f"{path}:{no}: the prompt")
        cat = str(row.get("category", "all"))
        cat = (group or {}).get(cat, cat)
        if limit is not None and per_cat[cat] >= limit:
            continue
        per_cat[cat] += 1
        prompts.append(BenchPrompt(text, cat, turns, str(row["id"]) if "id" in row else None))
    if not prompts:
        raise UserError(f"prompt file {path} holds no prompts")
    return prompts


