"""specheads draft heads: Medusa (a Medusa-2 LoRA adapter travels with its checkpoint), EAGLE-1,
EAGLE-3 and the DFlash-style block drafter (:mod:`heads.dflash`: one forward pass drafts a whole
block), their config (:class:`HeadConfig`, with the verifier's spec and fingerprint) and safetensors
checkpoints; :mod:`heads.interop` and :mod:`heads.dflash_export` write and read the layouts vLLM
and SGLang load.

Depends on torch and transformers only (plus safetensors / huggingface_hub for checkpoints).
"""

from .config import HEAD_TYPES, HeadConfig, HeadMismatchError, VerifierSpec, default_aux_layers, default_dflash_layers
from .io import CheckpointError, push_head, save_head
from .loading import load_head
from .modules import DraftHead, Eagle1Head, Eagle3Head, MedusaHeads, build_head

__all__ = [
    "HEAD_TYPES", "CheckpointError", "DraftHead", "Eagle1Head", "Eagle3Head", "HeadConfig", "HeadMismatchError",
    "MedusaHeads", "VerifierSpec", "build_head", "default_aux_layers", "default_dflash_layers", "load_head", "push_head", "save_head",
]
