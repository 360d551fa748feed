"""Loading what a command's arguments name, one way for every command (``generate``, ``chat``,
``bench``, ``serve``, ...): the tree, the verifier, the drafter, and the checks that come before
any model loads."""

from __future__ import annotations

from ..core.errors import UserError


def tree_for(args):
    """``--tree`` as a tree spec (None: the drafter's own)."""
    from ..core.tree import load_tree_spec

    return load_tree_spec(args.tree) if args.tree else None


def verifier_for(args, text_for: str | None = None, check=None):
    """The verifier, after checking the device (a bad --device fails before any loading); with
    ``text_for`` (what needs text), a verifier without a tokenizer is a user error. ``check``: see
    :func:`~infer.core.models.load_verifier` (runs before the weights load where it can)."""
    from ..core import models

    models.resolve_device(args.device)
    kw = {"check": check} if check is not None else {}
    lv = models.load_verifier(args.verifier, dtype=args.dtype, device=args.device, **kw)
    if text_for and lv.tokenizer is None:
        raise UserError(f"verifier {args.verifier!r} has no tokenizer: {text_for}")
    return lv


def check_drafts(*specs: str, trees=None) -> None:
    """Every --draft spec, checked before any model loads (names, paths, 'none' combined, twice),
    and that the drafter of each which would draw its tree (``trees``: one per spec, or None)
    grows that kind of tree."""
    from ..drafting.loading import check_tree, draft_parts

    for spec, tree in zip(specs, trees or [None] * len(specs)):
        draft_parts(spec, None)
        check_tree(spec, tree)


def drafter_for(args, draft: str, model, tree, tokenizer=None):
    """The drafter ``draft`` names (a ``--draft`` spec) for verifier ``model``, with the command's
    ``--draft-dtype`` and ``--compile`` (``--tree-budget`` is the engine's ``budget``)."""
    from ..core.static import resolve_compile
    from ..drafting.loading import load_drafter

    return load_drafter(draft, model, tree=tree, draft_dtype=args.draft_dtype, tokenizer=tokenizer,
                        compile=resolve_compile(args.compile, model)[0])

