"""Whether drafting pays: a per-generation gate on measured gains, and host-side acceptance counts."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Gate:
    """Whether drafting pays, per generation: an exponential moving average of each drafted
    step's gain (tokens it emitted over its cost in single-token verify passes, drafting
    included; 1.0 = as fast as not drafting). Below 1, drafting pauses for ``backoff`` steps and
    then probes once; every failed probe doubles the pause (up to ``max_backoff``: a head that
    never pays, e.g. when sampling from a broad distribution, costs one probe per 65 steps), a
    probe that pays resumes drafting. A sampled generation starts from the last one's gate
    (:class:`Gates`). Kept on the host from host-known counts: it reads nothing."""

    ema: float
    backoff: int = 1
    skip: int = 0
    max_backoff: int = 64
    alpha: float = 0.3
    paused: int = 0  # steps it paused drafting for (this generation)

    @classmethod
    def new(cls, device=None, start: float = 1.2) -> Gate:
        return cls(float(start))

    def should_draft(self) -> bool:
        if self.skip > 0:
            self.skip -= 1
            self.paused += 1
            return False
        return True

    def record(self, gain: float) -> None:
        """One drafted step's ``gain`` (a float; a 0-dim tensor is read): a probe after a pause
        counts on its own."""
        gain = float(gain)
        self.ema = gain if self.backoff > 1 else (1 - self.alpha) * self.ema + self.alpha * gain
        if self.ema > 1.0:
            self.backoff, self.skip = 1, 0
        else:
            self.skip = self.backoff
            self.backoff = min(2 * self.backoff, self.max_backoff)

    def carried(self) -> Gate:
        """The gate the next sampled generation starts from (:class:`Gates`): one still
        drafting where this one ended drafting; else one paused for half of this one's next pause,
        then probing (a head's value for one kind of generation seldom changes from one prompt to
        the next: at temperature 1.0, where it rarely pays, a fresh gate drafted ~10 of 256 steps
        to learn it again). Halving forgets: generations too short to probe shorten the pause."""
        if self.ema > 1.0:
            return Gate(self.ema)
        pause = max(1, self.backoff // 2)
        return Gate(self.ema, backoff=pause, skip=pause)

    def record_draft(self, accepted: int, nodes: int, seconds: float, cost) -> None:
        """One drafted step: ``accepted`` tokens of a ``nodes``-node draft that took ``seconds`` to
        draft, against ``cost`` (an online cost with ``seconds_per_token``)."""
        self.record((1.0 + accepted) / (cost(nodes) + seconds / cost.seconds_per_token))


class Gates:
    """A drafter's gates, one per kind of generation (``sampled`` or not), and ``current``, the one
    of the generation under way. At every :meth:`begin` the sampled gate is carried over
    (:meth:`Gate.carried`; at every generation, greedy ones too, so a pause not probed halves with
    each), as at a temperature where a head seldom pays it seldom pays on any prompt; greedy ones
    start fresh, as greedy acceptance depends on the prompt (code and copied text against free
    writing) and a pause carried over would hold the head back where it pays."""

    def __init__(self) -> None:
        self._by_kind: dict[bool, Gate] = {}
        self.current = Gate.new()

    def begin(self) -> None:
        """A new generation: its kind is not known until :meth:`select`."""
        self._by_kind = {True: self._by_kind[True].carried()} if True in self._by_kind else {}
        self.current = Gate.new()

    def select(self, sampled: bool) -> Gate:
        """Make the gate of this kind of generation ``current`` (a fresh one the first time)."""
        gate = self._by_kind.get(sampled)
        if gate is None:
            gate = self._by_kind[sampled] = Gate.new()
        self.current = gate
        return gate


def accepted_on_host(tokens: tuple[int, ...], parents: tuple[int, ...], committed: list[int]) -> int:
    """How many nodes of a draft (its host form: ``tokens``, ``parents``; node 0 the root) the
    ``committed`` tokens (its root, then what was accepted, by this draft or another drafter's)
    follow: no device read."""
    children = {(p, tok): i for i, (p, tok) in enumerate(zip(parents, tokens))}
    node, accepted = 0, 0
    for tok in committed[1:]:
        node = children.get((node, tok))
        if node is None:
            break
        accepted += 1
    return accepted
