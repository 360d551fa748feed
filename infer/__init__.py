"""specheads inference: tree-verified speculative decoding over an unmodified HF causal LM.

Entry points: :class:`Speculator` (``Speculator.from_pretrained(verifier, draft="auto")``, then
``.generate(text)`` / ``.stream(text)``), :func:`generate` / :func:`stream` (token ids in, token ids
out), :func:`generate_text` (text in, text out, with the chat template), :class:`Verifier`, the
drafters in :mod:`infer.drafting` (the interface in :mod:`infer.core.drafter`), :func:`load_drafter` and :func:`load_verifier`.

Importing the package does no work (the submodules below import torch and transformers only).
"""

from .core.accept import Acceptance, greedy_rows, q_rows, read_back_rows, typical_rows, warp_probs
from .core.drafter import Draft, Drafter, NoDrafter
from .core.engine import Chunk, GenerationResult, GenerationStats, generate, stream
from .core.errors import UserError
from .core.models import load_verifier
from .core.params import SamplingParams
from .core.text import encode_prompt, generate_text
from .core.tree import DynamicTreeSpec, StaticTreeSpec, Tree, build_tree, load_tree_spec
from .core.verifier import Verifier
from .drafting.loading import load_drafter
from .drafting.lookup import PromptLookupDrafter
from .speculator import Speculator

__all__ = [
    "Acceptance", "Chunk", "Draft", "Drafter", "DynamicTreeSpec", "GenerationResult", "GenerationStats",
    "NoDrafter", "PromptLookupDrafter", "SamplingParams", "Speculator", "StaticTreeSpec", "Tree", "UserError", "Verifier",
    "build_tree", "encode_prompt", "generate", "generate_text", "greedy_rows", "load_drafter", "load_tree_spec", "load_verifier",
    "q_rows", "read_back_rows", "stream", "typical_rows", "warp_probs",
]
