"""``specheads selfcheck``: one command that checks the engine on a device and measures it.

    specheads selfcheck --device cuda --out results/gpu-check        # make gpu-check
    specheads selfcheck --device cpu --small --out /tmp/check         # the CI-sized dry run

Writes ``selfcheck.json`` (after every part, so a stop keeps what ran) and ``selfcheck.png``.
Parts (``--parts``, default all):

* ``identity``: greedy output against HF ``generate`` on the tiny random model of every family,
  in float32 and bfloat16, with an oracle drafter (a 15-node binary tree that holds the
  verifier's own continuation), a half-right one, prompt lookup and a random EAGLE-3 head.
  float32 must be identical (it is the exactness reference); bfloat16 reports its share (a tree
  pass computes node rows in a differently shaped batch than one-token decoding, so near-ties
  can flip).
* ``speed``: a real-shape random verifier (``random:llama-3.1-8b`` in bfloat16; ``--small``: a
  small Llama) with a long prompt: HF ``generate`` tokens/s; the engine with no draft; oracle
  chains of depth 1/3/5/7 and an oracle 31-node tree, each against its ideal speedup
  ``tau x T(1) / T(n)`` from the verify-cost curve measured in the same run; a random EAGLE-3 head
  on ``eagle2-32`` and on a 60-node tree (draft ms against verify ms per step); for every engine
  run, the sync points per verify step counted at the dispatch level
  (:class:`~infer.core.diagnostics.HostReadCounter`) and, on CUDA, the warnings of one decoding loop
  under ``torch.cuda.set_sync_debug_mode("warn")`` (``cuda_sync_warnings``); the verify-cost
  curve for 1..128 nodes at two prefix lengths.
* ``batch``: batched generation on the same verifier at batch 1, 4 and 16 (prompts of different
  lengths): tokens/s of plain batched decoding, of an oracle chain per row and of HF ``generate``
  on the same left-padded batch; how many rows equal their prompt run alone; the syncs per verify
  step of a batch of 4.
* ``cli``: the command line end to end on ``random:smollm2-135m`` (``--small``:
  ``tiny-random:llama``): ``distill`` tokens/s at a large batch, ``accelerate launch`` training
  s/step of the EAGLE-3 recipe (bf16 on a GPU), and ``bench --verify-cost``.

Random weights mean random text: a trained head's acceptance means nothing on them, while
oracle drafts give a known tau, so speed and cost are those of real weights of the same shape.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

import torch

from ..drafting.lookup import PromptLookupDrafter
from ..testing import OracleDrafter, chain


def _binary(n: int) -> list[int]:
    return [-1] + [(i - 1) // 2 for i in range(1, n)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _hf_greedy(model, ids: torch.Tensor, n: int) -> list[int]:
    dev = model.get_input_embeddings().weight.device
    ids = ids.view(1, -1).to(dev)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def _timed(fn, device, repeats: int = 1):
    fn()  # warm-up
    best, result = float("inf"), None
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        result = fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best, result


def cuda_sync_warnings(fn):
    """Run ``fn()`` once under ``torch.cuda.set_sync_debug_mode("warn")``; returns the number of
    "synchronizing CUDA operation" warnings it raised and ``fn``'s result. The previous mode is
    restored afterwards, whatever happens."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return sum("synchronizing" in str(w.message) for w in caught), result


def _random_eagle3(model, draft_vocab: int, seed: int = 0):
    from heads import HeadConfig, VerifierSpec, build_head, default_aux_layers

    cfg = HeadConfig("eagle3", VerifierSpec.of(model, "random"), draft_vocab_size=min(draft_vocab, model.config.vocab_size),
                     aux_layers=default_aux_layers(model.config.num_hidden_layers), layer_config=model.config.to_dict())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_head(cfg)


# --------------------------------------------------------------------------------------------
# parts
# --------------------------------------------------------------------------------------------


def part_identity(device: torch.device, small: bool) -> dict:
    from ..core.engine import generate
    from ..core.models import TINY_ARCHS, tiny_random_model
    from ..core.tree import DynamicTreeSpec
    from ..drafting.head_drafters import EagleDrafter

    n_prompts, n_new = (2, 16) if small else (4, 48)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for arch in TINY_ARCHS:
            model = tiny_random_model(arch, vocab_size=256, seed=1).to(device, dtype)
            head = _random_eagle3(model, 200)
            ok = {"oracle": 0, "half": 0, "pld": 0, "eagle3": 0, "n": n_prompts}
            for p in range(n_prompts):
                g = torch.Generator().manual_seed(p)
                base = torch.randint(0, 256, (8,), generator=g)
                ids = torch.cat([base, base, torch.randint(0, 256, (8,), generator=g)])
                ref = _hf_greedy(model, ids, n_new)
                drafters = {
                    "oracle": OracleDrafter(ref, ids.numel(), _binary(15), device=device),
                    "half": OracleDrafter(ref, ids.numel(), _binary(15), p_right=0.5, seed=p, device=device),
                    "pld": PromptLookupDrafter(),
                    "eagle3": EagleDrafter(head, model, DynamicTreeSpec(4, 4, 16), adaptive=False),
                }
                for name, d in drafters.items():
                    ok[name] += int(generate(model, d, ids, max_new_tokens=n_new).token_ids == ref)
            out[f"{arch}/{str(dtype).removeprefix('torch.')}"] = ok
    out["cpu_generator_sampling"] = _cpu_generator_sampling(device)
    fp32 = [v for k, v in out.items() if k.endswith("float32")]
    out["fp32_all_identical"] = all(v[m] == v["n"] for v in fp32 for m in ("oracle", "half", "pld", "eagle3"))
    bf16 = [v for k, v in out.items() if k.endswith("bfloat16")]
    total = sum(v["n"] * 4 for v in bf16)
    out["bf16_identical_share"] = sum(v[m] for v in bf16 for m in ("oracle", "half", "pld", "eagle3")) / total
    return out


def _cpu_generator_sampling(device: torch.device) -> bool:
    """Sampling with a user's CPU ``generator=`` on ``device`` (on CUDA this once crashed): two
    runs from equal generator states give the same tokens, and unseeded sampling leaves the
    global generator as it was."""
    from ..core.engine import generate
    from ..core.models import tiny_random_model

    model = tiny_random_model("llama", vocab_size=256, seed=1).to(device)
    ids = torch.arange(1, 17) % 7
    runs = [generate(model, PromptLookupDrafter(), ids, max_new_tokens=12, temperature=1.0,
                     generator=torch.Generator().manual_seed(3)).token_ids for _ in range(2)]
    state = torch.get_rng_state()
    generate(model, None, ids, max_new_tokens=4, temperature=1.0)
    return runs[0] == runs[1] and len(runs[0]) == 12 and torch.equal(state, torch.get_rng_state())


#: The speed parts' random verifier has its output projection scaled by this: random weights give
#: nearly flat logits, whose near-ties bf16 rounding flips (on an H200 the engine's own greedy
#: output was not the same from one run to the next, and an oracle drafting it was rejected);
#: with margins this wide the greedy continuation is stable, so oracle drafts measure speed.
DECISIVE = 16.0


def _speed_model(device: torch.device, small: bool, shared: dict):
    """The speed and batch parts' verifier (made once per selfcheck): ``(model, name, dtype)``,
    its logits made decisive (:data:`DECISIVE`)."""
    if "model" not in shared:
        from ..core.models import random_model

        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        if small:
            from transformers import AutoConfig, AutoModelForCausalLM

            cfg = AutoConfig.for_model("llama", hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=1024, max_position_embeddings=4096)
            with torch.random.fork_rng(devices=[]), torch.device(device):
                torch.manual_seed(0)
                model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
            shared["model"] = (model, "small-llama", dtype)
        else:
            shared["model"] = (random_model("llama-3.1-8b", dtype=dtype, device=device), "random:llama-3.1-8b", dtype)
        with torch.no_grad():  # decisive logits: random weights give near-ties that rounding flips (see the docstring)
            shared["model"][0].get_output_embeddings().weight.mul_(DECISIVE)
    return shared["model"]


def part_speed(device: torch.device, small: bool, record, shared: dict | None = None) -> dict:
    from ..core.diagnostics import HostReadCounter
    from ..core.drafter import NoDrafter
    from ..core.engine import generate
    from ..core.schedule import VerifyCost, measure_verify_cost
    from ..core.tree import DynamicTreeSpec
    from ..drafting.head_drafters import EagleDrafter

    model, name, dtype = _speed_model(device, small, {} if shared is None else shared)
    if small:
        prompt_len, n_new, prefixes, nodes = 64, 16, (64, 128), (1, 2, 4, 8, 16)
    else:
        prompt_len, n_new, prefixes, nodes = 512, 128, (512, 2048), (1, 2, 4, 8, 16, 32, 64, 128)
    res = record({"verifier": name, "dtype": str(dtype).removeprefix("torch."), "prompt_tokens": prompt_len, "new_tokens": n_new})
    vocab = model.config.vocab_size
    for prefix in prefixes:
        c = measure_verify_cost(model, nodes, prefix_len=prefix, repeats=3 if small else 10)
        res[f"cost_prefix{prefix}"] = {"ms": {n: round(1e3 * s, 3) for n, s in c["seconds"].items()},
                                       "relative": {n: round(r, 3) for n, r in c["relative"].items()}}
        record(res)
    curve_data = res[f"cost_prefix{prefixes[0]}"]["relative"]
    curve = VerifyCost(tuple(curve_data), tuple(max(curve_data[n], 1.0) for n in curve_data))
    ids = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(0))
    t_hf, hf_ref = _timed(lambda: _hf_greedy(model, ids, n_new), device)
    res["hf_generate_tok_s"] = round(n_new / t_hf, 2)
    # the oracle drafts the engine's own greedy output: in bf16 on random weights near-tied logits
    # make HF's and the engine's greedy outputs part early (a one-token pass and HF's differ in
    # rounding), and an oracle of HF's output would then be rejected from there on
    ref = generate(model, NoDrafter(), ids, max_new_tokens=n_new).token_ids
    res["engine_equals_hf_greedy_tokens"] = next((i for i, (a, b) in enumerate(zip(ref, hf_ref)) if a != b), len(ref))
    runs = res["engine"] = {}

    def run(label, make, ideal_nodes=None):
        try:
            t, out = _timed(lambda: generate(model, make(), ids, max_new_tokens=n_new), device)
            st = out.stats
            with HostReadCounter(device) as reads:  # dispatch-level count of sync points
                counted = generate(model, make(), ids, max_new_tokens=min(n_new, 16)).stats
            steps = max(1, counted.verify_steps)
            row = {"tok_s": round(n_new / t, 2), "speedup_vs_hf": round(t_hf / t, 3), "tau": round(st.mean_accepted, 3),
                   "identical": out.token_ids == ref, "identical_to_hf": out.token_ids == hf_ref, "nodes_per_step": round(st.tree_nodes / max(1, st.verify_steps), 1),
                   "draft_ms_per_step": round(1e3 * st.draft_s / max(1, st.verify_steps), 3),
                   "verify_ms_per_step": round(1e3 * st.verify_s / max(1, st.verify_steps), 3),
                   "host_reads": reads.total, "syncs_per_step": round(reads.total / steps, 2),
                   "syncs_by_kind": dict(reads.counts)}
            if device.type == "cuda":  # what CUDA itself reports for the same decoding loop
                warned, st2 = cuda_sync_warnings(lambda: generate(model, make(), ids, max_new_tokens=min(n_new, 16)).stats)
                row["cuda_sync_warnings"] = warned
                row["cuda_sync_warnings_per_step"] = round(warned / max(1, st2.verify_steps), 2)
            if ideal_nodes is not None:
                row["ideal_speedup"] = round(st.mean_accepted / curve(ideal_nodes), 3)
                row["achieved_over_ideal"] = round(row["speedup_vs_hf"] / row["ideal_speedup"], 3)
            runs[label] = row
        except Exception:  # noqa: BLE001 - a failed run is a finding: record it and go on
            runs[label] = {"error": traceback.format_exc()[-2000:]}
        record(res)

    run("none", NoDrafter)
    for d in (1, 3, 5, 7):
        run(f"oracle_chain{d}", lambda d=d: OracleDrafter(ref, prompt_len, chain(d), vocab=vocab, device=device), d + 1)
    run("oracle_binary31", lambda: OracleDrafter(ref, prompt_len, _binary(31), vocab=vocab, device=device), 31)
    head = _random_eagle3(model, 32000)
    for label, spec in (("eagle3_random_eagle2-32", DynamicTreeSpec(6, 8, 32)), ("eagle3_random_60", DynamicTreeSpec(6, 10, 60))):
        run(label, lambda spec=spec: EagleDrafter(head, model, spec, adaptive=False))
    for label in ("eagle3_random_eagle2-32", "eagle3_random_60"):
        r = runs.get(label, {})
        if "draft_ms_per_step" in r and r["verify_ms_per_step"]:
            r["draft_over_verify"] = round(r["draft_ms_per_step"] / r["verify_ms_per_step"], 3)
    return res


def _hf_static_compiled(model, ids: torch.Tensor, n: int, compiled: dict, capacity: int | None = None,
                        eos: Sequence[int] = ()) -> list[int]:
    """Greedy decoding as gpt-fast does it with HF's pieces: a ``StaticCache`` (``capacity``
    columns, default the first call's prompt plus ``n``), the prompt eager, then the one-token
    forward compiled (CUDA graphs on CUDA; made once, in ``compiled``); stops after ``n`` tokens
    or at a token of ``eos`` (read per token, as HF ``generate``'s stopping criteria do)."""
    from transformers import StaticCache

    from ..core.verifier import cache_keyword

    dev = model.get_input_embeddings().weight.device
    ids = ids.view(1, -1).to(dev)
    kw = cache_keyword(model)
    if "step" not in compiled:  # one cache for every call (its buffers are where the graphs were captured)
        compiled["cache"] = StaticCache(config=model.config, max_cache_len=capacity or ids.shape[1] + n)
        compiled["step"] = torch.compile(model.forward, mode="reduce-overhead" if dev.type == "cuda" else None)
    cache = compiled["cache"]
    with torch.inference_mode():
        cache.reset()  # the last call's entries (the cache's tensors were made in inference mode)
        logits = model(input_ids=ids, use_cache=True, **{kw: cache}).logits[:, -1]
        out = [logits.argmax(-1)]
        for i in range(n - 1):
            if eos and int(out[-1]) in eos:
                break
            pos = torch.tensor([[ids.shape[1] + i]], device=dev)
            logits = compiled["step"](input_ids=out[-1].view(1, 1), position_ids=pos, use_cache=True, **{kw: cache}).logits[:, -1]
            out.append(logits.argmax(-1).clone())
    return torch.cat(out).tolist()


def part_compiled(device: torch.device, small: bool, record, shared: dict | None = None) -> dict:
    """The compiled static-shape engine (``compile="on"``), in order of value, written after each
    item: (a) batch 1 tokens/s of HF ``generate`` eager, HF's static cache with a compiled
    one-token step, and the compiled engine with no draft (and its warm-up seconds); (b) an oracle
    chain of depth 4 against its ideal speedup (tau over the verify cost of 5 nodes); (c) a
    random EAGLE-3 head's drafting time (its compiled batched loop) over the compiled verify time;
    (d) batches of 4 and 16; then the same head drafting eagerly row by row, for comparison."""
    from ..core.drafter import NoDrafter
    from ..core.engine import Engine, generate
    from ..core.schedule import measure_verify_cost
    from ..core.tree import DynamicTreeSpec
    from ..drafting.eagle_batch import BatchEagleDrafter
    from ..drafting.head_drafters import EagleDrafter

    model, name, dtype = _speed_model(device, small, {} if shared is None else shared)
    prompt_len, n_new = (64, 16) if small else (512, 128)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(0))
    res = record({"verifier": name, "dtype": str(dtype).removeprefix("torch."), "prompt_tokens": prompt_len, "new_tokens": n_new})
    t_hf, hf_ref = _timed(lambda: _hf_greedy(model, ids, n_new), device)
    res["hf_generate_tok_s"] = round(n_new / t_hf, 2)
    record(res)
    try:
        hf_static: dict = {}
        t_static, static_ref = _timed(lambda: _hf_static_compiled(model, ids, n_new, hf_static), device)
        res["hf_static_compiled_tok_s"] = round(n_new / t_static, 2)
        res["hf_static_compiled_equals_hf"] = static_ref == hf_ref
    except Exception:  # noqa: BLE001 - a baseline that fails here is a finding, not the end of the part
        res["hf_static_compiled_error"] = traceback.format_exc()[-1500:]
    record(res)
    t0 = time.perf_counter()
    engine = Engine(model, NoDrafter(), compile="on", max_rows=16)
    res["warmup_s"] = round(time.perf_counter() - t0, 1)
    res["step_path"] = engine.verifier.path.name
    compiled_v = engine.verifier
    ref = generate(model, NoDrafter(), ids, max_new_tokens=n_new).token_ids  # the eager engine's own output
    t_none, out = _timed(lambda: generate(compiled_v, NoDrafter(), ids, max_new_tokens=n_new), device)
    res["none"] = {"tok_s": round(n_new / t_none, 2), "over_hf": round(t_hf / t_none, 3),
                   "identical_to_eager": out.token_ids == ref}
    record(res)
    cost = measure_verify_cost(compiled_v, (1, 5), prefix_len=prompt_len, repeats=5)["seconds"]
    t4, out4 = _timed(lambda: generate(compiled_v, OracleDrafter(ref, prompt_len, chain(4), vocab=vocab, device=device), ids,
                                       max_new_tokens=n_new), device)
    ideal = out4.stats.mean_accepted / (cost[5] / cost[1])
    res["oracle_chain4"] = {"tok_s": round(n_new / t4, 2), "tau": round(out4.stats.mean_accepted, 3),
                            "speedup_vs_none": round(t_none / t4, 3), "ideal": round(ideal, 3),
                            "achieved_over_ideal": round(t_none / t4 / ideal, 3), "identical": out4.token_ids == ref}
    record(res)
    head, spec = _random_eagle3(model, min(32000, vocab)), DynamicTreeSpec(6, 8, 32)
    t0 = time.perf_counter()
    loop = BatchEagleDrafter(head, model, spec, compile=True)  # compiles its graphs
    res["eagle3_random"] = {"loop_warmup_s": round(time.perf_counter() - t0, 1)}
    res["eagle3_random"].update(_drafting_share(compiled_v, loop, ids, n_new, device))
    record(res)
    g = torch.Generator().manual_seed(2)
    for b in (4, 16):
        prompts = [torch.randint(0, vocab, (prompt_len,), generator=g) for _ in range(b)]
        alone = [generate(model, NoDrafter(), p, max_new_tokens=n_new).token_ids for p in prompts]
        t_b, outs = _timed(lambda prompts=prompts: generate(compiled_v, NoDrafter(), prompts, max_new_tokens=n_new,
                                                             max_batch=16), device)
        t_e, _ = _timed(lambda prompts=prompts: generate(model, NoDrafter(), prompts, max_new_tokens=n_new), device)
        res[f"batch{b}"] = {"tok_s": round(b * n_new / t_b, 1), "eager_tok_s": round(b * n_new / t_e, 1),
                            "identical_rows": sum(o.token_ids == r for o, r in zip(outs, alone))}
        record(res)
    eager = EagleDrafter(head, model, spec, adaptive=False)  # for comparison: the heads drafting row by row, eagerly
    res["eagle3_random_eager_drafter"] = _drafting_share(compiled_v, eager, ids, n_new, device)
    record(res)
    return res


def _drafting_share(verifier, drafter, ids: torch.Tensor, n_new: int, device) -> dict:
    """One generation through ``verifier`` with ``drafter`` (after a warm-up run that compiles
    the verify graphs with features): its drafting time over its verify time, per step."""
    from ..core.engine import generate

    _, out = _timed(lambda: generate(verifier, drafter, ids, max_new_tokens=n_new), device)
    st = out.stats
    return {"draft_over_verify": round(st.draft_s / max(st.verify_s, 1e-9), 3),
            "draft_ms_per_step": round(1e3 * st.draft_s / max(1, st.verify_steps), 3),
            "verify_ms_per_step": round(1e3 * st.verify_s / max(1, st.verify_steps), 3),
            "tau": round(st.mean_accepted, 3)}


def part_batch(device: torch.device, small: bool, record, shared: dict | None = None) -> dict:
    """Batched generation on the speed part's verifier: at batch 1, 4 and 16 (prompts of
    different lengths), tokens/s of plain batched decoding, of an oracle chain of 3 per row, and
    of HF ``generate`` on the same left-padded batch; whether every row equals the same prompt
    run alone through the engine; the syncs per verify step of a batch of 4 with prompt lookup
    (dispatch level)."""
    from ..core.diagnostics import HostReadCounter
    from ..core.drafter import NoDrafter
    from ..core.engine import Engine, generate
    from ..core.params import SamplingParams
    from ..core.verifier import Verifier

    model, name, dtype = _speed_model(device, small, {} if shared is None else shared)
    vocab = model.config.vocab_size
    n_new = 16 if small else 64
    sizes = (1, 4, 16)
    lengths = [int(x) for x in torch.randint(32, 64 if small else 512, (max(sizes),), generator=torch.Generator().manual_seed(1))]
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    res = record({"verifier": name, "dtype": str(dtype).removeprefix("torch."), "new_tokens": n_new, "prompt_tokens": lengths})
    alone = [generate(model, NoDrafter(), p, max_new_tokens=n_new).token_ids for p in prompts]
    refs = {tuple(p.tolist()): r for p, r in zip(prompts, alone)}

    class RowOracle(OracleDrafter):
        """An oracle chain of 3 that finds its row's continuation by its prompt."""

        def __init__(self):
            super().__init__([], 0, chain(3), vocab=vocab, device=device)

        def spawn(self):
            return RowOracle()

        def begin_row(self, prompt_ids, features=None, params=None):
            self.ref, self.prompt_len = refs[tuple(prompt_ids.tolist())], prompt_ids.numel()
            super().begin_row(prompt_ids, features, params)

    rows = res["batch"] = {}
    for b in sizes:
        batch = prompts[:b]
        row = {}
        for label, make in (("none", NoDrafter), ("oracle_chain3", RowOracle)):
            t, out = _timed(lambda make=make, batch=batch: generate(model, make(), batch, max_new_tokens=n_new), device)
            row[f"{label}_tok_s"] = round(b * n_new / t, 1)
            row[f"{label}_identical_rows"] = sum(o.token_ids == r for o, r in zip(out, alone[:b]))
            row[f"{label}_tau"] = round(sum(o.stats.mean_accepted for o in out) / b, 2)
        t_hf, _ = _timed(lambda batch=batch: _hf_batch(model, batch, n_new), device)
        row["hf_generate_tok_s"] = round(b * n_new / t_hf, 1)
        rows[str(b)] = row
        record(res)
    engine = Engine(Verifier(model), PromptLookupDrafter())  # the drafter the shipped `auto` builds on every verifier
    for p in prompts[:4]:
        engine.add(p, SamplingParams(max_new_tokens=n_new))
    engine.step()  # the admission
    counts = []
    while len(engine.rows) == 4:
        with HostReadCounter(device) as reads:
            engine.step()
        counts.append(reads.total)
    res["syncs_per_step_batch4"] = max(counts) if counts else None
    return res


def _hf_batch(model, prompts: list[torch.Tensor], n: int):
    """HF ``generate`` on a left-padded batch (the throughput reference)."""
    dev = model.get_input_embeddings().weight.device
    width = max(p.numel() for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - p.numel():] = p
        mask[r, width - p.numel():] = 1
    return model.generate(ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)


def _cli(args: list[str], timeout: int, env=None) -> dict:
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-m", "infer.tools.cli", *args], capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"rc": "timeout", "s": round(time.perf_counter() - t0, 1)}
    return {"rc": p.returncode, "s": round(time.perf_counter() - t0, 1), "tail": (p.stdout[-600:] + "\n" + p.stderr[-900:]).strip()}


def part_cli(device: torch.device, small: bool, out: Path, prompts: Path, record) -> dict:
    work = out / "cli"
    work.mkdir(parents=True, exist_ok=True)
    verifier = "tiny-random:llama" if small else "random:smollm2-135m"
    n_prompts, batch, n_new = (16, 8, 24) if small else (512, 128, 256)
    res = record({"verifier": verifier})
    data = work / "distilled.jsonl"
    data.unlink(missing_ok=True)
    t0 = time.perf_counter()
    d = _cli(["distill", "--verifier", verifier, "--device", str(device), "--prompts", str(prompts), "--out", str(data),
              "--limit", str(n_prompts), "--batch-size", str(batch), "--max-new-tokens", str(n_new)], 600)
    secs = time.perf_counter() - t0
    rows = [json.loads(line) for line in data.read_text().splitlines()] if data.exists() else []
    tokens = sum(sum(r["loss_mask"]) for r in rows if "loss_mask" in r)  # the first line is the data's header
    res["distill"] = {**d, "prompts": n_prompts, "batch": batch, "response_tokens": tokens,
                      "response_tok_s": round(tokens / secs, 1) if tokens else None}
    record(res)
    steps = 6 if small else 60
    acc = "configs/accelerate/single-gpu.yaml" if device.type == "cuda" else "configs/accelerate/cpu.yaml"
    run_dir = work / "eagle3"
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", acc, "train/train_heads.py",
           "--config", "configs/eagle3-default-cpu.yaml", f"verifier={verifier}", f"data={data}", "prompts=", f"output_dir={run_dir}",
           f"max_steps={steps}", f"save_every={steps}", f"eval_every={steps}", "cache_features=false", "cache_dir=", "log_with=",
           f"batch_size={4 if small else 16}", f"warmup_steps={max(1, steps // 10)}", "eval_fraction=0.1",
           f"draft_vocab_size={200 if small else 8192}", f"mixed_precision={'bf16' if device.type == 'cuda' else 'no'}"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        rc, tail = p.returncode, (p.stdout[-800:] + p.stderr[-800:])
    except subprocess.TimeoutExpired:
        rc, tail = "timeout", ""
    total = time.perf_counter() - t0
    history = run_dir / "train_history.json"
    step_s = None
    if history.exists():
        times = [h["step_s"] for h in json.loads(history.read_text())]
        step_s = round(sorted(times)[len(times) // 2], 3) if times else None
    res["train"] = {"rc": rc, "s": round(total, 1), "steps": steps, "median_step_s": step_s, "tail": tail[-800:]}
    record(res)
    bench_args = ["bench", "--verifier", verifier, "--device", str(device), "--draft", f"{run_dir},pld", "--prompts", str(prompts),
                  "--limit", "2" if small else "4", "--max-new-tokens", "32" if small else "128", "--verify-cost",
                  "--out", str(work / "bench.json"), "--no-chat" if verifier.startswith("tiny") else "--chat"]
    res["bench"] = _cli(bench_args, 900)
    if (work / "bench.json").exists():
        summary = json.loads((work / "bench.json").read_text())["methods"]
        res["bench"]["overall"] = {m: {k: v for k, v in r["overall"].items() if k in ("tokens_per_s", "tau", "speedup", "identical", "efficiency")}
                                   for m, r in summary.items()}
    record(res)
    return res


# --------------------------------------------------------------------------------------------
# the command
# --------------------------------------------------------------------------------------------


def plot(results: dict, path: Path) -> None:
    """Verify-cost curves, and achieved against ideal speedup of the oracle drafts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from heads.io import write_atomic

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    speed = results.get("speed", {})
    for key, val in speed.items():
        if key.startswith("cost_prefix") and isinstance(val, dict):
            ns = sorted(int(n) for n in val["relative"])
            axes[0].plot(ns, [val["relative"][n] if n in val["relative"] else val["relative"][str(n)] for n in ns], marker="o",
                         label=f"prefix {key.removeprefix('cost_prefix')}")
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("tree nodes")
    axes[0].set_ylabel("verify time / one token")
    axes[0].set_title(f"verify cost: {speed.get('verifier', '')} ({speed.get('dtype', '')})")
    if axes[0].lines:
        axes[0].legend()
    runs = {k: v for k, v in speed.get("engine", {}).items() if "speedup_vs_hf" in v}
    names = list(runs)
    axes[1].bar(range(len(names)), [runs[n]["speedup_vs_hf"] for n in names], label="achieved (vs HF generate)")
    axes[1].scatter([i for i, n in enumerate(names) if "ideal_speedup" in runs[n]],
                    [runs[n]["ideal_speedup"] for n in names if "ideal_speedup" in runs[n]], color="red", zorder=3, label="ideal")
    axes[1].set_xticks(range(len(names)), names, rotation=30, ha="right")
    axes[1].axhline(1.0, color="grey", lw=0.8)
    axes[1].set_title("engine speed")
    if names:
        axes[1].legend()
    fig.tight_layout()
    write_atomic(path, lambda p: fig.savefig(p, format="png", dpi=100))
    plt.close(fig)


def run_selfcheck(device: str, out: str | Path, *, small: bool = False, parts=("identity", "speed", "batch", "cli"),
                  prompts: str | Path | None = None) -> dict:
    """Run the parts, writing ``out/selfcheck.json`` after each; returns the results."""
    from heads.io import write_atomic

    from ..core.models import resolve_device

    dev = resolve_device(device)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = Path(prompts) if prompts else Path(str(resources.files("infer") / "presets" / "prompts" / "unseen.jsonl"))
    import transformers

    results: dict = {"env": {"torch": torch.__version__, "transformers": transformers.__version__, "device": str(dev),
                             "small": small, "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None},
                     "time_s": {}}

    def save() -> None:
        write_atomic(out / "selfcheck.json", lambda p: p.write_text(json.dumps(results, indent=1, default=str)))

    shared: dict = {}  # the verifier the speed and batch parts share (made once)
    for name in parts:
        if name == "cli":
            shared.clear()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        t0 = time.perf_counter()

        def record(partial: dict, name=name) -> dict:
            results[name] = partial
            save()
            return partial

        try:
            if name == "identity":
                record(part_identity(dev, small))
            elif name == "compiled":
                part_compiled(dev, small, record, shared)
            elif name in ("speed", "batch"):
                (part_speed if name == "speed" else part_batch)(dev, small, record, shared)
            elif name == "cli":
                part_cli(dev, small, out, prompts, record)
            else:
                raise ValueError(f"unknown part {name!r}")
        except Exception:  # noqa: BLE001 - record and go on to the next part
            results[name] = {**(results.get(name) or {}), "error": traceback.format_exc()[-3000:]}
        results["time_s"][name] = round(time.perf_counter() - t0, 1)
        save()
        print(f"selfcheck {name}: {results['time_s'][name]} s", file=sys.stderr, flush=True)
    try:
        plot(results, out / "selfcheck.png")
    except ImportError as e:  # a bare GPU machine may lack matplotlib: the JSON has everything
        results["plot_error"] = str(e)
        save()
    return results

