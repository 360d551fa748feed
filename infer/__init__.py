"""specheads inference: tree-verified speculative decoding over an unmodified HF causal LM.

Entry points: :func:`generate` / :func:`stream` (token ids in, token ids out),
:func:`generate_text` (text in, text out, with the chat template), :class:`Verifier`, the drafters
in :mod:`infer.drafters`, and :func:`load_verifier`.
"""

from .accept import Acceptance, greedy_accept, sample_accept, typical_accept, warp_probs
from .drafters import Draft, Drafter, NoDrafter, PromptLookupDrafter
from .engine import Chunk, GenerationResult, GenerationStats, generate, stream
from .errors import UserError
from .models import load_verifier
from .text import encode_prompt, generate_text
from .tree import DynamicTreeSpec, StaticTreeSpec, Tree, build_tree, load_tree_spec
from .verifier import Verifier

__all__ = [
    "Acceptance", "Chunk", "Draft", "Drafter", "DynamicTreeSpec", "GenerationResult", "GenerationStats",
    "NoDrafter", "PromptLookupDrafter", "StaticTreeSpec", "Tree", "UserError", "Verifier", "build_tree",
    "encode_prompt", "generate", "generate_text", "greedy_accept", "load_tree_spec", "load_verifier",
    "sample_accept", "stream", "typical_accept", "warp_probs",
]
