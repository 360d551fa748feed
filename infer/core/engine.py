"""The speculative decoding loop: ``generate`` and ``stream``, for one prompt or a batch, and the
continuous-batching :class:`Engine` under both (and under ``specheads serve``).

Each step: every row's drafter proposes a tree rooted at its newest token, the verifier scores
all rows' nodes in one masked forward pass, an acceptance rule keeps each row's longest valid path
plus the verifier's own bonus token, and the KV cache keeps exactly those paths. Rows join at a
step boundary and leave when they end. Greedy output is token
for token the verifier's plain greedy output; sampled output follows the verifier's own sampling
distribution exactly (``acceptance="typical"`` is the documented lossy exception).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field

import torch

from .accept import (
    RowsAcceptance,
    greedy_accept,
    greedy_accept_rows,
    noise_sample,
    position_uniforms,
    row_tree,
    sample_accept,
    seed_tensor,
    stack_acceptances,
    typical_accept,
    warp_probs,
)
from .batch import TreeBatch, prefill_groups, stack_drafts
from .cost import ALL, ONE, BatchCost, SpecPolicy
from .drafter import Draft, Drafter, NoDrafter, host_draft
from .errors import UserError
from .params import MAX_SEED, SamplingParams
from .tree import TreeSpec
from .verifier import Verifier


@dataclass
class GenerationStats:
    """Counters of one generation.

    ``mean_accepted`` is tau: the tokens the verify passes emitted per verify pass (the bonus token
    counts; the first new token comes from the prefill and is not a verify pass's, so decoding
    with no draft has tau 1.0 exactly). ``accepted_hist[k]`` counts the verify steps that emitted
    ``k`` tokens.
    """

    new_tokens: int = 0
    verify_steps: int = 0
    mean_accepted: float = 0.0
    accepted_hist: list[int] = field(default_factory=list)
    tree_nodes: int = 0  # summed over verify steps
    nodes_hist: list[int] = field(default_factory=list)  # [n]: verify steps over n tree nodes
    prefill_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    tokens_per_s: float = 0.0
    finish_reason: str = ""

    def as_dict(self) -> dict:
        return asdict(self)

    def _finish(self) -> None:
        # the prefill emits the first new token; every later one came from a verify pass
        self.mean_accepted = max(0, self.new_tokens - 1) / max(1, self.verify_steps)
        total = self.prefill_s + self.decode_s
        self.tokens_per_s = self.new_tokens / total if total > 0 else 0.0


@dataclass
class GenerationResult:
    """New token ids (prompt excluded) and the generation's stats."""

    token_ids: list[int]
    stats: GenerationStats


@dataclass
class Chunk:
    """Tokens accepted in one step, and the running stats (the same object every step).
    ``index``: which prompt of a batch they belong to (0 for a single prompt)."""

    token_ids: list[int]
    stats: GenerationStats
    index: int = 0


def is_batch(input_ids) -> bool:
    """Whether ``input_ids`` holds several prompts: a list or tuple of prompts (lists, tuples or
    tensors of token ids), or a ``[B, L]`` tensor with ``B > 1``."""
    if isinstance(input_ids, torch.Tensor):
        return input_ids.dim() == 2 and input_ids.shape[0] > 1
    return (isinstance(input_ids, (list, tuple)) and len(input_ids) > 0
            and isinstance(input_ids[0], (list, tuple, torch.Tensor)))


def batch_prompts(input_ids) -> list:
    """The prompts of a batch (see :func:`is_batch`), each still to be checked."""
    if isinstance(input_ids, torch.Tensor):
        return list(input_ids)
    return list(input_ids)


def check_prompt_ids(input_ids) -> torch.Tensor:
    """The prompt as a 1-D long tensor on the host, or a :class:`UserError` naming what is
    expected: ``[L]`` or ``[1, L]`` integer token ids (one prompt; a batch is a list of them)."""
    if isinstance(input_ids, torch.Tensor):
        ids = input_ids
    else:
        try:
            ids = torch.as_tensor(input_ids)
        except (TypeError, ValueError, RuntimeError):
            raise UserError("input_ids must be a sequence of integer token ids or a tensor of shape [L] or [1, L]") from None
    if ids.numel() == 0:
        raise UserError("the prompt is empty: give at least one token")
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise UserError(f"input_ids must hold integer token ids (torch.long), not {ids.dtype}")
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise UserError(f"input_ids must have shape [L] or [1, L] for one prompt (a batch: a list of prompts), not {list(ids.shape)}")
    if ids.numel() == 0:
        raise UserError("the prompt is empty: give at least one token")
    return ids.to(torch.long).cpu()


class _Stopper:
    """Decides, token by token, where plain decoding would have stopped."""

    def __init__(self, max_new_tokens, eos_token_id, stop, tokenizer):
        if eos_token_id is None:
            eos = set()
        elif isinstance(eos_token_id, int):
            eos = {eos_token_id}
        else:
            eos = {int(e) for e in eos_token_id}
        self.eos = eos
        if isinstance(stop, str):  # one stop string, not its characters
            stop = [stop]
        stop = list(stop or [])
        if not all(isinstance(s, str) for s in stop):
            raise UserError(f"stop must be a string or a list of strings, not {stop!r:.80}")
        self.stop = [s for s in stop if s]
        if self.stop and tokenizer is None:
            raise UserError("stop strings need the tokenizer: pass tokenizer=")
        self.tokenizer = tokenizer
        self.window = max((len(s) for s in self.stop), default=0) + 2
        self.max_new = max_new_tokens
        self.tokens: list[int] = []
        self.reason = ""

    def feed(self, chunk: Sequence[int]) -> list[int]:
        """Append ``chunk``; return the part plain decoding would also have produced."""
        out = []
        for t in chunk:
            out.append(t)
            self.tokens.append(t)
            if t in self.eos:
                self.reason = "eos"
            elif self.stop and any(
                s in self.tokenizer.decode(self.tokens[-self.window :]) for s in self.stop
            ):
                self.reason = "stop"
            elif len(self.tokens) >= self.max_new:
                self.reason = "length"
            if self.reason:
                break
        return out


_UNSET = object()  # a keyword argument that was not given


def sampling_params(params, **given) -> SamplingParams:
    """``params`` or the keyword arguments ``given`` (those not ``_UNSET``) as one
    :class:`SamplingParams`; both at once is refused (one would silently win)."""
    passed = {k: v for k, v in given.items() if v is not _UNSET}
    if params is not None:
        if passed:
            raise UserError(f"give either params= or the keyword arguments {', '.join(sorted(passed))}, not both")
        return params
    return SamplingParams(**passed)


def stream(
    verifier,
    drafter: Drafter | None,
    input_ids,
    *,
    max_new_tokens: int = _UNSET,
    temperature: float = _UNSET,
    top_p: float = _UNSET,
    top_k: int = _UNSET,
    seed: int | None = _UNSET,
    acceptance: str = _UNSET,
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    generator: torch.Generator | None = None,
    tree: TreeSpec | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    stop: Sequence[str] | None = None,
    tokenizer=None,
    max_batch: int = 64,
) -> Iterator[Chunk]:
    """Speculative generation, yielding each step's accepted tokens as a :class:`Chunk`.

    Args:
        verifier: a :class:`~infer.core.verifier.Verifier` or an HF causal LM.
        drafter: proposes the trees; ``None`` decodes plainly through the same loop.
        input_ids: one prompt (``[L]`` or ``[1, L]`` integer token ids), or a batch: a list of
            prompts (of any lengths) or a ``[B, L]`` tensor. A batch's chunks carry the prompt's
            position in ``index``; every row is its own generation (its own tree, acceptance,
            stop conditions and randomness) and leaves the batch when it ends.
        max_new_tokens: exact upper bound on new tokens (default 128).
        temperature: 0 (default) = greedy; otherwise sample with ``top_p`` / ``top_k`` as HF does.
        seed / generator: randomness for sampling. A seeded row's token at each position is
            drawn with noise that depends on the seed and the position alone
            (:func:`~infer.core.accept.position_uniforms`), so a seed gives the same text whatever
            the drafter, the tree, the batch or the timing (drafts that carry their ``q``, and
            typical acceptance, also draw from a generator seeded with it: their text repeats for
            the same drafter and tree). Without a seed, one is drawn from ``generator`` (which
            advances it), else from the OS (the global torch generators are never touched). In a
            batch, row ``i`` is seeded with ``seed + i``, or with a number drawn from ``generator``.
        acceptance: ``"exact"`` (lossless, default) or ``"typical"`` (Medusa typical acceptance, lossy).
        params: ``max_new_tokens`` .. ``acceptance`` as one :class:`~infer.core.params.SamplingParams`
            (a batch may give one per prompt); giving both ``params`` and any of those is refused.
        tree: overrides the drafter's tree shape.
        eos_token_id: token id(s) that end generation (included in the output, as in HF).
        stop: a string, or strings, that end generation once the decoded output contains one
            (needs ``tokenizer``); the output ends with the token that completed the stop string.
        max_batch: rows decoded at once; a longer batch waits and joins as rows end.
    """
    given = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                 acceptance=acceptance)
    engine = Engine(verifier, drafter, tree=tree, max_rows=max_batch, spawn=is_batch(input_ids))
    if not is_batch(input_ids):
        if isinstance(params, (list, tuple)):
            raise UserError("one prompt takes one SamplingParams, not a list")
        engine.add(input_ids, sampling_params(params, **given), eos_token_id=eos_token_id, stop=stop,
                   tokenizer=tokenizer, generator=generator)
        return engine.run()
    prompts = batch_prompts(input_ids)
    if isinstance(params, (list, tuple)):
        if given and any(v is not _UNSET for v in given.values()):
            raise UserError("give either params= or the sampling keyword arguments, not both")
        if len(params) != len(prompts):
            raise UserError(f"{len(params)} SamplingParams for {len(prompts)} prompts: give one per prompt, or one for all")
        per_row = list(params)
    else:
        one = sampling_params(params, **given)
        per_row = [one] * len(prompts)
    for i, (ids, p) in enumerate(zip(prompts, per_row)):
        if p.seed is not None and not p.greedy:
            p = SamplingParams(p.max_new_tokens, p.temperature, p.top_p, p.top_k, (p.seed + i) % (MAX_SEED + 1), p.acceptance)
        row_gen = None
        if generator is not None:
            row_gen = torch.Generator(device=generator.device).manual_seed(
                int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device).item()))
        engine.add(ids, p, eos_token_id=eos_token_id, stop=stop, tokenizer=tokenizer, generator=row_gen)
    return engine.run()


def _same_device(a: torch.device, b: torch.device) -> bool:
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.type == "cuda":  # "cuda" is the current CUDA device
        cur = torch.cuda.current_device()
        return (a.index if a.index is not None else cur) == (b.index if b.index is not None else cur)
    return a.index == b.index or a.index is None or b.index is None


def row_seed(seed: int | None, generator: torch.Generator | None) -> int:
    """A generation's seed: ``seed``, else a number drawn from ``generator`` (advancing it), else
    one from the OS (no global torch generator is touched)."""
    if seed is not None:
        return seed
    if generator is not None:
        return int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device).item())
    return int.from_bytes(os.urandom(8), "little")


def sampling_generator(device, seed: int | None, generator: torch.Generator | None) -> torch.Generator:
    """The generator the engine samples with, on ``device`` (the verifier's): ``generator`` when
    it is there already; else a fresh one on ``device``, seeded with ``seed``, or with a number
    drawn from ``generator`` (e.g. a CPU generator given for a CUDA verifier: the same
    generator state gives the same output), or from the OS (no global generator is touched)."""
    if generator is not None:
        if _same_device(generator.device, device):
            return generator
        seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device).item())
    local = torch.Generator(device=device)
    if seed is None:
        local.seed()  # non-deterministic, and local: torch.seed() would reseed the global generators
    else:
        local.manual_seed(seed)
    return local


@dataclass
class _Row:
    """One generation in the batch: its drafter, stop rule, randomness and running stats."""

    index: int
    ids: torch.Tensor
    drafter: Drafter
    stopper: _Stopper
    params: SamplingParams
    generator: torch.Generator | None  # for drafts that carry q, and typical acceptance
    seed: int = 0  # keys the row's sampling noise (with the position)
    key: torch.Tensor | None = None  # ``seed`` as a ``[1]`` int64 tensor on the device (copied there once)
    stats: GenerationStats = field(default_factory=GenerationStats)
    root: int = 0
    t_decode: float = 0.0
    cancelled: bool = False
    held_tokens: list[int] = field(default_factory=list)  # committed in plain steps, not yet given to the drafter
    held_features: list = field(default_factory=list)  # their verifier features, ``[F, H]`` each (or None)
    warm: bool = True  # prefilled with the drafter's features; a cold row never drafts

    def hand_over(self) -> None:
        """Give the drafter what plain steps committed since it last saw the context (one
        :meth:`~infer.core.drafter.Drafter.update` for them all)."""
        if not self.held_tokens:
            return
        feats = torch.stack(self.held_features) if self.held_features[0] is not None else None
        self.drafter.update(torch.tensor(self.held_tokens, dtype=torch.long), feats)
        self.held_tokens, self.held_features = [], []

    @property
    def greedy(self) -> bool:
        return self.params.greedy


class Engine:
    """Speculative decoding of many generations at once, with continuous batching.

    :meth:`add` queues a generation; :meth:`step` runs one pass: the queued generations join
    (their prompts prefilled in left-padded passes, one per group of like lengths, their first
    tokens returned), or, when none waits, every running row is drafted, verified in one masked pass and accepted; rows that end
    (eos, a stop string, their token limit, :meth:`cancel`) leave the batch. One engine owns its
    verifier's KV cache: drive it from one thread.

    Each row has its own drafter: the engine's own for a single generation (``spawn=False``, so a
    drafter's learning carries over from one call to the next), else ``drafter.spawn()`` per row.
    Rows size their trees by the verify-cost curve as a batch of the current size sees it
    (:class:`~infer.core.cost.BatchCost`): trees shrink as the batch grows, and drafting stops
    where it cannot pay; and a batch drafts only while drafting has measured faster than plain
    decoding at its size (:class:`~infer.core.cost.SpecPolicy`, dynamic speculation). Rows that
    join where the policy keeps more coming steps plain than they can live
    (:meth:`~infer.core.cost.SpecPolicy.quiet_steps`) are *cold*: prefilled without the drafter's
    features, their drafter never begun, they decode plainly to their end (probes take warm rows).

    Args:
        verifier: a :class:`~infer.core.verifier.Verifier` or an HF causal LM.
        drafter: the drafter (``None``: plain decoding through the same loop).
        tree: overrides the drafter's tree shape.
        max_rows: rows decoded at once; more wait in the queue.
        spawn: give every row a drafter of its own (``drafter.spawn()``).
        policy: whether a batched step drafts at all (default: the drafter's
            :meth:`~infer.core.drafter.Drafter.batch_policy`, which measures it and is kept with
            the drafter from one batch to the next); any object with its ``plan``, ``record``
            and ``quiet_steps`` methods.
        join_wait: steps that queued generations may wait, with a row free, for a running row
            that reaches its token limit within them, so that they join in one prefill pass (a
            pass streams all the weights whatever its rows, so two prompts cost far less than two
            passes of one). Rows that started together then end together again after a draft put
            one of them ahead, as TGI's ``max_waiting_tokens`` batches prefills; 0: join at the next step.
    """

    #: what a prefill pass costs beyond its padded token slots, in token slots: joining prompts of
    #: unlike lengths are prefilled in separate passes where that saves more (:func:`prefill_groups`)
    PREFILL_PASS_TOKENS = 64
    #: plain steps whose committed tokens a row holds before its drafter is updated with them all
    #: at once (sooner when the row drafts): a drafter update per row and step costs a batched
    #: plain step about 1% at 16 rows, for work only a drafting step needs
    HOLD_STEPS = 32

    def __init__(self, verifier, drafter: Drafter | None = None, *, tree: TreeSpec | None = None, max_rows: int = 64,
                 spawn: bool = True, policy: SpecPolicy | None = None, join_wait: int = 4):
        if not isinstance(max_rows, int) or isinstance(max_rows, bool) or max_rows < 1:
            raise UserError(f"max_batch must be a positive integer, not {max_rows!r}")
        if not isinstance(join_wait, int) or isinstance(join_wait, bool) or join_wait < 0:
            raise UserError(f"join_wait must be a non-negative integer, not {join_wait!r}")
        self.join_wait = join_wait
        self._waited = 0  # steps the queued generations have waited for a row about to end
        self.drafter = drafter or NoDrafter()
        self.verifier = verifier if isinstance(verifier, Verifier) else Verifier(verifier)
        self.verifier.feature_layers = tuple(self.drafter.feature_layers)
        self.verifier.drop_rows([])  # whatever an unfinished earlier generation left behind
        self.tree, self.max_rows, self.spawn = tree, max_rows, spawn
        self.base_cost = self.drafter.cost
        self.policy = policy if policy is not None else self.drafter.batch_policy(SpecPolicy)
        self.rows: list[_Row] = []
        self.pending: list[_Row] = []
        self._cost_rows = 1  # the batch size the rows' cost curves were set for
        self._cost = self.base_cost  # the curve they were given
        self.last_sizes: tuple[int, ...] = ()  # the rows' tree sizes in the last decode step (for metrics)
        self.last_drafted = False  # whether any row drafted in the last decode step (for metrics)
        self._probe = 0  # the row that drafts when the policy probes one
        self._admitted_last = False
        self._admitting = 0  # rows taken from the queue and being prefilled (in neither list)
        self._next = 0

    # ---- the queue -----------------------------------------------------------------------------

    def add(self, input_ids, params: SamplingParams | None = None, *, eos_token_id=None, stop=None, tokenizer=None,
            generator: torch.Generator | None = None) -> int:
        """Queue a generation of prompt ``input_ids`` (``[L]`` token ids); returns its index (the
        ``Chunk.index`` of its output). Bad input is refused here with a :class:`UserError`."""
        params = params or SamplingParams()
        ids = check_prompt_ids(input_ids)
        vocab = self.verifier.vocab_size
        if int(ids.max()) >= vocab or int(ids.min()) < 0:
            raise UserError(f"prompt token ids must be in [0, {vocab}) for this verifier")
        self.verifier.check_fits(ids.numel() + params.max_new_tokens)
        stopper = _Stopper(params.max_new_tokens, eos_token_id, stop, tokenizer)
        seed = row_seed(params.seed, generator)
        gen = None if params.greedy else sampling_generator(self.verifier.device, seed, None)
        if self.spawn or self._next > 0:
            drafter = self.drafter.spawn()
        else:
            drafter = self.drafter
        key = None if params.greedy else seed_tensor([seed], self.verifier.device)
        row = _Row(self._next, ids, drafter, stopper, params, gen, seed, key)
        self._next += 1
        self.pending.append(row)
        return row.index

    def cancel(self, index: int) -> bool:
        """Stop generation ``index`` at the next step boundary (its row leaves the batch);
        whether it was still queued or running."""
        for row in self.pending:
            if row.index == index:
                self.pending.remove(row)
                return True
        for row in self.rows:
            if row.index == index:
                row.cancelled = True
                return True
        return False

    def reset(self) -> None:
        """Drop every generation, running or queued (after a failed step)."""
        self.rows, self.pending = [], []
        self.verifier.drop_rows([])

    @property
    def busy(self) -> bool:
        """Whether any generation is running or queued."""
        return bool(self.rows or self.pending or self._admitting)

    def run(self) -> Iterator[Chunk]:
        """:meth:`step` until every generation has ended, yielding the chunks."""
        while self.busy:
            yield from self.step()

    # ---- one step ------------------------------------------------------------------------------

    def step(self) -> list[Chunk]:
        """One pass: the queued generations join (when there is room, not twice in a row while
        rows are running, and not while a running row ends within the steps left of
        ``join_wait``), else every running row takes one speculative step."""
        joins = self.joins_next
        self._leave([r for r in self.rows if r.cancelled])
        room = self.max_rows - len(self.rows)
        if joins:
            self._admitted_last, self._waited = True, 0
            return self._admit(self.pending[:room])
        self._admitted_last = False
        if self.pending and room > 0:
            self._waited += 1
        return self._decode() if self.rows else []

    @property
    def joins_next(self) -> bool:
        """Whether the next :meth:`step` admits queued generations (else it decodes the running
        rows): a benchmark that steps two engines in turn uses it to take turns per kind of step."""
        rows = [r for r in self.rows if not r.cancelled]
        return (bool(self.pending) and len(rows) < self.max_rows and not (self._admitted_last and rows)
                and not self._ends_soon(rows))

    def _ends_soon(self, rows: list[_Row]) -> bool:
        """Whether one of ``rows`` reaches its token limit within the steps this join may still
        wait (``join_wait`` in all): the rows that take its place then join in the same prefill pass."""
        left = self.join_wait - self._waited
        return left > 0 and any(r.stopper.max_new - len(r.stopper.tokens) <= left for r in rows)

    def _admit(self, rows: list[_Row]) -> list[Chunk]:
        """Prefill ``rows`` (in passes of like prompt lengths), append them to the batch; their first
        tokens. Another thread reading :attr:`busy` meanwhile sees them (e.g. a server draining)."""
        self._admitting = len(rows)
        try:
            return self._prefill(rows)
        finally:
            self._admitting = 0

    def _prefill(self, rows: list[_Row]) -> list[Chunk]:
        del self.pending[: len(rows)]
        self.last_sizes = ()
        if not self.rows:
            self.verifier.drop_rows([])  # what the last generation left
        t0 = time.perf_counter()
        # prompts of unlike lengths in passes of their own (less padding); the batch's rows in pass order
        groups = [[rows[i] for i in g] for g in prefill_groups([int(r.ids.numel()) for r in rows], self.PREFILL_PASS_TOKENS)]
        rows = [r for group in groups for r in group]
        quiet = self.policy.quiet_steps(len(self.rows) + len(rows))
        outs = []
        for group in groups:  # a pass whose rows all end before the batch would let them draft: cold
            warm = any(r.stopper.max_new - 1 > quiet for r in group)
            for r in group:
                r.warm = warm
            outs += self.verifier.add_rows([r.ids for r in group], features=warm)
        firsts = []
        for row, out in zip(rows, outs):
            if row.warm:
                row.drafter.set_params(row.params)
                row.drafter.begin(row.ids, out.features)
            if row.greedy:
                firsts.append(out.logits[-1].argmax().view(1))
            else:
                firsts.append(self._sample(row, out.logits[-1:], torch.zeros(1, dtype=torch.long, device=out.logits.device)).view(1))
        roots = torch.cat(firsts).tolist()  # one read for every new row
        elapsed = time.perf_counter() - t0
        now = time.perf_counter()
        chunks = []
        for row, root in zip(rows, roots):
            row.root = root
            row.stats.prefill_s = elapsed
            row.t_decode = now
            emitted = row.stopper.feed([root])
            row.stats.new_tokens = len(emitted)
            self.rows.append(row)
            chunks.append(self._chunk(row, emitted))
        self._cost_rows = 0  # the new rows' drafters have not been given the batch's curve yet
        self._leave([r for r in rows if r.stopper.reason])
        return chunks

    def _chunk(self, row: _Row, emitted: list[int]) -> Chunk:
        st = row.stats
        st.decode_s = time.perf_counter() - row.t_decode
        st._finish()  # running values, for live displays
        if row.stopper.reason:
            st.finish_reason = row.stopper.reason
        return Chunk(emitted, st, row.index)

    def _leave(self, rows: list[_Row]) -> None:
        """These rows leave the batch (their cache rows are dropped)."""
        if not rows:
            return
        gone = {id(r) for r in rows}
        keep = [i for i, r in enumerate(self.rows) if id(r) not in gone]
        if keep or self.pending:  # the last generation's cache stays until the next joins (to be inspected)
            self.verifier.drop_rows(keep)
        self.rows = [self.rows[i] for i in keep]

    def _set_costs(self) -> None:
        """Give every row the cost curve of a batch of the current size (when it changed)."""
        b = len(self.rows)
        if self.base_cost is None or b == self._cost_rows:
            return
        cost = self.base_cost if b == 1 else BatchCost(self.base_cost, b)
        for row in self.rows:
            row.drafter.set_cost(cost)
        self._cost_rows, self._cost = b, cost

    def _decode(self) -> list[Chunk]:
        """One speculative step of every running row."""
        rows = self.rows
        self._set_costs()
        t0 = time.perf_counter()
        plan = self.policy.plan(len(rows))
        warm = [r.warm for r in rows]
        if plan == ONE:  # one row drafts (the policy measures what one row's draft adds), the warm rows in turn
            turn = [(self._probe + 1 + j) % len(rows) for j in range(len(rows))]
            self._probe = next((i for i in turn if warm[i]), self._probe)
        drafting = [warm[i] and (plan == ALL or (plan == ONE and i == self._probe)) for i in range(len(rows))]
        self.last_drafted = any(drafting)
        drafts: list[Draft] = []
        for row, draft_row in zip(rows, drafting):
            t1 = time.perf_counter()
            if draft_row:
                row.hand_over()
                alone = plan == ONE and self.base_cost is not None
                if alone:  # a probe: the other rows are padded to its tree, so its tree is sized for that
                    row.drafter.set_cost(BatchCost(self.base_cost, len(rows), alone=True))
                remaining = row.stopper.max_new - len(row.stopper.tokens)
                drafts.append(row.drafter.propose(row.root, tree=self.tree, max_depth=remaining - 1,
                                                  generator=None if row.greedy else row.generator))
                if alone:
                    row.drafter.set_cost(self._cost)
            else:  # the batch decodes plainly this step: no drafter runs (each catches up when it next drafts)
                drafts.append(host_draft((row.root,), (-1,)))
            row.stats.draft_s += time.perf_counter() - t1
        t2 = time.perf_counter()
        trees = stack_drafts(drafts, self.verifier.device)
        self.last_sizes = trees.sizes
        out = self.verifier.verify_rows(trees, features=any(warm))
        acc = self._accept(rows, trees, out.logits, drafts)
        t3 = time.perf_counter()  # the acceptance's one read back waited for the verify pass
        self.drafter.observe_verify(len(rows) * trees.num_nodes, t3 - t2)
        self.verifier.commit_rows(acc.paths, [a.node_ids for a in acc.rows], acc.lengths)
        chunks = []
        firsts = out.features[:, 0].unbind(0) if out.features is not None else [None] * len(rows)  # [F, H] views
        for b, (row, a) in enumerate(zip(rows, acc.rows)):
            if drafting[b]:  # its drafter learns what of its draft was accepted now
                feats = out.features[b].index_select(0, a.nodes) if out.features is not None else None
                row.drafter.update(torch.tensor((row.root,) + a.tokens[:-1], dtype=torch.long), feats)
            elif row.warm:  # a plain step commits the root alone, at the tree's first node: held for the drafter
                row.held_tokens.append(row.root)
                row.held_features.append(firsts[b])
                if len(row.held_tokens) >= self.HOLD_STEPS:
                    row.hand_over()
            emitted = row.stopper.feed(list(a.tokens))
            st = row.stats
            n = trees.sizes[b]
            st.verify_s += t3 - t2
            st.verify_steps += 1
            st.tree_nodes += n
            if len(st.nodes_hist) <= n:
                st.nodes_hist.extend([0] * (n + 1 - len(st.nodes_hist)))
            st.nodes_hist[n] += 1
            st.new_tokens += len(emitted)
            k = len(a.tokens)
            if len(st.accepted_hist) <= k:
                st.accepted_hist.extend([0] * (k + 1 - len(st.accepted_hist)))
            st.accepted_hist[k] += 1
            row.root = a.bonus
            chunks.append(self._chunk(row, emitted))
        self.policy.record(len(rows), sum(drafting), sum(len(a.tokens) for a in acc.rows), time.perf_counter() - t0)
        self._leave([r for r in rows if r.stopper.reason])
        return chunks

    def _sample(self, row: _Row, logits: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        """Row ``row``'s sampled token after each of its nodes (``logits [N, V]``, ``depths [N]``
        on the device): ``[N]``, from noise keyed by its seed and the position the token takes."""
        first = row.ids.numel() + len(row.stopper.tokens)  # where the token after the root goes
        u = position_uniforms(row.key, (depths + first).view(1, -1))[0]
        p = row.params  # typical acceptance may run at temperature 0: its first token is then the argmax
        return noise_sample(warp_probs(logits, max(p.temperature, 1e-5), p.top_k, p.top_p), u)

    def _accept(self, rows: list[_Row], trees: TreeBatch, logits: torch.Tensor, drafts: list[Draft]) -> RowsAcceptance:
        """Every row's acceptance. A row's target after each node is the verifier's token there:
        its argmax (greedy), or the token its seeded noise samples (exact sampling of a
        deterministic draft, :meth:`_sample`); a child is accepted when it equals its parent's
        target, so those rows are accepted together by one rule with one read back. A row whose
        draft carries ``q``, or that asks for typical acceptance, is accepted alone."""
        target = logits.argmax(-1)
        alone = [not r.greedy and (r.params.acceptance == "typical" or drafts[b].q is not None) for b, r in enumerate(rows)]
        for b, row in enumerate(rows):
            if not row.greedy and not alone[b]:
                target[b] = self._sample(row, logits[b], trees.depths[b])
        if not any(alone):
            return greedy_accept_rows(trees, target)
        accs = []
        for b, row in enumerate(rows):
            tokens, tree = row_tree(trees, b)
            if not alone[b]:
                accs.append(greedy_accept(tokens, tree, target[b, : tree.num_nodes]))
            elif row.params.acceptance == "typical":
                probs = warp_probs(logits[b, : tree.num_nodes], max(row.params.temperature, 1e-5), row.params.top_k, row.params.top_p)
                accs.append(typical_accept(tokens, tree, probs, generator=row.generator))
            else:
                q = drafts[b].q
                accs.append(sample_accept(tokens, tree, _probs(row.params, logits[b, : tree.num_nodes]), q, row.generator))
        return stack_acceptances(accs, trees.num_nodes, self.verifier.device)


def _probs(params: SamplingParams, logits: torch.Tensor) -> torch.Tensor:
    """A row's sampling distribution after each node (``logits [N, V]``)."""
    return warp_probs(logits, params.temperature, params.top_k, params.top_p)


def generate(verifier, drafter: Drafter | None, input_ids, **kwargs) -> GenerationResult | list[GenerationResult]:
    """Run :func:`stream` to the end; returns the new token ids and the stats (a list of them,
    in prompt order, for a batch).

    Takes the same arguments as :func:`stream`.
    """
    batch = is_batch(input_ids)
    n = len(batch_prompts(input_ids)) if batch else 1
    tokens: list[list[int]] = [[] for _ in range(n)]
    stats = [GenerationStats() for _ in range(n)]
    for chunk in stream(verifier, drafter, input_ids, **kwargs):
        tokens[chunk.index].extend(chunk.token_ids)
        stats[chunk.index] = chunk.stats
    results = [GenerationResult(t, s) for t, s in zip(tokens, stats)]
    return results if batch else results[0]
