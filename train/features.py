"""The frozen verifier's hidden states for a batch, computed online or read from a disk cache.

Per position ``t`` of a sequence: ``last [T, h]`` (the final, normed hidden state; its LM-head
projection is the verifier's next-token logits) and, for EAGLE-3, ``aux [T, 3, h]`` (the inputs
of the three fused layers).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from heads.io import write_atomic

from .data import Batch


@dataclass
class Features:
    last: torch.Tensor  # [B, T, h]
    aux: torch.Tensor | None  # [B, T, 3, h]


def verifier_logits(model, last: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The verifier's logits from its final hidden states ``[..., h]`` -> ``[..., V]`` (with the
    final logit soft-capping of models whose config has one). ``rows`` ``[Vd]``: only those
    vocabulary entries, ``[..., Vd]`` (a fraction of the full projection's cost)."""
    lm_head = model.get_output_embeddings()
    if rows is None:
        logits = lm_head(last.to(lm_head.weight.dtype))
    else:
        bias = lm_head.bias[rows] if getattr(lm_head, "bias", None) is not None else None
        logits = torch.nn.functional.linear(last.to(lm_head.weight.dtype), lm_head.weight[rows], bias)
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


@torch.no_grad()
def compute_features(model, batch: Batch, aux_layers: tuple[int, ...]) -> Features:
    """One no-grad forward of the verifier (in eval mode) over the batch."""
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        output_hidden_states=True,
        logits_to_keep=1,
    )
    hs = out.hidden_states
    aux = torch.stack([hs[i] for i in aux_layers], dim=2) if aux_layers else None
    return Features(last=hs[-1], aux=aux)


class FeatureCache:
    """Verifier features per record as safetensors files (float16), for multi-epoch runs.

    A record's file is named by its content (``keys[i]``, :meth:`train.data.Record.key`) inside a
    folder named by ``source`` (the verifier's fingerprint, dtype and fused layers), so data that
    grows or is reordered, another verifier or another head type never reads features that are
    not its own; one ``cache_dir`` can serve them all."""

    def __init__(self, directory: str | Path, keys: list[str], source: str, dtype: torch.dtype = torch.float16):
        self.dir = Path(directory) / hashlib.sha256(source.encode()).hexdigest()[:12]
        self.dir.mkdir(parents=True, exist_ok=True)
        note = self.dir / "SOURCE.txt"
        if not note.exists():
            write_atomic(note, lambda p: Path(p).write_text(source + "\n"))
        self.keys = keys
        self.dtype = dtype

    def _path(self, index: int) -> Path:
        return self.dir / f"{self.keys[index]}.safetensors"

    def get(self, model, batch: Batch, aux_layers: tuple[int, ...]) -> Features:
        idx = batch.index.tolist()
        missing = [r for r, i in enumerate(idx) if not self._path(i).exists()]
        if missing:
            fresh = compute_features(model, batch, aux_layers)
            for r in missing:
                n = int(batch.attention_mask[r].sum())
                tensors = {"last": fresh.last[r, :n].to(self.dtype).contiguous().cpu()}
                if fresh.aux is not None:
                    tensors["aux"] = fresh.aux[r, :n].to(self.dtype).contiguous().cpu()
                write_atomic(self._path(idx[r]), lambda p, t=tensors: save_file(t, p))
        b, t = batch.input_ids.shape
        h = model.config.hidden_size
        last = torch.zeros(b, t, h)
        aux = torch.zeros(b, t, len(aux_layers), h) if aux_layers else None
        for r, i in enumerate(idx):
            stored = load_file(str(self._path(i)))
            n = stored["last"].shape[0]
            last[r, :n] = stored["last"].float()
            if aux is not None:
                aux[r, :n] = stored["aux"].float()
        dev = batch.input_ids.device
        return Features(last=last.to(dev), aux=aux.to(dev) if aux is not None else None)
