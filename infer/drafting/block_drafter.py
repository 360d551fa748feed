"""The block drafter's drafter: one head pass drafts a chain of ``block_size - 1`` tokens.

Per step: the verifier features of the tokens committed since the last step are fused and
appended to the head's context cache (each layer's keys and values), then one pass over the
block ``[root, mask, ..., mask]`` gives every drafted position's distribution at once; the
chain is the top-1 token at each position. The draft is deterministic (no ``q``), so it is
exact under sampling too, and it merges with prompt lookup's trie (``--draft PATH+pld``).

With a priced budget, the chain is cut where a longer one stops paying: the depth ``d`` that
maximises ``(1 + sum_j prod_{i<=j} p_i) / cost(d + 1)``, ``p_i`` the head's top-1 probability at
position ``i`` (one read per step, of those probabilities and the chain's tokens; without a
price, none). Whether the head drafts at all is the engine's to decide (its row gates pause a
head that is rarely accepted: one probe every few dozen steps instead of a pass every step).
"""

from __future__ import annotations

import copy

import torch

from heads.dflash import DFlashHead
from heads.masks import additive_mask

from ..core.drafter import Budget, Draft, RowDrafter, root_only
from ..core.tree import DynamicTreeSpec, build_tree
from ..core.verifier import ReservedCache, crop_cache


def hold_block_tables(d, head: DFlashHead, verifier_model, tree: DynamicTreeSpec | None, dtype) -> None:
    """Give drafter ``d`` what every block drafter holds: its device and ``dtype`` (default: the
    verifier's), the head there, its block size, feature layers and ``tree`` (default: the
    longest chain), the verifier's embeddings, the LM-head rows of the draft vocabulary
    ``lm_rows [Vd, h]`` and their verifier ids ``vocab [Vd]``, the mask token's embeddings
    ``mask_embeds [bs - 1, h]`` and every chain it can propose (``_chains``: depth -> tree), copied
    to the device once here, not during a step."""
    emb = verifier_model.get_input_embeddings()
    d.device, d.dtype = emb.weight.device, dtype or emb.weight.dtype
    d.head = head.to(device=d.device, dtype=d.dtype).eval()
    d.block_size = head.config.block_size
    d.feature_layers = head.config.feature_layers
    d.tree = tree or DynamicTreeSpec(depth=d.block_size - 1, top_k=1, num_nodes=d.block_size)
    d.embed = emb
    with torch.inference_mode():
        d.lm_rows = head.lm_rows(verifier_model.get_output_embeddings()).to(d.dtype)
        d.vocab = head.target_ids(torch.arange(head.config.draft_vocab_size, device=d.device))
        mask = torch.full((d.block_size - 1,), head.config.mask_token_id, dtype=torch.long, device=d.device)
        d.mask_embeds = emb(mask).to(d.dtype)
    d._chains = {n: build_tree(list(range(-1, n)), device=d.device) for n in range(1, d.block_size)}


class BlockDrafter(RowDrafter):
    """Drafts with a :class:`~heads.dflash.DFlashHead` (see the module docstring).

    ``tree``: only its ``depth`` is used (the longest chain; default ``block_size - 1``).
    ``dtype``: what the head computes in (default: the verifier's)."""

    def __init__(self, head: DFlashHead, verifier_model, tree: DynamicTreeSpec | None = None, *,
                 dtype: torch.dtype | None = None):
        hold_block_tables(self, head, verifier_model, tree, dtype)
        self.cache = ReservedCache()
        self.length = 0
        self._pending: list[torch.Tensor] = []

    def spawn(self) -> BlockDrafter:
        """A drafter for another row: the same head and tables; its own context cache."""
        new = copy.copy(self)
        new._pending = []
        new.cache, new.length = ReservedCache(), 0
        return new

    def begin_row(self, prompt_ids, features, params=None) -> None:
        self.cache = ReservedCache()
        self.length = 0
        self._pending = [features]  # [T, F, h]: the prompt's features, fed at the first proposal

    def update_row(self, tokens, features) -> None:
        self._pending.append(features)

    def state(self) -> dict:
        return {"block_size": self.block_size}

    def _catch_up(self) -> None:
        """Append the fused features of every committed position not yet in the context cache."""
        feats = torch.cat(self._pending) if len(self._pending) > 1 else self._pending[0]
        self._pending = []
        k = feats.shape[0]
        if k == 0:
            return
        context = self.head.fuse(feats.to(self.dtype))  # [k, h]
        positions = torch.arange(self.length, self.length + k, device=self.device)
        allowed = torch.ones(k, self.length + k, dtype=torch.bool, device=self.device).tril(diagonal=self.length)
        self.head.add_context(context[None], positions[None], additive_mask(allowed, self.dtype)[None], self.cache)
        self.length += k

    @staticmethod
    def _depth(top_p: list[float], cost) -> int:
        """The chain depth that pays best under ``cost``, from the head's top-1 probabilities
        per position (host floats)."""
        run, expected, best, best_gain = 1.0, 1.0, 0, 1.0 / cost(1)
        for d, p in enumerate(top_p, start=1):
            run *= p
            expected += run
            gain = expected / cost(d + 1)
            if gain > best_gain:
                best, best_gain = d, gain
        return best

    @torch.inference_mode()
    def block_logits(self, root: int) -> torch.Tensor:
        """One head pass over ``[root, mask, ...]`` after the committed context -> the draft
        logits at block positions ``1 .. block_size - 1``, ``[bs - 1, Vd]`` (the context cache
        keeps the committed positions only)."""
        self._catch_up()
        bs = self.block_size  # the whole block, as trained (its positions see each other)
        root_t = torch.full((1,), root, dtype=torch.long, device=self.device)
        embeds = torch.cat([self.embed(root_t).to(self.dtype), self.mask_embeds])  # [bs, h]
        positions = torch.arange(self.length, self.length + bs, device=self.device)
        mask = torch.zeros(1, 1, bs, self.length + bs, dtype=self.dtype, device=self.device)  # context + block: all visible
        out = self.head(embeds[None], positions[None], mask, self.cache)[0]  # [bs, h]
        crop_cache(self.cache, self.length)
        return self.head.logits(out[1:], self.lm_rows)

    @torch.inference_mode()
    def propose_row(self, root: int, budget: Budget, generator=None) -> Draft:
        depth = min(self.block_size - 1, getattr(self.tree, "depth", self.block_size - 1), budget.depth,
                    (budget.nodes or self.block_size) - 1)
        if depth <= 0:
            return root_only(root, self.device)  # no head pass: the context catches up at the next one
        logits = self.block_logits(root)[:depth]  # [depth, Vd]
        top_p, top = torch.softmax(logits.float(), -1).max(-1)
        ids = self.vocab[top]  # [depth] verifier ids
        root_t = torch.full((1,), root, dtype=torch.long, device=self.device)
        if budget.cost is None:  # the full chain, nothing read
            return Draft(torch.cat([root_t, ids]), self._chains[depth])
        probs, host_ids = torch.stack([top_p, ids.to(top_p.dtype)]).tolist()  # the step's one read
        depth = self._depth(probs, budget.cost)
        host = ((int(root), *(int(t) for t in host_ids[:depth])), (-1, *range(depth)))
        if depth == 0:
            return root_only(root, self.device)
        return Draft(torch.cat([root_t, ids[:depth]]), self._chains[depth], host=host)

