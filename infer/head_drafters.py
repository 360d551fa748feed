"""Drafters backed by trained heads (``heads``): Medusa on a static tree, EAGLE-1/3 on a
dynamic EAGLE-2 tree. Both read the verifier's hidden states through ``feature_layers``."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from heads import Eagle3Head, MedusaHeads, load_head
from heads.modules import DraftHead, _float_mask

from .drafters import Draft, Drafter, root_only
from .errors import UserError
from .tree import DynamicTreeSpec, StaticTreeSpec, build_tree, grow_dynamic_tree, load_tree_spec
from .verifier import crop_cache


class MedusaDrafter(Drafter):
    """Fills a static tree: the node reached by sibling ranks ``(r1, ..., rd)`` gets head
    ``d - 1``'s ``rd``-th most likely token. Deterministic (``q`` is one-hot)."""

    def __init__(self, head: MedusaHeads, verifier_model, tree: StaticTreeSpec | None = None):
        self.head = head.eval()
        self.lm_head = None if head.lm_heads is not None else verifier_model.get_output_embeddings()
        self.feature_layers = (-1,)
        self.tree = tree or load_tree_spec("medusa-16")
        self._feat: torch.Tensor | None = None
        self._trees: dict = {}

    def begin(self, prompt_ids, features) -> None:
        self._feat = features[-1, 0]

    def update(self, tokens, features) -> None:
        self._feat = features[-1, 0]

    def _shape(self, spec: StaticTreeSpec, depth: int):
        key = (spec, depth)
        if key not in self._trees:
            nodes, parents = spec.ordered()
            n = sum(1 for c in nodes if len(c) <= depth)  # nodes are sorted by depth
            ranks = [c[-1] for c in nodes[1:n]]
            heads_ = [len(c) - 1 for c in nodes[1:n]]
            self._trees[key] = (build_tree(parents[:n]), torch.tensor(heads_), torch.tensor(ranks), max(ranks, default=0) + 1)
        return self._trees[key]

    @torch.inference_mode()
    def propose(self, root, *, tree=None, max_depth=8, generator=None) -> Draft:
        spec = tree or self.tree
        if not isinstance(spec, StaticTreeSpec):
            raise UserError("Medusa heads fill a static tree: pass a static tree (e.g. medusa-16 or chain:4)")
        depth = min(max_depth, spec.depth, self.head.config.num_heads)
        if depth <= 0:
            return root_only(root)
        shape, head_idx, ranks, top = self._shape(spec, depth)
        logits = self.head(self._feat, self.lm_head)  # [K, V]
        topk = logits[:depth].topk(top, dim=-1).indices.cpu()  # [depth, top]
        tokens = torch.cat([torch.tensor([root]), topk[head_idx, ranks]])
        return Draft(tokens, shape)


class EagleDrafter(Drafter):
    """EAGLE-1 / EAGLE-3 drafting on an EAGLE-2 dynamic tree.

    The head keeps its own KV cache over the committed context: position ``j`` holds the pair
    (verifier feature at ``j``, token ``j + 1``). Proposing runs the head once per tree depth on
    the frontier nodes (a tree mask over the cache, as in the verifier); :meth:`update` drops the
    tree and appends the accepted tokens with the verifier's true features.
    """

    def __init__(self, head: DraftHead, verifier_model, tree: DynamicTreeSpec | None = None, cost=None):
        self.head = head.eval()
        self.cost = cost  # a VerifyCost: choose the node budget per step (None: always tree.num_nodes)
        self.eagle3 = isinstance(head, Eagle3Head)
        self.embed = verifier_model.get_input_embeddings()
        self.lm_head = verifier_model.get_output_embeddings()
        self.vocab_size = int(self.lm_head.weight.shape[0])
        self.feature_layers = head.config.feature_layers
        self.tree = tree or DynamicTreeSpec(depth=5, top_k=4, num_nodes=16)
        self.vocab_map = head.target_ids(torch.arange(head.config.draft_vocab_size)) if self.eagle3 else None

    @property
    def dtype(self):
        return self.head.fc.weight.dtype

    def _features(self, features: torch.Tensor) -> torch.Tensor:
        """Verifier features ``[T, F, h]`` -> head input features ``[T, h]``."""
        features = features.to(self.dtype)
        return self.head.fuse(features) if self.eagle3 else features[:, 0]

    def _run(self, feats, tokens, positions, allowed) -> torch.Tensor:
        """Run the head on ``k`` pairs; ``allowed [k, S]`` bool over cache + new -> hidden ``[k, h]``."""
        dev = self.embed.weight.device
        embeds = self.embed(tokens.to(dev)).to(self.dtype)
        mask = _float_mask(allowed[None].to(dev), self.dtype)
        out = self.head(feats[None].to(dev), embeds[None], positions[None].to(dev), mask, self.cache)
        return out[0]

    def _extend(self, feats, tokens) -> None:
        k = tokens.numel()
        if k == 0:
            return
        allowed = torch.ones(k, self.length + k, dtype=torch.bool).tril(diagonal=self.length)
        self._run(feats, tokens, torch.arange(self.length, self.length + k), allowed)
        self.length += k

    @torch.inference_mode()
    def begin(self, prompt_ids, features) -> None:
        self.cache = DynamicCache()
        self.length = 0
        feats = self._features(features)
        self._extend(feats[:-1], prompt_ids[1:])
        self.pending = feats[-1]

    @torch.inference_mode()
    def update(self, tokens, features) -> None:
        crop_cache(self.cache, self.length)
        feats = self._features(features)
        self._extend(torch.cat([self.pending[None], feats[:-1]]), tokens)
        self.pending = feats[-1]

    def _logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head.logits(hidden) if self.eagle3 else self.lm_head(hidden)
        return torch.log_softmax(logits.float(), dim=-1)

    @torch.inference_mode()
    def propose(self, root, *, tree=None, max_depth=8, generator=None) -> Draft:
        spec = tree or self.tree
        if not isinstance(spec, DynamicTreeSpec):
            raise UserError("EAGLE heads grow a dynamic tree: pass a dynamic tree (e.g. eagle2-16 or dynamic:5,4,16)")
        if max_depth <= 0:
            return root_only(root)
        crop_cache(self.cache, self.length)
        slot: dict[int, int] = {}
        anc: dict[int, list[int]] = {}
        hidden: dict[int, torch.Tensor] = {}
        pos: dict[int, int] = {}

        def expand(ids, parents, toks):
            k, start = len(ids), self.length + len(slot)
            feats = torch.stack([self.pending if p < 0 else hidden[p] for p in parents.tolist()])
            positions = torch.tensor([self.length if p < 0 else pos[p] + 1 for p in parents.tolist()])
            allowed = torch.zeros(k, start + k, dtype=torch.bool)
            allowed[:, : self.length] = True
            for r, (i, p) in enumerate(zip(ids.tolist(), parents.tolist())):
                anc[i] = [] if p < 0 else anc[p] + [slot[p]]
                allowed[r, anc[i]] = True
                allowed[r, start + r] = True
            out = self._run(feats, toks, positions, allowed)
            for r, i in enumerate(ids.tolist()):
                slot[i], hidden[i], pos[i] = start + r, out[r], int(positions[r])
            return self._logprobs(out)

        t = grow_dynamic_tree(expand, root, spec, max_depth=max_depth, generator=generator,
                              vocab_map=self.vocab_map, vocab_size=self.vocab_size, cost=self.cost)
        return Draft(t.tokens, build_tree(t.parents), t.q)


def load_head_drafter(path_or_repo: str, verifier_model, tree=None, cost=None) -> Drafter:
    """A drafter for a saved head; refuses a head trained for another verifier.

    A Medusa-2 checkpoint carries LoRA adapters for the verifier (``adapter/``): they are merged
    into ``verifier_model`` **in place**, and that adapted model is the verifier from then on
    (greedy output is identical to *its* greedy output)."""
    from pathlib import Path

    from heads import CheckpointError, HeadMismatchError
    from heads.io import resolve

    try:
        head = load_head(path_or_repo, verifier=verifier_model)
        adapter = resolve(path_or_repo) / "adapter"
    except (CheckpointError, HeadMismatchError) as e:
        raise UserError(str(e)) from None
    if (Path(adapter) / "adapter_config.json").is_file():
        from peft import PeftModel

        PeftModel.from_pretrained(verifier_model, str(adapter)).merge_and_unload()
    head = head.to(next(verifier_model.parameters()).device)
    if isinstance(head, MedusaHeads):
        return MedusaDrafter(head, verifier_model, tree)
    return EagleDrafter(head, verifier_model, tree, cost)
