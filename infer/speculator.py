"""An application's entry point: a verifier, its tokenizer and a drafter, loaded once.

    from infer import Speculator

    spec = Speculator.from_pretrained("default", draft="auto")
    print(spec.generate("Explain KV caches.", max_new_tokens=128).text)
    for piece in spec.stream("Write a haiku about GPUs."):
        print(piece.text, end="", flush=True)
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import torch

from .core.drafter import Drafter
from .core.engine import Engine, GenerationResult, GenerationStats, queue
from .core.errors import UserError
from .core.models import load_verifier
from .core.params import SamplingParams
from .core.static import resolve_compile
from .core.text import StreamDecoder, encode_prompt, eos_ids
from .core.tree import TreeSpec, load_tree_spec
from .core.verifier import Verifier
from .drafting.loading import draft_parts, load_drafter


@dataclass
class TextChunk:
    """What one step added: its tokens, their text (complete characters only; a split multi-byte
    character waits for the next chunk), and the running stats."""

    token_ids: list[int]
    text: str
    stats: GenerationStats
    index: int = 0


@dataclass
class SpeculatorResult(GenerationResult):
    """New token ids, their text (None without a tokenizer) and the generation's stats."""

    text: str | None = None


BUSY = ("this Speculator is already generating (an unfinished stream() or another thread): it runs one "
        "call at a time; finish or close() the other stream first, pass several prompts as one list (a batch), "
        "or serve concurrent callers with `specheads serve`")


class Speculator:
    """Speculative generation with a loaded verifier and drafter. Greedy output is the verifier's
    own greedy output; sampled output follows its sampling distribution.

    One generation at a time: a second ``stream()`` / ``generate()`` while one is unfinished (an
    unexhausted stream, or another thread) is refused with a :class:`UserError`; it never
    interleaves with the first (they share the verifier's KV cache and the drafter's state).
    Every call runs on one long-lived :class:`~infer.core.engine.Engine`, so what its schedule
    learns (the verify cost, the drafter's own cost, the gates) carries over from call to call.
    ``budget``: the engine's (``auto``: the verify cost and the drafter's own cost probed now);
    ``compile``: its verify step (``--compile``; ``auto`` compiles where this machine measured it
    faster, :func:`~infer.core.static.resolve_compile`, at the price of a warm-up here)."""

    def __init__(self, model, tokenizer, drafter: Drafter, *, name: str = "", linear: str = "auto", budget="auto",
                 compile: str = "auto"):
        self.model, self.tokenizer, self.drafter, self.name = model, tokenizer, drafter, name
        self.engine = Engine(Verifier(model, linear=linear), drafter, budget=budget, compile=compile)
        # one generation at a time: the verifier's KV cache and the drafter's state are per generation
        self._busy = threading.Lock()

    @classmethod
    def from_pretrained(cls, verifier: str = "default", *, draft: str = "auto", dtype: str | torch.dtype = "auto",
                        device: str = "cpu", tree: str | TreeSpec | None = None, tree_budget: str = "auto",
                        draft_dtype: str | torch.dtype = "auto", linear: str = "auto", compile: str = "auto") -> Speculator:
        """Load ``verifier`` (what ``--verifier`` accepts) and the drafter ``draft`` (what
        ``--draft`` accepts: ``auto``, ``pld``, ``none``, a head checkpoint, ``a+b``).
        ``draft_dtype`` and ``linear`` are ``--draft-dtype`` and ``--linear``."""
        from .core.kernels import check_kernel_device

        spec = load_tree_spec(tree) if isinstance(tree, str) else tree
        check_kernel_device(linear, device)  # before loading anything
        draft_parts(draft, None)  # a bad draft spec fails before the verifier loads
        lv = load_verifier(verifier, dtype=dtype, device=device)
        drafter = load_drafter(draft, lv.model, tree=spec, draft_dtype=draft_dtype, tokenizer=lv.tokenizer,
                               compile=resolve_compile(compile, lv.model)[0])
        return cls(lv.model, lv.tokenizer, drafter, name=verifier, linear=linear, budget=tree_budget, compile=compile)

    def _ids(self, prompt, chat: bool | None) -> torch.Tensor:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise UserError("this verifier has no tokenizer: give token ids instead of text")
            return encode_prompt(self.tokenizer, prompt, chat=chat)
        return prompt

    def stream(self, prompt: str | Sequence[int] | torch.Tensor | Sequence[str | Sequence[int]], *, max_new_tokens: int = 128,
               temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
               stop: str | Sequence[str] | None = None, chat: bool | None = None, max_batch: int = 64) -> Iterator[TextChunk]:
        """Generate from text (through the chat template when the tokenizer has one, unless
        ``chat=False``) or token ids, yielding each step's tokens and text as they are accepted.

        A list of prompts (texts or token-id lists) is generated as a batch: every chunk names its
        prompt in ``index``; each prompt is its own generation (row ``i`` sampled with
        ``seed + i``), and up to ``max_batch`` run at once."""
        params = SamplingParams(max_new_tokens, temperature, top_p, top_k, seed)
        batch = isinstance(prompt, (list, tuple)) and len(prompt) > 0 and not isinstance(prompt[0], int)
        if batch:
            ids = [self._ids(p, chat) for p in prompt]
        else:
            ids = self._ids(prompt, chat)
        eos = eos_ids(self.model, self.tokenizer) if self.tokenizer is not None else None
        if not self._busy.acquire(blocking=False):
            raise UserError(BUSY)
        engine = self.engine
        try:
            if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 1:
                raise UserError(f"max_batch must be a positive integer, not {max_batch!r}")
            engine.max_rows = max_batch
            at = {index: i for i, index in enumerate(queue(engine, ids, params, eos_token_id=eos, stop=stop,
                                                           tokenizer=self.tokenizer))}
        except BaseException:
            engine.reset()
            self._busy.release()
            raise
        chunks = (replace(c, index=at[c.index]) for c in engine.run())
        return _Held(self._texts(chunks), self._release)

    def _release(self) -> None:
        """A call ended (exhausted, failed or closed early): its rows leave, the next may start."""
        if self.engine.busy:
            self.engine.reset()
        self._busy.release()

    def _texts(self, chunks: Iterator) -> Iterator[TextChunk]:
        """The engine's chunks with their text (per prompt, complete characters only)."""
        decoders: dict[int, StreamDecoder] = {}
        for chunk in chunks:
            piece = ""
            if self.tokenizer is not None:
                pieces = decoders.setdefault(chunk.index, StreamDecoder(self.tokenizer))
                piece = pieces.push(chunk.token_ids)
                if chunk.stats.finish_reason:  # the last chunk: whatever is left
                    piece += pieces.flush()
            yield TextChunk(chunk.token_ids, piece, chunk.stats, chunk.index)

    def generate(self, prompt, **kwargs) -> SpeculatorResult | list[SpeculatorResult]:
        """:meth:`stream` to the end: the new token ids, their text and the stats (a list of
        them, in prompt order, for a list of prompts)."""
        batch = isinstance(prompt, (list, tuple)) and len(prompt) > 0 and not isinstance(prompt[0], int)
        n = len(prompt) if batch else 1
        tokens: list[list[int]] = [[] for _ in range(n)]
        stats = [GenerationStats() for _ in range(n)]
        for chunk in self.stream(prompt, **kwargs):
            tokens[chunk.index].extend(chunk.token_ids)
            stats[chunk.index] = chunk.stats
        decode = (lambda t: self.tokenizer.decode(t, skip_special_tokens=True)) if self.tokenizer is not None else (lambda t: None)
        results = [SpeculatorResult(t, s, decode(t)) for t, s in zip(tokens, stats)]
        return results if batch else results[0]


class _Held:
    """An iterator that holds a lock until it is exhausted, fails, is closed or is collected
    (started or not: a generator's own ``finally`` never runs if it was never started)."""

    def __init__(self, inner: Iterator, release):
        self._inner, self._release = inner, release

    def __iter__(self):
        return self

    def __next__(self):
        if self._release is None:
            raise StopIteration
        try:
            return next(self._inner)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop here: the rest is not generated, and the lock is released."""
        if self._release is not None:
            release, self._release = self._release, None
            self._inner.close()
            release()

    def __del__(self):
        self.close()
