"""Module layout, the one place its rules are tested: no import cycles (function-level imports
included), heads/ <- infer/ <- train/ (heads/ imports neither, infer/ never imports train/), infer/'s
three rooms (core/ imports neither drafting/ nor tools/; drafting/ never imports tools/), and the
helpers used across modules have public names."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _imports(path: pathlib.Path, package: str) -> set[str]:
    """Fully qualified modules imported anywhere in ``path`` (top level and inside functions)."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    parent = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = parent.rsplit(".", node.level - 1)[0] if node.level > 1 else parent
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            out.add(target)
            for a in node.names:  # `from . import io` imports the submodule heads.io
                out.add(f"{target}.{a.name}")
    return out


def _graph(package: str) -> dict[str, set[str]]:
    files = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (ROOT / package).rglob("*.py")}
    return {m: {t for t in _imports(p, package) if t in files and t != m} for m, p in files.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state:
                found = visit(t)
                if found:
                    return found
        state[m] = 2
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_heads_import_graph_has_no_cycle():
    graph = _graph("heads")
    assert set(graph) >= {"heads", "heads.modules", "heads.io", "heads.interop", "heads.loading", "heads.masks"}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
    assert "heads.io" not in graph["heads.modules"] and "heads.loading" not in graph["heads.modules"]


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_heads_and_infer_never_import_train():
    for pkg, forbidden in (("heads", ("train", "infer")), ("infer", ("train",))):
        for path in (ROOT / pkg).rglob("*.py"):
            for name in _imports(path, pkg):
                assert name.split(".")[0] not in forbidden, f"{path.relative_to(ROOT)} imports {name}"


def test_infer_core_drafting_tools_depend_one_way():
    for room, forbidden in (("infer/core", ("infer.drafting", "infer.tools")), ("infer/drafting", ("infer.tools",))):
        files = list((ROOT / room).rglob("*.py"))
        assert files, room
        for path in files:
            for name in _imports(path, "infer"):
                assert not name.startswith(forbidden), f"{path.relative_to(ROOT)} imports {name}"


def test_infer_has_no_cycle_and_train_does_not_need_the_benchmark():
    graph = _graph("infer")
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
    for path in (ROOT / "train").rglob("*.py"):
        assert not any(n.startswith("infer.tools.bench") or n.startswith("infer.tools.cli") for n in _imports(path, "train")), path
    for path in (ROOT / "infer").rglob("*.py"):  # one mask helper, by its public name
        assert "_float_mask" not in path.read_text(), path


def test_public_helpers():
    import torch

    from heads import DraftHead
    from heads.masks import additive_mask, causal_mask
    from train.losses import seq_mean

    allowed = torch.tensor([[True, False], [True, True]])
    mask = additive_mask(allowed, torch.float32)
    assert mask.shape == (1, 2, 2) and mask[0, 0, 1] == torch.finfo(torch.float32).min and mask[0, 1].eq(0).all()
    assert torch.equal(causal_mask(2, 0, 1, torch.float32, "cpu"), additive_mask(allowed[None], torch.float32))
    assert float(seq_mean(torch.tensor([[1.0, 3.0]]), torch.tensor([[True, True]]))) == 2.0
    for name in ("save_pretrained", "from_pretrained", "push_to_hub"):
        assert callable(getattr(DraftHead, name))
    # one atomic-write helper: train/ uses heads.io.write_atomic, no local tmp + os.replace copies
    for path in (ROOT / "train").glob("*.py"):
        assert "os.replace" not in path.read_text(), path
