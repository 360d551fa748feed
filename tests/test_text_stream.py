"""Streaming text: the pieces of :class:`infer.core.text.StreamDecoder` join into the full decoded
text, a character split over tokens waits for its last byte, and each step decodes a short
window only (the old loops re-decoded the whole output at every step)."""

import pytest

from infer.core.models import byte_tokenizer
from infer.core.text import StreamDecoder

TEXT = "Grüße aus Köln 🚀 — naïve café, 東京 and ASCII tail. " * 6


class CountingTokenizer:
    """A tokenizer whose ``decode`` records how many ids it was given."""

    def __init__(self, tok):
        self.tok, self.lengths = tok, []

    def decode(self, ids, **kw):
        self.lengths.append(len(ids))
        return self.tok.decode(ids, **kw)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_pieces_join_into_the_full_text(chunk):
    tok = byte_tokenizer()
    ids = tok(TEXT)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]  # a special token: skipped
    dec = StreamDecoder(tok)
    pieces = [dec.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(dec.flush())
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == TEXT
    assert all("\ufffd" not in p for p in pieces)  # a split character waits for its last byte


def test_a_split_character_waits_for_its_last_byte():
    tok = byte_tokenizer()
    ids = tok("🚀")["input_ids"]
    assert len(ids) == 4  # four UTF-8 bytes, four tokens
    dec = StreamDecoder(tok)
    assert [dec.push([t]) for t in ids] == ["", "", "", "🚀"]
    dec2 = StreamDecoder(tok)
    dec2.push(ids[:2])
    assert dec2.flush() == "\ufffd"  # a generation that ended inside a character: shown as such


def test_each_step_decodes_a_short_window():
    tok = CountingTokenizer(byte_tokenizer())
    ids = tok.tok(TEXT)["input_ids"]
    dec = StreamDecoder(tok)
    for t in ids:
        dec.push([t])
    assert len(ids) > 300 and max(tok.lengths) <= 8  # never the whole output again


def test_speculator_streams_through_short_windows(llama):
    """The application entry point streams with the incremental decoder (as the CLI and chat do)."""
    import torch

    from infer import Speculator
    from infer.core.drafter import NoDrafter

    class Delegating(CountingTokenizer):
        def __getattr__(self, name):
            return getattr(self.tok, name)

    tok = Delegating(byte_tokenizer())
    spec = Speculator(llama, tok, NoDrafter(), linear="stock")
    pieces = list(spec.stream(torch.tensor([5, 6, 7, 8]), max_new_tokens=200))
    ids = [t for p in pieces for t in p.token_ids]
    assert len(ids) == 200 and max(tok.lengths) <= 8
    assert "".join(p.text for p in pieces) == tok.tok.decode(ids, skip_special_tokens=True)
