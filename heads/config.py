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

HEAD_TYPES = ("medusa", "eagle1", "eagle3", "dflash")
#: Bounds on a head's sizes read from a config.json (Medusa uses 4-5 heads of one block).
MAX_HEADS = 64
MAX_HEAD_LAYERS = 64


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

    def __post_init__(self) -> None:  # a hand-edited config.json: say which field has the wrong type
        for key in ("hidden_size", "vocab_size", "num_layers"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"verifier.{key} must be a positive integer, not {value!r}")
        for key in ("name", "model_type", "fingerprint"):
            if not isinstance(getattr(self, key), str):
                raise ValueError(f"verifier.{key} must be a string, not {getattr(self, key)!r}")

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
        head_type: ``medusa``, ``eagle1``, ``eagle3`` or ``dflash`` (the block drafter).
        verifier: the verifier it was trained for.
        num_heads / num_layers: Medusa heads and residual blocks per head.
        own_lm_head: Medusa: a projection per head (True) or the verifier's LM head (False).
        draft_vocab_size: EAGLE-3: size of the reduced draft vocabulary.
        aux_layers: EAGLE-3: the verifier layers whose *inputs* are fused (HF ``hidden_states``
            indices); default :func:`default_aux_layers` (``(2, N // 2, N - 3)``, made distinct).
        layer_config: EAGLE, DFlash: the verifier's config as a dict (sizes the draft decoder layers).
        block_size: DFlash: tokens per block (the root, then ``block_size - 1`` drafted tokens).
        mask_token_id: DFlash: the verifier vocabulary id whose embedding fills the masked slots.
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
    block_size: int = 0
    mask_token_id: int = -1
    layer_config: dict[str, Any] = field(default_factory=dict)
    training: dict[str, Any] = field(default_factory=dict)
    adapter_sha256: str = ""

    def __post_init__(self) -> None:
        if self.head_type not in HEAD_TYPES:
            raise ValueError(f"head_type must be one of {', '.join(HEAD_TYPES)}, not {self.head_type!r}")
        for key, limit in (("num_heads", MAX_HEADS), ("num_layers", MAX_HEAD_LAYERS), ("draft_vocab_size", None)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{key} must be a non-negative integer, not {value!r}")
            if limit is not None and value > limit:
                raise ValueError(f"{key} {value} is beyond the limit of {limit}")
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in self.aux_layers):
            raise ValueError(f"aux_layers must be integers, not {list(self.aux_layers)!r}")
        if self.head_type == "eagle3":
            n = self.verifier.num_layers
            if any(not 0 <= i <= n for i in self.aux_layers):
                raise ValueError(f"aux_layers {list(self.aux_layers)} are out of range: a verifier of {n} layers has hidden "
                                 f"states 0..{n} (0 = the embeddings, i = the input of decoder layer i)")
            if not 0 < self.draft_vocab_size <= self.verifier.vocab_size:
                raise ValueError("eagle3 needs 0 < draft_vocab_size <= the verifier's vocab size")
            if len(self.aux_layers) != 3:
                raise ValueError("eagle3 fuses exactly three verifier layers (aux_layers)")
            if list(self.aux_layers) != sorted(self.aux_layers):
                raise ValueError("aux_layers must be in ascending order (the order fc reads them, as in vLLM/SGLang)")
        if self.head_type == "dflash":
            if not 0 < self.draft_vocab_size <= self.verifier.vocab_size:
                raise ValueError("dflash needs 0 < draft_vocab_size <= the verifier's vocab size")
            if self.block_size < 2 or self.num_layers < 1:
                raise ValueError("dflash needs block_size >= 2 and num_layers >= 1")
            if not 0 <= self.mask_token_id < self.verifier.vocab_size:
                raise ValueError("dflash needs 0 <= mask_token_id < the verifier's vocab size")
            aux = list(self.aux_layers)
            if not aux or aux != sorted(set(aux)) or aux[0] < 0 or aux[-1] > self.verifier.num_layers:
                raise ValueError("dflash aux_layers must be distinct hidden_states indices in ascending order")
        if self.head_type == "medusa" and (self.num_heads < 1 or self.num_layers < 1):
            raise ValueError("medusa needs num_heads >= 1 and num_layers >= 1")

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The verifier hidden states the head consumes (HF ``hidden_states`` indices)."""
        return self.aux_layers if self.head_type in ("eagle3", "dflash") else (-1,)

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


def default_dflash_layers(num_layers: int, count: int) -> tuple[int, ...]:
    """The verifier layers a DFlash head reads, as HF ``hidden_states`` indices: the outputs of
    ``count`` decoder layers spread evenly from layer 1 to layer N - 3 (DFlash's own rule: ids
    ``round(1 + i (N - 4) / (count - 1))``, layer output ``i`` = ``hidden_states[i + 1]``). Small
    verifiers take evenly spaced distinct layers over all of them (fewer when N < count)."""
    n, count = num_layers, max(1, min(count, num_layers))
    if count == 1:
        ids = [n // 2]
    elif n - 4 >= count - 1:
        ids = [int(round(1 + i * (n - 4) / (count - 1))) for i in range(count)]
    else:
        ids = sorted({int(round(i * (n - 1) / (count - 1))) for i in range(count)})
    return tuple(i + 1 for i in ids)
