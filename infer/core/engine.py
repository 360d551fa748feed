"""The speculative decoding loop: ``generate`` and ``stream``.

Each step: the drafter proposes a tree rooted at the newest token, the verifier scores all of
its nodes in one masked forward pass, an acceptance rule keeps the longest valid path plus the
verifier's own bonus token, and the KV cache is compacted to that path. Greedy output is token
for token the verifier's plain greedy output; sampled output follows the verifier's own sampling
distribution exactly (``acceptance="typical"`` is the documented lossy exception).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field

import torch

from .accept import greedy_accept, sample_accept, typical_accept, warp_probs
from .drafter import Drafter, NoDrafter
from .errors import UserError
from .params import SamplingParams
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
    """Tokens accepted in one step, and the running stats (the same object every step)."""

    token_ids: list[int]
    stats: GenerationStats


def check_prompt_ids(input_ids) -> torch.Tensor:
    """The prompt as a 1-D long tensor on the host, or a :class:`UserError` naming what is
    expected: ``[L]`` or ``[1, L]`` integer token ids (one prompt: batches are not supported yet)."""
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
        raise UserError(f"input_ids must have shape [L] or [1, L] (one prompt; batches are not supported yet), not {list(ids.shape)}")
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


def stream(
    verifier,
    drafter: Drafter | None,
    input_ids,
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    params: SamplingParams | None = None,
    generator: torch.Generator | None = None,
    tree: TreeSpec | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    stop: Sequence[str] | None = None,
    tokenizer=None,
    acceptance: str = "exact",
) -> Iterator[Chunk]:
    """Speculative generation, yielding each step's accepted tokens as a :class:`Chunk`.

    Args:
        verifier: a :class:`~infer.core.verifier.Verifier` or an HF causal LM (batch 1).
        drafter: proposes the trees; ``None`` decodes plainly through the same loop.
        input_ids: ``[L]`` or ``[1, L]`` integer prompt token ids (one prompt).
        max_new_tokens: exact upper bound on new tokens.
        temperature: 0 = greedy; otherwise sample with ``top_p`` / ``top_k`` as HF does.
        seed / generator: randomness for sampling. A ``generator`` on another device than the
            verifier's (a CPU generator with a CUDA verifier) seeds one on the verifier's device
            with a number drawn from it; without either, a fresh local generator is seeded from
            the OS (the global torch generators are never reseeded).
        params: all of ``max_new_tokens`` .. ``seed`` and ``acceptance`` as one
            :class:`~infer.core.params.SamplingParams` (then those arguments are ignored).
        tree: overrides the drafter's tree shape.
        eos_token_id: token id(s) that end generation (included in the output, as in HF).
        stop: a string, or strings, that end generation once the decoded output contains one
            (needs ``tokenizer``); the output ends with the token that completed the stop string.
        acceptance: ``"exact"`` (lossless) or ``"typical"`` (Medusa typical acceptance, lossy).
    """
    if params is None:
        params = SamplingParams(max_new_tokens, temperature, top_p, top_k, seed, acceptance)
    max_new_tokens, temperature, top_p, top_k, seed, acceptance = (
        params.max_new_tokens, params.temperature, params.top_p, params.top_k, params.seed, params.acceptance)
    ids = check_prompt_ids(input_ids)
    drafter = drafter or NoDrafter()
    if not isinstance(verifier, Verifier):
        verifier = Verifier(verifier)
    verifier.feature_layers = tuple(drafter.feature_layers)
    vocab = verifier.vocab_size
    if int(ids.max()) >= vocab or int(ids.min()) < 0:
        raise UserError(f"prompt token ids must be in [0, {vocab}) for this verifier")
    verifier.check_fits(ids.numel() + max_new_tokens)
    stopper = _Stopper(max_new_tokens, eos_token_id, stop, tokenizer)
    greedy = params.greedy
    if not greedy:
        generator = sampling_generator(verifier.device, seed, generator)
    return _loop(verifier, drafter, ids, stopper, greedy, temperature, top_p, top_k, generator, tree, acceptance)


def _same_device(a: torch.device, b: torch.device) -> bool:
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.type == "cuda":  # "cuda" is the current CUDA device
        cur = torch.cuda.current_device()
        return (a.index if a.index is not None else cur) == (b.index if b.index is not None else cur)
    return a.index == b.index or a.index is None or b.index is None


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


def _loop(verifier, drafter, ids, stopper, greedy, temperature, top_p, top_k, generator, tree, acceptance):
    stats = GenerationStats()
    dev = verifier.device
    # the engine times every verify pass; a drafter whose cost curve learns from them gets them
    observe = getattr(getattr(drafter, "cost", None), "observe", None)
    t0 = time.perf_counter()
    out = verifier.prefill(ids)
    drafter.begin(ids, out.features)
    if greedy:
        root = int(out.logits[-1].argmax())
    else:
        probs = warp_probs(out.logits[-1], max(temperature, 1e-5), top_k, top_p)
        root = int(torch.multinomial(probs, 1, generator=generator))
    stats.prefill_s = time.perf_counter() - t0
    t_dec = time.perf_counter()
    emitted = stopper.feed([root])
    stats.new_tokens = len(emitted)
    while True:
        stats.decode_s = time.perf_counter() - t_dec
        stats._finish()  # running values, for live displays
        if stopper.reason:
            stats.finish_reason = stopper.reason
            yield Chunk(emitted, stats)
            return
        yield Chunk(emitted, stats)
        t1 = time.perf_counter()
        remaining = stopper.max_new - len(stopper.tokens)
        draft = drafter.propose(root, tree=tree, max_depth=remaining - 1, generator=None if greedy else generator)
        draft = draft.to(dev)
        n = draft.tree.num_nodes
        t2 = time.perf_counter()
        vout = verifier.verify(draft.tokens, draft.tree)
        if greedy:
            acc = greedy_accept(draft.tokens, draft.tree, vout.logits.argmax(-1))
        elif acceptance == "typical":
            probs = warp_probs(vout.logits, max(temperature, 1e-5), top_k, top_p)
            acc = typical_accept(draft.tokens, draft.tree, probs, generator=generator)
        else:
            probs = warp_probs(vout.logits, temperature, top_k, top_p)
            acc = sample_accept(draft.tokens, draft.tree, probs, draft.q, generator)
        t3 = time.perf_counter()  # the acceptance's one read back waited for the verify pass
        if observe is not None:
            observe(n, t3 - t2)
        verifier.commit(acc.nodes, acc.node_ids)
        feats = vout.features[acc.nodes] if vout.features is not None else None
        drafter.update(torch.tensor((root,) + acc.tokens[:-1], dtype=torch.long), feats)
        chunk = list(acc.tokens)
        emitted = stopper.feed(chunk)
        stats.draft_s += t2 - t1
        stats.verify_s += t3 - t2
        stats.verify_steps += 1
        stats.tree_nodes += n
        if len(stats.nodes_hist) <= n:
            stats.nodes_hist.extend([0] * (n + 1 - len(stats.nodes_hist)))
        stats.nodes_hist[n] += 1
        stats.new_tokens += len(emitted)
        if len(stats.accepted_hist) <= len(chunk):
            stats.accepted_hist.extend([0] * (len(chunk) + 1 - len(stats.accepted_hist)))
        stats.accepted_hist[len(chunk)] += 1
        root = acc.bonus


def generate(verifier, drafter: Drafter | None, input_ids, **kwargs) -> GenerationResult:
    """Run :func:`stream` to the end; returns the new token ids and the stats.

    Takes the same arguments as :func:`stream`.
    """
    tokens: list[int] = []
    stats = GenerationStats()
    for chunk in stream(verifier, drafter, input_ids, **kwargs):
        tokens.extend(chunk.token_ids)
        stats = chunk.stats
    return GenerationResult(tokens, stats)
