"""The verifier adapter: an unmodified HF ``AutoModelForCausalLM`` driven through its public API.

One generation at a time (batch 1). :meth:`Verifier.prefill` runs the prompt;
:meth:`Verifier.verify` runs a whole draft tree in one forward pass, with a 4D attention mask in
which every node sees the committed prefix and its own ancestors, and ``position_ids`` = prefix
length + depth; :meth:`Verifier.commit` keeps exactly the accepted path in the KV cache, moving its
entries in place along the sequence dimension and cropping the rest (no copy of the cache, no
re-prefill). The cache is a :class:`ReservedCache`: a ``DynamicCache`` that appends in place.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .errors import UserError
from .kernels import kernel_context, linear_kernel
from .tree import Tree


@dataclass(frozen=True)
class VerifierOutput:
    """What one verifier pass returns.

    Attributes:
        logits: ``[T, V]``: next-token logits after each input position (prefill: last only).
        features: ``[T, F, H]`` hidden states at the ``F`` requested layers for every input
            position, or None when no layer was requested.
    """

    logits: torch.Tensor
    features: torch.Tensor | None


def cache_keyword(model) -> str:
    """The name ``model.forward`` takes its KV cache by: transformers 5.24 renamed
    ``past_key_values`` to ``cache`` (the old name still works, with a warning)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_layers(cache: DynamicCache) -> list:
    """The initialised layers of a cache (each with ``keys`` / ``values`` ``[B, H, S, D]``)."""
    return [layer for layer in cache.layers if getattr(layer, "keys", None) is not None]


class ReservedLayer(DynamicLayer):
    """A ``DynamicLayer`` that appends in place: ``keys`` / ``values`` ``[B, H, S, D]`` are views
    into buffers with room to spare (about doubled whenever full), so a pass copies only its new
    positions, where ``DynamicLayer`` concatenates (allocates and copies) the whole cache of every
    layer at every pass: at 500 cached positions on a 2-core CPU that cost ~4% of a one-token pass
    of the default verifier, and on a GPU it is a full read and write of the cache per step.

    Everything that works on a ``DynamicLayer`` keeps working: a crop is a shorter view (the next
    update writes over what was cut), in-place writes into the view land in the buffer
    (:meth:`Verifier.commit`), and keys replaced by any other tensor are copied into a fresh buffer
    at the next update."""

    _key_buf: torch.Tensor | None = None
    _value_buf: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = self.get_seq_length()
        end = n + key_states.shape[-2]
        if not (_views_into(self.keys, self._key_buf, end) and _views_into(self.values, self._value_buf, end)):
            self._key_buf = _reserve(self.keys, key_states, n, end)
            self._value_buf = _reserve(self.values, value_states, n, end)
        self._key_buf[:, :, n:end].copy_(key_states)
        self._value_buf[:, :, n:end].copy_(value_states)
        self.keys, self.values = self._key_buf[:, :, :end], self._value_buf[:, :, :end]
        return self.keys, self.values


def _views_into(view: torch.Tensor, buf: torch.Tensor | None, end: int) -> bool:
    """Whether ``view`` is the start of ``buf`` along dim 2 and ``buf`` holds ``end`` positions."""
    return (buf is not None and end <= buf.shape[2] and view.dim() == buf.dim()
            and view.data_ptr() == buf.data_ptr() and view.stride() == buf.stride())


def _reserve(old: torch.Tensor, new: torch.Tensor, n: int, end: int) -> torch.Tensor:
    """A buffer ``[B, H, ~2 * end, D]`` like ``new`` holding the ``n`` positions of ``old``."""
    buf = new.new_empty((*new.shape[:2], max(2 * end, 256), new.shape[3]))
    if n:
        buf[:, :, :n].copy_(old)
    return buf


class ReservedCache(DynamicCache):
    """A ``DynamicCache`` (no config: every layer full attention) of :class:`ReservedLayer` s."""

    def __init__(self):
        super().__init__()
        self.layer_class_to_replicate = ReservedLayer


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` positions of every layer (views: nothing is copied)."""
    with torch.inference_mode():
        for layer in cache_layers(cache):
            layer.keys = layer.keys[:, :, :length]
            layer.values = layer.values[:, :, :length]


def sliding_window(config) -> int | None:
    """The attention window that binds some layer of this model, or None."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    return int(window)


def context_length(config) -> int | None:
    return getattr(config, "max_position_embeddings", None)


def check_fits(config, total_length: int, what: str = "prompt plus max_new_tokens") -> None:
    """A one-line :class:`UserError` when ``total_length`` positions exceed the context (or the
    sliding window) of a model of ``config``: checkable before the model's weights are loaded."""
    ctx = context_length(config)
    if ctx is not None and total_length > ctx:
        raise UserError(
            f"{what} is {total_length} tokens but the verifier's context is "
            f"{ctx}: shorten the prompt or lower max_new_tokens"
        )
    window = sliding_window(config)
    if window is not None and total_length > window:
        raise UserError(
            f"{what} is {total_length} tokens, beyond the verifier's sliding "
            f"window of {window}; tree verification with sliding-window attention is only exact "
            f"inside the window: shorten the prompt or lower max_new_tokens"
        )


class Verifier:
    """Wraps a causal LM for tree verification.

    Args:
        model: any HF causal LM (Llama, Qwen2/3, Mistral, Gemma families); put in ``eval()``.
        feature_layers: indices into HF's ``hidden_states`` tuple that drafters need
            (0 = embeddings, ``i`` = output of decoder layer ``i``, -1 = final normed output).
        linear: the kernel of its float32 CPU linear layers (``auto``, ``stock``, ``onednn``, ``hybrid``;
            see :mod:`infer.core.kernels`): small-row products, what tree verification runs, are
            several times faster on oneDNN than on MKL on some CPUs. ``self.kernel`` tells the choice.
    """

    def __init__(self, model, feature_layers: Sequence[int] = (), *, linear: str = "auto"):
        self.model = model.eval()
        self.kernel = linear_kernel(model, linear)
        self.config = model.config
        self.feature_layers = tuple(feature_layers)
        self.cache: DynamicCache | None = None
        self.length = 0  # tokens in the KV cache
        embed = model.get_input_embeddings().weight
        self.device: torch.device = embed.device  # where inputs go (read once, not per step)
        self.dtype: torch.dtype = embed.dtype
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self._mask_min = torch.finfo(self.dtype).min
        self._mask: torch.Tensor | None = None  # reused tree-mask buffer, see _tree_mask
        self._clean = 0  # columns [0, _clean) of the buffer are all 0 (visible)
        self._cache_kw = cache_keyword(model)

    def check_fits(self, total_length: int) -> None:
        """Refuse, before any work, a generation whose positions exceed what the model handles."""
        check_fits(self.config, total_length)

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor) -> VerifierOutput:
        """Run the prompt ``[L]`` from an empty cache; logits ``[1, V]`` for the last position."""
        self.cache = ReservedCache()
        ids = input_ids.to(self.device).view(1, -1)
        with kernel_context(self.kernel, ids.shape[1]):
            out = self.model(
                input_ids=ids,
                use_cache=True,
                output_hidden_states=bool(self.feature_layers),
                logits_to_keep=1,
                **{self._cache_kw: self.cache},
            )
        self.length = ids.shape[1]
        return VerifierOutput(out.logits[0], self._features(out))

    @torch.inference_mode()
    def verify(self, tokens: torch.Tensor, tree: Tree) -> VerifierOutput:
        """Score every node of a draft tree in one forward pass.

        Args:
            tokens: ``[N]`` node tokens (node 0 = the root, the newest token not yet in the cache).
            tree: the topology; its ancestor mask becomes the tree part of the attention mask.

        Returns logits ``[N, V]`` (the verifier's next-token logits after each node) and features.
        The tree's keys and values are appended to the cache until :meth:`commit`.
        """
        n, past = tree.num_nodes, self.length
        tree = tree.to(self.device)
        # one node sees the whole prefix: the model's own causal mask is that, and cheaper to build
        mask = self._tree_mask(tree, past) if n > 1 else None
        with kernel_context(self.kernel, n):
            out = self.model(
                input_ids=tokens.to(self.device, non_blocking=True).view(1, n),
                attention_mask=mask,
                position_ids=(tree.depths + past).view(1, n),
                use_cache=True,
                output_hidden_states=bool(self.feature_layers),
                **{self._cache_kw: self.cache},
            )
        return VerifierOutput(out.logits[0], self._features(out))

    def _tree_mask(self, tree: Tree, past: int) -> torch.Tensor:
        """Additive mask ``[1, 1, N, past + N]``: every node sees the ``past`` cached positions and
        its own ancestors. A view into a buffer reused across steps: only the new tree's block is
        written (and the columns that the last tree dirtied, now committed prefix, are cleared)."""
        n = tree.num_nodes
        buf = self._mask
        if buf is None or buf.shape[0] < n or buf.shape[1] < past + n:
            rows = max(64, n, 0 if buf is None else buf.shape[0])
            cols = -(-max(1024, 2 * (past + n)) // 64) * 64  # rows stay 64-aligned for fused kernels
            buf = self._mask = torch.zeros(rows, cols, dtype=self.dtype, device=self.device)
            self._clean = cols
        if self._clean < past:
            buf[:, self._clean : past] = 0.0
        block = buf[:n, past : past + n]
        block.fill_(self._mask_min)
        block.masked_fill_(tree.ancestor_mask, 0.0)
        self._clean = past
        return buf[:n, : past + n][None, None]

    @torch.inference_mode()
    def commit(self, nodes: torch.Tensor, node_ids: Sequence[int] | None = None) -> None:
        """Keep only the accepted ``nodes`` (``[k]`` tree indices, root first) of the last verified
        tree in the cache: their keys/values move in place to follow the prefix, the rest is cut.
        ``node_ids``: the same indices on the host, if known (saves a device read)."""
        k = int(nodes.shape[0])
        src = nodes.to(self.device, non_blocking=True) + self.length
        start = self.length
        self.length += k
        ids = list(node_ids) if node_ids is not None else nodes.tolist()
        if ids != list(range(k)):  # else a prefix of the tree: nothing moves
            for layer in cache_layers(self.cache):
                layer.keys[:, :, start : start + k] = layer.keys.index_select(2, src)
                layer.values[:, :, start : start + k] = layer.values.index_select(2, src)
        self.rollback()

    def rollback(self) -> None:
        """Drop whatever the cache holds beyond the committed tokens (an unaccepted tree)."""
        crop_cache(self.cache, self.length)

    def _features(self, out) -> torch.Tensor | None:
        if not self.feature_layers:
            return None
        hs = out.hidden_states
        return torch.stack([hs[i][0] for i in self.feature_layers], dim=1)
