"""Self-distillation data: the verifier's own responses to prompts, as token ids with a loss mask.

``distill`` is resumable: records are appended one batch at a time (flushed and synced), a
restarted run skips the ids already written, and a torn last line is dropped, so every record is
written exactly once; the file's first line is a header naming the verifier and the generation
settings (:mod:`train.datafile`), and appending with another verifier or other settings is
refused. Multi-turn prompts (``"turns"``) are played out turn by turn: the verifier
answers the first user turn, its answer stays in the conversation, and so on; the record holds
the whole conversation with the loss mask on every answer.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from infer.core.text import encode_prompt, eos_ids
from infer.tools.prompts import read_prompts
from train.datafile import (  # noqa: F401 - write_header / make_header: prepend a header to older data
    DataError,
    check_output_name,
    check_same_source,
    headerless_message,
    iter_records,
    lock_file,
    make_header,
    repair_tail,
    scan_output,
    scan_prompt_file,
    write_header,
)

#: distill() sorts the prompts by length within runs of this many batches (see length_sorted)
SORT_WINDOW_BATCHES = 8


@dataclass(frozen=True)
class Prompt:
    """A prompt to distil: its first user turn (``text``) and, for conversations, the later ones."""

    id: str
    text: str
    later_turns: tuple[str, ...] = ()


def load_prompts(spec: str, limit: int = 0, seed: int = 0, shuffle: bool = False) -> list[Prompt]:
    """Prompts from a JSONL file (``prompt`` or ``turns``; ``id`` if present), a ``datasets``
    dataset (``hf:NAME[:SPLIT]``, column ``prompt``), or ``synthetic:N`` (N short generated
    prompts, for tiny random verifiers). ``shuffle`` (seeded) before taking the first ``limit``,
    so that any prefix is a mix of the sources."""
    prompts = _load_prompts(spec, seed)
    if shuffle:
        random.Random(seed).shuffle(prompts)
    return prompts[: limit or None]


def _load_prompts(spec: str, seed: int) -> list[Prompt]:
    if spec.startswith("synthetic:"):
        rng = random.Random(seed)
        words = ["alpha", "beta", "gamma", "delta", "one", "two", "three", "red", "green", "blue", "cat", "dog"]
        out = []
        for i in range(int(spec.split(":", 1)[1])):
            seq = " ".join(rng.choice(words) for _ in range(rng.randint(3, 8)))
            out.append(Prompt(f"synthetic-{i}", f"Repeat: {seq} {seq}"))
        return out
    if spec.startswith("hf:"):
        import datasets

        name, _, split = spec[3:].partition(":")
        ds = datasets.load_dataset(name, split=split or "train")
        return [Prompt(str(r.get("id", i)), r["prompt"]) for i, r in enumerate(ds)]
    scan_prompt_file(spec)  # bounded, and no lone surrogates: a DataError naming the line
    return [Prompt(p.id if p.id is not None else str(i), p.text, p.turns[1:]) for i, p in enumerate(read_prompts(spec))]


def _turn_joint(tokenizer, eos_text: str | None) -> callable:
    """``joint(history, user_text, ended) -> ids``: the tokens that follow an assistant answer
    in the chat template up to the next answer (its end-of-turn, the next user turn, the
    generation prompt). ``ended``: the answer already ends with the end-of-turn token."""
    mark = "\u2063SPECHEADS\u2063"

    def joint(history: list[dict], user_text: str, ended: bool) -> list[int]:
        def render(msgs, gen):
            return tokenizer.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)

        before = render([*history, {"role": "assistant", "content": mark}], False)
        after = render([*history, {"role": "assistant", "content": mark}, {"role": "user", "content": user_text}], True)
        if not after.startswith(before):
            raise ValueError("this chat template rewrites earlier turns: multi-turn distillation needs one that appends")
        tail = before[before.index(mark) + len(mark):]
        if ended and eos_text and tail.startswith(eos_text):
            tail = tail[len(eos_text):]
        return tokenizer(tail + after[len(before):], add_special_tokens=False)["input_ids"]

    return joint


def _generate(model, seqs: list[list[int]], pad: int, eos: list[int], max_new_tokens: int, temperature: float,
              generator: torch.Generator | None = None) -> list[list[int]]:
    """The verifier's continuations of ``seqs``, each cut after its first end-of-sequence token:
    one left-padded batch (explicit ``position_ids``), greedy at ``temperature`` 0, else sampled
    from the verifier's distribution at ``temperature`` (no top-k / top-p) with ``generator``.

    A row leaves the batch as soon as it ends (its cache rows dropped through the cache object),
    so a batch costs the sum of its answers' lengths rather than its size times the longest
    answer (``model.generate`` keeps every row to the end). The token ids come to the host once
    a step (one small copy): the rows' bookkeeping is host-side, as in ``generate``.

    seqs: B lists of token ids -> B lists of at most ``max_new_tokens`` new token ids."""
    from transformers import DynamicCache

    from infer.core.verifier import cache_keyword

    device = next(model.parameters()).device
    width = max(len(e) for e in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, e in enumerate(seqs):  # left padding
        ids[i, width - len(e) :] = torch.tensor(e, dtype=torch.long)
        mask[i, width - len(e) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    position = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, width): each row counts from its first token
    cache = DynamicCache(config=model.config)
    uses = {cache_keyword(model): cache}
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position, use_cache=True, logits_to_keep=1,
                   **uses).logits[:, -1]
    rows = list(range(len(seqs)))  # the input row each batch row holds
    nxt_pos = position[:, -1:] + 1  # (B, 1)
    responses: list[list[int]] = [[] for _ in seqs]
    ends = set(eos)
    for step in range(max_new_tokens):
        if temperature > 0:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        else:
            nxt = logits.argmax(dim=-1)
        chosen = nxt.tolist()  # (b,) on the host: the one copy a step
        for r, t in zip(rows, chosen):
            responses[r].append(t)
        keep = [j for j, t in enumerate(chosen) if t not in ends]
        if not keep or step + 1 == max_new_tokens:
            break
        if len(keep) < len(rows):  # drop the ended rows everywhere
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            mask, nxt, nxt_pos = mask[index], nxt[index], nxt_pos[index]
            rows = [rows[j] for j in keep]
        mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=-1)
        logits = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=nxt_pos, use_cache=True,
                       **uses).logits[:, -1]
        nxt_pos = nxt_pos + 1
    return responses


def length_sorted(lengths: list[int], window: int) -> list[int]:
    """An order of ``len(lengths)`` items that sorts each run of ``window`` consecutive items by
    length (shortest first) and keeps the runs in order: batches cut from it hold prompts of
    similar length (little left padding) while any prefix keeps the original mix of sources.

    lengths: N ints -> a permutation of range(N)."""
    order = []
    for start in range(0, len(lengths), max(window, 1)):
        order += sorted(range(start, min(start + max(window, 1), len(lengths))), key=lambda i: lengths[i])
    return order


@torch.inference_mode()
def distill(
    model,
    tokenizer,
    prompts: list[Prompt],
    out_path: str | Path,
    *,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    temperature: float = 0.0,
    seed: int = 0,
    max_prompt_tokens: int = 768,
    max_conversation_tokens: int = 1536,
    progress: bool = True,
    verifier_name: str = "",
    lock: bool = True,
) -> int:
    """Generate the verifier's responses (batched, greedy or sampled) and append records
    ``{"id", "input_ids", "loss_mask"}`` (mask 1 on response tokens) to ``out_path``, whose first
    line is the header (:func:`train.datafile.make_header`; written when the file is new). A
    conversation's later turns are played out while it stays under ``max_conversation_tokens``.
    ``lock``: hold ``out_path``'s exclusive lock while writing (False: the caller holds it).
    A file of another verifier or other settings, one without a header, or a damaged one is a
    :class:`train.datafile.DataError`. Returns the number of records written by this call."""
    out_path = Path(out_path)
    check_output_name(out_path, "distill output")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    header = make_header(model, verifier_name, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                         max_prompt_tokens=max_prompt_tokens, max_conversation_tokens=max_conversation_tokens)
    held = lock_file(out_path) if lock else None
    try:
        scan = scan_output(out_path)
        if scan.header is None and scan.records:
            raise DataError(headerless_message(out_path))
        if scan.header is not None:
            check_same_source(out_path, scan.header, header)
        else:
            write_header(out_path, header)
        return _distill(model, tokenizer, prompts, out_path, scan.done, max_new_tokens=max_new_tokens,
                        batch_size=batch_size, temperature=temperature, seed=seed, max_prompt_tokens=max_prompt_tokens,
                        max_conversation_tokens=max_conversation_tokens, progress=progress)
    except BaseException:  # Ctrl-C or a kill mid-append: no torn last line left behind
        repair_tail(out_path)
        raise
    finally:
        if held is not None:
            held.release()


def _distill(model, tokenizer, prompts, out_path: Path, done: set[str], *, max_new_tokens, batch_size, temperature,
             seed, max_prompt_tokens, max_conversation_tokens, progress) -> int:
    from tqdm.auto import tqdm

    todo = [p for p in prompts if p.id not in done]
    eos = eos_ids(model, tokenizer)
    pad = eos[0] if eos else 0
    eos_text = tokenizer.decode(eos[:1]) if eos else None
    joint = _turn_joint(tokenizer, eos_text) if any(p.later_turns for p in todo) else None
    written = 0
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    firsts = [encode_prompt(tokenizer, p.text)[-max_prompt_tokens:].tolist() for p in todo]
    window = SORT_WINDOW_BATCHES * batch_size
    order = length_sorted([len(e) for e in firsts], window)
    todo, firsts = [todo[i] for i in order], [firsts[i] for i in order]
    # (prompt position, record line) of the window being distilled: a window is written in prompt order, so the
    # file stays a prefix of the prompt list in its order (MANIFEST's "how far" is a prompt count, a source-balanced
    # prompt file stays balanced in every prefix); the cost is that a kill loses the window's finished answers.
    pending: list[tuple[int, str]] = []
    with open(out_path, "a", encoding="utf-8") as f, tqdm(total=len(prompts), initial=len(prompts) - len(todo),
                                                           desc="distill", disable=not progress) as bar:
        for start in range(0, len(todo), batch_size):
            batch = todo[start : start + batch_size]
            seqs = [list(e) for e in firsts[start : start + batch_size]]
            masks = [[0] * len(e) for e in seqs]
            history = [[{"role": "user", "content": p.text}] for p in batch]
            live = list(range(len(batch)))
            for turn in range(1 + max((len(p.later_turns) for p in batch), default=0)):
                responses = _generate(model, [seqs[i] for i in live], pad, eos, max_new_tokens, temperature, generator)
                nxt = []
                for i, resp in zip(live, responses):
                    seqs[i] += resp
                    masks[i] += [1] * len(resp)
                    later = batch[i].later_turns
                    if turn < len(later) and joint is not None:
                        history[i].append({"role": "assistant", "content": tokenizer.decode(resp, skip_special_tokens=True)})
                        ids = joint(history[i][:-1], later[turn], bool(resp) and resp[-1] in eos)
                        if len(seqs[i]) + len(ids) + max_new_tokens <= max_conversation_tokens:
                            history[i].append({"role": "user", "content": later[turn]})
                            seqs[i] += ids
                            masks[i] += [0] * len(ids)
                            nxt.append(i)
                live = nxt
                if not live:
                    break
            pending += [(order[start + j], json.dumps({"id": p.id, "input_ids": e, "loss_mask": m}) + "\n")
                        for j, (p, e, m) in enumerate(zip(batch, seqs, masks))]
            bar.update(len(batch))
            if len(pending) >= window or start + batch_size >= len(todo):  # a window is written in prompt order
                f.write("".join(line for _, line in sorted(pending)))
                f.flush()
                os.fsync(f.fileno())
                written += len(pending)
                pending = []
    return written


@dataclass
class Record:
    input_ids: list[int]
    loss_mask: list[int]
    source: str = field(default="", compare=False)  # its id's prefix ("dolly" of "dolly-12"); not in key()

    def key(self) -> str:
        """A content hash of the token ids and the loss mask (24 hex digits): the record's name in
        the feature cache and in the held-out split, so both survive data that grows or is
        reordered."""
        h = hashlib.sha256(",".join(map(str, self.input_ids)).encode())
        h.update(bytes(1 if m else 0 for m in self.loss_mask))
        return h.hexdigest()[:24]


def record_source(record_id) -> str:
    """The prompt source a distilled record's id names: the part before its first ``-``
    (``"xquad_en_qa-5726"`` -> ``"xquad_en_qa"``); ``""`` for an id without one."""
    head, dash, _ = ("" if record_id is None else str(record_id)).partition("-")
    return head if dash else ""


def load_records(path: str | Path, max_seq_len: int) -> list[Record]:
    """Distilled records, truncated to ``max_seq_len``; records without response tokens dropped.
    ``path``: a ``.jsonl``, ``.jsonl.gz`` or ``.jsonl.xz`` file, or a directory of such parts
    (read in name order); header records are skipped (:func:`train.datafile.check_data_source`
    checks them). Reads at most :data:`train.datafile.MAX_DATA_BYTES`."""
    out = []
    for part, no, r in iter_records(path):
        try:
            rec = Record(r["input_ids"][:max_seq_len], r["loss_mask"][:max_seq_len], record_source(r.get("id")))
            if not all(isinstance(t, int) for t in rec.input_ids) or len(rec.input_ids) != len(rec.loss_mask):
                raise TypeError
            masked = sum(rec.loss_mask)
        except (KeyError, TypeError):
            raise DataError(f"{part}:{no}: not a distilled record (needs input_ids and loss_mask)") from None
        if masked >= 2:
            out.append(rec)
    return out


def split_records(records: list[Record], eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic train / held-out split of record indices, decided per record by a hash of
    ``seed`` and its content (:meth:`Record.key`): a record keeps its side when data is appended
    or reordered (a head trained on one version of the data is evaluated on records it never saw
    in the next), and identical records fall on the same side. About ``eval_fraction`` of the
    records are held out; at least one, and never all, when ``eval_fraction > 0`` and there are
    two or more."""
    if eval_fraction <= 0 or len(records) < 2:
        return list(range(len(records))), []

    def score(r: Record) -> float:
        return int(hashlib.sha256(f"{seed}:{r.key()}".encode()).hexdigest()[:13], 16) / 16**13

    scores = [score(r) for r in records]
    held = [i for i, s in enumerate(scores) if s < eval_fraction]
    if not held:
        held = [min(range(len(records)), key=scores.__getitem__)]
    if len(held) == len(records):
        held.remove(max(held, key=scores.__getitem__))
    held_set = set(held)
    return [i for i in range(len(records)) if i not in held_set], sorted(held)


def records_by_source(order: list[int], records) -> dict[str, list[int]]:
    """The indices of ``order`` grouped by their record's prompt source (``Record.source``), each
    group in ``order``'s order, sources sorted by name."""
    groups: dict[str, list[int]] = {}
    for i in order:
        groups.setdefault(records[i].source, []).append(i)
    return dict(sorted(groups.items()))


def source_weighted(train_idx: list[int], records: list[Record], weights: dict[str, float], generator) -> list[int]:
    """One epoch's training records before shuffling, each prompt source (:attr:`Record.source`)
    weighed by ``weights`` (a source not named: 1). A source of ``n`` training records and weight
    ``w`` gives ``round(w * n)`` entries: every record ``floor(w)`` times, then the first of a fresh
    random order of them for the rest (2.5: each record twice, a random half three times; 0.5: a
    random half once; 0: none), so an epoch always has the same size and over epochs each record
    of the source is seen ``w`` times on average. ``weights`` empty: ``train_idx`` itself, and
    ``generator`` is not used (the run is the unweighted one).
    train_idx: [n] record indices; generator: a seeded ``torch.Generator``. Returns [m] indices."""
    if not weights:
        return list(train_idx)
    out: list[int] = []
    for source, idx in records_by_source(train_idx, records).items():
        w = float(weights.get(source, 1.0))
        whole, rest = int(w), round(w * len(idx)) - int(w) * len(idx)
        out += idx * whole
        if rest > 0:
            out += [idx[j] for j in torch.randperm(len(idx), generator=generator)[:rest].tolist()]
    return out


def check_source_weights(weights: dict[str, float], sources: set[str]) -> None:
    """Every source ``weights`` names is one the training records come from (a misspelt source
    would silently weigh nothing); raises ValueError naming the sources there are."""
    unknown = sorted(set(weights) - sources)
    if unknown:
        there = ", ".join(repr(s) for s in sorted(sources)) or "none"
        raise ValueError(f"source_weights names {', '.join(repr(s) for s in unknown)}, which no training record comes "
                         f"from (the sources, the prefix of each record's id: {there})")


@dataclass
class Batch:
    """A right-padded batch. ``input_ids``, ``attention_mask``, ``loss_mask``: ``[B, T]``;
    ``index``: ``[B]`` record indices (for the feature cache)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    index: torch.Tensor

    def to(self, device) -> Batch:
        return Batch(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.loss_mask, self.index)))


def collate(records: list[Record], indices: list[int]) -> Batch:
    width = max(len(records[i].input_ids) for i in indices)
    b = len(indices)
    ids = torch.zeros(b, width, dtype=torch.long)
    att = torch.zeros(b, width, dtype=torch.long)
    lm = torch.zeros(b, width, dtype=torch.long)
    for row, i in enumerate(indices):
        r = records[i]
        n = len(r.input_ids)
        ids[row, :n] = torch.tensor(r.input_ids)
        att[row, :n] = 1
        lm[row, :n] = torch.tensor(r.loss_mask)
    return Batch(ids, att, lm, torch.tensor(indices))


def response_token_counts(records: list[Record], vocab_size: int) -> torch.Tensor:
    """How often each token appears in the responses ``[V]`` (for EAGLE-3's draft vocabulary)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for r in records:
        toks = torch.tensor([t for t, m in zip(r.input_ids, r.loss_mask) if m], dtype=torch.long)
        counts += torch.bincount(toks, minlength=vocab_size)[:vocab_size]
    return counts
