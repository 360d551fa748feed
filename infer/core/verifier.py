"""The verifier adapter: an unmodified HF ``AutoModelForCausalLM`` driven through its public API.

A batch of rows (one prompt is a batch of one): :meth:`Verifier.add_rows` prefills joining
prompts; :meth:`Verifier.verify_rows` runs every row's draft tree in one forward pass, with a 4D
attention mask in which every node sees its row's committed prefix and its own ancestors, and
``position_ids`` = the row's committed length + depth; :meth:`Verifier.commit_rows` keeps exactly
each row's accepted path in the KV cache, moving its entries in place along the sequence
dimension and cropping the rest (no copy of the cache, no re-prefill); :meth:`Verifier.drop_rows`
lets rows leave. The cache is a :class:`ReservedCache`: a ``DynamicCache`` that appends in place.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .attention import use_grouped_attention
from .batch import TreeBatch
from .errors import UserError
from .kernels import kernel_context, linear_kernel


@dataclass(frozen=True)
class PrefillOutput:
    """What a prefill pass returns for one of its rows (:meth:`Verifier.add_rows`).

    Attributes:
        logits: ``[1, V]``: the next-token logits after the prompt's last position.
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
    _finite = 0  # every column of the buffers below this one holds finite values, in every row

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               write_index: torch.Tensor | None = None, **kwargs):
        """Append the pass's ``N`` positions; with ``write_index`` (``[B, H, N, D]`` column of
        each new entry, every column below ``S + N``) row ``b``'s entries go to its own columns
        instead of ``[S, S + N)`` (what is left in ``[S, S + N)`` of a row written lower is
        stale: the caller masks it)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = self.get_seq_length()
        end = n + key_states.shape[-2]
        if not (_views_into(self.keys, self._key_buf, end) and _views_into(self.values, self._value_buf, end)):
            self._key_buf = _reserve(self.keys, key_states, n, end)
            self._value_buf = _reserve(self.values, value_states, n, end)
            self._finite = n
        if write_index is None:
            self._key_buf[:, :, n:end].copy_(key_states)
            self._value_buf[:, :, n:end].copy_(value_states)
            self._finite = max(self._finite, end)
        else:
            if end > self._finite:  # never-written memory: zeros (masked, but a masked NaN still poisons attention)
                top = min(self._key_buf.shape[2], end + 64)
                self._key_buf[:, :, self._finite : top].zero_()
                self._value_buf[:, :, self._finite : top].zero_()
                self._finite = top
            self._key_buf.scatter_(2, write_index, key_states)
            self._value_buf.scatter_(2, write_index, value_states)
        self.keys, self.values = self._key_buf[:, :, :end], self._value_buf[:, :, :end]
        return self.keys, self.values

    def keep_rows(self, first: int, tail: torch.Tensor, width: int) -> None:
        """Keep rows ``[0, first)`` and then rows ``tail`` (ascending, all past ``first``) of the
        first ``width`` columns: the tail moves down in place in the buffers (no new buffer)."""
        k = first + tail.numel()
        if not (_views_into(self.keys, self._key_buf, width) and _views_into(self.values, self._value_buf, width)):
            index = torch.cat([torch.arange(first, device=tail.device), tail])
            self.keys = self.keys.index_select(0, index)[:, :, :width]
            self.values = self.values.index_select(0, index)[:, :, :width]
            return
        for buf in (self._key_buf, self._value_buf):
            if tail.numel():
                buf[first:k, :, :width] = buf[:, :, :width].index_select(0, tail)
        self._key_buf, self._value_buf = self._key_buf[:k], self._value_buf[:k]
        self.keys, self.values = self._key_buf[:, :, :width], self._value_buf[:, :, :width]

    def append_rows(self, keys: torch.Tensor, values: torch.Tensor, width: int) -> None:
        """Rows ``keys`` / ``values`` ``[b, H, w, D]`` (``w <= width``) after this layer's, both
        padded with zero columns to ``width``: one copy into a fresh buffer."""
        bufs = []
        for old, new in ((self.keys, keys), (self.values, values)):
            b0 = old.shape[0]
            buf = new.new_empty((b0 + new.shape[0], new.shape[1], max(2 * width, 256), new.shape[3]))
            buf[:b0, :, : old.shape[2]].copy_(old)
            buf[:b0, :, old.shape[2] : width].zero_()
            buf[b0:, :, : new.shape[2]].copy_(new)
            buf[b0:, :, new.shape[2] : width].zero_()
            bufs.append(buf)
        self._key_buf, self._value_buf = bufs
        self.keys, self.values = self._key_buf[:, :, :width], self._value_buf[:, :, :width]
        self._finite = width


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
    """A ``DynamicCache`` (no config: every layer full attention) of :class:`ReservedLayer` s.

    ``write_at`` (``[B]`` long on the device, or None: append) is the column where each row's
    entries of the next pass start: rows of unlike lengths write right after their own last
    entry, so that a batched pass leaves every row's accepted prefix in place (nothing to move
    at commit) however far the rows' lengths are apart."""

    write_at: torch.Tensor | None = None

    def __init__(self):
        super().__init__()
        self.layer_class_to_replicate = ReservedLayer
        self._index: dict[tuple, torch.Tensor] = {}

    def set_write_at(self, write_at: torch.Tensor | None) -> None:
        """Where each row's entries of the next pass go (``[B]``), or None to append."""
        self.write_at = write_at
        self._index = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.write_at is not None:
            shape = tuple(key_states.shape)  # [B, H, N, D]: one index for every layer of the pass
            if shape not in self._index:
                cols = self.write_at[:, None] + torch.arange(shape[2], device=self.write_at.device)  # [B, N]
                self._index[shape] = cols[:, None, :, None].expand(shape)
            kwargs["write_index"] = self._index[shape]
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


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


@dataclass
class StepPath:
    """Which verify step a verifier runs (reported in the generation stats): ``static`` shapes
    (:mod:`infer.core.static`) or not, ``compiled`` or eager, with which ``backend``, the seconds
    its warm-up took (compilation included) and why this path was chosen (``--compile``)."""

    compiled: bool = False
    static: bool = False
    backend: str = ""
    warmup_s: float = 0.0
    reason: str = ""

    @property
    def name(self) -> str:
        return "compiled" if self.compiled else "static" if self.static else "eager"


@dataclass(frozen=True)
class RowsOutput:
    """What one verifier pass over a batch of rows returns.

    Attributes:
        logits: ``[B, N, V]``: next-token logits after each node of each row.
        features: ``[B, N, F, H]`` hidden states at the requested layers, or None.
    """

    logits: torch.Tensor
    features: torch.Tensor | None


class Verifier:
    """Wraps a causal LM for tree verification of a batch of rows.

    Every row has its own committed length: the KV cache is one ``[B, H, S, D]`` tensor per layer
    and row ``b``'s committed tokens lie in columns ``[starts[b], ends[b])``; what lies outside
    (the left padding of a shorter prompt, the hole left behind a row that accepted fewer tokens
    than another) is masked out of every pass and never read. Positions are explicit per row
    (``position_ids`` = committed tokens + depth in the tree). A verify pass appends every row's
    tree after column ``S = max(ends)``; :meth:`commit_rows` moves each row's accepted nodes to
    its own end and crops what no row keeps. Rows join (:meth:`add_rows`) and leave
    (:meth:`drop_rows`) between passes.

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
        use_grouped_attention(model)  # shared key/value heads read in place, not copied per pass
        self.kernel = linear_kernel(model, linear)
        self.config = model.config
        self.feature_layers = tuple(feature_layers)
        self.cache: DynamicCache | None = None
        self.starts: list[int] = []  # per row: its first committed cache column
        self.ends: list[int] = []  # per row: one past its last committed cache column
        embed = model.get_input_embeddings().weight
        self.device: torch.device = embed.device  # where inputs go (read once, not per step)
        self.dtype: torch.dtype = embed.dtype
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self._starts_dev = torch.zeros(0, dtype=torch.long, device=self.device)  # the same, on the device
        self._ends_dev = torch.zeros(0, dtype=torch.long, device=self.device)
        self._mask_min = torch.finfo(self.dtype).min
        self._mask: torch.Tensor | None = None  # reused tree-mask buffer, see _tree_mask
        self._clean = 0  # columns [0, _clean) of the buffer are all 0 (visible)
        self._cache_kw = cache_keyword(model)
        self.path = StepPath()

    def check_fits(self, total_length: int) -> None:
        """Refuse, before any work, a generation whose positions exceed what the model handles."""
        check_fits(self.config, total_length)

    # ---- the rows ------------------------------------------------------------------------------

    @property
    def rows(self) -> int:
        return len(self.ends)

    @property
    def width(self) -> int:
        """``S``: the cache columns every row spans (the longest row's end)."""
        return max(self.ends, default=0)

    def _compact(self) -> bool:
        """Whether no row has masked columns (every row spans ``[0, S)``): the plain causal case."""
        s = self.width
        return all(a == 0 for a in self.starts) and all(e == s for e in self.ends)

    @torch.inference_mode()
    def add_rows(self, prompts: Sequence[torch.Tensor], *, features: bool = True) -> list[PrefillOutput]:
        """Prefill new rows, one per prompt ``[L_r]``, in one left-padded pass, and append them to
        the batch (after the rows already there). Returns per new row its last position's logits
        ``[1, V]`` and its features ``[L_r, F, H]`` (None without ``features``, or without
        ``feature_layers``)."""
        lengths = [int(p.numel()) for p in prompts]
        width = max(lengths)
        pads = [width - n for n in lengths]
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, pads[r]:] = p.to(torch.long).cpu()
        cache = ReservedCache()
        kwargs = {}
        if any(pads):  # left padding: a 2D mask and explicit positions per row
            keep = torch.arange(width)[None, :] >= torch.tensor(pads)[:, None]
            kwargs["attention_mask"] = keep.long().to(self.device, non_blocking=True)
            kwargs["position_ids"] = (torch.arange(width)[None, :] - torch.tensor(pads)[:, None]).clamp(min=0).to(
                self.device, non_blocking=True)
        with kernel_context(self.kernel, ids.numel()):
            out = self.model(
                input_ids=ids.to(self.device, non_blocking=True),
                use_cache=True,
                output_hidden_states=self._hidden_states_arg(features),
                logits_to_keep=1,
                **kwargs,
                **{self._cache_kw: cache},
            )
        if any(pads):  # the padding's keys/values are masked out of every later pass: make them finite zeros
            for layer in cache_layers(cache):
                for r, pad in enumerate(pads):
                    if pad:
                        layer.keys[r, :, :pad] = 0.0
                        layer.values[r, :, :pad] = 0.0
        self._merge(cache, pads, width)
        feats = self._features(out)
        return [PrefillOutput(out.logits[r], feats[r, pads[r]:] if feats is not None else None) for r in range(len(prompts))]

    def _merge(self, cache: DynamicCache, pads: list[int], width: int) -> None:
        """Append the rows of ``cache`` (``width`` columns, row ``r`` starting at ``pads[r]``) to
        the batch, padding the shorter of the two on the right (masked holes)."""
        if self.cache is None or not self.ends:
            self.cache, self.starts, self.ends = cache, list(pads), [width] * len(pads)
        else:
            s = max(self.width, width)
            for old, new in zip(cache_layers(self.cache), cache_layers(cache)):  # ReservedLayers, as every cache here
                old.append_rows(new.keys, new.values, s)  # one copy, into the buffer the next passes append to
            self.starts += list(pads)
            self.ends += [width] * len(pads)
        self._sync_rows()

    def _sync_rows(self) -> None:
        """The rows' starts and ends on the device (after a host change of the batch)."""
        both = torch.tensor([self.starts, self.ends], dtype=torch.long).to(self.device, non_blocking=True)
        self._starts_dev, self._ends_dev = both[0], both[1]

    @torch.inference_mode()
    def drop_rows(self, keep: Sequence[int]) -> None:
        """Keep only the rows ``keep`` (indices, in the order given); the others leave the batch."""
        keep = list(keep)
        if keep == list(range(self.rows)):
            return
        if not keep:
            self.cache, self.starts, self.ends = None, [], []
            self._sync_rows()
            return
        self.starts = [self.starts[i] for i in keep]
        self.ends = [self.ends[i] for i in keep]
        s = self.width
        layers = cache_layers(self.cache)
        if keep == sorted(keep):
            # rows leaving: the rows after the first gap move down in place (no new buffers)
            first = next(i for i, r in enumerate(keep + [-1]) if r != i)
            tail = torch.tensor(keep[first:], dtype=torch.long).to(self.device, non_blocking=True)
            for layer in layers:
                layer.keep_rows(first, tail, s)
        else:
            index = torch.tensor(keep, dtype=torch.long).to(self.device, non_blocking=True)
            for layer in layers:
                layer.keys = layer.keys.index_select(0, index)[:, :, :s]
                layer.values = layer.values.index_select(0, index)[:, :, :s]
        self._sync_rows()

    # ---- a verify pass -------------------------------------------------------------------------

    @torch.inference_mode()
    def verify_rows(self, trees: TreeBatch, *, features: bool = True) -> RowsOutput:
        """Score every node of every row's tree (``trees``: one per row, in row order) in one
        forward pass. Returns logits ``[B, N, V]`` and features ``[B, N, F, H]`` (None without
        ``features``); the trees' keys and values are appended to the cache until :meth:`commit_rows`."""
        if trees.rows != self.rows:
            raise ValueError(f"{trees.rows} trees for {self.rows} rows")
        return self._forward(trees.tokens, trees.ancestor_mask, trees.depths, trees.num_nodes, features)

    def _forward(self, tokens: torch.Tensor, ancestors: torch.Tensor, depths: torch.Tensor, n: int,
                 features: bool = True) -> RowsOutput:
        """The pass over ``tokens [B, N]`` with tree ``ancestors [B, N, N]`` and ``depths [B, N]``."""
        b, s = self.rows, self.width
        if self._compact():
            positions = depths + s
            if b == 1:  # one node sees the whole prefix: the model's own causal mask is that, and cheaper
                mask = self._tree_mask(ancestors[0], s) if n > 1 else None
            else:
                mask = self._rows_mask(ancestors)
        else:  # rows of unlike lengths: each row's nodes are written right after its own end
            positions = depths + (self._ends_dev - self._starts_dev)[:, None]
            mask = self._rows_mask(ancestors)
            self.cache.set_write_at(self._ends_dev)
        try:
            with kernel_context(self.kernel, b * n):
                out = self.model(
                    input_ids=tokens,
                    attention_mask=mask,
                    position_ids=positions,
                    use_cache=True,
                    output_hidden_states=self._hidden_states_arg(features),
                    **{self._cache_kw: self.cache},
                )
        finally:
            self.cache.set_write_at(None)
        return RowsOutput(out.logits, self._features(out))

    def _rows_mask(self, ancestors: torch.Tensor) -> torch.Tensor:
        """Additive mask ``[B, 1, N, S + N]``: row ``b``'s nodes see its committed columns
        ``[starts[b], ends[b])`` and their own ancestors, which are written at columns
        ``ends[b] + node`` (the same as ``S + node`` when every row ends at ``S``), nothing else."""
        b, n, _ = ancestors.shape
        cols = torch.arange(self.width + n, device=self.device)
        rel = cols - self._ends_dev[:, None]  # [B, S + N]: a column's place after the row's end
        seen = (cols >= self._starts_dev[:, None]) & (rel < 0)
        in_tree = (rel >= 0) & (rel < n)
        tree = ancestors.gather(2, rel.clamp(0, n - 1)[:, None, :].expand(b, n, -1)) & in_tree[:, None, :]
        allowed = seen[:, None, :] | tree  # [B, N, S + N]
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device).masked_fill_(~allowed, self._mask_min)
        return mask[:, None]

    def _tree_mask(self, ancestors: torch.Tensor, past: int) -> torch.Tensor:
        """Additive mask ``[1, 1, N, past + N]`` of one compact row: every node sees the ``past``
        cached positions and its own ancestors. A view into a buffer reused across steps: only
        the new tree's block is written (and the columns that the last tree dirtied, now
        committed prefix, are cleared)."""
        n = ancestors.shape[0]
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
        block.masked_fill_(ancestors, 0.0)
        self._clean = past
        return buf[:n, : past + n][None, None]

    # ---- keeping the accepted paths ------------------------------------------------------------

    @torch.inference_mode()
    def commit_rows(self, paths: torch.Tensor, node_ids: Sequence[Sequence[int]], lengths: torch.Tensor | None = None) -> None:
        """Keep every row's accepted path of the last verified trees.

        Args:
            paths: ``[B, K]`` long on the device: row ``b``'s accepted node indices, root first, in
                its first ``k_b`` entries (the rest is ignored).
            node_ids: per row, the same ``k_b`` indices on the host.
            lengths: ``[B]`` the ``k_b`` on the device, if known there (else copied from the host).

        Row ``b``'s nodes were written from column ``ends[b]`` on (:meth:`_forward`); its
        accepted keys and values move to columns ``[ends[b], ends[b] + k_b)`` (where an accepted
        path is the tree's first nodes, as in every plain step, nothing moves); everything past
        the longest row is cropped."""
        ks = [len(ids) for ids in node_ids]
        if self.rows == 1:
            k_dev = ks[0]  # a number: the ends below move without a copy
        else:
            k_dev = lengths if lengths is not None else torch.tensor(ks, dtype=torch.long).to(self.device, non_blocking=True)
        if not all(list(ids) == list(range(len(ids))) for ids in node_ids):  # else every accepted node is in place
            kmax = paths.shape[1]
            j = torch.arange(kmax, device=self.device)
            dst = self._ends_dev[:, None] + j  # [B, K]
            src = self._ends_dev[:, None] + paths
            if self.rows > 1:
                src = torch.where(j < k_dev[:, None], src, dst)  # past a row's path: a harmless self-copy
            for layer in cache_layers(self.cache):
                for t in (layer.keys[: self.rows], layer.values[: self.rows]):  # a static cache has spare slots
                    shape = (t.shape[0], t.shape[1], kmax, t.shape[3])
                    moved = t.gather(2, src[:, None, :, None].expand(shape))
                    t.scatter_(2, dst[:, None, :, None].expand(shape), moved)
        self.ends = [e + k for e, k in zip(self.ends, ks)]
        self._ends_dev = self._ends_dev + k_dev
        self.rollback()

    def rollback(self) -> None:
        """Drop whatever the cache holds beyond the longest row (an unaccepted tree)."""
        crop_cache(self.cache, self.width)

    def _hidden_states_arg(self, features: bool = True) -> bool | list[int]:
        """``output_hidden_states`` for a pass: only the drafters' layers where transformers keeps
        just the selected ones (5.25 and later: the others are freed layer by layer, as without
        features; keeping all of them costs a long prefill about 5%), else all of them."""
        if not (features and self.feature_layers):
            return False
        return list(self.feature_layers) if _selects_hidden_states() else True

    def _features(self, out) -> torch.Tensor | None:
        """``[B, T, F, H]``: the requested layers' hidden states at every input position (None
        where the pass asked for none, :meth:`_hidden_states_arg`)."""
        hs = out.hidden_states
        if hs is None:
            return None
        return torch.stack([hs[i] for i in self.feature_layers], dim=2)


@functools.cache
def _selects_hidden_states() -> bool:
    """Whether this transformers takes ``output_hidden_states`` as the indices of the hidden states to keep."""
    try:
        from transformers.utils.output_capturing import selected_hidden_states  # noqa: F401
    except ImportError:
        return False
    return True
