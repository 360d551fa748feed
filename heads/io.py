"""The specheads checkpoint format: safetensors weights + ``config.json`` + a model card, local or
on the Hub. (Which format a directory holds is decided by :mod:`heads.loading`; other layouts
are :mod:`heads.interop`'s.)

Nothing is ever unpickled. Saving writes each file under a temporary name and renames it into
place, so an interrupted save never leaves a half-written file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .config import HeadConfig, VerifierSpec
from .modules import DraftHead, build_head

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
CARD = "README.md"


class CheckpointError(ValueError):
    """A directory or repository that is not a usable specheads checkpoint."""


def model_card(config: HeadConfig) -> str:
    """A Hub model card for a head: verifier, head type, data, training steps, measured tau."""
    from huggingface_hub import ModelCard, ModelCardData

    t = config.training
    data = ModelCardData(
        library_name="specheads",
        tags=["speculative-decoding", config.head_type, "draft-head"],
        base_model=config.verifier.name or None,
    )
    lines = [
        f"# {config.head_type} draft head for `{config.verifier.name}`",
        "",
        f"A draft head ({config.head_type}) trained with [specheads](https://pypi.org/project/specheads/) "
        "for lossless speculative decoding: the verifier checks every drafted token, so greedy output "
        "is identical to the verifier's own.",
        "",
        "| | |",
        "| --- | --- |",
        f"| verifier | `{config.verifier.name}` ({config.verifier.model_type}, hidden {config.verifier.hidden_size}, "
        f"vocab {config.verifier.vocab_size}, {config.verifier.num_layers} layers, fingerprint `{config.verifier.fingerprint}`) |",
        f"| head type | {config.head_type} |",
    ]
    if config.head_type == "medusa":
        lines.append(f"| heads x blocks | {config.num_heads} x {config.num_layers} (own LM heads: {config.own_lm_head}) |")
    if config.head_type == "eagle3":
        lines.append(f"| draft vocabulary | {config.draft_vocab_size} tokens; fused layers {list(config.aux_layers)} |")
    if config.head_type == "dflash":
        lines.append(f"| block drafter | {config.num_layers} layers, block of {config.block_size}, mask token {config.mask_token_id}, "
                     f"draft vocabulary {config.draft_vocab_size}; fused layers {list(config.aux_layers)} |")
    known = (("data", "training data"), ("records", "training records"), ("steps", "training steps"),
             ("tokens", "training tokens"), ("wall_time_s", "training wall time (s)"), ("peak_memory_mb", "peak CPU memory of the training process (MB)"),
             ("acceptance", "held-out top-1 acceptance per depth"), ("tau", "estimated tau (chain, from acceptance)"))
    for key, label in known:
        if key in t:
            lines.append(f"| {label} | {t[key]} |")
    for key in sorted(set(t) - {k for k, _ in known}):  # free-form notes (the recipe's `extra`)
        lines.append(f"| {key.replace('_', ' ')} | {t[key]} |")
    lines += ["", "```bash", f"specheads generate --verifier {config.verifier.name or 'VERIFIER'} --draft THIS_DIR --prompt \"...\"", "```", ""]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)).content


def write_atomic(path: Path, write) -> None:
    """``write(tmp_path)``, then rename over ``path``: readers never see a half-written file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o644)  # mkstemp makes files private; checkpoints are ordinary files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_directory(out: str | Path, fill, *, overwrite: bool = False) -> Path:
    """Make ``out`` hold exactly what ``fill(tmp)`` writes into ``tmp``, a fresh temporary
    directory beside it, which is then renamed into place: an export never mixes with files
    already in ``out`` and is never seen half-written. A non-empty ``out`` is refused
    (:class:`CheckpointError`) unless ``overwrite``; it is then replaced as a whole."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} is an existing file: give a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise CheckpointError(f"{out} is not empty: export into a new directory, or replace it as a whole with --force (overwrite=True)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.new-", dir=out.parent))
    try:
        fill(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes directories private; exports are ordinary directories
        for f in tmp.rglob("*"):  # and safetensors writes its files private (0600): a server reads them as another user
            if f.is_file() and not f.is_symlink():
                os.chmod(f, 0o644)
            elif f.is_dir():
                os.chmod(f, 0o755)
        if not out.exists():
            os.replace(tmp, out)
            return out
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old)  # an (empty) directory is replaced by rename
        try:
            os.replace(tmp, out)
        except BaseException:
            os.replace(old, out)
            raise
        shutil.rmtree(old, ignore_errors=True)
        return out
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


ADAPTER = "adapter"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def file_digest(path: str | Path) -> str:
    """SHA-256 of one file (hex), read in 1 MiB chunks."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def adapter_digest(directory: str | Path) -> str:
    """SHA-256 of ``directory/adapter/adapter_model.safetensors`` (a Medusa-2 LoRA adapter)."""
    path = Path(directory) / ADAPTER / ADAPTER_WEIGHTS
    if not path.is_file():
        raise CheckpointError(f"{path.parent} has no {ADAPTER_WEIGHTS}: not a LoRA adapter saved with safetensors")
    return file_digest(path)


def verifier_adapter(directory: str | Path, config: HeadConfig) -> Path | None:
    """The LoRA adapter that loading the head in ``directory`` merges into the verifier: the one its
    config declares (``adapter_sha256``), checked against the file, else None. An ``adapter/``
    that the config does not declare (a leftover of another export) is refused, never merged."""
    directory = Path(directory)
    present = (directory / ADAPTER).exists()
    if not config.adapter_sha256:
        if present:
            raise CheckpointError(
                f"{directory / ADAPTER} is not declared by {directory / CONFIG} (no adapter_sha256): it would change the "
                "verifier, so it is not merged; remove it (a leftover of another export?) or re-export the head"
            )
        return None
    if not present:
        raise CheckpointError(f"{directory / CONFIG} declares a LoRA adapter for the verifier, but {directory / ADAPTER} is missing")
    if adapter_digest(directory) != config.adapter_sha256:
        raise CheckpointError(
            f"{directory / ADAPTER} is not the adapter {directory / CONFIG} declares (SHA-256 differs): re-export the head"
        )
    return directory / ADAPTER


def save_head(head: DraftHead, directory: str | Path, *, weights_dtype: torch.dtype | None = None, **training) -> Path:
    """Save ``head`` (weights, config with ``training`` facts merged in, model card) into
    ``directory`` (created if needed; other files in it are left alone). Each file is written to a
    temporary name and renamed, weights first and config last. ``weights_dtype``: store floating-point
    weights in it (e.g. ``torch.bfloat16`` halves the file; loading upcasts to float32)."""
    directory = Path(directory)
    config = head.config
    if training:
        config = HeadConfig.from_dict({**config.to_dict(), "training": {**config.training, **training}})
        head.config = config
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    if weights_dtype is not None:
        state = {k: v.to(weights_dtype) if v.is_floating_point() else v for k, v in state.items()}
    write_atomic(directory / WEIGHTS, lambda p: save_file(state, p, metadata={"format": "pt"}))
    write_atomic(directory / CARD, lambda p: p.write_text(model_card(config)))
    write_atomic(directory / CONFIG, lambda p: p.write_text(json.dumps(config.to_dict(), indent=1)))
    return directory


#: Heads shipped inside the package (``heads/pretrained/<name>``), addressed by name.
PRETRAINED_DIR = Path(__file__).parent / "pretrained"


def pretrained_names() -> list[str]:
    """Names of the heads shipped inside the package (``--draft NAME``)."""
    if not PRETRAINED_DIR.is_dir():
        return []
    return sorted(p.name for p in PRETRAINED_DIR.iterdir() if (p / CONFIG).is_file())


def pretrained_for(model: torch.nn.Module) -> list[str]:
    """Names of the shipped heads trained for ``model`` (same shapes and weight fingerprint)."""
    from .config import HeadMismatchError

    names, spec = [], None
    for name in pretrained_names():
        spec = spec or VerifierSpec.of(model)
        try:
            read_config(PRETRAINED_DIR / name).verifier.check(spec, model)
        except (HeadMismatchError, CheckpointError):
            continue
        names.append(name)
    return names


#: What a Hugging Face Hub repo id looks like (``org/name``); anything else with a ``/`` is a path.
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def is_hub_id(text: str) -> bool:
    """``text`` reads as a Hub repo id (``org/name``) and names nothing on the local disk (nor
    does its ``org`` part: ``runs/typo`` next to a ``runs/`` directory is a missing path)."""
    return bool(HUB_ID.fullmatch(text)) and not os.path.lexists(text) and not os.path.isdir(text.split("/", 1)[0])


def local_path_problem(text: str) -> str | None:
    """Why ``text``, meant as a local directory, is not one (None when it is a directory): no such
    file or directory, a broken symbolic link or a link loop, or a file."""
    p = Path(text)
    try:
        if p.is_dir():
            return None
        if p.exists():
            return f"{text} is a file, not a directory"
    except OSError as e:  # e.g. a name too long
        return f"{text}: {e.strerror or e}"
    if os.path.lexists(p):
        return f"{text}: a broken symbolic link or a symbolic-link loop"
    return f"{text}: no such file or directory"


def hub_access(repo_id: str, what: str, filename: str = "config.json") -> bool:
    """Before asking the Hub for ``repo_id``: whether to load from the local cache only (True: it is
    cached and the Hub cannot be reached). A repo that is not cached while ``HF_HUB_OFFLINE`` is set
    or the Hub's host does not answer within a few seconds is a :class:`CheckpointError` at once,
    instead of a minute of retries."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants, try_to_load_from_cache

    cached = isinstance(try_to_load_from_cache(repo_id, filename), str)
    if constants.HF_HUB_OFFLINE:
        if cached:
            return True
        raise CheckpointError(f"{what} {repo_id!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set: "
                              "download it where the Hub is reachable, or give a local directory")
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=3).close()
    except OSError as e:
        if cached:
            return True
        raise CheckpointError(f"{what} {repo_id!r} is not in the local Hugging Face cache and the Hub ({constants.ENDPOINT}) "
                              f"cannot be reached ({e.strerror or type(e).__name__}): download it where the Hub is reachable, "
                              "or give a local directory") from None
    return False


def resolve(path_or_repo: str | Path) -> Path:
    """A local checkpoint directory, the name of a head shipped in the package (``default``), or
    a Hub repo id downloaded to the local cache."""
    p = Path(path_or_repo)
    if str(path_or_repo) in pretrained_names() and not p.is_dir():
        return PRETRAINED_DIR / str(path_or_repo)
    if p.is_dir():
        return p
    text = str(path_or_repo)
    if is_hub_id(text):
        from huggingface_hub import snapshot_download

        local_only = hub_access(text, "draft head")
        try:
            cache_only = {"local_files_only": True} if local_only else {}
            return Path(snapshot_download(text, allow_patterns=["*.json", "*.safetensors", "*.md"], **cache_only))
        except Exception as e:  # noqa: BLE001 - any hub failure becomes one clear message
            raise CheckpointError(f"cannot fetch draft head {text!r} from the Hub: {type(e).__name__}") from None
    raise CheckpointError(f"no draft head at {local_path_problem(text)}: give a checkpoint directory or a Hub repo id")


def is_foreign(directory: Path) -> bool:
    """A checkpoint directory written by another tool (no specheads config.json)."""
    path = directory / CONFIG
    if not path.is_file():
        return any(directory.glob("*.safetensors")) or any(directory.glob("*.bin")) or any(directory.glob("*.pt"))
    try:
        return json.loads(config_text(path)).get("format") != "specheads"
    except (json.JSONDecodeError, AttributeError, UnicodeDecodeError):
        return False


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file (on the CPU); a truncated or foreign file (a pickle under
    that name) is a :class:`CheckpointError`. Never unpickles anything."""
    try:
        return load_file(str(path))
    except SafetensorError as e:
        raise CheckpointError(f"{path} is not a valid safetensors file ({e}): re-save or re-download it") from None


def load_state_strict(head: torch.nn.Module, state: dict, what: str) -> None:
    """Load ``state`` into ``head``: every key and every shape must match, else :class:`CheckpointError`."""
    try:
        missing, unexpected = head.load_state_dict(state, strict=False)
    except RuntimeError as e:  # size mismatch
        reasons = [line.strip() for line in str(e).splitlines() if "size mismatch" in line] or [str(e).splitlines()[0]]
        raise CheckpointError(f"{what} does not fit: {reasons[0]}") from None
    if missing or unexpected:
        raise CheckpointError(f"{what} does not fit: missing {missing[:4]}, unexpected {unexpected[:4]}")


#: A head's config.json is a few KB: anything beyond this is not one (and is not read into memory).
MAX_CONFIG_BYTES = 4 << 20


def config_text(path: Path) -> str:
    """The text of a config.json of at most :data:`MAX_CONFIG_BYTES` (else a :class:`CheckpointError`)."""
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise CheckpointError(f"{path} is larger than the limit of {MAX_CONFIG_BYTES >> 20} MB: not a head config")
    return path.read_text()


def read_config(directory: Path) -> HeadConfig:
    try:
        raw = json.loads(config_text(directory / CONFIG))
    except FileNotFoundError:
        raise CheckpointError(f"{directory} has no {CONFIG}: not a draft-head checkpoint") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{directory / CONFIG} is not valid JSON ({e.msg})") from None
    try:
        return HeadConfig.from_dict(raw)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{directory / CONFIG}: {e}") from None


def load_specheads(directory: Path, verifier: torch.nn.Module | None = None) -> DraftHead:
    """A head saved by :func:`save_head` (float32, CPU); with ``verifier``, refuse a head trained
    for another verifier (:class:`~heads.config.HeadMismatchError`)."""
    config = read_config(directory)
    if verifier is not None:
        config.verifier.check(VerifierSpec.of(verifier), verifier)
    weights = directory / WEIGHTS
    if not weights.is_file():
        raise CheckpointError(f"{directory} has no {WEIGHTS} (only safetensors checkpoints are loaded)")
    head = build_head(config)
    load_state_strict(head, read_safetensors(weights), f"{weights} ({config.head_type} head)")
    return head.float().eval()


def push_head(directory: str | Path, repo_id: str, *, token: str | None = None, private: bool = False) -> str:
    """Upload a saved checkpoint directory to the Hub; returns the repo URL."""
    from huggingface_hub import HfApi

    directory = Path(directory)
    read_config(directory)  # refuse to upload something that is not a checkpoint
    api = HfApi(token=token)
    url = api.create_repo(repo_id, private=private, exist_ok=True)
    api.upload_folder(folder_path=str(directory), repo_id=repo_id, commit_message="Upload specheads draft head")
    return str(url)
