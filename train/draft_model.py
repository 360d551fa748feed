"""A separate draft model for ``head_type: draft_model``: a small standalone causal LM of the
verifier's own architecture, distilled from it, saved as a plain Hugging Face model directory.

:func:`build_draft_model` copies the verifier's config with ``num_hidden_layers = N`` and starts
from the verifier's embedding, final norm and LM head (and optionally its first ``N`` decoder
layers); :func:`draft_model_loss` fits it to the verifier's next-token distribution (KL) plus
the distilled tokens (cross-entropy). The trained model loads with ``AutoModelForCausalLM`` alone
(no specheads code): ``--draft model:DIR`` here, HF assisted generation, vLLM ``draft_model``.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from .features import Features, verifier_logits
from .losses import _scatter, _shift, _shifted_valid, seq_mean

#: config keys of the verifier that describe where or how it was loaded, not its architecture
_DROPPED = ("_name_or_path", "quantization_config")


def draft_config(verifier, num_layers: int):
    """The verifier's config with ``num_layers`` decoder layers (per-layer lists cut to match)."""
    if not 1 <= num_layers <= int(verifier.config.num_hidden_layers):
        raise ValueError(f"draft_layers must be in 1..{verifier.config.num_hidden_layers} (the verifier's layers), not {num_layers}")
    cfg = copy.deepcopy(verifier.config)
    for key in _DROPPED:
        if hasattr(cfg, key):
            try:
                delattr(cfg, key)
            except AttributeError:
                setattr(cfg, key, None)
    cfg._name_or_path = ""
    cfg.num_hidden_layers = num_layers
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = cfg.layer_types[:num_layers]
    cfg.use_cache = True
    return cfg


@torch.no_grad()
def build_draft_model(verifier, num_layers: int, copy_layers: bool = True, train_embeddings: bool = False):
    """A float32 causal LM of the verifier's architecture with ``num_layers`` layers: embedding,
    final norm and LM head copied from the verifier, and with ``copy_layers`` its first
    ``num_layers`` decoder layers too (else fresh, seeded by the caller's torch seed). Without
    ``train_embeddings`` the embedding and LM head are frozen (they are the verifier's)."""
    from transformers import AutoModelForCausalLM

    draft = AutoModelForCausalLM.from_config(draft_config(verifier, num_layers), dtype=torch.float32)
    draft.get_input_embeddings().weight.copy_(verifier.get_input_embeddings().weight.float())
    out_d, out_v = draft.get_output_embeddings(), verifier.get_output_embeddings()
    if out_d.weight.data_ptr() != draft.get_input_embeddings().weight.data_ptr():  # untied
        out_d.weight.copy_(out_v.weight.float())
        if getattr(out_d, "bias", None) is not None and getattr(out_v, "bias", None) is not None:
            out_d.bias.copy_(out_v.bias.float())
    dec_d, dec_v = draft.get_decoder(), verifier.get_decoder()
    if getattr(dec_d, "norm", None) is not None and getattr(dec_v, "norm", None) is not None:
        dec_d.norm.load_state_dict({k: v.float() for k, v in dec_v.norm.state_dict().items()})
    if copy_layers:
        for mine, theirs in zip(dec_d.layers, dec_v.layers):
            mine.load_state_dict({k: v.float() for k, v in theirs.state_dict().items()})
    if not train_embeddings:
        draft.get_input_embeddings().weight.requires_grad_(False)
        out_d.weight.requires_grad_(False)
    return draft.train()


def draft_model_loss(draft, verifier, feats: Features, batch, kl_weight: float = 1.0, ce_weight: float = 0.1):
    """KL(verifier || draft) of the next-token distributions plus ``ce_weight`` x cross-entropy on
    the distilled tokens, at every position whose next token is a response token; the vocabulary
    projections run at those positions only. Metric ``acc_1``: the draft's top-1 equals the
    verifier's."""
    valid = _shifted_valid(batch.loss_mask, 1)  # position t predicts response token t + 1
    hidden = draft.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    q_logits = verifier_logits(draft, hidden[valid]).float()  # [N, V]
    with torch.no_grad():
        p_logits = verifier_logits(verifier, feats.last[valid]).float()
        log_p = torch.log_softmax(p_logits, -1)
    log_q = torch.log_softmax(q_logits, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    target = _shift(batch.input_ids, 1)[valid]
    ce = F.cross_entropy(q_logits, target, reduction="none")
    loss = kl_weight * seq_mean(_scatter(kl, valid), valid) + ce_weight * seq_mean(_scatter(ce, valid), valid)
    hit = (q_logits.argmax(-1) == p_logits.argmax(-1)).float()
    return loss, {"acc_1": seq_mean(_scatter(hit, valid), valid).detach(),
                  "kl": seq_mean(_scatter(kl.detach(), valid), valid)}


def save_draft_model(draft, tokenizer, out, facts: dict) -> None:
    """``out``: ``config.json`` (the verifier's ``model_type``), ``model.safetensors``,
    ``generation_config.json``, the verifier's tokenizer files and ``training.json`` (what the
    run did). Files already there from the run (checkpoints, logs) stay."""
    import json
    from pathlib import Path

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    draft = draft.to("cpu").eval()
    for p in draft.parameters():
        p.requires_grad_(True)
    draft.save_pretrained(str(out), safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    (out / "training.json").write_text(json.dumps({"format": "specheads draft_model", **facts}, indent=1) + "\n")
