"""What a plain decoding step and a prompt cost the default verifier, outside the engine's loop:

1. a one-token step, HF style (a ``DynamicCache``, which concatenates the whole cache at every
   step, and a 2D mask) against the verifier's (``ReservedCache``, one-node tree, no mask), and
   the verifier's on a ``DynamicCache``; the three interleaved step by step, medians over ROUNDS;
2. a prefill of 80 and 700 tokens on the stock kernel and on oneDNN (``hybrid`` keeps long prompts
   on stock), the two in turn, medians over PREFILLS after a warm-up round.

    python docs/scripts/step_costs.py        # nothing else running: a shared 2-core CPU is noisy
"""
import contextlib
import statistics
import time

import torch
from transformers import DynamicCache

from infer.core.kernels import OneDNNLinear
from infer.core.models import load_verifier
from infer.core.tree import build_tree
from infer.core.verifier import Verifier

ROUNDS = 250
PREFILLS = 5


def main() -> None:
    model = load_verifier("default", dtype="fp32").model
    ids = torch.randint(100, 40000, (1, 300), generator=torch.Generator().manual_seed(0))
    tok, one, zero = torch.tensor([5]), build_tree([-1]), torch.tensor([0])
    ours, dynamic = Verifier(model, linear="stock"), Verifier(model, linear="stock")
    ours.prefill(ids[0])
    dynamic.prefill(ids[0])
    with torch.inference_mode():
        dynamic.cache = DynamicCache()  # the same verifier on HF's own cache
        model(input_ids=ids, past_key_values=dynamic.cache, use_cache=True, logits_to_keep=1)
        hf_cache = DynamicCache()
        model(input_ids=ids, past_key_values=hf_cache, use_cache=True, logits_to_keep=1)
    state = {"hf": ids.shape[1]}

    def hf_step():
        n = state["hf"]
        with torch.inference_mode():
            model(input_ids=tok.view(1, 1), past_key_values=hf_cache, use_cache=True,
                  position_ids=torch.tensor([[n]]), attention_mask=torch.ones(1, n + 1, dtype=torch.long), logits_to_keep=1)
        state["hf"] = n + 1

    def step(v):
        v.verify(tok, one)
        v.commit(zero, [0])

    steps = {"HF step (DynamicCache, 2D mask)": hf_step, "verifier step (ReservedCache)": lambda: step(ours),
             "verifier step on a DynamicCache": lambda: step(dynamic)}
    times = {k: [] for k in steps}
    for _ in range(ROUNDS):
        for name, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    for name, t in times.items():
        print(f"{name}: median {1000 * statistics.median(t):.1f} ms over {ROUNDS} (cache {ids.shape[1]} -> {ids.shape[1] + ROUNDS})")
    kernels = {"stock": contextlib.nullcontext, "oneDNN": OneDNNLinear}
    for length in (80, 700):
        prompt = torch.randint(100, 40000, (1, length), generator=torch.Generator().manual_seed(1))
        t = {k: [] for k in kernels}
        for r in range(PREFILLS + 1):  # the two kernels in turn, so that a busy moment hits both; round 0 warms up
            for name, ctx in kernels.items():
                t0 = time.perf_counter()
                with torch.inference_mode(), ctx():
                    model(input_ids=prompt, past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)
                if r:
                    t[name].append(time.perf_counter() - t0)
        for name, times in t.items():
            print(f"prefill {length} tokens on {name}: median {1000 * statistics.median(times):.0f} ms over {PREFILLS}")

if __name__ == "__main__":
    main()
