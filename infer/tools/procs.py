"""Child processes of the command line (``specheads distill`` and ``train`` run ``python -m``
programs): they import this installed package whatever the working directory, and they end when
the command that started them ends, even when it is killed with SIGKILL.

* **Imports**: a ``python -m`` child puts its working directory first on ``sys.path``, so a
  user's own ``heads/`` folder would shadow the package. Children run with ``PYTHONSAFEPATH=1``
  (Python >= 3.11: no working directory on ``sys.path``, inherited by ``accelerate``'s own
  children) and, when the package is not in a site directory (a source checkout), with its
  absolute root first on ``PYTHONPATH``.
* **Lifetime**: on Linux each child asks the kernel for SIGTERM when its parent dies
  (``prctl(PR_SET_PDEATHSIG)``, set between fork and exec), and the training programs do the same
  for themselves when ``SPECHEADS_DIE_WITH_PARENT`` is set (``accelerate launch`` sits between).
  SIGTERM and SIGHUP sent to the command are passed on to the child; Ctrl-C reaches the child
  from the terminal itself (same process group), which stops cleanly.
"""

from __future__ import annotations

import contextlib
import os
import signal
import site
import sys
import threading
from pathlib import Path

PR_SET_PDEATHSIG = 1
DIE_WITH_PARENT = "SPECHEADS_DIE_WITH_PARENT"


def package_root() -> Path:
    """The directory that holds the ``heads``, ``infer`` and ``train`` packages in use."""
    return Path(__file__).resolve().parents[2]


def child_env(env: dict | None = None) -> dict:
    """The environment of a ``python -m`` child: safe path, this package first, die with parent."""
    env = dict(os.environ if env is None else env)
    env["PYTHONSAFEPATH"] = "1"
    env[DIE_WITH_PARENT] = "1"
    root = str(package_root())
    site_dirs = {str(Path(d).resolve()) for d in [*site.getsitepackages(), site.getusersitepackages()]}
    if root not in site_dirs:
        rest = [str(Path(p).resolve()) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join([root, *(p for p in rest if p != root)])
    return env


def _prctl_pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies (Linux; elsewhere a
    no-op). If the parent is already gone (re-parented to init or a subreaper), exit now."""
    parent = os.getppid()
    if _prctl_pdeathsig(sig) and (parent == 1 or not _alive(parent)):
        os._exit(128 + int(sig))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def preexec_die_with_parent():
    """A ``preexec_fn`` for :class:`subprocess.Popen`: the child gets SIGTERM when this process
    dies (closes the race where the parent died between fork and the call)."""
    me = os.getpid()

    def preexec() -> None:
        if _prctl_pdeathsig(signal.SIGTERM) and os.getppid() != me:
            os._exit(143)

    return preexec if sys.platform.startswith("linux") else None


@contextlib.contextmanager
def forward_signals(proc):
    """While the block runs (in the main thread): SIGTERM and SIGHUP to this process are passed
    on to ``proc`` as SIGTERM; SIGINT (Ctrl-C, which the terminal sends to the child as well) is
    left to the child, so it stops cleanly and says so once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum, frame):
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)

    def leave_to_child(signum, frame):
        pass

    wanted = {signal.SIGTERM: forward, signal.SIGINT: leave_to_child}
    if hasattr(signal, "SIGHUP"):
        wanted[signal.SIGHUP] = forward
    old = {s: signal.signal(s, h) for s, h in wanted.items()}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def exit_status(code: int) -> int:
    """A child's return code as a shell exit status (killed by signal N: 128 + N)."""
    return 128 - code if code < 0 else code
