"""A separate draft model (Leviathan et al. 2023): any HF causal LM with the verifier's vocabulary
drafts with its own KV cache, a chain of tokens or an EAGLE-2 dynamic tree of its top-k branches.

``--draft model:PATH`` loads one from a local directory (a plain HF model directory, e.g. what
``head_type: draft_model`` training writes). Its vocabulary is checked against the verifier's
before its weights load (a one-line :class:`~infer.core.errors.UserError` names both sizes or the
first differing token). It runs unmodified through its public API: explicit ``position_ids``, a
4D additive mask for tree nodes, and a ``transformers`` ``DynamicCache`` that is cropped back to
the committed tokens after every verify step (``DynamicCache.crop``).

Drafts:

* a chain (the default, ``chain:K`` or a dynamic tree with ``top_k`` 1): greedy, the draft's
  argmax at every step (deterministic, no ``q``); sampled, each token drawn from the draft's
  distribution warped like the verifier's (temperature, top-k, top-p) and reported as ``q``, so
  the verifier's exact tree rejection sampling accepts it with probability ``min(1, p / q)``. The
  chain stops early when one more token would not pay on the verify-cost curve; that decision is
  made from the draft's distribution *before* drawing the token (its top probability, or
  ``sum q^2`` when sampling), so the drawn tokens stay distributed as ``q``.
* a dynamic tree (``dynamic:D,K,N`` or a preset such as ``eagle2-16``): the draft's top-``K``
  children at every expanded node, grown and budgeted by
  :func:`~infer.core.tree.grow_dynamic_tree` like EAGLE's; deterministic (no ``q``), so exact under
  greedy and sampled verification alike.

In a union (``model:PATH+pld``) the drafter is asked for deterministic drafts (greedy chains
also when sampling), since a union verifies one proposal distribution per node only.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from ..core.accept import warp_probs
from ..core.drafter import Budget, Draft, RowDrafter, accepted_on_host, host_draft, root_only
from ..core.errors import UserError
from ..core.tree import DynamicTreeSpec, TreeSpec, grow_dynamic_tree
from ..core.verifier import cache_keyword

PREFIX = "model:"
#: tokens a chain drafts by default (the cost curve may stop it earlier)
DEFAULT_DEPTH = 5


def is_draft_model_spec(part: str) -> bool:
    return part.startswith(PREFIX)


def draft_model_path(part: str) -> Path:
    """The directory of a ``model:PATH`` part, checked (a one-line UserError): a local directory
    with a ``config.json`` that transformers reads as a causal LM config."""
    text = part[len(PREFIX):].strip()
    if not text:
        raise UserError("--draft model: needs a directory: model:PATH (a Hugging Face causal LM saved locally)")
    path = Path(text).expanduser()
    if not path.is_dir():
        raise UserError(f"draft model {text!r} is not a local directory: give model:PATH with a saved Hugging Face causal LM")
    if not (path / "config.json").is_file():
        raise UserError(f"draft model {text!r} has no config.json: give a directory written by save_pretrained")
    return path


def read_draft_config(path: Path):
    """The draft model's ``AutoConfig`` (a one-line UserError when transformers cannot read it)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot read draft model {str(path)!r}: {first}") from None
    if not isinstance(getattr(config, "vocab_size", None), int):
        raise UserError(f"draft model {str(path)!r}: its config.json has no vocab_size: not a causal LM")
    return config


def check_vocab(config, path: Path, verifier_model, verifier_tokenizer=None) -> None:
    """The draft model's vocabulary against the verifier's: the same LM-head size and, when both
    have tokenizers, the same token at every id (a one-line UserError naming the difference)."""
    v_size = int(verifier_model.get_output_embeddings().weight.shape[0])
    d_size = int(config.vocab_size)
    if d_size != v_size:
        raise UserError(f"draft model {str(path)!r} has vocab size {d_size} but the verifier has {v_size}: "
                        f"a draft model needs the verifier's vocabulary")
    if verifier_tokenizer is None or not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return
    from transformers import AutoTokenizer

    try:
        mine = AutoTokenizer.from_pretrained(str(path)).get_vocab()
    except (OSError, ValueError, KeyError):
        return  # no readable tokenizer: the sizes agree, which is what decoding needs
    theirs = verifier_tokenizer.get_vocab()
    by_id_mine = {i: t for t, i in mine.items()}
    by_id_theirs = {i: t for t, i in theirs.items()}
    for i in sorted(set(by_id_mine) | set(by_id_theirs)):
        if by_id_mine.get(i) != by_id_theirs.get(i):
            raise UserError(f"draft model {str(path)!r} has token {by_id_mine.get(i)!r} at id {i} where the verifier "
                            f"has {by_id_theirs.get(i)!r}: a draft model needs the verifier's vocabulary")


def load_draft_model_drafter(part: str, verifier_model, tree: TreeSpec | None = None, *,
                             dtype="auto", tokenizer=None) -> DraftModelDrafter:
    """The drafter of a ``model:PATH`` part for ``verifier_model``: the vocabulary is checked
    first, then the weights load on the verifier's device, in the dtype a head would draft in
    (:func:`~infer.drafting.head_drafters.draft_dtype`: the verifier's, or bf16 on a float32 CPU
    verifier with native bf16 dot products)."""
    from transformers import AutoModelForCausalLM

    from .head_drafters import draft_dtype

    path = draft_model_path(part)
    config = read_draft_config(path)
    check_vocab(config, path, verifier_model, tokenizer)
    device = verifier_model.get_input_embeddings().weight.device
    dt = draft_dtype(verifier_model, dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dt)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot load draft model {str(path)!r}: {first}") from None
    out_rows = int(model.get_output_embeddings().weight.shape[0])
    v_rows = int(verifier_model.get_output_embeddings().weight.shape[0])
    if out_rows != v_rows:
        raise UserError(f"draft model {str(path)!r} has an LM head of {out_rows} tokens but the verifier has {v_rows}")
    return DraftModelDrafter(model.to(device).eval(), tree)


def _chain_depth(spec: TreeSpec) -> int | None:
    """The depth of a chain-shaped spec (a static chain, or a dynamic tree of top_k 1), else None."""
    if isinstance(spec, DynamicTreeSpec):
        return spec.depth if spec.top_k == 1 else None
    if all(all(r == 0 for r in c) for c in spec.choices):
        return spec.depth
    return None


class DraftModelDrafter(RowDrafter):
    """Drafts with a separate causal LM ``model`` (on the verifier's device, with the verifier's
    vocabulary) and its own KV cache over the committed tokens (see the module docstring).

    The cache holds the committed tokens the model has seen; tokens committed since (and those a
    skipped step did not draft) wait in ``_pending`` and are fed with the next root in one pass.
    The budget's price sizes drafts (chains stop, trees are budgeted); it counts this model's
    own measured time per drafted token, so a draft model as costly as the verifier is not asked
    to draft at all (:class:`~infer.core.schedule.Schedule`)."""

    def __init__(self, model, tree: TreeSpec | None = None):
        self.model = model.eval()
        embed = model.get_input_embeddings().weight
        self.device, self.dtype = embed.device, embed.dtype
        self.tree = tree or DynamicTreeSpec(depth=DEFAULT_DEPTH, top_k=1, num_nodes=DEFAULT_DEPTH + 1)
        #: asked for by a union: greedy chains also when sampling (no q)
        self.deterministic = False
        self.params = None  # the generation's SamplingParams (begin_row), for the warped q
        self._cache_kw = cache_keyword(model)
        self._mask_min = torch.finfo(self.dtype).min
        self._reset()

    def _reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache()
        self.length = 0  # committed tokens in the cache
        self._pending: list[int] = []  # committed tokens not yet in the cache
        self._last: tuple | None = None  # the last draft: (host tokens, host parents, cached chain, seconds)
        self._fed = 0  # drafted tokens after the root that the cache holds (until update)

    def spawn(self) -> DraftModelDrafter:
        """Another row's drafter: the same model, its own cache."""
        new = copy.copy(self)
        new._reset()
        return new

    def begin_row(self, prompt_ids, features=None, params=None) -> None:
        self._reset()
        self.params = params
        self._pending = [int(t) for t in prompt_ids.tolist()]

    def update_row(self, tokens, features=None) -> None:
        committed = [int(t) for t in tokens.tolist()]  # a host tensor: no device read
        if self._last is None:  # nothing drafted this step: the root and its tokens are still to feed
            self._crop(self.length)
            self._pending += committed
            return
        host_tokens, host_parents, chain = self._last
        self._last = None
        accepted = accepted_on_host(host_tokens, host_parents, committed)
        # the cache holds the root (committed[0]) and, for a chain, its first `_fed` drafted tokens
        keep = min(len(committed) - 1, self._fed) if chain else 0
        keep = min(keep, accepted)
        self.length += 1 + keep
        self._crop(self.length)
        self._pending = committed[1 + keep :]
        self._fed = 0

    # ---- the model -----------------------------------------------------------------------------

    def _crop(self, length: int) -> None:
        """Cut the cache back to ``length`` positions (a negative ``crop`` removes that many tokens
        in every transformers version; a positive one was an absolute length before 5.25)."""
        extra = self.cache.get_seq_length() - length
        if extra > 0:
            self.cache.crop(-extra)

    def _forward(self, ids: torch.Tensor, start: int, mask: torch.Tensor | None = None, last_only: bool = False) -> torch.Tensor:
        """The model on ``ids [k]`` at positions ``start ..`` (or all at ``start`` with a tree
        ``mask [k, S + k]``), appending to the cache; logits ``[k, V]`` (``[1, V]``: last only)."""
        k = ids.numel()
        if mask is None:
            positions = torch.arange(start, start + k, device=self.device)
        else:
            positions = torch.full((k,), start, dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids.view(1, -1), position_ids=positions.view(1, -1),
                         attention_mask=mask[None, None] if mask is not None else None, use_cache=True,
                         logits_to_keep=1 if last_only else 0, **{self._cache_kw: self.cache})
        return out.logits[0]

    def _catch_up(self, root: int) -> torch.Tensor:
        """Feed the pending committed tokens and the root in one causal pass; the logits after
        the root ``[V]``. The root counts as committed here (:meth:`update` crops it away when a
        step drafted nothing)."""
        self._crop(self.length)
        ids = torch.tensor(self._pending + [int(root)], dtype=torch.long).to(self.device, non_blocking=True)
        logits = self._forward(ids, self.length, last_only=True)[-1]
        self._pending = []
        return logits

    def _warp(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        if p is None or p.greedy:
            return torch.softmax(logits.float(), -1)
        return warp_probs(logits, p.temperature, p.top_k, p.top_p)

    # ---- drafting ------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose_row(self, root: int, budget: Budget, generator=None) -> Draft:
        spec = self.tree
        chain = _chain_depth(spec)
        if chain is None and not isinstance(spec, DynamicTreeSpec):
            raise UserError("a draft model drafts a chain (chain:K) or a dynamic tree (e.g. eagle2-16 or dynamic:5,4,16), "
                            "not a static tree")
        self._last = None
        max_depth = min(budget.depth, (budget.nodes or budget.depth + 1) - 1)
        if max_depth <= 0:
            return root_only(root, self.device)
        logits = self._catch_up(root)  # the cache now holds the root
        root_len = self.cache.get_seq_length()  # the position of the first drafted token
        if chain is not None:
            draft = self._chain(int(root), logits, min(chain, max_depth), root_len,
                                generator if not self.deterministic else None, budget.cost)
        else:
            draft = self._tree(int(root), logits, spec, min(spec.depth, max_depth), root_len, budget.cost)
        # the committed length excludes the root until update() says it entered the verifier
        self.length = root_len - 1
        host = draft.host if draft.host is not None else (tuple(draft.tokens.tolist()), tuple(draft.tree.parents.tolist()))
        self._last = (host[0], host[1], chain is not None)
        return draft

    @staticmethod
    def _pays(expected: float, prob: float, nodes: int, cost) -> bool:
        """Whether one more node of path probability ``prob`` raises the expected tokens per
        unit of ``cost`` of a draft of ``nodes`` nodes expecting ``expected`` tokens."""
        if cost is None:
            return True
        return (expected + prob) / cost(nodes + 1) >= expected / cost(nodes)

    def _chain(self, root: int, logits: torch.Tensor, depth: int, start: int, generator, cost) -> Draft:
        """A chain of up to ``depth`` tokens; sampled (with ``q``) when ``generator`` is given."""
        tokens, qs = [root], []
        expected, path = 1.0, 1.0
        sampled = generator is not None
        self._fed = 0
        for d in range(depth):
            probs = self._warp(logits)
            if cost is not None:  # the next token's chance, judged before it is drawn
                chance = float((probs * probs).sum()) if sampled else float(probs.max())
                if not self._pays(expected, path * chance, len(tokens), cost):
                    break
                path *= chance
                expected += path
            if sampled:
                tok = torch.multinomial(probs, 1, generator=generator)
                qs.append(probs)
            else:
                tok = probs.argmax().view(1)
            tokens.append(tok)
            if d + 1 < depth:
                logits = self._forward(tok.view(1), start + d)[-1]
                self._fed += 1
        if len(tokens) == 1:
            return root_only(root, self.device)
        ids = torch.cat([t.view(1) for t in tokens[1:]]).tolist()  # the one read of the drafted tokens
        parents = list(range(-1, len(ids)))
        if not sampled:
            return host_draft([root] + ids, parents, self.device)
        q = torch.cat([torch.zeros(1, qs[0].shape[-1], device=qs[0].device), torch.stack(qs)])
        draft = host_draft([root] + ids, parents, self.device)
        return Draft(draft.tokens, draft.tree, q, draft.host)

    def _tree(self, root: int, logits: torch.Tensor, spec: DynamicTreeSpec, depth: int, start: int, cost) -> Draft:
        """An EAGLE-2 dynamic tree of the draft's top-k children (deterministic)."""
        width = spec.top_k
        slots = 1 + (depth - 1) * width  # model passes: the root (done), then <= top_k frontier nodes per depth
        slot_anc = torch.zeros(slots, slots, dtype=torch.bool, device=self.device)
        cand_slot = torch.zeros(1 + depth * width * width, dtype=torch.long, device=self.device)
        low = self._mask_min
        state = {"slots": 0, "depth": 0}
        root_logp = torch.log_softmax(logits.float(), -1)[None]

        def expand(ids, parents, toks):
            k, s, d = ids.numel(), state["slots"], state["depth"]
            new = torch.arange(s, s + k, device=self.device)
            if d == 0:
                slot_anc[0, 0] = True
                out = root_logp
            else:
                ps = cand_slot[parents]
                slot_anc[s : s + k] = slot_anc[ps]
                slot_anc[new, new] = True
                # the committed prefix (and the root, slot 0, at start - 1) visible; then the tree slots
                mask = torch.zeros(k, start - 1 + s + k, dtype=self.dtype, device=self.device)
                mask[:, start - 1 :] = torch.where(slot_anc[s : s + k, : s + k], 0.0, low).to(self.dtype)
                out = torch.log_softmax(self._forward(toks, start - 1 + d, mask).float(), -1)
            cand_slot[ids] = new
            state["slots"], state["depth"] = s + (k if d > 0 else 1), d + 1
            return out

        t = grow_dynamic_tree(expand, root, spec, max_depth=depth, cost=cost, device=self.device)
        self._fed = 0
        return Draft(t.tokens, t.tree, host=(t.host_tokens, t.host_parents))
