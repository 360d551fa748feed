"""Output paths, checked before any work (a benchmark must not run for an hour and then fail to
write its results); writing itself goes through :func:`heads.io.write_atomic`."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..core.errors import UserError


def _check_parent(path: Path, what: str) -> None:
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.exists():
        raise UserError(f"{what} {path}: the directory {parent} does not exist")
    if not parent.is_dir():
        raise UserError(f"{what} {path}: {parent} is not a directory")
    _probe(parent, path, what)


def _probe(directory: Path, path: Path, what: str) -> None:
    """Create and remove a temporary file in ``directory`` (permission bits do not tell root)."""
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".specheads-check-"):
            pass
    except OSError as e:
        raise UserError(f"cannot write {what} {path}: {e.strerror or e}") from None


def check_output_file(path: str | Path, what: str = "output") -> Path:
    """``path`` can be written as a file (its directory exists and is writable; it is not a
    directory; an existing file is writable), or a one-line :class:`UserError`. Writes nothing."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{what} {path} is a directory: give a file path")
    _check_parent(path, what)
    if path.exists() and not os.access(path, os.W_OK):
        raise UserError(f"cannot write {what} {path}: permission denied")
    return path


def check_output_dir(path: str | Path, what: str = "output directory") -> Path:
    """``path`` can be used as an output directory (it is one, or it can be made: its nearest
    existing ancestor is a writable directory; it is not an existing file), or a one-line
    :class:`UserError`. Creates nothing."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{what} {path} is an existing file: give a directory")
    base = path
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise UserError(f"{what} {path}: {base} is not a directory")
    _probe(base, path, what)
    return path


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether two paths name one file (the same inode when both exist: links, ``./x`` and ``x``)."""
    try:
        if os.path.exists(a) and os.path.exists(b):
            return os.path.samefile(a, b)
        return Path(a).resolve() == Path(b).resolve()
    except (OSError, RuntimeError):  # a symlink loop: not a file we would read
        return False


def check_not_input(path: str | Path, what: str, inputs) -> None:
    """A one-line :class:`UserError` when the output ``path`` is one of ``inputs`` (``(name, path)``
    pairs): writing it would destroy what the run reads."""
    for name, source in inputs:
        if source is not None and same_file(path, source):
            raise UserError(f"{what} {path} is also {name} {source}: writing it would overwrite that; give another path")
