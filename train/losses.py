"""Training losses per head type, all on response tokens only.

Every loss is a mean over the valid positions of each sequence, then a mean over sequences, so
that gradient accumulation over micro-batches equals one bigger batch (and DDP across processes
equals one process with the same global batch). Each returns ``(loss, metrics)``; metrics hold
per-depth top-1 agreement with the verifier (``acc_<d>``) as float tensors.

Positions: the verifier's features at position ``t`` predict token ``t + 1``. EAGLE pairs are
(feature ``t``, token ``t + 1``) at position ``t``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from heads.masks import additive_mask, causal_mask

from .features import Features, verifier_logits


def seq_mean(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``values``, ``valid``: ``[B, T]`` -> mean over valid positions per row, then over rows
    that have any (a scalar; 0 when none)."""
    valid = valid.to(values.dtype)
    per_row = (values * valid).sum(-1)
    count = valid.sum(-1)
    rows = count > 0
    if not rows.any():
        return values.sum() * 0.0
    return (per_row[rows] / count[rows]).mean()


def _shifted_valid(loss_mask: torch.Tensor, shift: int) -> torch.Tensor:
    """``valid[b, t]`` = position ``t + shift`` exists and is a response token; ``[B, T]``."""
    valid = torch.zeros_like(loss_mask, dtype=torch.bool)
    if shift < loss_mask.shape[1]:
        valid[:, : loss_mask.shape[1] - shift] = loss_mask[:, shift:].bool()
    return valid


def _shift(x: torch.Tensor, shift: int, dim: int = 1) -> torch.Tensor:
    """``out[:, t] = x[:, t + shift]`` (zero past the end)."""
    out = torch.zeros_like(x)
    n = x.shape[dim]
    if shift < n:
        out.narrow(dim, 0, n - shift).copy_(x.narrow(dim, shift, n - shift))
    return out


def _scatter(values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """``values [N]`` at the ``N`` true positions of ``where [B, T]`` -> ``[B, T]`` (0 elsewhere)."""
    out = values.new_zeros(where.shape)
    out[where] = values
    return out


def medusa_loss(head, verifier, feats: Features, input_ids, loss_mask, decay: float = 0.8):
    """Medusa-1: head ``k`` at position ``t`` predicts token ``t + 2 + k``; CE weighted ``decay**k``.
    The vocabulary projections run only at positions some head has a target for."""
    lm_head = None if head.lm_heads is not None else verifier.get_output_embeddings()
    k_heads = head.config.num_heads
    valid = [_shifted_valid(loss_mask, 2 + k) for k in range(k_heads)]
    used = torch.stack(valid).any(0)  # [B, T]
    logits = head(feats.last[used], lm_head)  # [K, N, V]
    total = logits.new_zeros(())
    metrics = {}
    for k in range(k_heads):
        target = _shift(input_ids, 2 + k)[used]
        ce = F.cross_entropy(logits[k].float(), target, reduction="none")
        total = total + decay**k * seq_mean(_scatter(ce, used), valid[k])
        hit = (logits[k].argmax(-1) == target).float()
        metrics[f"acc_{k + 1}"] = seq_mean(_scatter(hit, used), valid[k]).detach()
    return total, metrics


def _soft_ce(logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """``-sum p log q`` over the last dim."""
    return -(target_probs * torch.log_softmax(logits.float(), -1)).sum(-1)


def eagle1_loss(head, verifier, feats: Features, input_ids, loss_mask, ce_weight: float = 0.1):
    """EAGLE-1: from (feature ``t``, token ``t + 1``) predict feature ``t + 1``: SmoothL1 on the
    feature plus ``ce_weight`` x soft CE of its LM-head projection against the verifier's
    distribution at ``t + 1``."""
    f = feats.last
    b, t, _ = f.shape
    embeds = verifier.get_input_embeddings()(_shift(input_ids, 1)).to(f.dtype)
    pos = torch.arange(t, device=f.device).expand(b, t)
    mask = causal_mask(t, 0, b, f.dtype, f.device)
    pred = head(f, embeds, pos, mask)
    target = _shift(f, 1)
    valid = _shifted_valid(loss_mask, 1) & _shifted_valid(torch.ones_like(loss_mask), 1)
    reg = F.smooth_l1_loss(pred.float(), target.float(), reduction="none").mean(-1)
    # vocabulary projections only where there is a target (a fraction of all B x T positions)
    with torch.no_grad():
        p = torch.softmax(verifier_logits(verifier, target[valid]).float(), -1)  # [N, V]
    q_logits = verifier_logits(verifier, pred[valid])
    ce = _scatter(_soft_ce(q_logits, p), valid)
    loss = seq_mean(reg, valid) + ce_weight * seq_mean(ce, valid)
    acc = seq_mean(_scatter((q_logits.argmax(-1) == p.argmax(-1)).float(), valid), valid).detach()
    return loss, {"acc_1": acc}


def eagle3_loss(head, verifier, feats: Features, input_ids, loss_mask, steps: int = 3, decay: float = 0.8):
    """EAGLE-3 training-time test: unroll ``steps`` draft steps. Step 0 reads the fused verifier
    features; step ``s`` at index ``t`` reads the head's own step ``s - 1`` output, token
    ``t + 1 + s`` at position ``t + s``, and attends to step-0 keys at indices ``<= t`` plus its own
    keys of steps ``1..s`` (as at inference: committed prefix + draft ancestors). Each step's
    draft distribution over the draft vocabulary is fit by soft CE to the verifier's distribution
    (restricted to the draft vocabulary) at ``t + 1 + s``, weighted ``decay**s``. Metrics
    ``acc_<s>``: the draft's top-1 equals the verifier's; in training mode against the verifier's
    top-1 within the draft vocabulary (an upper bound), in eval mode against its full-vocabulary
    top-1."""
    from transformers import DynamicCache

    last = feats.last
    b, t, _ = last.shape
    device, dtype = last.device, head.fc.weight.dtype
    draft_ids = head.target_ids(torch.arange(head.config.draft_vocab_size, device=device))
    with torch.no_grad():
        # Training projects onto the draft vocabulary only (the loss needs nothing else; the full
        # projection costs ~6x more). Evaluation also checks that the verifier's argmax is in it.
        draft_logits = verifier_logits(verifier, last, draft_ids).float()  # [B, T, Vd]
        p_draft = torch.softmax(draft_logits, -1)
        argmax_draft = draft_logits.argmax(-1)
        if head.training:
            in_vocab = torch.ones_like(argmax_draft, dtype=torch.bool)
        else:
            in_vocab = head.t2d[verifier_logits(verifier, last).argmax(-1)]
    hidden = head.fuse(feats.aux.to(dtype))
    cache = DynamicCache()
    eye = torch.eye(t, dtype=torch.bool, device=device).expand(b, t, t)
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril().expand(b, t, t)
    total = hidden.new_zeros(())
    metrics = {}
    embed = verifier.get_input_embeddings()
    for s in range(steps):
        tokens = _shift(input_ids, 1 + s)
        embeds = embed(tokens).to(dtype)
        pos = (torch.arange(t, device=device) + s).expand(b, t)
        allowed = torch.cat([causal] + [eye] * s, dim=-1)  # [B, T, (s + 1) T]
        out = head(hidden, embeds, pos, additive_mask(allowed, dtype), cache)
        logits = head.logits(out)  # [B, T, Vd]
        target = _shift(p_draft, 1 + s)
        valid = _shifted_valid(loss_mask, 1 + s) & _shifted_valid(torch.ones_like(loss_mask), 1 + s)
        total = total + decay**s * seq_mean(_soft_ce(logits, target), valid)
        hit = (logits.argmax(-1) == _shift(argmax_draft, 1 + s)) & _shift(in_vocab, 1 + s)
        metrics[f"acc_{s + 1}"] = seq_mean(hit.float(), valid).detach()
        hidden = out
    return total, metrics


def estimated_tau(metrics: dict) -> float:
    """Chain estimate from per-depth top-1 acceptance: ``1 + a1 + a1 a2 + ...``."""
    tau, run = 1.0, 1.0
    for d in range(1, 100):
        a = metrics.get(f"acc_{d}")
        if a is None:
            break
        run *= float(a)
        tau += run
    return tau


def dflash_anchors(loss_mask: torch.Tensor, lengths: list[int], num_anchors: int, generators=None):
    """Random block anchors per sequence: positions ``a`` whose next token ``a + 1`` is a
    response token, up to ``num_anchors`` per row, sorted. ``lengths``: each row's real length.
    Each row's scores are drawn for its own length (global RNG, or ``generators[r]``), so the
    anchors of a record do not depend on the batch it is in (accumulation == bigger batch).
    Returns ``anchors [B, N]`` long (0 where unused) and ``keep [B, N]`` bool."""
    rows = []
    for r, n in enumerate(lengths):
        mask = loss_mask[r, 1:n].bool().cpu()  # [n - 1]: anchor a is valid if token a + 1 is a response token
        scores = torch.rand(n, generator=generators[r] if generators else None)[: n - 1]
        cand = torch.nonzero(mask).flatten()
        if cand.numel() > num_anchors:
            cand = cand[scores[cand].topk(num_anchors).indices]
        rows.append(cand.sort().values)
    n_max = max((c.numel() for c in rows), default=0)
    anchors = torch.zeros(len(rows), n_max, dtype=torch.long)
    keep = torch.zeros(len(rows), n_max, dtype=torch.bool)
    for r, c in enumerate(rows):
        anchors[r, : c.numel()] = c
        keep[r, : c.numel()] = True
    return anchors.to(loss_mask.device), keep.to(loss_mask.device)


def dflash_blocks(head, embed, aux: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """All blocks of a batch in one pass: block ``j`` of row ``r`` starts at ``anchors[r, j]``
    (its token, then mask tokens), sees the fused features ``aux [B, T, F, h]`` at positions before
    its anchor and its whole block, and no other block. ``embed``: the verifier's input embedding.
    Returns the head's outputs ``[B, N, bs, h]`` (before the final norm)."""
    from transformers import DynamicCache

    b, t = input_ids.shape
    n, bs = anchors.shape[1], head.config.block_size
    device, dtype = input_ids.device, head.fc.weight.dtype
    cache = DynamicCache()
    head.add_context(head.fuse(aux), torch.arange(t, device=device).expand(b, t), causal_mask(t, 0, b, dtype, device), cache)
    q = n * bs
    positions = (anchors[:, :, None] + torch.arange(bs, device=device)).reshape(b, q)
    block = torch.full((b, n, bs), head.config.mask_token_id, dtype=torch.long, device=device)
    block[:, :, 0] = torch.gather(input_ids, 1, anchors)
    anchor_q = anchors.repeat_interleave(bs, dim=1)  # [B, Q]
    sees_context = torch.arange(t, device=device)[None, None, :] < anchor_q[:, :, None]  # [B, Q, T]
    block_id = torch.arange(q, device=device) // bs
    same_block = (block_id[:, None] == block_id[None, :]).expand(b, q, q)
    mask = additive_mask(torch.cat([sees_context, same_block], -1), dtype)
    return head(embed(block.reshape(b, q)).to(dtype), positions, mask, cache).view(b, n, bs, -1)


def dflash_loss(head, verifier, feats: Features, batch, num_anchors: int = 32, gamma: float = 4.0):
    """DFlash training: per sequence, random anchors ``a`` (:func:`dflash_anchors`); each block
    holds token ``a`` then mask tokens at positions ``a .. a + bs - 1``, sees the fused verifier
    features at positions ``< a`` and, non-causally, its own block, and predicts tokens
    ``a + 1 .. a + bs - 1``. Cross-entropy on the data's tokens (the verifier's own greedy text)
    over the draft vocabulary, block position ``k`` weighted ``exp(-(k - 1) / gamma)``; a mean per
    sequence, then over sequences. All blocks of a batch run in one pass (each blind to the others).

    Metrics ``acc_<k>``: at block position ``k``, how often the draft's top-1 is right given that
    positions ``1 .. k - 1`` were (the chain acceptance: ``estimated_tau`` of them is the mean
    accepted length + 1); a token outside the draft vocabulary counts as a miss. Training draws
    anchors from the global RNG; evaluation seeds them by record, so each eval sees the same blocks."""
    input_ids, loss_mask = batch.input_ids, batch.loss_mask
    b, t = input_ids.shape
    device, dtype = input_ids.device, head.fc.weight.dtype
    bs = head.config.block_size
    lengths = batch.attention_mask.sum(-1).tolist()
    gens = None if head.training else [torch.Generator().manual_seed(int(i)) for i in batch.index.tolist()]
    anchors, keep = dflash_anchors(loss_mask, lengths, num_anchors, gens)
    n = anchors.shape[1]
    metrics = {f"acc_{k}": torch.zeros((), device=device) for k in range(1, bs)}
    if n == 0:
        return head.fc.weight.sum() * 0.0, metrics
    out = dflash_blocks(head, verifier.get_input_embeddings(), feats.aux.to(dtype), input_ids, anchors)  # [B, N, bs, h]
    offsets = torch.arange(bs, device=device)
    out = out[:, :, 1:]  # [B, N, bs - 1, h]
    label_pos = anchors[:, :, None] + offsets[1:]  # [B, N, bs - 1]
    inside = label_pos < torch.tensor(lengths, device=device)[:, None, None]
    flat = label_pos.clamp(max=t - 1).reshape(b, -1)
    labels = torch.gather(input_ids, 1, flat).view_as(label_pos)
    valid = keep[:, :, None] & inside & torch.gather(loss_mask, 1, flat).view_as(label_pos).bool()
    sel = valid & head.t2d[labels]
    rows = head.lm_rows(verifier.get_output_embeddings()).detach()
    logits = head.logits(out[sel], rows)  # [M, Vd]: only where there is a target
    target = head.draft_index(labels[sel])
    ce = out.new_zeros(valid.shape, dtype=torch.float32)
    ce[sel] = F.cross_entropy(logits.float(), target, reduction="none")
    weight = torch.exp(-torch.arange(bs - 1, device=device, dtype=torch.float32) / gamma) * sel.float()
    num, den = (ce * weight).sum((1, 2)), weight.sum((1, 2))
    has = den > 0
    loss = (num[has] / den[has]).mean() if bool(has.any()) else logits.sum() * 0.0
    with torch.no_grad():
        hit = torch.zeros_like(valid)
        hit[sel] = logits.argmax(-1) == target
        prefix = torch.cumprod(torch.cat([torch.ones_like(hit[..., :1]), hit], -1).float(), -1)  # [B, N, bs]
        for k in range(1, bs):
            asked = (prefix[..., k - 1] * valid[..., k - 1]).sum()
            metrics[f"acc_{k}"] = (prefix[..., k] * valid[..., k - 1]).sum() / asked.clamp(min=1)
    return loss, metrics
