"""Shared fixtures: tiny random verifiers of every supported family (the test drafter with a known
continuation is :class:`infer.selfcheck.OracleDrafter`)."""

from __future__ import annotations

import pytest
import torch

from infer.models import TINY_ARCHS, tiny_random_model

VOCAB = 256


@pytest.fixture(scope="session", params=TINY_ARCHS)
def tiny_model(request):
    """A 2-layer, hidden-64, vocab-256 random model of each supported family."""
    return tiny_random_model(request.param, vocab_size=VOCAB, seed=1)


@pytest.fixture(scope="session")
def llama():
    return tiny_random_model("llama", vocab_size=VOCAB, seed=1)


def hf_greedy(model, ids: torch.Tensor, n: int, eos=None) -> list[int]:
    """The reference: HF generate, greedy."""
    out = model.generate(
        ids.view(1, -1), attention_mask=torch.ones(1, ids.numel(), dtype=torch.long), max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=0,
        min_new_tokens=0 if eos is not None else n,
    )
    return out[0, ids.numel():].tolist()


@pytest.fixture
def fresh_accelerate_state():
    """Resets accelerate's process-wide state after a test that made an ``Accelerator``."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def run_cli(argv, capsys):
    """``specheads ARGV`` in this process -> ``(exit code, stdout, stderr)``."""
    from infer.cli import main

    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err
