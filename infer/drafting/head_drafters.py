"""Drafters backed by trained heads (``heads``): Medusa on a static tree, EAGLE-1/3 on a
dynamic EAGLE-2 tree. Both read the verifier's hidden states through ``feature_layers``.

Everything runs on the verifier's device in the verifier's dtype (a head follows its verifier
whatever dtype it was saved in). EAGLE drafting reads the device at most once per draft depth
(whether a deeper level can still change the tree) plus once for the node budget; Medusa never.

EAGLE drafters also keep score of themselves (:class:`Calibration`): how often their
predictions come true against how often they said they would (per depth), which rescales the
probabilities that size each tree against the budget's price. Whether drafting pays at all is
the engine's to decide (:mod:`infer.core.schedule`); a step it keeps plain costs no head pass
(the committed tokens the head missed are fed to it in one batch when it drafts again).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from heads import Eagle3Head, MedusaHeads, load_head
from heads.masks import additive_mask
from heads.modules import DraftHead

from ..core.drafter import Budget, Draft, Drafter, RowDrafter, root_only
from ..core.errors import UserError
from ..core.kernels import median_seconds
from ..core.static import compile_step
from ..core.tree import DynamicTree, DynamicTreeSpec, StaticTreeSpec, build_tree, grow_dynamic_tree, load_tree_spec
from ..core.verifier import ReservedCache, crop_cache


def _verifier_place(verifier_model) -> tuple[torch.device, torch.dtype]:
    w = verifier_model.get_input_embeddings().weight
    return w.device, w.dtype


class MedusaDrafter(Drafter):
    """Fills a static tree for every drafting row of a step at once: the node reached by sibling
    ranks ``(r1, ..., rd)`` gets head ``d - 1``'s ``rd``-th most likely token at the row's newest
    verifier feature. Deterministic (no ``q``); nothing is read from the device. A row's budget
    keeps the tree's first nodes (they are ordered by depth): those within its depth, at most its
    node count.

    ``compile``: ``False`` (eagerly), ``True`` (Inductor on a CPU, CUDA graphs on CUDA) or a
    ``torch.compile`` backend (tests): the heads' pass and the tree's fill as one graph for one
    row and one for every row count above (:meth:`fill`)."""

    def __init__(self, head: MedusaHeads, verifier_model, tree: StaticTreeSpec | None = None, *, compile=False):
        self.device, self.dtype = _verifier_place(verifier_model)
        self.head = head.to(device=self.device, dtype=self.dtype).eval()
        self.lm_head = None if head.lm_heads is not None else verifier_model.get_output_embeddings()
        self.feature_layers = (-1,)
        self.tree = tree or load_tree_spec("medusa-16")
        if not isinstance(self.tree, StaticTreeSpec):
            raise UserError("Medusa heads fill a static tree: pass a static tree (e.g. medusa-16 or chain:4)")
        self.depth = min(self.tree.depth, head.config.num_heads)
        nodes, parents = self.tree.ordered()
        nodes = [c for c in nodes if len(c) <= self.depth]  # a deeper node has no head to fill it
        self.parents = parents[: len(nodes)]
        self.within = [sum(1 for c in nodes if len(c) <= d) for d in range(self.depth + 1)]  # nodes up to depth d
        self.head_of = torch.tensor([len(c) - 1 for c in nodes[1:]], device=self.device)  # [N - 1]
        self.rank_of = torch.tensor([c[-1] for c in nodes[1:]], device=self.device)  # [N - 1]
        self.top = max(c[-1] for c in nodes[1:]) + 1
        self._trees: dict[int, object] = {}
        self.feats: dict[int, torch.Tensor] = {}  # row -> its newest feature [h]
        self.compiled, self.warmup_s = bool(compile), 0.0
        self._fill = self.fill
        if compile:
            self._fill = compile_step(self.fill, self.device, "inductor" if compile is True else compile)
            self.warm_up()

    def begin(self, rows) -> None:
        for r in rows:
            self.feats[r.slot] = r.features[-1, 0]

    def update(self, accepted) -> None:
        for a in accepted:
            self.feats[a.slot] = a.features[-1, 0]

    def end(self, slots) -> None:
        for s in slots:
            self.feats.pop(s, None)

    def fill(self, feats: torch.Tensor, roots: torch.Tensor, head_of: torch.Tensor, rank_of: torch.Tensor) -> torch.Tensor:
        """Every row's full tree: ``feats [R, h]`` (each row's newest feature), ``roots [R]``,
        the nodes' head ``head_of [N - 1]`` and sibling rank ``rank_of [N - 1]`` -> the nodes'
        tokens ``[R, N]`` (the root first)."""
        top = self.head(feats, self.lm_head)[: self.depth].topk(self.top, dim=-1).indices  # [D, R, top]
        return torch.cat([roots[:, None], top[head_of, :, rank_of].T], dim=1)

    def warm_up(self, rows=(1, 2)) -> float:
        """Run (and so compile) :meth:`fill` for ``rows`` rows; the seconds it took."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            for r in rows:
                feats = torch.zeros(r, self.head.config.verifier.hidden_size, dtype=self.dtype, device=self.device)
                self._call(feats, torch.zeros(r, dtype=torch.long, device=self.device))
        self.warmup_s += time.perf_counter() - t0
        return self.warmup_s

    def _call(self, feats: torch.Tensor, roots: torch.Tensor) -> torch.Tensor:
        if feats.shape[0] > 1:  # one graph for every row count above 1
            for t in (feats, roots):
                torch._dynamo.maybe_mark_dynamic(t, 0)
        return self._fill(feats, roots, self.head_of, self.rank_of)

    def _size(self, budget: Budget) -> int:
        """How many of the tree's nodes a row drafts within ``budget`` (1: the root alone)."""
        n = self.within[max(0, min(budget.depth, self.depth))]
        return max(1, min(n, budget.nodes or n))

    def _shape(self, n: int):
        if n not in self._trees:  # made once per size, copied to the device then, not during a step
            self._trees[n] = build_tree(self.parents[:n], device=self.device)
        return self._trees[n]

    @torch.inference_mode()
    def propose(self, requests) -> list[Draft]:
        sizes = [self._size(q.budget) for q in requests]
        drafting = [q for q, n in zip(requests, sizes) if n > 1]
        if not drafting:
            return [root_only(q.root, self.device) for q in requests]
        feats = torch.stack([self.feats[q.slot] for q in drafting])  # [R, h]
        roots = torch.tensor([q.root for q in drafting]).to(self.device, non_blocking=True)
        out = iter(self._call(feats, roots))  # [R, N]
        return [Draft(next(out)[:n], self._shape(n)) if n > 1 else root_only(q.root, self.device)
                for q, n in zip(requests, sizes)]


@dataclass
class Calibration:
    """How often a head's drafted children are accepted against how often it predicted, per
    depth, on the drafting device. At a node on the accepted path that had children, the head
    predicted that one of them would be accepted with the sum of their conditional
    probabilities, and one was or was not. ``log_scale`` gives per-depth log multipliers of the
    head's conditional probabilities (``prior`` pseudo-observations keep them near 1 at first)."""

    predicted: torch.Tensor  # [D] float
    observed: torch.Tensor  # [D] float
    prior: float = 2.0

    @classmethod
    def new(cls, depth: int, device) -> Calibration:
        return cls(torch.zeros(depth, device=device), torch.zeros(depth, device=device))

    def log_scale(self) -> torch.Tensor:
        """``[D]``: log of (observed + prior) / (predicted + prior), clamped to [-3, 1.5]."""
        return ((self.observed + self.prior) / (self.predicted + self.prior)).log().clamp(-3.0, 1.5)

    def forget(self, keep: float = 0.5) -> None:
        """Fade older evidence (called when a new generation starts)."""
        self.predicted.mul_(keep)
        self.observed.mul_(keep)

    def record(self, draft: DynamicTree, committed: torch.Tensor) -> torch.Tensor:
        """Compare ``draft`` with the ``committed [k]`` tokens (its root, then what was accepted:
        by this draft or another drafter's). Returns the number of this draft's nodes that were
        accepted (0-dim, on the device)."""
        tree, tokens = draft.tree, draft.tokens
        k = committed.numel()
        depth = tree.depths
        within = (depth >= 1) & (depth <= k - 1)
        match = within & (tokens == committed[depth.clamp(max=k - 1)])
        match[0] = True
        on_path = ~(tree.ancestor_mask & ~match[None, :]).any(-1)  # [N]
        parents = tree.parents.clamp(min=0)
        cond = (draft.scores - draft.scores[parents]).exp()  # [N]: q of each node given its parent
        n = tokens.numel()
        kids = torch.zeros(n, device=cond.device).index_add_(0, parents[1:], cond[1:])
        has_kids = torch.zeros(n, device=cond.device).index_add_(0, parents[1:], torch.ones_like(cond[1:])) > 0
        asked = (on_path & has_kids).float()
        d_max = self.predicted.numel()
        level = depth.clamp(max=d_max - 1)
        self.predicted.index_add_(0, level, kids * asked)
        hit = (on_path & (depth >= 1)).float()
        self.observed.index_add_(0, (depth - 1).clamp(min=0, max=d_max - 1), hit)
        return hit.sum()


class EagleDrafter(RowDrafter):
    """EAGLE-1 / EAGLE-3 drafting on an EAGLE-2 dynamic tree.

    The head keeps its own KV cache over the committed context: position ``j`` holds the pair
    (verifier feature at ``j``, token ``j + 1``). Proposing first feeds the head the committed
    pairs it has not seen (one batched pass), then runs it once per tree depth on the frontier
    nodes, with a tree mask over its cache built on the device from the tree's tensors.

    The budget's price sizes each tree; with ``adaptive``, the head's confidences are calibrated
    against what is accepted (see :class:`Calibration`; shared by the rows). ``prune=False``
    drafts every depth (for tests). ``dtype``: what the head computes in (default: the
    verifier's; see :func:`draft_dtype`).
    """

    def __init__(self, head: DraftHead, verifier_model, tree: DynamicTreeSpec | None = None, *,
                 adaptive: bool = True, prune: bool = True, dtype: torch.dtype | None = None):
        self.device, verifier_dtype = _verifier_place(verifier_model)
        self.dtype = dtype or verifier_dtype  # the head computes in the verifier's dtype unless told
        self.head = head.to(device=self.device, dtype=self.dtype).eval()
        self.adaptive, self.prune = adaptive, prune
        self.eagle3 = isinstance(head, Eagle3Head)
        self.embed = verifier_model.get_input_embeddings()
        self.lm_head = verifier_model.get_output_embeddings()
        self.feature_layers = head.config.feature_layers
        self.tree = tree or DynamicTreeSpec(depth=5, top_k=4, num_nodes=16)
        vd = head.config.draft_vocab_size
        self.vocab_map = self.head.target_ids(torch.arange(vd, device=self.device)) if self.eagle3 else None
        self._calibration: dict[tuple[bool, int], Calibration] = {}
        self._last: tuple | None = None
        self.cache = ReservedCache()
        self.length = 0

    def spawn(self) -> EagleDrafter:
        """A drafter for another row: the same head, embeddings and calibration; its own KV cache."""
        new = copy.copy(self)
        new._last = None
        new.cache, new.length = ReservedCache(), 0
        return new

    # ---- the committed context -----------------------------------------------------------------

    def _fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Verifier features ``[T, F, h]`` -> head input features ``[T, h]``."""
        features = features.to(self.dtype)
        return self.head.fuse(features) if self.eagle3 else features[:, 0]

    def _run(self, feats, tokens, positions, mask) -> torch.Tensor:
        """The head on ``k`` pairs with an additive ``mask [k, S]`` over cache + new -> ``[k, h]``."""
        embeds = self.embed(tokens).to(self.dtype)
        return self.head(feats[None], embeds[None], positions[None], mask[None, None], self.cache)[0]

    @torch.inference_mode()
    def begin_row(self, prompt_ids, features, params=None) -> None:
        self.cache = ReservedCache()
        self.length = 0
        self._feats = [features]  # verifier features at positions length .. T - 1 (not yet fed)
        self._tokens = [prompt_ids[1:].to(self.device, non_blocking=True)]  # tokens length + 1 .. T - 1
        self._last = None
        for cal in self._calibration.values():
            cal.forget()

    @torch.inference_mode()
    def update_row(self, tokens, features) -> None:
        tokens = tokens.to(self.device, non_blocking=True)
        if self._last is not None:
            draft, key = self._last
            self._last = None
            self._calibration[key].record(draft, tokens)
        self._feats.append(features)
        self._tokens.append(tokens)

    def state(self) -> dict:
        return {"calibration": {f"{'sampled' if s else 'greedy'}, depth {d}": [round(x, 3) for x in c.log_scale().tolist()]
                                for (s, d), c in self._calibration.items()}}

    def _catch_up(self, root: torch.Tensor) -> torch.Tensor:
        """Feed the head every committed pair it has not seen and the root's pair (the last
        committed feature, the root token) in one causal pass; the root's output ``[1, h]`` is
        returned (its cache entry is the first of the tree's and is cut with it)."""
        crop_cache(self.cache, self.length)
        feats = torch.cat(self._feats) if len(self._feats) > 1 else self._feats[0]
        tokens = torch.cat(self._tokens + [root.view(1)])
        k = tokens.numel()  # the committed pairs, then the root's
        allowed = torch.ones(k, self.length + k, dtype=torch.bool, device=self.device).tril(diagonal=self.length)
        positions = torch.arange(self.length, self.length + k, device=self.device)
        out = self._run(self._fuse(feats), tokens, positions, additive_mask(allowed, self.dtype)[0])
        self.length += k - 1
        self._feats, self._tokens = [feats[k - 1 :]], []
        return out[-1:]

    # ---- drafting ------------------------------------------------------------------------------

    def _logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head.logits(hidden) if self.eagle3 else self.lm_head(hidden.to(self.lm_head.weight.dtype))
        return torch.log_softmax(logits.float(), dim=-1)

    @torch.inference_mode()
    def propose_row(self, root: int, budget: Budget, generator=None) -> Draft:
        spec = self.tree
        if not isinstance(spec, DynamicTreeSpec):
            raise UserError("EAGLE heads grow a dynamic tree: pass a dynamic tree (e.g. eagle2-16 or dynamic:5,4,16)")
        if budget.depth <= 0 or (budget.nodes or 2) < 2:
            return root_only(root, self.device)
        if budget.nodes is not None and budget.nodes < spec.num_nodes:
            spec = DynamicTreeSpec(spec.depth, spec.top_k, budget.nodes)
        root_t = torch.full((), root, dtype=torch.long, device=self.device)
        root_out = self._catch_up(root_t)  # [1, h]: the head's output at the root (slot 0)
        depth = min(spec.depth, budget.depth)
        key = (generator is not None, spec.depth)
        cal = self._calibration.setdefault(key, Calibration.new(spec.depth, self.device))
        width = spec.top_k
        slots = 1 + (depth - 1) * width  # head passes: the root, then <= top_k frontier nodes per depth
        hidden = torch.empty(slots, root_out.shape[-1], dtype=self.dtype, device=self.device)
        slot_anc = torch.zeros(slots, slots, dtype=torch.bool, device=self.device)
        cand_slot = torch.zeros(1 + depth * width * width, dtype=torch.long, device=self.device)
        mask = torch.zeros(width, self.length + slots, dtype=self.dtype, device=self.device)
        low = torch.finfo(self.dtype).min
        state = {"slots": 0, "depth": 0}

        def expand(ids, parents, toks):
            k, s, d = ids.numel(), state["slots"], state["depth"]
            new = torch.arange(s, s + k, device=self.device)
            if d == 0:  # the root: already run with the committed pairs
                slot_anc[0, 0] = True
                out = root_out
            else:
                ps = cand_slot[parents]
                slot_anc[s : s + k] = slot_anc[ps]
                slot_anc[new, new] = True
                m = mask[:k, : self.length + s + k]  # committed prefix: 0 (visible); then the tree part
                m[:, self.length :] = torch.where(slot_anc[s : s + k, : s + k], 0.0, low).to(self.dtype)
                positions = torch.full((k,), self.length + d, dtype=torch.long, device=self.device)
                out = self._run(hidden[ps], toks, positions, m)
            cand_slot[ids] = new
            hidden[s : s + k] = out
            state["slots"], state["depth"] = s + k, d + 1
            return self._logprobs(out)

        log_scale = cal.log_scale() if self.adaptive else None
        t = grow_dynamic_tree(expand, root_t, spec,
                              max_depth=depth, vocab_map=self.vocab_map, cost=budget.cost, prune=self.prune,
                              log_scale=log_scale, device=self.device)
        crop_cache(self.cache, self.length)
        if t.tokens.numel() > 1 or self.adaptive:
            self._last = (t, key)
        return Draft(t.tokens, t.tree, host=(t.host_tokens, t.host_parents))


def draft_dtype(verifier_model, choice: str | torch.dtype | None = "auto") -> torch.dtype:
    """What a head computes in: ``auto`` is the verifier's dtype, except that a float32 verifier
    on a CPU with native bfloat16 dot products (AVX512-BF16 or AMX, from /proc/cpuinfo; elsewhere
    a ~10 ms probe decides) drafts in bfloat16, which halves the head's time there. Drafting
    precision never changes the output (the verifier checks every token), only how often drafts
    are accepted; ``fp32`` / ``bf16`` / ``fp16`` / a torch dtype force one."""
    device, dtype = _verifier_place(verifier_model)
    if isinstance(choice, torch.dtype):
        return choice
    if choice in ("fp32", "bf16", "fp16"):
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[choice]
    if choice not in (None, "auto"):
        raise UserError(f"draft dtype must be auto, fp32, bf16 or fp16, not {choice!r}")
    if device.type != "cpu" or dtype != torch.float32:
        return dtype
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU has native bfloat16 dot products (AVX512-BF16 or AMX; without them torch
    runs bfloat16 matrix products in a slow fallback, single-threaded here)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return _bf16_is_faster()
    return any(f in flags.split() for f in ("avx512_bf16", "amx_bf16"))


def _bf16_is_faster(rows: int = 8, width: int = 576, vocab: int = 8192, repeats: int = 5) -> bool:
    """Time a head-sized projection in float32 and bfloat16 on this CPU (medians)."""
    x = torch.randn(rows, width)
    w = torch.randn(vocab, width)
    times = {}
    for dt in (torch.float32, torch.bfloat16):
        a, b = x.to(dt), w.to(dt)
        times[dt] = median_seconds(lambda a=a, b=b: torch.nn.functional.linear(a, b), repeats)
    return times[torch.bfloat16] * 1.3 < times[torch.float32]


def load_head_drafter(path_or_repo: str, verifier_model, tree=None, *, dtype: str | torch.dtype | None = "auto",
                      compile=False) -> Drafter:
    """A drafter for a saved head; refuses a head trained for another verifier.

    A Medusa-2 checkpoint carries LoRA adapters for the verifier (``adapter/``), declared in its
    config by their SHA-256: they are merged into ``verifier_model`` **in place**, and that adapted
    model is the verifier from then on (greedy output is identical to *its* greedy output). No
    other head changes the verifier: an undeclared ``adapter/`` is refused before anything is
    merged (:func:`heads.io.verifier_adapter`). ``dtype``: what an EAGLE head computes in
    (:func:`draft_dtype`); ``compile``: a head drafts every row of a step in one compiled computation
    where true (EAGLE: :class:`~infer.drafting.eagle_batch.BatchEagleDrafter`; the block drafter:
    :class:`~infer.drafting.block_batch.BatchBlockDrafter`; Medusa: :class:`MedusaDrafter`)."""
    from heads import CheckpointError, HeadMismatchError
    from heads.io import resolve, verifier_adapter

    try:
        head = load_head(path_or_repo, verifier=verifier_model)
        adapter = verifier_adapter(resolve(path_or_repo), head.config)
    except (CheckpointError, HeadMismatchError) as e:
        raise UserError(str(e)) from None
    if adapter is not None:
        from peft import PeftModel

        PeftModel.from_pretrained(verifier_model, str(adapter)).merge_and_unload()
    if isinstance(head, MedusaHeads):
        return MedusaDrafter(head, verifier_model, tree, compile=compile)
    if head.config.head_type == "dflash" and compile:
        from .block_batch import BatchBlockDrafter

        return BatchBlockDrafter(head, verifier_model, tree if isinstance(tree, DynamicTreeSpec) else None,
                                 dtype=draft_dtype(verifier_model, dtype), compile=compile)
    if head.config.head_type == "dflash":
        from .block_drafter import BlockDrafter

        return BlockDrafter(head, verifier_model, tree if isinstance(tree, DynamicTreeSpec) else None,
                            dtype=draft_dtype(verifier_model, dtype))
    if compile:
        from .eagle_batch import BatchEagleDrafter

        return BatchEagleDrafter(head, verifier_model, tree, dtype=draft_dtype(verifier_model, dtype), compile=compile)
    return EagleDrafter(head, verifier_model, tree, dtype=draft_dtype(verifier_model, dtype))


