"""Configuration of a draft head checkpoint (``config.json``), and the verifier it belongs to.

Every checkpoint records the head type, its hyperparameters and the verifier it was trained for,
including a fingerprint of the verifier's embedding and LM-head weights; loading a head for a
different verifier is refused with a message that says which field differs.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

HEAD_TYPES = ("medusa", "eagle1", "eagle3")


class HeadMismatchError(ValueError):
    """The head was trained for another verifier."""


@dataclass(frozen=True)
class VerifierSpec:
    """What a head needs to know about its verifier (and checks on load)."""

    name: str
    model_type: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    fingerprint: str

    @classmethod
    def of(cls, model: torch.nn.Module, name: str = "") -> VerifierSpec:
        cfg = model.config
        return cls(
            name=name or str(getattr(cfg, "_name_or_path", "") or ""),
            model_type=str(cfg.model_type),
            hidden_size=int(cfg.hidden_size),
            vocab_size=int(model.get_output_embeddings().weight.shape[0]),
            num_layers=int(cfg.num_hidden_layers),
            fingerprint=weights_fingerprint(model),
        )

    def check(self, other: VerifierSpec, model: torch.nn.Module | None = None) -> None:
        """Raise :class:`HeadMismatchError` when ``other`` (the verifier in use, ``model``) is not
        the one this head was trained for. Heads saved before fingerprints became dtype-proof
        carry a float fingerprint, which is compared with ``model``'s when it is given."""
        for key in ("hidden_size", "vocab_size", "num_layers", "model_type", "fingerprint"):
            mine, theirs = getattr(self, key), getattr(other, key)
            if key == "fingerprint" and not mine.startswith(FINGERPRINT_PREFIX) and model is not None:
                theirs = legacy_fingerprint(model)
            if mine != theirs:
                raise HeadMismatchError(
                    f"this draft head was trained for verifier {self.name!r} ({key} {mine}) but the verifier "
                    f"in use has {key} {theirs}: use the verifier it was trained for, or train a head for this one"
                )


FINGERPRINT_PREFIX = "s1-"


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A short hash of the verifier's input embedding and LM-head weights: the sign bits of a
    strided sample of each. Signs survive any rounding between float32, bfloat16 and float16
    (underflow keeps a signed zero), so a head trained on a float32 verifier loads for the same
    verifier in bfloat16; different weights differ in thousands of signs."""
    h = hashlib.sha256()
    for w in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
        flat = w.detach().reshape(-1)
        step = max(1, flat.numel() // 4096)
        sample = torch.signbit(flat[::step][:4096]).cpu()
        h.update(str(tuple(w.shape)).encode())
        h.update(sample.numpy().tobytes())
    return FINGERPRINT_PREFIX + h.hexdigest()[:16]


def legacy_fingerprint(model: torch.nn.Module) -> str:
    """The fingerprint of heads saved before ``s1-``: rounded float32 values (dtype-sensitive)."""
    h = hashlib.sha256()
    for w in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
        flat = w.detach().reshape(-1)
        step = max(1, flat.numel() // 4096)
        sample = flat[::step][:4096].float().cpu()
        h.update(str(tuple(w.shape)).encode())
        h.update(torch.round(sample * 1e4).to(torch.int64).numpy().tobytes())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class HeadConfig:
    """Everything that defines a draft head.

    Attributes:
        head_type: ``medusa``, ``eagle1`` or ``eagle3``.
        verifier: the verifier it was trained for.
        num_heads / num_layers: Medusa heads and residual blocks per head.
        own_lm_head: Medusa: a projection per head (True) or the verifier's LM head (False).
        draft_vocab_size: EAGLE-3: size of the reduced draft vocabulary.
        aux_layers: EAGLE-3: the verifier layers whose *inputs* are fused (HF ``hidden_states``
            indices); default :func:`default_aux_layers` (``(2, N // 2, N - 3)``, made distinct).
        layer_config: EAGLE: the verifier's config as a dict (builds the draft decoder layer).
        training: free-form facts for the model card (data, steps, measured acceptance).
        adapter_sha256: Medusa-2: the SHA-256 of ``adapter/adapter_model.safetensors``, the LoRA
            adapter that loading merges into the verifier. Empty (every other head): loading
            never changes the verifier, and an ``adapter/`` beside the head is refused.
    """

    head_type: str
    verifier: VerifierSpec
    num_heads: int = 4
    num_layers: int = 1
    own_lm_head: bool = False
    draft_vocab_size: int = 0
    aux_layers: tuple[int, ...] = ()
    eagle1_input_norm: bool = True  # False for EAGLE-1 checkpoints whose layer has no input norm
    layer_config: dict[str, Any] = field(default_factory=dict)
    training: dict[str, Any] = field(default_factory=dict)
    adapter_sha256: str = ""

    def __post_init__(self) -> None:
        if self.head_type not in HEAD_TYPES:
            raise ValueError(f"head_type must be one of {', '.join(HEAD_TYPES)}, not {self.head_type!r}")
        if self.head_type == "eagle3":
            if not 0 < self.draft_vocab_size <= self.verifier.vocab_size:
                raise ValueError("eagle3 needs 0 < draft_vocab_size <= the verifier's vocab size")
            if len(self.aux_layers) != 3:
                raise ValueError("eagle3 fuses exactly three verifier layers (aux_layers)")
            if list(self.aux_layers) != sorted(self.aux_layers):
                raise ValueError("aux_layers must be in ascending order (the order fc reads them, as in vLLM/SGLang)")
        if self.head_type == "medusa" and (self.num_heads < 1 or self.num_layers < 1):
            raise ValueError("medusa needs num_heads >= 1 and num_layers >= 1")

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The verifier hidden states the head consumes (HF ``hidden_states`` indices)."""
        return self.aux_layers if self.head_type == "eagle3" else (-1,)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["aux_layers"] = list(self.aux_layers)
        d["format"] = "specheads"
        return d

    @classmethod
    def from_dict(cls, d: dict) -> HeadConfig:
        d = dict(d)
        d.pop("format", None)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown keys in head config: {', '.join(unknown)}")
        vf = {f.name for f in dataclasses.fields(VerifierSpec)}
        v = d.get("verifier")
        if not isinstance(v, dict) or set(v) != vf:
            raise ValueError(f"head config 'verifier' must have exactly the keys {', '.join(sorted(vf))}")
        d["verifier"] = VerifierSpec(**v)
        d["aux_layers"] = tuple(d.get("aux_layers", ()))
        return cls(**d)


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's fused layers for a verifier of ``N`` layers: the inputs of decoder layers 2,
    N // 2 and N - 3 (HF ``hidden_states`` indices). vLLM and SGLang capture each id once, at the
    input of a decoder layer (0..N-1), so for N >= 3 the three are made distinct and kept below N
    (N = 6: 2, 3, 4). A verifier of 1-2 layers has no three distinct inputs: its ids repeat or
    reach N (after the final norm), which only specheads itself can read (export refuses them)."""
    n = num_layers
    aux = sorted(min(max(i, 0), n) for i in (2, n // 2, n - 3))
    if n < 3:
        return tuple(aux)  # type: ignore[return-value]
    for k in (1, 2):  # distinct: push up ...
        aux[k] = max(aux[k], aux[k - 1] + 1)
    aux[2] = min(aux[2], n - 1)  # ... and below N
    for k in (1, 0):
        aux[k] = min(aux[k], aux[k + 1] - 1)
    return tuple(aux)  # type: ignore[return-value]
