"""Text in, text out: prompts through the tokenizer's chat template, outputs decoded."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .engine import GenerationStats, generate
from .errors import UserError


def check_text(text: str, what: str = "the prompt") -> None:
    """A :class:`UserError` when ``text`` is not valid Unicode text (a lone surrogate such as
    ``"\\ud800"``, which JSON and Python strings can hold but no tokenizer can encode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start:e.start + 1].encode("unicode_escape").decode()
        raise UserError(f"{what} holds {bad} at character {e.start}, a lone surrogate that is not valid "
                        "Unicode text: remove it or encode the text as UTF-8") from None


def encode_prompt(tokenizer, prompt: str, *, chat: bool | None = None) -> torch.Tensor:
    """Token ids ``[L]`` of ``prompt``: as a single user turn through the chat template when
    ``chat`` (default: when the tokenizer has a template), else the raw text."""
    if not prompt or not prompt.strip():
        raise UserError("the prompt is empty: give some text")
    check_text(prompt)
    if chat is None:
        chat = getattr(tokenizer, "chat_template", None) is not None
    if chat:
        if getattr(tokenizer, "chat_template", None) is None:
            raise UserError("this tokenizer has no chat template: use --no-chat")
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
    else:
        ids = tokenizer(prompt)["input_ids"]
    return torch.tensor(ids, dtype=torch.long).reshape(-1)


def eos_ids(model, tokenizer) -> list[int]:
    """End-of-sequence ids: the model's generation config, else the tokenizer's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


class StreamDecoder:
    """Incremental detokenization for streaming: :meth:`push` takes each step's new token ids
    and returns the text they complete, decoding only a short window (the previous piece's
    tokens and the new ones), never the whole output again. A character split across tokens
    (a multi-byte UTF-8 sequence) waits for the token that completes it; :meth:`flush` returns
    what is left at the end. The pieces joined are the full text as ``tokenizer.decode`` writes
    it (special tokens skipped), also where a tokenizer's decoding of a token depends on the
    one before (a leading space), because every window starts one piece back."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # the window starts here: the first token of the last piece
        self._read = 0  # tokens up to here have been returned as text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def push(self, token_ids) -> str:
        """Append ``token_ids``; the new complete text (possibly empty)."""
        self.ids.extend(int(t) for t in token_ids)
        before = self._decode(self.ids[self._prefix:self._read])
        text = self._decode(self.ids[self._prefix:])
        if len(text) <= len(before) or text.endswith("\ufffd") or not text.startswith(before):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(before):]

    def flush(self) -> str:
        """The text of the tokens not returned yet (an incomplete character as U+FFFD)."""
        before = self._decode(self.ids[self._prefix:self._read])
        text = self._decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return text[len(before):] if text.startswith(before) else text


@dataclass
class TextResult:
    text: str
    token_ids: list[int]
    stats: GenerationStats


def generate_text(model, drafter, tokenizer, prompt: str, *, chat: bool | None = None, **kwargs) -> TextResult:
    """Generate from a text prompt; ``kwargs`` as for :func:`infer.generate` (EOS defaults to the
    model's)."""
    ids = encode_prompt(tokenizer, prompt, chat=chat)
    kwargs.setdefault("eos_token_id", eos_ids(getattr(model, "model", model), tokenizer))
    res = generate(model, drafter, ids, tokenizer=tokenizer, **kwargs)
    return TextResult(tokenizer.decode(res.token_ids, skip_special_tokens=True), res.token_ids, res.stats)
