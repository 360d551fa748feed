"""Shared fixtures: tiny random verifiers of every supported family (the test drafter with a known
continuation is :class:`infer.tools.selfcheck.OracleDrafter`)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from infer.core.models import TINY_ARCHS, tiny_random_model

VOCAB = 256

#: set in each process that pytest-xdist runs tests in (``make test`` runs two, one per core)
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")


def pytest_configure(config):
    """One torch thread per xdist worker (the workers share the cores), and a project cache that
    holds no compile measurements: a developer's ``compile.json`` must not change what the tests
    run (``--compile auto`` would compile at construction where it says "faster"), and what the
    tests measure must not reach it. The cache is a temporary folder of links to the real one's
    entries (converted verifiers are reused), made once by the process that starts the run (xdist's
    workers inherit it); what the run converted anew is moved into the real cache at the end."""
    if XDIST_WORKER:
        torch.set_num_threads(1)
        return
    from infer.core.converted import cache_root

    real = cache_root()
    if real is None:  # the cache is off (SPECHEADS_CACHE=''): nothing is stored, nothing to seal
        return
    sealed = Path(tempfile.mkdtemp(prefix="specheads-test-cache-"))
    for entry in real.iterdir() if real.is_dir() else ():
        if entry.name != "compile.json" and not entry.name.startswith("."):
            (sealed / entry.name).symlink_to(entry)
    os.environ["SPECHEADS_CACHE"] = str(sealed)  # inherited by the workers and the subprocesses tests start
    config.add_cleanup(lambda: _unseal(sealed, real))


def pytest_collection_modifyitems(config, items):
    """The tests marked ``early`` first, in their order (a stable sort): started last, one of them
    would run alone at the end while the other worker idles."""
    items.sort(key=lambda item: item.get_closest_marker("early") is None)


def _unseal(sealed: Path, real: Path) -> None:
    """Keep what the run converted (new, whole conversions in ``sealed``) in ``real``; remove
    ``sealed`` (its links, not what they point to)."""
    from infer.core.converted import MARKER

    for entry in sealed.iterdir():
        whole = entry.is_dir() and not entry.is_symlink() and (entry / MARKER).is_file()
        if whole and not entry.name.startswith(".") and not (real / entry.name).exists():
            real.mkdir(parents=True, exist_ok=True)
            shutil.move(str(entry), str(real / entry.name))
    shutil.rmtree(sealed, ignore_errors=True)


@pytest.fixture(scope="session", params=TINY_ARCHS)
def tiny_model(request):
    """A 2-layer, hidden-64, vocab-256 random model of each supported family."""
    return tiny_random_model(request.param, vocab_size=VOCAB, seed=1)


@pytest.fixture(scope="session")
def llama():
    return tiny_random_model("llama", vocab_size=VOCAB, seed=1)


#: operations that make the host wait for the device (Dynamo's graphs are checked for them)
SYNCING = {"item", "_local_scalar_dense", "nonzero", "tolist", "numpy", "masked_select", "unique",
           "repeat_interleave", "equal", "is_nonzero"}


def host_syncs(graphs) -> list[str]:
    """The nodes of Dynamo's ``graphs`` (``GraphModule`` s) that would make the host wait."""
    return [node.format_node() for gm in graphs for node in gm.graph.nodes
            if node.op in ("call_function", "call_method")
            and str(getattr(node.target, "__name__", node.target)).split(".")[0] in SYNCING]


def hf_greedy(model, ids: torch.Tensor, n: int, eos=None) -> list[int]:
    """The reference: HF generate, greedy."""
    out = model.generate(
        ids.view(1, -1), attention_mask=torch.ones(1, ids.numel(), dtype=torch.long), max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=0,
        min_new_tokens=0 if eos is not None else n,
    )
    return out[0, ids.numel():].tolist()


@pytest.fixture
def fresh_accelerate_state():
    """Resets accelerate's process-wide state after a test that made an ``Accelerator``."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def run_cli(argv, capsys):
    """``specheads ARGV`` in this process -> ``(exit code, stdout, stderr)``."""
    from infer.tools.cli import main

    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@contextlib.contextmanager
def bench_stopped_at_prompt_two(monkeypatch):
    """Inside: ``infer.tools.bench``'s HF baseline raises ``KeyboardInterrupt`` on its third call (the
    warm-up, prompt 1, then prompt 2), as a user's Ctrl-C would; after: the real baseline again."""
    import infer.tools.bench as bench

    real, calls = bench.hf_generate, {"n": 0}

    def stop_at_third_call(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(bench, "hf_generate", stop_at_third_call)
    try:
        yield
    finally:
        monkeypatch.setattr(bench, "hf_generate", real)


def forked_map(fn, items, workers: int | None = None) -> list:
    """``[fn(x) for x in items]``, the items dealt round-robin to ``workers`` processes forked from
    this one (each with one torch thread; this process takes the first share), so that the long
    statistical tests use every core of a CI machine (default: 2, or 1 in an xdist worker, whose
    neighbour keeps the other core busy). ``fn`` returns picklable plain values; the
    forked processes start from this process's state (models, drafters, monkeypatches) and their
    later state changes stay theirs. Falls back to one process where ``fork`` does not exist."""
    import multiprocessing as mp

    items = list(items)
    if workers is None:
        workers = 1 if XDIST_WORKER else 2
    if workers < 2 or "fork" not in mp.get_all_start_methods():
        return [fn(x) for x in items]
    ctx = mp.get_context("fork")
    shares = [items[k::workers] for k in range(workers)]

    def child(share, conn):
        torch.set_num_threads(1)
        try:
            conn.send(("ok", [fn(x) for x in share]))
        except BaseException as e:  # the parent raises it: a failed share must fail the test
            conn.send(("error", f"{type(e).__name__}: {e}"))
        conn.close()

    readers, procs = [], []
    for share in shares[1:]:
        r, w = ctx.Pipe(duplex=False)
        p = ctx.Process(target=child, args=(share, w), daemon=True)
        p.start()
        w.close()
        readers.append(r)
        procs.append(p)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = [[fn(x) for x in shares[0]]]
    finally:
        torch.set_num_threads(threads)
    for r, p in zip(readers, procs):
        status, value = r.recv()
        p.join()
        if status != "ok":
            raise AssertionError(f"a forked share failed: {value}")
        results.append(value)
    out = [None] * len(items)
    for k, share in enumerate(results):
        out[k::workers] = share
    return out


# ---- one row through the batched verifier (what the product's one-row calls were) --------------


def prefill_one(v, ids):
    """Row 0 of an emptied verifier: the prompt ``ids``; its prefill output."""
    v.drop_rows([])
    return v.add_rows([ids])[0]


def verify_one(v, tokens, tree):
    """The one row's tree verified: ``.logits [N, V]`` and ``.features`` (or None)."""
    from types import SimpleNamespace

    from infer.core.batch import stack_drafts
    from infer.core.drafter import Draft

    out = v.verify_rows(stack_drafts([Draft(tokens, tree)], v.device))
    return SimpleNamespace(logits=out.logits[0], features=out.features[0] if out.features is not None else None)


def commit_one(v, nodes, node_ids=None):
    """Keep the one row's accepted ``nodes`` (root first)."""
    v.commit_rows(nodes.view(1, -1), [list(node_ids) if node_ids is not None else nodes.tolist()])


def row_length(v) -> int:
    """Committed tokens of the one row."""
    return v.ends[0] - v.starts[0]
