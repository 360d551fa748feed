"""Acceptance rules: which root-to-node path of a verified tree to keep, and the bonus token.

All functions are pure (the only state is an explicit ``torch.Generator``). They take the draft
tree's tokens and topology and the verifier's outputs at every node, and return an
:class:`Acceptance`: the accepted node indices (root first) and the verifier's own next token
after the last accepted node.

Names follow the papers: ``p`` is the verifier's (target) distribution, ``q`` the draft's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import Tree


@dataclass(frozen=True)
class Acceptance:
    """Accepted path and bonus token.

    Attributes:
        nodes: ``[k]`` long, tree node indices from the root (always node 0) to the deepest
            accepted node; ``k - 1`` draft tokens were accepted.
        bonus: the verifier's token after the last accepted node.
    """

    nodes: torch.Tensor
    bonus: int


def warp_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The verifier's sampling distribution, as HF ``generate`` builds it (temperature, then
    top-k, then top-p), for ``logits`` ``[..., V]``; returns probabilities ``[..., V]`` (float32).

    ``temperature`` must be > 0; greedy decoding does not sample and never calls this.
    """
    scores = logits.float() / temperature
    if top_k and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, sorted_idx = torch.sort(scores, descending=False, dim=-1)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        remove_sorted = cum <= (1 - top_p)
        remove_sorted[..., -1:] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores.softmax(-1)


def _deepest_valid(tree: Tree, node_ok: torch.Tensor) -> torch.Tensor:
    """Index (0-dim) of the deepest node whose whole root path is ``node_ok`` (first on ties)."""
    path_ok = ~(tree.ancestor_mask & ~node_ok[None, :]).any(-1)  # [N]
    return torch.where(path_ok, tree.depths, -1).argmax()


def greedy_accept(tokens: torch.Tensor, tree: Tree, target: torch.Tensor) -> Acceptance:
    """Greedy verification.

    Args:
        tokens: ``[N]`` draft tokens (node 0 = root).
        tree: the draft's topology.
        target: ``[N]`` the verifier's argmax after each node.

    A node is accepted when its token equals the verifier's argmax at its parent and its parent
    is accepted; the longest such path is kept and ``target`` at its end is the bonus token, so
    the output equals plain greedy decoding token for token.
    """
    tokens, target = tokens.cpu(), target.cpu()
    match = torch.ones(tree.num_nodes, dtype=torch.bool)
    match[1:] = tokens[1:] == target[tree.parents[1:]]
    best = _deepest_valid(tree, match)
    return Acceptance(nodes=tree.ancestor_mask[best].nonzero().flatten(), bonus=int(target[best]))


def sample_accept(
    tokens: torch.Tensor,
    tree: Tree,
    p: torch.Tensor,
    q: torch.Tensor | None,
    generator: torch.Generator | None,
) -> Acceptance:
    """Lossless multi-candidate tree rejection sampling (SpecInfer / EAGLE).

    Args:
        tokens: ``[N]`` draft tokens (node 0 = root).
        tree: the draft's topology; siblings are tried in index order.
        p: ``[N, V]`` the verifier's (warped) distribution after each node.
        q: ``[N, V]`` or None. Row ``i`` is the distribution node ``i``'s token was drawn from,
            given its earlier siblings (for i.i.d. children: the parent's draft distribution; for
            draws without replacement: that distribution without the earlier siblings). ``None``,
            or a row that gives the token no mass, means a deterministic draft (one-hot ``q``).
        generator: the source of randomness (same seed, same result).

    Walking down from the root with ``r = p(node)``: child ``x`` (drawn from ``q_x``) is accepted
    with probability ``min(1, r(x) / q_x(x))``; on rejection ``r <- norm(max(r - q_x, 0))`` and the
    next sibling is tried. When no child is accepted, the bonus token is drawn from ``r``. The
    emitted tokens are distributed exactly as sampling from ``p`` one token at a time.
    """
    children = tree.children()
    tok = tokens.tolist()
    node, path = 0, [0]
    residual = p[0]
    while True:
        for c in children[node]:
            x = tok[c]
            qc = q[c] if q is not None else None
            qx = float(qc[x]) if qc is not None else 0.0
            if qx <= 0.0:  # deterministic candidate
                qc, qx = None, 1.0
            r = float(torch.rand((), generator=generator, device=p.device))
            if r * qx < float(residual[x]):
                node = c
                path.append(c)
                residual = p[c]
                break
            if qc is None:
                residual = residual.clone()
                residual[x] = 0.0
            else:
                residual = (residual - qc).clamp_(min=0.0)
            total = float(residual.sum())
            # With exact arithmetic a rejection implies mass left; guard float round-off.
            residual = residual / total if total > 1e-12 else p[node]
        else:
            bonus = int(torch.multinomial(residual, 1, generator=generator))
            return Acceptance(nodes=torch.tensor(path, dtype=torch.long), bonus=bonus)


def typical_accept(
    tokens: torch.Tensor,
    tree: Tree,
    probs: torch.Tensor,
    *,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
    generator: torch.Generator | None = None,
) -> Acceptance:
    """Medusa's typical acceptance. **Lossy**: the output does not follow the verifier's
    distribution exactly; it is off unless asked for.

    Args:
        tokens: ``[N]`` draft tokens; tree: topology; probs: ``[N, V]`` the verifier's
            temperature-scaled distribution after each node.

    A child is accepted when its probability under the verifier exceeds
    ``min(posterior_threshold, posterior_alpha * exp(-entropy))`` at its parent; the longest
    accepted path is kept and the bonus token is sampled from the verifier at its end.
    """
    probs = probs.float()
    entropy = -(probs * probs.clamp_min(1e-20).log()).sum(-1)  # [N]
    threshold = torch.minimum(torch.full_like(entropy, posterior_threshold), posterior_alpha * entropy.neg().exp())
    tokens = tokens.to(probs.device)
    parents = tree.parents.to(probs.device)
    ok = torch.ones(tree.num_nodes, dtype=torch.bool, device=probs.device)
    ok[1:] = probs[parents[1:], tokens[1:]] > threshold[parents[1:]]
    best = _deepest_valid(tree, ok.cpu())
    bonus = int(torch.multinomial(probs[best], 1, generator=generator))
    return Acceptance(nodes=tree.ancestor_mask[best].nonzero().flatten(), bonus=bonus)
