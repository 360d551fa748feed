"""Choosing and loading drafters: what ``--draft`` accepts, as a library function.

:func:`load_drafter` takes exactly the specs the command line does: ``auto`` (the heads shipped
for this verifier together with prompt lookup; else prompt lookup), ``pld``, ``none``, the name
of a shipped head (``default``), a head checkpoint (directory or Hub id), or several joined by
``+`` (their drafts are verified as one trie), or ``model:PATH``, a separate draft model (a local
HF causal LM with the verifier's vocabulary, :mod:`infer.drafting.draft_model`; never in ``auto``).
How much each drafts is the engine's to decide (:mod:`infer.core.schedule`).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..core.drafter import Drafter, NoDrafter
from ..core.errors import UserError
from ..core.tree import StaticTreeSpec, TreeSpec
from .draft_model import draft_model_path, is_draft_model_spec, read_draft_config
from .lookup import PromptLookupDrafter
from .union import UnionDrafter


def draft_parts(spec: str, model) -> list[str]:
    """The drafters a ``--draft`` spec names, checked (a one-line UserError otherwise); ``auto``
    resolves to the shipped heads that fit ``model`` (by path), then ``pld``. With ``model=None``
    the spec is only checked (before any model loads; ``auto`` then resolves to ``["auto"]``)."""
    from heads.io import PRETRAINED_DIR, is_hub_id, local_path_problem, pretrained_for, pretrained_names

    spec = spec.strip()
    if not spec:
        raise UserError("--draft is empty: use auto, pld, none, a shipped head name or a head checkpoint")
    if spec == "auto":  # explicit paths: a local directory that happens to share a shipped name is not picked up
        return ["auto"] if model is None else [str(PRETRAINED_DIR / n) for n in pretrained_for(model)] + ["pld"]
    parts = [spec] if Path(spec).is_dir() else [p.strip() for p in spec.split("+")]
    shipped = pretrained_names()
    for part in parts:
        if is_draft_model_spec(part):  # a separate draft model: its directory and config.json, read now
            read_draft_config(draft_model_path(part))
            continue
        is_head = part in shipped or Path(part).is_dir() or is_hub_id(part)
        if part not in ("pld", "none", *shipped) and not is_head and (
                "/" in part or os.sep in part or part.startswith((".", "~")) or os.path.lexists(part)):
            raise UserError(f"draft {local_path_problem(part)}: give a draft-head checkpoint directory or a Hub id (org/name)")
        if part not in ("pld", "none") and not is_head:
            names = ", ".join([*shipped, "pld", "none"])
            raise UserError(f"unknown draft {part!r}: use auto, {names}, a draft-head checkpoint directory or Hub id, model:PATH (a draft model), or several joined by +")
    if model is None:  # a head's own config.json, read before any model loads (sizes, aux_layers, types)
        for part in parts:
            if part not in ("pld", "none") and not is_draft_model_spec(part) and Path(part).is_dir():
                check_head_config(part)
    if len(parts) > 1 and "none" in parts:
        raise UserError(f"--draft {spec!r}: 'none' cannot be combined with other drafts")
    if len(set(parts)) != len(parts):
        raise UserError(f"--draft {spec!r} names a drafter twice")
    return parts


def check_head_config(path: str) -> None:
    """A specheads head directory's config.json, parsed and checked (a one-line UserError); other
    layouts are checked when they are imported, which needs the verifier."""
    from heads.io import CheckpointError, is_foreign, read_config

    try:
        if not is_foreign(Path(path)):
            read_config(Path(path))
    except CheckpointError as e:
        raise UserError(str(e)) from None


def tree_fits(head_path: str, tree: TreeSpec) -> bool:
    """Whether the head at ``head_path`` grows ``tree``'s kind of tree (Medusa: static, EAGLE: dynamic)."""
    from heads.io import read_config, resolve

    if is_draft_model_spec(head_path):
        return not isinstance(tree, StaticTreeSpec) or all(all(r == 0 for r in c) for c in tree.choices)
    return (read_config(resolve(head_path)).head_type in ("medusa", "medusa2")) == isinstance(tree, StaticTreeSpec)


def tree_target(spec: str, parts: list[str], tree: TreeSpec | None) -> int | None:
    """Which of a spec's ``parts`` draws ``tree`` (None: no tree given): the first, except under
    ``auto``, where it is the first that grows that kind of tree (prompt lookup, last, grows any)."""
    if tree is None:
        return None
    if spec.strip() == "auto":
        return next((i for i, part in enumerate(parts) if part == "pld" or tree_fits(part, tree)), len(parts) - 1)
    return 0


def check_tree(spec: str, tree: TreeSpec | None, model=None) -> None:
    """A one-line UserError when the drafter of ``spec`` that would draw ``tree`` grows another kind
    (an EAGLE or block head: dynamic trees; a Medusa head: static ones; a draft model: chains).
    Without ``model`` (before loading) only local and shipped heads are read; ``auto`` always fits."""
    from heads.io import CheckpointError, is_hub_id, pretrained_names

    parts = draft_parts(spec, model) if model is not None or spec.strip() != "auto" else []
    i = tree_target(spec, parts, tree) if parts else None
    if i is None or parts[i] in ("pld", "none"):
        return
    part = parts[i]
    if is_hub_id(part) and part not in pretrained_names() and not Path(part).is_dir():
        return  # checked when it is loaded
    try:
        fits = tree_fits(part, tree)
    except CheckpointError as e:
        raise UserError(str(e)) from None
    if not fits:
        given = "a static" if isinstance(tree, StaticTreeSpec) else "a dynamic"
        raise UserError(f"--tree is {given} tree, but the drafter that draws it, {part!r}, grows {_grows(part)}")


def _grows(part: str) -> str:
    """What kind of tree the drafter ``part`` grows, for an error message."""
    from heads.io import read_config, resolve

    if is_draft_model_spec(part):
        return "chains (chain:D, or a dynamic tree)"
    if read_config(resolve(part)).head_type in ("medusa", "medusa2"):
        return "static trees: pass one such as medusa-16 or chain:4"
    return "dynamic trees: pass one such as eagle2-16 or dynamic:5,4,16"


def load_drafter(spec: str, model, *, tree: TreeSpec | None = None, draft_dtype="auto", tokenizer=None,
                 compile=False) -> Drafter:
    """The drafter a ``--draft`` spec names, for verifier ``model`` (see the module docstring).

    ``tree`` shapes the first drafter; under ``auto``, the first one that grows that kind of tree
    (prompt lookup grows any). ``draft_dtype``: what EAGLE heads compute in
    (:func:`~infer.drafting.head_drafters.draft_dtype`). A head trained for another verifier is
    refused, and so is a draft model (``model:PATH``) whose vocabulary differs from the
    verifier's (``tokenizer``: the verifier's, to compare tokens too). ``compile``: a head drafts
    all rows of a step in one compiled computation (EAGLE, Medusa, the block drafter:
    :func:`~infer.drafting.head_drafters.load_head_drafter`; ``True``, or a ``torch.compile``
    backend) instead of eagerly (``False``)."""
    parts = draft_parts(spec, model)
    if parts == ["none"]:
        return NoDrafter()

    def one(part: str, tree_):
        if part == "pld":
            return PromptLookupDrafter(tree=tree_)
        if is_draft_model_spec(part):
            from .draft_model import load_draft_model_drafter

            return load_draft_model_drafter(part, model, tree_, dtype=draft_dtype, tokenizer=tokenizer)
        from .head_drafters import load_head_drafter

        return load_head_drafter(part, model, tree_, dtype=draft_dtype, compile=compile)

    check_tree(spec, tree, model)
    target = tree_target(spec, parts, tree)  # the drafter that `tree` shapes (drafters carry their trees)
    drafters = [one(part, tree if i == target else None) for i, part in enumerate(parts)]
    return drafters[0] if len(drafters) == 1 else UnionDrafter(drafters)
