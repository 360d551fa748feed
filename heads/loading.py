"""Load any draft-head checkpoint, and the checkpoint methods of every head.

The modules of ``heads`` import one way: ``config``, ``masks`` <- ``modules`` (the nn.Modules
only) <- ``io`` (the specheads format) <- ``interop`` (vLLM / SGLang / published layouts) <-
``loading`` (picks the format of a directory; gives :class:`~heads.modules.DraftHead` its
``save_pretrained``, ``from_pretrained`` and ``push_to_hub``).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from .config import HeadMismatchError
from .interop import import_head
from .io import CheckpointError, is_foreign, load_specheads, push_head, resolve, save_head
from .modules import DraftHead


def load_head(
    path_or_repo: str | Path,
    *,
    verifier: torch.nn.Module | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> DraftHead:
    """Load a head: a directory saved by :func:`~heads.io.save_head`, the name of a head shipped
    in the package, a Hub repo id, or a checkpoint in another layout (EAGLE-3 as published or as
    ``speculators`` writes it, EAGLE-1, Medusa; see :mod:`heads.interop`), which needs ``verifier``.
    With ``verifier``, a head trained for another verifier is refused
    (:class:`~heads.config.HeadMismatchError`), and the head follows the verifier's device and
    floating dtype unless ``dtype`` / ``device`` say otherwise; without one it is float32 on the
    CPU. Integer and bool buffers (``d2t``, ``t2d``) keep their dtypes."""
    directory = resolve(path_or_repo)
    if is_foreign(directory):
        if verifier is None:
            raise CheckpointError(f"{directory} is not a specheads checkpoint: importing it needs the verifier")
        try:
            head = import_head(directory, verifier, name=str(path_or_repo))
        except (CheckpointError, HeadMismatchError):
            raise
        except (ValueError, TypeError) as e:  # HeadConfig's checks of what the foreign config says (aux_layers, sizes)
            raise CheckpointError(f"{directory}: {e}") from None
    else:
        head = load_specheads(directory, verifier)
    dtype_, device_ = _placement(verifier)
    return head.to(device=device or device_, dtype=dtype or dtype_)


def _placement(verifier: torch.nn.Module | None) -> tuple[torch.dtype, torch.device]:
    """The floating dtype and device of ``verifier``'s parameters (float32 on the CPU without one)."""
    param = next((p for p in verifier.parameters() if p.is_floating_point()), None) if verifier is not None else None
    if param is None:
        return torch.float32, torch.device("cpu")
    return param.dtype, param.device


class CheckpointMethods:
    """``save_pretrained`` / ``from_pretrained`` / ``push_to_hub``: every head has them (they are
    attached to :class:`~heads.modules.DraftHead` below, so that the modules import no IO)."""

    def save_pretrained(self, directory: str | Path, **card) -> Path:
        """:func:`~heads.io.save_head` (``weights_dtype=`` and model-card facts as keywords)."""
        return save_head(self, directory, **card)

    @classmethod
    def from_pretrained(cls, path_or_repo, verifier=None, *, dtype=None, device=None):
        """:func:`load_head`; on a subclass, the checkpoint must hold that kind of head."""
        head = load_head(path_or_repo, verifier=verifier, dtype=dtype, device=device)
        if not isinstance(head, cls):
            raise CheckpointError(f"{path_or_repo} holds a {type(head).__name__}, not a {cls.__name__}")
        return head

    def push_to_hub(self, repo_id: str, directory: str | Path | None = None, **kwargs) -> str:
        """Save into ``directory`` (a temporary one by default) and upload it: :func:`~heads.io.push_head`."""
        with tempfile.TemporaryDirectory() as tmp:
            path = self.save_pretrained(directory or Path(tmp) / "head")
            return push_head(path, repo_id, **kwargs)


for _name in ("save_pretrained", "from_pretrained", "push_to_hub"):
    setattr(DraftHead, _name, CheckpointMethods.__dict__[_name])
