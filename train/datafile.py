"""Distilled data on disk: the header record, bounded reading, compressed files, directories of
parts, and the exclusive locks of the files and directories a run writes.

A distilled JSONL file starts with one **header record** that says which verifier made it and how:

    {"specheads_distill": 1, "verifier": {"name", "model_type", "hidden_size", "vocab_size",
     "num_layers", "fingerprint"}, "settings": {"dtype", "max_new_tokens", "temperature", "seed",
     "max_prompt_tokens", "max_conversation_tokens"}}

(``verifier`` is :class:`heads.VerifierSpec`, the same fingerprint a trained head records). Every
other line is a record ``{"id", "input_ids", "loss_mask"}``. Files made before headers existed
are still read for training (with a warning line); appending to one is refused until it has a
header (:func:`write_header`, or ``specheads distill --write-header-only``).

Training reads ``.jsonl``, ``.jsonl.gz``, ``.jsonl.xz``, a directory of such parts (read in
name order; hidden files skipped) and a glob pattern of such files (:func:`data_files`). Every
line and every file read is bounded (:data:`MAX_LINE_BYTES`, :data:`MAX_DATA_BYTES`,
:data:`MAX_PROMPT_FILE_BYTES`).
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import lzma
import os
import stat
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HEADER_KEY = "specheads_distill"
HEADER_VERSION = 1
#: the longest line read from a prompt or data file (a record of 1,536 tokens is ~15 KB)
MAX_LINE_BYTES = 16 << 20
#: the most (decompressed) bytes of distilled data one training run reads into memory
MAX_DATA_BYTES = 8 << 30
#: the largest prompt file distillation reads
MAX_PROMPT_FILE_BYTES = 1 << 30
#: names of the files training reads (and of the parts of a data directory)
DATA_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.xz")
#: the verifier fields that must agree (the name may differ: a path, a Hub id, "default")
VERIFIER_KEYS = ("model_type", "hidden_size", "vocab_size", "num_layers", "fingerprint")


def _limit(name: str) -> int:
    """A size limit of this module, read when used (tests lower them)."""
    return globals()[name]


class DataError(ValueError):
    """A data, prompt or output file that cannot be used: a one-line message that says what to do."""


# ---------------------------------------------------------------------------- the header record


def make_header(model, verifier_name: str = "", *, max_new_tokens: int, temperature: float, seed: int,
                max_prompt_tokens: int, max_conversation_tokens: int) -> dict:
    """The header record of data distilled from ``model`` with these generation settings
    (the dtype is the model's own)."""
    from heads import VerifierSpec

    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return {HEADER_KEY: HEADER_VERSION, "verifier": dataclasses.asdict(VerifierSpec.of(model, verifier_name)),
            "settings": {"dtype": dtype, "max_new_tokens": int(max_new_tokens), "temperature": float(temperature),
                         "seed": int(seed), "max_prompt_tokens": int(max_prompt_tokens),
                         "max_conversation_tokens": int(max_conversation_tokens)}}


def is_header(row) -> bool:
    return isinstance(row, dict) and HEADER_KEY in row


def _describe(verifier: dict) -> str:
    return (f"verifier {verifier.get('name') or '?'!r} ({verifier.get('model_type')}, fingerprint "
            f"{verifier.get('fingerprint')})")


def verifier_mismatch(made_by: dict, current: dict) -> str | None:
    """Which verifier field differs between two headers' ``verifier`` entries (None: the same)."""
    for key in VERIFIER_KEYS:
        if made_by.get(key) != current.get(key):
            return key
    return None


def _comparable(settings: dict) -> dict:
    """Settings that change the data: the seed only matters when sampling."""
    out = dict(settings)
    if not out.get("temperature"):
        out.pop("seed", None)
    return out


def check_same_source(path: Path, existing: dict, header: dict) -> None:
    """Appending to ``path`` (header ``existing``) with a run whose header is ``header``: the
    same verifier and the same generation settings, or a :class:`DataError`."""
    if verifier_mismatch(existing["verifier"], header["verifier"]):
        raise DataError(f"{path} holds data distilled from {_describe(existing['verifier'])}, not from this "
                        f"{_describe(header['verifier'])}: write to another file")
    mine, theirs = _comparable(existing.get("settings", {})), _comparable(header["settings"])
    if mine != theirs:
        diff = ", ".join(f"{k} {mine.get(k)!r} (now {theirs.get(k)!r})" for k in sorted(set(mine) | set(theirs))
                         if mine.get(k) != theirs.get(k))
        raise DataError(f"{path} was distilled with other settings: {diff}: continue it with the same settings, or "
                        f"write to another file (a directory of parts can hold both for training)")


def headerless_message(path: Path) -> str:
    return (f"{path} holds records but no header (made before specheads recorded the verifier): if this verifier "
            f"with these settings made it, add its header with `specheads distill --write-header-only --out {path} "
            f"--verifier V [--dtype/--max-new-tokens/--temperature/--seed as distilled]` (stop any run writing it "
            f"first) and run again; else write to another file")


# ---------------------------------------------------------------------------- bounded reading


def check_readable_file(path: Path, what: str) -> None:
    """``path`` is an existing regular file (a device, FIFO or directory would be read forever
    or not at all)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise DataError(f"cannot read {what} {path}: {e.strerror}") from None
    if not stat.S_ISREG(mode):
        raise DataError(f"{what} {path} is not a regular file")


def _open_binary(path: Path):
    name = path.name
    if name.endswith(".xz"):
        return lzma.open(path, "rb")
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


def iter_lines(path: Path, what: str, *, max_total: int, max_line: int | None = None,
               budget: list[int] | None = None) -> Iterator[tuple[int, bytes, bool]]:
    """``(line number, line without its newline, complete)`` for every line of ``path`` (xz or
    gzip when its name says so), read in bounded pieces: a line over ``max_line`` bytes or a file
    over ``max_total`` (decompressed) bytes is a :class:`DataError` naming the limit. ``budget``:
    a one-element list of bytes left, shared by the parts of one data set."""
    check_readable_file(path, what)
    max_line = MAX_LINE_BYTES if max_line is None else max_line
    left = budget if budget is not None else [max_total]
    try:
        with _open_binary(path) as f:
            no = 0
            while True:
                line = f.readline(max_line + 1)
                if not line:
                    return
                no += 1
                left[0] -= len(line)
                if left[0] < 0:
                    raise DataError(f"{what} {path} is larger than {max_total:,} bytes (the limit): split it, or "
                                    f"read fewer parts at once")
                complete = line.endswith(b"\n")
                if not complete and len(line) > max_line:
                    raise DataError(f"{path}:{no}: a line longer than {max_line:,} bytes (the limit): this is not "
                                    f"a {what}")
                yield no, line[:-1] if complete else line, complete
    except (lzma.LZMAError, gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise DataError(f"{what} {path} is not a valid compressed file ({e}): recompress it (xz or gzip)") from None


def scan_prompt_file(path: str | Path) -> None:
    """Refuse a prompt file that cannot be distilled, before any model loads: not a regular file,
    over :data:`MAX_PROMPT_FILE_BYTES`, a line over :data:`MAX_LINE_BYTES`, not UTF-8, or a
    string holding a lone surrogate (``"\\ud800"`` is valid JSON but no character). Other
    problems are :func:`infer.tools.prompts.read_prompts`'s to name."""
    path = Path(path)
    for no, line, _ in iter_lines(path, "prompt file", max_total=_limit("MAX_PROMPT_FILE_BYTES")):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            raise DataError(f"{path}:{no}: not UTF-8 text") from None
        if "\\u" not in text.lower():  # only an escape can make a lone surrogate in decoded UTF-8
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError:
            continue
        try:
            json.dumps(row, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise DataError(f"{path}:{no}: the prompt holds a lone surrogate (an escape like \\ud800 that is no "
                            f"character): fix or remove that line") from None


# ---------------------------------------------------------------------------- a distill output


@dataclass
class OutputScan:
    """What a distill output holds: its header (None: none), the ids already distilled, and
    the number of records."""

    header: dict | None
    done: set[str]
    records: int


def check_output_name(path: Path, what: str = "--out") -> None:
    """Distillation appends plain JSONL: a compressed name or a non-regular file is refused."""
    if path.name.endswith((".gz", ".xz", ".zst", ".bz2")):
        raise DataError(f"{what} {path}: distillation writes plain JSONL; compress it afterwards (xz or gzip), "
                        f"training reads .jsonl.xz and .jsonl.gz")
    if path.exists() and not path.is_file():
        raise DataError(f"{what} {path} is not a regular file")


def scan_output(path: str | Path, *, repair: bool = True) -> OutputScan:
    """Read a distill output in bounded lines: its header and the ids already written. A torn
    last line (killed mid-write) is cut off when ``repair`` (hold the file's lock); a corrupt
    line anywhere else is a :class:`DataError` naming it and what to do."""
    path = Path(path)
    if not path.exists():
        return OutputScan(None, set(), 0)
    check_output_name(path)
    header, done, records, good_end, torn = None, set(), 0, 0, False
    for no, line, complete in iter_lines(path, "distilled JSONL", max_total=1 << 62):
        if not complete:
            torn = True
            break
        if line.strip():
            try:
                row = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                row = None
            if no == 1 and is_header(row):
                header = row
            elif isinstance(row, dict) and isinstance(row.get("id"), str) and "input_ids" in row:
                done.add(row["id"])
                records += 1
            else:
                what = "a header record after the first line" if is_header(row) else "not a distilled record"
                raise DataError(f"{path}:{no}: {what}: the file is damaged; remove that line (sed -i '{no}d' {path}) "
                                f"and run again (its prompt is distilled again), or write to another file")
        good_end += len(line) + 1
    if torn and repair:
        with open(path, "r+b") as f:
            f.truncate(good_end)
    return OutputScan(header, done, records)


def repair_tail(path: str | Path) -> None:
    """Cut a torn last line (an interrupted append) off ``path``, if any."""
    path = Path(path)
    if not path.is_file():
        return
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return
        pos, keep = size, 0
        while pos > 0:
            step = min(1 << 16, pos)
            f.seek(pos - step)
            chunk = f.read(step)
            if pos == size and chunk.endswith(b"\n"):
                return
            nl = chunk.rfind(b"\n")
            if nl >= 0:
                keep = pos - step + nl + 1
                break
            pos -= step
        f.truncate(keep)


def write_header(path: str | Path, header: dict) -> Path:
    """Put ``header`` (:func:`make_header`) on the first line of the distilled JSONL ``path``
    (which has none), atomically: a new file with the header and the old lines, renamed over it.
    A missing or empty file becomes a file holding the header alone. Stop any process still
    appending to ``path`` first: its later lines would go to the replaced file."""
    path = Path(path)
    if not is_header(header):
        raise DataError("write_header needs a header record (train.datafile.make_header)")
    scan = scan_output(path)
    if scan.header is not None:
        raise DataError(f"{path} already has a header ({_describe(scan.header['verifier'])})")
    writers = open_elsewhere(path)
    if writers:
        raise DataError(f"{path} is open in process {', '.join(map(str, writers))}: stop it first (its later lines would "
                        f"go to the replaced file), then add the header")
    from heads.io import write_atomic

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as out:
            out.write((json.dumps(header) + "\n").encode())
            if path.exists():
                with open(path, "rb") as src:
                    while chunk := src.read(1 << 20):
                        out.write(chunk)
            out.flush()
            os.fsync(out.fileno())

    write_atomic(path, write)
    return path


def open_elsewhere(path: Path) -> list[int]:
    """Other processes that hold ``path`` open (Linux ``/proc``; elsewhere, or unreadable: none)."""
    try:
        st = os.stat(path)
    except OSError:
        return []
    out = []
    for proc in Path("/proc").glob("[0-9]*"):
        if int(proc.name) == os.getpid():
            continue
        try:
            fds = list((proc / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                fst = os.stat(fd)
            except OSError:
                continue
            if (fst.st_dev, fst.st_ino) == (st.st_dev, st.st_ino):
                out.append(int(proc.name))
                break
    return out


# ---------------------------------------------------------------------------- data for training


def is_data_pattern(path: str | Path) -> bool:
    """Whether a ``data`` value is a glob pattern: ``*``, ``?`` or ``[`` in it and no file or
    directory of that name (an existing ``runs/exp[1]/d.jsonl`` is that file, not a pattern)."""
    return any(c in str(path) for c in "*?[") and not Path(path).exists()


def literal_prefix_escaped(pattern: str | Path) -> str:
    """``pattern`` with its leading directories that exist under their literal names escaped, so
    that ``runs/exp[1]/late-*.jsonl`` looks inside the existing directory ``runs/exp[1]``."""
    parts = Path(pattern).parts
    n = 0
    while n < len(parts) - 1 and Path(*parts[: n + 1]).is_dir():
        n += 1
    if n == 0:
        return str(pattern)
    return str(Path(glob.escape(str(Path(*parts[:n]))), *parts[n:]))


def data_files(path: str | Path) -> list[Path]:
    """The files of a data set: ``path`` itself, a directory's ``*.jsonl``, ``*.jsonl.gz`` and
    ``*.jsonl.xz`` files in name order (hidden files skipped), or the data files a glob pattern
    matches, in name order (e.g. ``train/data/distilled/late-*.jsonl.xz``: one series; ``**``
    matches any depth of directories)."""
    if is_data_pattern(path):
        found = glob.glob(literal_prefix_escaped(path), recursive=True)
        parts = sorted(Path(p) for p in found if p.endswith(DATA_SUFFIXES) and Path(p).is_file())
        if not parts:
            dirs = sorted(p for p in found if Path(p).is_dir())
            hint = f" (it matches the directory {dirs[0]}: give the directory itself, or a pattern of its files)" if dirs else ""
            raise DataError(f"data pattern {path} matches no *.jsonl, *.jsonl.gz or *.jsonl.xz file{hint}")
        return parts
    path = Path(path)
    if path.is_dir():
        parts = sorted(p for p in path.iterdir() if p.name.endswith(DATA_SUFFIXES) and not p.name.startswith("."))
        if not parts:
            raise DataError(f"data directory {path} holds no *.jsonl, *.jsonl.gz or *.jsonl.xz parts")
        return parts
    if not path.exists():
        raise DataError(f"data {path} does not exist")
    return [path]


def first_record(part: Path) -> dict | None:
    """The header record of one data file (None: it has none)."""
    for _, line, _ in iter_lines(part, "distilled data", max_total=_limit("MAX_DATA_BYTES")):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None
        return row if is_header(row) else None
    return None


def check_data_source(path: str | Path, verifier: dict | None = None, warn=None) -> list[tuple[Path, dict | None]]:
    """Every part's header: they must name one verifier (and ``verifier``, a
    :class:`heads.VerifierSpec` as a dict, when given); a part without a header is trusted with a
    warning line through ``warn`` (default: stderr). Returns ``[(part, header or None)]``."""
    warn = warn or (lambda msg: print(msg, file=sys.stderr, flush=True))
    found = [(p, first_record(p)) for p in data_files(path)]
    first = next(((p, h) for p, h in found if h is not None), None)
    for part, header in found:
        if header is None:
            warn(f"warning: {part} has no header record (distilled before specheads recorded the verifier): "
                 f"trusting that this verifier made it")
        elif first is not None and verifier_mismatch(first[1]["verifier"], header["verifier"]):
            raise DataError(f"data parts disagree: {first[0]} was distilled from {_describe(first[1]['verifier'])} but "
                            f"{part} from {_describe(header['verifier'])}: keep one verifier's data together")
    if verifier is not None and first is not None:
        key = verifier_mismatch(first[1]["verifier"], verifier)
        if key:
            raise DataError(f"data {first[0]} was distilled from {_describe(first[1]['verifier'])} but this run's "
                            f"{_describe(verifier)} differs ({key}): distil data for this verifier (prompts=), or "
                            f"train for the verifier that made it")
    return found


def iter_records(path: str | Path) -> Iterator[tuple[Path, int, dict]]:
    """``(part, line number, row)`` of every record of a data set (headers skipped), with at
    most :data:`MAX_DATA_BYTES` read in all; a line that is not JSON is a :class:`DataError`."""
    limit = _limit("MAX_DATA_BYTES")
    budget = [limit]
    for part in data_files(path):
        for no, line, _ in iter_lines(part, "distilled data", max_total=limit, budget=budget):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise DataError(f"{part}:{no}: not a distilled record (not JSON)") from None
            if is_header(row):
                if no != 1:
                    raise DataError(f"{part}:{no}: a header record after the first line (concatenated files? "
                                    f"keep them as parts of a directory instead)")
                continue
            yield part, no, row


# ---------------------------------------------------------------------------- locks


def lock_path_for_file(path: str | Path) -> Path:
    path = Path(path)
    return path.parent / f".{path.name}.lock"


def lock_path_for_dir(path: str | Path) -> Path:
    return Path(path) / ".specheads.lock"


class Lock:
    """An exclusive ``flock`` on a lock file, held until :meth:`release` (or the process ends:
    the kernel drops it with the file descriptor, even on SIGKILL)."""

    def __init__(self, path: Path, what: str):
        self.path, self.fd = Path(path), None
        try:
            import fcntl
        except ImportError:  # not POSIX: no locking
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip()
            os.close(fd)
            raise DataError(f"{what} is in use by another run{f' (pid {holder})' if holder.isdigit() else ''}: wait "
                            f"for it to finish or stop it") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __del__(self) -> None:
        self.release()

    def __enter__(self) -> Lock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_file(path: str | Path, what: str | None = None) -> Lock:
    """Lock the output file ``path`` (through ``.NAME.lock`` beside it)."""
    return Lock(lock_path_for_file(path), what or f"{path}")


def lock_dir(path: str | Path, what: str | None = None) -> Lock:
    """Lock the output directory ``path`` (made if needed; through ``.specheads.lock`` in it)."""
    Path(path).mkdir(parents=True, exist_ok=True)
    return Lock(lock_path_for_dir(path), what or f"output_dir {path}")


def probe_dir_lock(path: str | Path, what: str | None = None) -> None:
    """Refuse at once when a run holds ``path``'s lock (creates nothing when none was ever taken)."""
    if lock_path_for_dir(path).exists():
        Lock(lock_path_for_dir(path), what or f"output_dir {path}").release()
