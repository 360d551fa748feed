"""The speculative decoding loop: ``generate`` and ``stream``, for one prompt or a batch, and the
continuous-batching :class:`Engine` under both (and under ``specheads serve``).

Each step: the schedule gives every row a budget, the drafter proposes a tree for each drafting
row (rooted at its newest token) in one call, the verifier scores all rows' nodes in one masked
forward pass, an acceptance rule keeps each row's longest valid path plus the verifier's own
bonus token, and the KV cache keeps exactly those paths. Rows join at a
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
    greedy_rows,
    noise_sample,
    position_uniforms,
    q_rows,
    read_back_rows,
    row_uniforms,
    rows_of,
    seed_tensor,
    typical_rows,
    warp_probs,
)
from .batch import TreeBatch, prefill_groups, stack_drafts
from .drafter import Accepted, Draft, Drafter, NoDrafter, Request, RowStart, host_draft
from .errors import UserError
from .params import MAX_SEED, SamplingParams
from .schedule import Gate, RowView, Schedule, SpecPolicy, StepRecord, probe_cost
from .static import check_compile, static_for
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
    step_path: str = "eager"  # the verify step that ran: eager, static or compiled (--compile)
    warmup_s: float = 0.0  # the compiled step's warm-up (compilation), paid once per engine

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
    eos_token_id: int | Sequence[int] | None = None,
    stop: Sequence[str] | None = None,
    tokenizer=None,
    max_batch: int = 64,
    budget="fixed",
    compile: str = "off",
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
        eos_token_id: token id(s) that end generation (included in the output, as in HF).
        stop: a string, or strings, that end generation once the decoded output contains one
            (needs ``tokenizer``); the output ends with the token that completed the stop string.
        max_batch: rows decoded at once; a longer batch waits and joins as rows end.
        budget: how drafts are sized (:class:`Engine`): ``"fixed"`` (default), ``"auto"`` (probe the
            verifier first, then learn) or a cost curve. An application that generates again and
            again keeps one :class:`Engine` (or a :class:`~infer.speculator.Speculator`), so that
            what it learns persists.
        compile: the verify step (:class:`Engine`): ``"off"`` (default: eager), ``"on"`` (static
            shapes, compiled) or ``"auto"`` (compiled on CUDA, and on a CPU where a stored
            measurement found it faster, :func:`~infer.core.static.resolve_compile`).
    """
    given = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                 acceptance=acceptance)
    engine = Engine(verifier, drafter, max_rows=max_batch, budget=budget, compile=compile)
    queue(engine, input_ids, params, generator=generator, eos_token_id=eos_token_id, stop=stop, tokenizer=tokenizer, **given)
    return engine.run()


def queue(engine: Engine, input_ids, params=None, *, generator=None, eos_token_id=None, stop=None, tokenizer=None,
          **given) -> list[int]:
    """Queue one prompt or a batch on ``engine`` as :func:`stream` takes them (``given``: its
    sampling keyword arguments, those not ``_UNSET``); the rows' indices, in prompt order."""
    if not is_batch(input_ids):
        if isinstance(params, (list, tuple)):
            raise UserError("one prompt takes one SamplingParams, not a list")
        return [engine.add(input_ids, sampling_params(params, **given), eos_token_id=eos_token_id, stop=stop,
                           tokenizer=tokenizer, generator=generator)]
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
    indices = []
    for i, (ids, p) in enumerate(zip(prompts, per_row)):
        if p.seed is not None and not p.greedy:
            p = SamplingParams(p.max_new_tokens, p.temperature, p.top_p, p.top_k, (p.seed + i) % (MAX_SEED + 1), p.acceptance)
        row_gen = None
        if generator is not None:
            row_gen = torch.Generator(device=generator.device).manual_seed(
                int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device).item()))
        indices.append(engine.add(ids, p, eos_token_id=eos_token_id, stop=stop, tokenizer=tokenizer, generator=row_gen))
    return indices


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
    """One generation in the batch: its stop rule, randomness, gate and running stats."""

    index: int  # its slot: the Chunk.index of its output, and the drafter's name for it
    ids: torch.Tensor
    stopper: _Stopper
    params: SamplingParams
    generator: torch.Generator | None  # for drafts that carry q, and typical acceptance
    seed: int = 0  # keys the row's sampling noise (with the position)
    key: torch.Tensor | None = None  # ``seed`` as a ``[1]`` int64 tensor on the device (copied there once)
    gate: Gate = field(default_factory=Gate)
    stats: GenerationStats = field(default_factory=GenerationStats)
    root: int = 0
    t_decode: float = 0.0
    cancelled: bool = False
    held_tokens: list[int] = field(default_factory=list)  # committed in plain steps, not yet given to the drafter
    held_features: list = field(default_factory=list)  # their verifier features, ``[F, H]`` each (or None)
    warm: bool = True  # prefilled with the drafter's features and begun by it; a cold row never drafts
    drafted: bool = False  # whether it has drafted yet (its first draft feeds the drafter its prompt)

    def hand_over(self) -> Accepted | None:
        """What plain steps committed since the drafter last saw this row (None: nothing)."""
        if not self.held_tokens:
            return None
        feats = torch.stack(self.held_features) if self.held_features[0] is not None else None
        out = Accepted(self.index, torch.tensor(self.held_tokens, dtype=torch.long), feats)
        self.held_tokens, self.held_features = [], []
        return out

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    @property
    def left(self) -> int:
        """Tokens it may still emit."""
        return self.stopper.max_new - len(self.stopper.tokens)


@dataclass
class StepReport:
    """What one :meth:`Engine.step` did: its chunks, and for metrics its ``kind`` (``"join"``:
    queued rows were prefilled; ``"decode"``: the running rows took a speculative step;
    ``"idle"``), the rows it ran, their tree sizes and how many drafted."""

    chunks: list[Chunk]
    kind: str = "idle"
    rows: int = 0
    sizes: tuple[int, ...] = ()
    drafted: int = 0


def schedule_for(verifier: Verifier, budget, policy=None) -> Schedule:
    """The schedule of an engine: ``budget`` ``"fixed"`` (drafts keep their size), ``"auto"``
    (the verifier's cost curve probed now, then learnt step by step) or a cost curve."""
    if isinstance(budget, str):
        if budget not in ("auto", "fixed"):
            raise UserError(f"budget must be 'auto' or 'fixed', not {budget!r}")
        cost = probe_cost(verifier) if budget == "auto" else None
    else:
        cost = budget
    return Schedule(cost, policy)


class Engine:
    """Speculative decoding of many generations at once, with continuous batching.

    :meth:`add` queues a generation; :meth:`step` runs one pass: the queued generations join
    (their prompts prefilled in left-padded passes, one per group of like lengths, their first
    tokens returned), or, when none waits, every running row is drafted, verified in one masked
    pass and accepted; rows that end (eos, a stop string, their token limit, :meth:`cancel`)
    leave the batch. One engine owns its verifier's KV cache: drive it from one thread. Keep
    one for as long as the application generates: its :class:`~infer.core.schedule.Schedule`
    learns the costs as it goes.

    The engine owns scheduling (:class:`~infer.core.schedule.Schedule`); the drafter proposes for
    all the drafting rows of a step in one call, each within the budget it is given, and is told
    what was accepted (:mod:`infer.core.drafter`). Budgets price a draft by the verify cost of a
    batch of the current size (trees shrink as the batch grows) plus the drafter's own measured
    cost, and a batch drafts only while drafting has measured faster than plain decoding at its
    size (:class:`~infer.core.schedule.SpecPolicy`). Rows that join where the policy keeps more
    coming steps plain than they can live are *cold*: prefilled without the drafter's features,
    never begun by it, they decode plainly to their end.

    Args:
        verifier: a :class:`~infer.core.verifier.Verifier` or an HF causal LM.
        drafter: the drafter (``None``: plain decoding through the same loop).
        max_rows: rows decoded at once; more wait in the queue.
        budget: ``"fixed"`` (drafts keep their tree's size; no timing), ``"auto"`` (the verifier's
            cost curve probed at construction, then learnt from every step, and the drafter's own
            cost measured) or a cost curve (:class:`~infer.core.schedule.VerifyCost`, or an
            :class:`~infer.core.schedule.OnlineCost` that learns).
        policy: whether a batched step drafts at all (default: measured,
            :class:`~infer.core.schedule.SpecPolicy`, where the budget times the verifier; else
            every row drafts); any object with its ``plan``, ``record`` and ``quiet_steps`` methods.
        compile: ``"off"`` (the eager step), ``"on"`` (a static-shape step, compiled and warmed up
            here: :mod:`infer.core.static`) or ``"auto"`` (:func:`~infer.core.static.resolve_compile`).
        join_wait: steps that queued generations may wait, with a row free, for a running row
            that reaches its token limit within them, so that they join in one prefill pass (a
            pass streams all the weights whatever its rows, so two prompts cost far less than two
            passes of one); 0: join at the next step.
    """

    #: what a prefill pass costs beyond its padded token slots, in token slots: joining prompts of
    #: unlike lengths are prefilled in separate passes where that saves more (:func:`prefill_groups`)
    PREFILL_PASS_TOKENS = 64
    #: plain steps whose committed tokens a row holds before the drafter is told them all at once
    #: (sooner when the row drafts): an update per row and step costs a batched plain step about
    #: 1% at 16 rows, for work only a drafting step needs
    HOLD_STEPS = 32

    def __init__(self, verifier, drafter: Drafter | None = None, *, max_rows: int = 64, budget="fixed",
                 policy: SpecPolicy | None = None, join_wait: int = 4, compile: str = "off"):
        if not isinstance(max_rows, int) or isinstance(max_rows, bool) or max_rows < 1:
            raise UserError(f"max_batch must be a positive integer, not {max_rows!r}")
        if not isinstance(join_wait, int) or isinstance(join_wait, bool) or join_wait < 0:
            raise UserError(f"join_wait must be a non-negative integer, not {join_wait!r}")
        check_compile(compile)
        self.join_wait = join_wait
        self._waited = 0  # steps the queued generations have waited for a row about to end
        self.drafter = drafter or NoDrafter()
        self.verifier = verifier if isinstance(verifier, Verifier) else Verifier(verifier)
        self.verifier.feature_layers = tuple(self.drafter.feature_layers)
        self.verifier = static_for(self.verifier, compile, max_rows)  # compiled and warmed up before the probe
        self.schedule = schedule_for(self.verifier, budget, policy)  # probes after dropping what was left
        self.verifier.drop_rows([])  # whatever an unfinished earlier generation left behind
        self.max_rows = max_rows
        self.rows: list[_Row] = []
        self.pending: list[_Row] = []
        self._admitted_last = False
        self._admitting = 0  # rows taken from the queue and being prefilled (in neither list)
        self._next = 0
        if budget == "auto" and self.schedule.cost is not None and not isinstance(self.drafter, NoDrafter):
            self._probe_drafter()

    def _probe_drafter(self, prompt_tokens: int = 32, new_tokens: int = 24) -> None:
        """The drafter's own cost, measured before the first generation joins, as the verifier's
        was (:func:`schedule_for`): a greedy generation of a seeded random prompt through this
        engine, drafting a node every step (``Schedule.measuring``: no gate, no refusal) until that
        cost and a plain step's seconds are known, so that a drafter too costly to pay (a draft model as costly as the
        verifier) is refused from the first real step on and never runs a real prompt. Its row is
        gone after, and the callers' generations are numbered from 0."""
        g = torch.Generator().manual_seed(0)
        self.schedule.measuring = True
        try:
            index = self.add(torch.randint(0, self.verifier.vocab_size, (prompt_tokens,), generator=g),
                             SamplingParams(max_new_tokens=new_tokens))
            while self.busy and (self.schedule.draft.seconds_per_node is None or not self.schedule.timed):
                self.step()
            self.cancel(index)
            while self.busy:
                self.step()
        finally:
            self.schedule.measuring = False
        self._next = 0

    @property
    def policy(self):
        """The batch's draft-or-plain policy (the schedule's)."""
        return self.schedule.policy

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
        key = None if params.greedy else seed_tensor([seed], self.verifier.device)
        row = _Row(self._next, ids, stopper, params, gen, seed, key)
        row.stats.step_path, row.stats.warmup_s = self.verifier.path.name, self.verifier.path.warmup_s
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
        self.drafter.end([r.index for r in self.rows if r.warm])
        self.rows, self.pending = [], []
        self.verifier.drop_rows([])

    @property
    def busy(self) -> bool:
        """Whether any generation is running or queued."""
        return bool(self.rows or self.pending or self._admitting)

    def run(self) -> Iterator[Chunk]:
        """:meth:`step` until every generation has ended, yielding the chunks."""
        while self.busy:
            yield from self.step().chunks

    # ---- one step ------------------------------------------------------------------------------

    def step(self) -> StepReport:
        """One pass: the queued generations join (when there is room, not twice in a row while
        rows are running, and not while a running row ends within the steps left of
        ``join_wait``), else every running row takes one speculative step."""
        joins = self.joins_next
        self._leave([r for r in self.rows if r.cancelled])
        room = self.max_rows - len(self.rows)
        if joins:
            self._admitted_last, self._waited = True, 0
            chunks = self._admit(self.pending[:room])
            return StepReport(chunks, "join", len(chunks))
        self._admitted_last = False
        if self.pending and room > 0:
            self._waited += 1
        return self._decode() if self.rows else StepReport([])

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
        return left > 0 and any(r.left <= left for r in rows)

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
        if not self.rows:
            self.verifier.drop_rows([])  # what the last generation left
        t0 = time.perf_counter()
        # prompts of unlike lengths in passes of their own (less padding); the batch's rows in pass order
        groups = [[rows[i] for i in g] for g in prefill_groups([int(r.ids.numel()) for r in rows], self.PREFILL_PASS_TOKENS)]
        rows = [r for group in groups for r in group]
        quiet = self.schedule.quiet_steps(len(self.rows) + len(rows), max(r.stopper.max_new for r in rows) - 1)
        outs = []
        for group in groups:  # a pass whose rows all end before the batch would let them draft: cold
            warm = any(r.stopper.max_new - 1 > quiet for r in group)
            for r in group:
                r.warm = warm
            outs += self.verifier.add_rows([r.ids for r in group], features=warm)
        self.drafter.begin([RowStart(r.index, r.ids, out.features, r.params) for r, out in zip(rows, outs) if r.warm])
        firsts = []
        for row, out in zip(rows, outs):
            row.gate = self.schedule.gate(not row.greedy)
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
        """These rows leave the batch (their cache rows are dropped, the drafter told)."""
        if not rows:
            return
        gone = {id(r) for r in rows}
        keep = [i for i, r in enumerate(self.rows) if id(r) not in gone]
        if keep or self.pending:  # the last generation's cache stays until the next joins (to be inspected)
            self.verifier.drop_rows(keep)
        self.drafter.end([r.index for r in rows if r.warm])
        for r in rows:
            self.schedule.retire(r.gate, not r.greedy)
        self.rows = [self.rows[i] for i in keep]

    def _propose(self, rows: list[_Row], budgets: list) -> tuple[list[Draft], float]:
        """Every row's draft (just the root where its budget is None), with one drafter call for
        the drafting rows (each told first what plain steps committed); the call's seconds."""
        handed = [a for r, b in zip(rows, budgets) if b is not None for a in [r.hand_over()] if a is not None]
        if handed:
            self.drafter.update(handed)
        requests = [Request(r.index, r.root, b, None if r.greedy else r.generator) for r, b in zip(rows, budgets) if b is not None]
        t0 = time.perf_counter()
        proposed = iter(self.drafter.propose(requests) if requests else [])
        seconds = time.perf_counter() - t0
        drafts = [next(proposed) if b is not None else host_draft((r.root,), (-1,)) for r, b in zip(rows, budgets)]
        return drafts, seconds

    def _decode(self) -> StepReport:
        """One speculative step of every running row."""
        rows = self.rows
        t0 = time.perf_counter()
        budgets = self.schedule.plan([RowView(r.warm, r.left - 1, r.gate) for r in rows])
        drafting = [b is not None for b in budgets]
        drafts, draft_s = self._propose(rows, budgets)
        t2 = time.perf_counter()
        trees = stack_drafts(drafts, self.verifier.device)
        out = self.verifier.verify_rows(trees, features=any(r.warm for r in rows))
        acc = self._accept(rows, trees, out.logits, drafts)
        t3 = time.perf_counter()  # the acceptance's one read back waited for the verify pass
        self.verifier.commit_rows(acc.paths, [a.node_ids for a in acc.rows], acc.lengths)
        self._tell(rows, drafting, acc, out.features)
        share = draft_s / max(sum(drafting), 1)  # each drafting row's share of the one proposal
        chunks = []
        for b, (row, a) in enumerate(zip(rows, acc.rows)):
            if drafting[b]:
                self.schedule.judge(row.gate, trees.sizes[b], len(a.tokens) - 1, share)
            self._count(row, trees.sizes[b], len(a.tokens), share if drafting[b] else 0.0, t3 - t2)
            emitted = row.stopper.feed(list(a.tokens))
            row.stats.new_tokens += len(emitted)
            row.root = a.bonus
            chunks.append(self._chunk(row, emitted))
        # a row's first draft also feeds the drafter its whole prompt: not what drafting a node costs
        first = any(d and not r.drafted for r, d in zip(rows, drafting))
        drafted_nodes = 0 if first else sum(n - 1 for n, d in zip(trees.sizes, drafting) if d)
        self.schedule.record(StepRecord(len(rows), sum(drafting), sum(len(a.tokens) for a in acc.rows),
                                        time.perf_counter() - t0, len(rows) * trees.num_nodes, t3 - t2,
                                        drafted_nodes, 0.0 if first else draft_s))
        for r, d in zip(rows, drafting):
            r.drafted = r.drafted or d
        self._leave([r for r in rows if r.stopper.reason])
        return StepReport(chunks, "decode", len(rows), trees.sizes, sum(drafting))

    def _tell(self, rows: list[_Row], drafting: list[bool], acc: RowsAcceptance, features) -> None:
        """The drafter learns what the drafting rows committed (one update); a plain step commits a
        warm row's root alone, at its tree's first node: held for the drafter."""
        if isinstance(self.drafter, NoDrafter):  # nothing to learn
            return
        told = []
        firsts = features[:, 0].unbind(0) if features is not None else [None] * len(rows)  # [F, H] views
        for b, (row, a) in enumerate(zip(rows, acc.rows)):
            if drafting[b]:  # the committed tokens as a host tensor (a drafter may read it back for free)
                feats = features[b].index_select(0, a.nodes) if features is not None else None
                told.append(Accepted(row.index, torch.tensor((row.root,) + a.tokens[:-1], dtype=torch.long), feats))
            elif row.warm:
                row.held_tokens.append(row.root)
                row.held_features.append(firsts[b])
                if len(row.held_tokens) >= self.HOLD_STEPS:
                    told.append(row.hand_over())
        if told:
            self.drafter.update(told)

    @staticmethod
    def _count(row: _Row, nodes: int, accepted: int, draft_s: float, verify_s: float) -> None:
        """A decode step in the row's stats: ``nodes`` verified, ``accepted`` tokens emitted."""
        st = row.stats
        st.draft_s += draft_s
        st.verify_s += verify_s
        st.verify_steps += 1
        st.tree_nodes += nodes
        if len(st.nodes_hist) <= nodes:
            st.nodes_hist.extend([0] * (nodes + 1 - len(st.nodes_hist)))
        st.nodes_hist[nodes] += 1
        if len(st.accepted_hist) <= accepted:
            st.accepted_hist.extend([0] * (accepted + 1 - len(st.accepted_hist)))
        st.accepted_hist[accepted] += 1

    def _sample(self, row: _Row, logits: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        """Row ``row``'s sampled token after each of its nodes (``logits [N, V]``, ``depths [N]``
        on the device): ``[N]``, from noise keyed by its seed and the position the token takes."""
        first = row.ids.numel() + len(row.stopper.tokens)  # where the token after the root goes
        u = position_uniforms(row.key, (depths + first).view(1, -1))[0]
        p = row.params  # typical acceptance may run at temperature 0: its first token is then the argmax
        return noise_sample(warp_probs(logits, max(p.temperature, 1e-5), p.top_k, p.top_p), u)

    def _accept(self, rows: list[_Row], trees: TreeBatch, logits: torch.Tensor, drafts: list[Draft]) -> RowsAcceptance:
        """Every row's acceptance, with one read back for the batch. A row's target after each node
        is the verifier's token there: its argmax (greedy), or the token its seeded noise samples
        (exact sampling of a deterministic draft, :meth:`_sample`); a child is accepted when it
        equals its parent's target. Rows whose draft carries ``q`` (tree rejection sampling) and
        rows that ask for typical acceptance take their own rule, batched too, on noise keyed by
        their seed (:func:`~infer.core.accept.row_uniforms`)."""
        target = logits.argmax(-1)
        typical = [b for b, r in enumerate(rows) if not r.greedy and r.params.acceptance == "typical"]
        with_q = [b for b, r in enumerate(rows) if not r.greedy and b not in typical and drafts[b].q is not None]
        for b, row in enumerate(rows):
            if not row.greedy and b not in typical and b not in with_q:
                target[b] = self._sample(row, logits[b], trees.depths[b])
        end, bonus = greedy_rows(trees, target)
        for group, rule in ((typical, self._typical), (with_q, self._with_q)):
            if group:
                end_g, bonus_g = rule([rows[b] for b in group], rows_of(trees, group), torch.stack([logits[b] for b in group]))
                for i, b in enumerate(group):  # device copies into the batch's results: nothing read
                    end[b], bonus[b] = end_g[i], bonus_g[i]
        return read_back_rows(trees, end, bonus)

    def _noise(self, rows: list[_Row], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The acceptance uniforms of ``rows`` this step: ``[R, n]`` per node and ``[R]`` for the bonus."""
        first = [r.ids.numel() + len(r.stopper.tokens) for r in rows]
        return row_uniforms(torch.cat([r.key for r in rows]), first, n)

    def _typical(self, rows: list[_Row], trees: TreeBatch, logits: torch.Tensor):
        probs = torch.stack([warp_probs(lg, max(r.params.temperature, 1e-5), r.params.top_k, r.params.top_p)
                             for r, lg in zip(rows, logits)])
        return typical_rows(trees, probs, self._noise(rows, trees.num_nodes)[1])

    def _with_q(self, rows: list[_Row], trees: TreeBatch, logits: torch.Tensor):
        p = torch.stack([warp_probs(lg, r.params.temperature, r.params.top_k, r.params.top_p) for r, lg in zip(rows, logits)])
        u, u_bonus = self._noise(rows, trees.num_nodes)
        return q_rows(trees, p, trees.q.to(p.dtype), u, u_bonus)


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
