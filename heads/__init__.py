"""specheads draft heads: Medusa, EAGLE-1 and EAGLE-3 modules, their config and checkpoints.

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
