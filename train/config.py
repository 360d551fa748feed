"""One typed config per training run: defaults live here, recipes in ``configs/*.yaml`` override
them, ``key=value`` arguments override the recipe. Unknown keys and bad values are refused by
name when the config is made; the paths it names by :meth:`TrainConfig.check_paths`, before any work."""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

#: the largest recipe read (a YAML file of a few dozen keys)
MAX_RECIPE_BYTES = 1 << 20


class ConfigError(ValueError):
    """A bad recipe or override: the message names the key."""


@dataclass
class TrainConfig:
    # what to train, for which verifier
    verifier: str = "default"
    head_type: str = "eagle3"  # medusa | medusa2 | eagle1 | eagle3 | dflash | draft_model
    output_dir: str = "runs/head"
    # data: distilled JSONL (token ids + loss mask), a directory of parts or a glob pattern of parts;
    # made from `prompts` first if missing
    data: str = ""
    prompts: str = ""  # JSONL prompts, or synthetic:N for N generated prompts (tiny verifiers)
    max_prompts: int = 0  # 0 = all
    shuffle_prompts: bool = True  # seeded shuffle before max_prompts: any prefix mixes the sources
    distill_max_new_tokens: int = 256
    distill_batch_size: int = 8
    distill_temperature: float = 0.0
    max_seq_len: int = 1024
    eval_fraction: float = 0.05
    # prompt source (the prefix of a record's id, e.g. gsm8k_train) -> times its training records
    # are seen per epoch (0.5: a random half each epoch, 2: twice); a source not named: 1
    source_weights: dict = field(default_factory=dict)
    # optimisation
    seed: int = 0
    batch_size: int = 4  # per process, per micro-step
    grad_accum: int = 1
    max_steps: int = 1000  # optimizer steps
    optimizer: str = "adamw"  # adamw | sgd (sgd: gradients compare linearly, used by equivalence tests)
    lr: float = 3e-4
    weight_decay: float = 0.0
    warmup_steps: int = 20
    max_grad_norm: float = 1.0
    mixed_precision: str = "no"  # no | bf16 | fp16 (accelerate)
    # checkpoints, evaluation, logging
    save_every: int = 200
    keep_checkpoints: int = 3  # keep the newest K resumable checkpoints (0 = keep all)
    eval_every: int = 200
    eval_batches: int = 8
    length_window: int = 0  # sort each run of this many shuffled records by length (less padding); 0 = off
    resume: bool = False
    log_with: str = ""  # "" | tensorboard | wandb
    cache_features: bool = False  # cache verifier hidden states to disk (safetensors shards)
    cache_dir: str = ""  # default: <output_dir>/features
    interrupt_after: int = 0  # stop (as if killed) after this many optimizer steps; for tests
    init_from: str = ""  # start from this head checkpoint (same head type and verifier; its draft vocabulary is kept)
    eval_only: bool = False  # with init_from: only measure that head's held-out acceptance on this data (and per prompt source)
    # head hyperparameters
    medusa_num_heads: int = 4
    medusa_num_layers: int = 1
    medusa_own_lm_head: bool = False
    medusa_decay: float = 0.8
    eagle1_ce_weight: float = 0.1
    draft_vocab_size: int = 8192
    ttt_steps: int = 3  # EAGLE-3 training-time test: unrolled draft steps
    ttt_decay: float = 0.8
    lora_r: int = 8  # medusa2
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    medusa2_kl_weight: float = 1.0
    dflash_layers: int = 2  # the block drafter's decoder layers
    dflash_block_size: int = 8  # tokens per block: the root, then block_size - 1 drafted
    dflash_num_features: int = 5  # verifier layers fused (DFlash's spread from layer 1 to N - 3)
    dflash_anchors: int = 32  # random blocks per sequence and step
    dflash_decay_gamma: float = 4.0  # block position k weighs exp(-(k - 1) / gamma)
    dflash_mask_token_id: int = -1  # -1: the least frequent token of the training data
    draft_layers: int = 2  # draft_model: decoder layers of the standalone draft LM
    draft_init_layers: bool = True  # draft_model: start from the verifier's first draft_layers layers (else fresh)
    draft_train_embeddings: bool = False  # draft_model: also train the embedding / LM head (copied from the verifier)
    draft_kl_weight: float = 1.0  # draft_model: KL(verifier || draft) of the next-token distributions
    draft_ce_weight: float = 0.1  # draft_model: cross-entropy on the distilled tokens
    extra: dict = field(default_factory=dict)  # free-form notes copied into the model card

    def __post_init__(self) -> None:
        """Every value, checked before any work (paths: :meth:`check_paths`)."""
        if self.head_type not in ("medusa", "medusa2", "eagle1", "eagle3", "dflash", "draft_model"):
            raise ConfigError(f"head_type must be medusa, medusa2, eagle1, eagle3, dflash or draft_model, not {self.head_type!r}")
        if self.head_type == "draft_model" and self.init_from:
            raise ConfigError("init_from is for draft heads; a draft_model run starts from the verifier (draft_init_layers) "
                              "and continues with --resume")
        if not str(self.verifier).strip():
            raise ConfigError("verifier must not be empty: 'default', tiny-random:<arch>, a model directory or a Hub id")
        for key in ("batch_size", "grad_accum", "max_steps", "save_every", "eval_every", "eval_batches", "ttt_steps",
                    "max_seq_len", "medusa_num_heads", "medusa_num_layers", "draft_vocab_size", "lora_r", "lora_alpha",
                    "distill_max_new_tokens", "distill_batch_size", "dflash_layers", "dflash_num_features", "dflash_anchors",
                    "draft_layers"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} must be >= 1, not {getattr(self, key)}")
        for key in ("warmup_steps", "max_prompts", "interrupt_after", "keep_checkpoints", "length_window", "weight_decay", "max_grad_norm",
                    "distill_temperature", "eagle1_ce_weight", "medusa2_kl_weight", "draft_kl_weight", "draft_ce_weight"):
            if not getattr(self, key) >= 0:  # `not >=` also refuses NaN
                raise ConfigError(f"{key} must be >= 0, not {getattr(self, key)}")
        if self.dflash_block_size < 2:
            raise ConfigError(f"dflash_block_size must be >= 2, not {self.dflash_block_size}")
        if not self.dflash_decay_gamma > 0:
            raise ConfigError(f"dflash_decay_gamma must be > 0, not {self.dflash_decay_gamma}")
        if self.dflash_mask_token_id < -1:
            raise ConfigError(f"dflash_mask_token_id must be a token id or -1 (auto), not {self.dflash_mask_token_id}")
        if not self.lr > 0:
            raise ConfigError(f"lr must be > 0, not {self.lr}")
        for key in ("eval_fraction", "lora_dropout"):
            if not 0 <= getattr(self, key) < 1:
                raise ConfigError(f"{key} must be in [0, 1), not {getattr(self, key)}")
        for key in ("ttt_decay", "medusa_decay"):
            if not 0 < getattr(self, key) <= 1:
                raise ConfigError(f"{key} must be in (0, 1], not {getattr(self, key)}")
        if self.optimizer not in ("adamw", "sgd"):
            raise ConfigError("optimizer must be adamw or sgd")
        if self.mixed_precision not in ("no", "bf16", "fp16"):
            raise ConfigError("mixed_precision must be no, bf16 or fp16")
        if self.log_with not in ("", "tensorboard", "wandb"):
            raise ConfigError(f"log_with must be '' (none), tensorboard or wandb, not {self.log_with!r}")
        for source, w in self.source_weights.items():
            if not isinstance(source, str) or isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w < 1e6:
                raise ConfigError(f"source_weights must map prompt sources to weights >= 0 (e.g. {{gsm8k_train: 0.5}}), "
                                  f"not {source!r}: {w!r}")
        if self.eval_only and not self.init_from:
            raise ConfigError("eval_only needs init_from= (the head to measure)")
        if not self.data and not self.prompts:
            raise ConfigError("give data= (a distilled JSONL) or prompts= (to distil first)")

    def check_paths(self) -> None:
        """The files the run reads and the directories it writes, checked before any work:
        ``prompts`` (a JSONL file; ``synthetic:N`` and ``hf:`` are not files) and ``data`` (made
        from the prompts when they are given, else a file, a directory or a glob pattern that
        matches data files); ``output_dir`` and ``cache_dir``
        must be directories that exist or can be made. Nothing is created here."""
        if self.prompts.startswith("synthetic:"):
            n = self.prompts.split(":", 1)[1]
            if not n.isdigit() or int(n) < 1:
                raise ConfigError(f"prompts must be synthetic:N with N >= 1, not {self.prompts!r}")
        elif self.prompts and not self.prompts.startswith("hf:") and not Path(self.prompts).is_file():
            raise ConfigError(f"prompts file {self.prompts} does not exist (JSONL, hf:NAME[:SPLIT] or synthetic:N)")
        from train.datafile import DataError, data_files, is_data_pattern

        if self.prompts:  # distilled into data first
            if is_data_pattern(self.data):
                raise ConfigError(f"data {self.data} is a pattern, not a JSONL file (distillation appends to one file)")
            if self.distilled_path.is_dir():
                raise ConfigError(f"data {self.distilled_path} is a directory, not a JSONL file (distillation appends to one file)")
            if self.distilled_path.name.endswith((".gz", ".xz")):
                raise ConfigError(f"data {self.distilled_path} is compressed: distillation appends plain JSONL (train on "
                                  f"compressed data with prompts= empty)")
            _check_creatable(self.distilled_path.parent, "data")
        elif is_data_pattern(self.data):
            try:
                data_files(self.data)
            except DataError as e:
                raise ConfigError(f"{e}: give an existing file, directory or pattern") from None
        elif Path(self.data).exists() and not Path(self.data).is_file() and not Path(self.data).is_dir():
            raise ConfigError(f"data {self.data} is not a regular file")
        elif not Path(self.data).is_file() and not Path(self.data).is_dir():
            raise ConfigError(f"data file {self.data} does not exist: give distilled data (.jsonl, .jsonl.xz, .jsonl.gz or "
                              f"a directory of them), or prompts= to distil one")
        _check_creatable(Path(self.output_dir), "output_dir")
        if self.init_from:
            from heads.io import pretrained_names

            if self.init_from not in pretrained_names() and not (Path(self.init_from) / "config.json").is_file():
                raise ConfigError(f"init_from {self.init_from} is not a head checkpoint directory (no config.json) nor a shipped head")
        if self.cache_dir:
            _check_creatable(Path(self.cache_dir), "cache_dir")

    @property
    def distilled_path(self) -> Path:
        return Path(self.data) if self.data else Path(self.output_dir) / "distilled.jsonl"


def _check_creatable(path: Path, key: str) -> None:
    """``path`` is a writable directory, or the nearest existing ancestor is (so it can be made)."""
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"{key} {path} is a file, not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(f"{key} {path} is not writable")
        return
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ConfigError(f"cannot create {key} {path}: {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot create {key} {path}: {ancestor} is not writable")


def _coerce(key: str, value, typ):
    origin = typing.get_origin(typ)
    if typ is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "1", "yes"):
            return True
        if str(value).lower() in ("false", "0", "no"):
            return False
        raise ConfigError(f"{key} must be true or false, not {value!r}")
    if typ is str and isinstance(value, bool):  # YAML 1.1 reads an unquoted no / yes as a boolean
        return "yes" if value else "no"
    if typ in (int, float, str):
        try:
            return typ(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key} must be {typ.__name__}, not {value!r}") from None
    if origin is dict or typ is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping")
        return value
    if isinstance(typ, types.UnionType):
        return value
    return value


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """A :class:`TrainConfig` from a YAML recipe and ``key=value`` overrides."""
    raw: dict = {}
    if path:
        try:
            if Path(path).exists() and not Path(path).is_file() and not Path(path).is_dir():
                raise ConfigError(f"config {path} is not a regular file")
            if Path(path).is_file() and Path(path).stat().st_size > MAX_RECIPE_BYTES:
                raise ConfigError(f"config {path} is larger than {MAX_RECIPE_BYTES:,} bytes (the limit): not a recipe")
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as e:
            raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config {path} is not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config {path} must be a mapping of keys to values")
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value")
        k, v = item.split("=", 1)
        try:
            raw[k.strip()] = yaml.safe_load(v) if v.strip() else ""
        except yaml.YAMLError:
            raw[k.strip()] = v
    hints = typing.get_type_hints(TrainConfig)
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    for k in raw:
        if k not in known:
            raise ConfigError(f"unknown config key {k!r}")
    values = {k: _coerce(k, v, hints[k]) for k, v in raw.items()}
    return TrainConfig(**values)
