"""The ``specheads`` command line: ``generate``, ``chat``, ``bench``, ``cost``, ``distill``,
``train``, ``push``, ``export`` and ``selfcheck``.

Every bad argument or input ends with one line on stderr (``specheads: error: ...``) and exit
status 2, never a traceback; arguments and output paths are checked before anything is loaded.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from ..core.errors import UserError
from .load import check_drafts, drafter_for, tree_for, verifier_for


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        self.exit(2, f"specheads: error: {message}\n")


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verifier", default="default", help="'default' (SmolLM2-135M-Instruct), 'tiny-random:<arch>', 'random:<preset>' (a real shape with random weights: llama-3.1-8b, qwen3-8b, llama-3.2-1b, mistral-7b, smollm2-135m) or 'random:<dir with config.json>', a model directory or a Hub id")
    p.add_argument("--draft", default="auto", help="'auto' (the default: the heads shipped for this verifier, if any, together with prompt lookup; else prompt lookup), 'default' (the head shipped for --verifier default), 'pld' (prompt lookup), 'none' (plain decoding through the engine), a draft-head checkpoint directory / Hub id, or several joined by '+' (e.g. default+pld: verify the union of their drafts); bench takes a comma-separated list, each optionally with its own tree after '@' (e.g. default+pld,default+pld@dynamic:7,4,16)")
    p.add_argument("--tree", default=None, help="tree preset name (configs/trees), a JSON file, chain:D or dynamic:D,K,N")
    p.add_argument("--tree-budget", choices=("auto", "fixed"), default="auto",
                   help="auto: measure the verify-cost curve at load and learn it while decoding; every draft is sized by it and by the drafter's own measured cost, and a drafter that cannot pay is not asked. fixed: drafts keep their tree's num_nodes (prompt lookup sizes its chains by the built-in curve)")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="the verify step: on = static shapes compiled with torch.compile (Inductor on a CPU, CUDA graphs on a GPU; "
                   "warm-up compiles it first, cached across processes), off = eager, auto = on for CUDA, and on a CPU where "
                   "a run with --compile on measured it faster on this machine for this model (generate: off on a CPU, where "
                   "one prompt never wins back the warm-up)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None, help="apply the chat template (default: when the tokenizer has one)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    _add_placement(p, kernels=True)
    p.add_argument("--draft-dtype", choices=("auto", "bf16", "fp16", "fp32"), default="auto",
                   help="what trained heads compute in: auto = the verifier's dtype, bf16 for a float32 verifier on a CPU with native bf16 (never changes the output)")


def _add_placement(p: argparse.ArgumentParser, kernels: bool = False) -> None:
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp16", "fp32"), default="auto",
                   help="the verifier's dtype: auto = float32 on CPU, the checkpoint's dtype (bf16 if none) on a GPU; heads follow it")
    p.add_argument("--linear", default="auto", help="kernel of the verifier's float32 CPU linear layers: auto (oneDNN where "
                   "a short measurement finds it faster than stock, hybrid where only a one-token forward is slower on it; never on a GPU), "
                   "stock, onednn or hybrid (oneDNN for tree passes; one-token passes and long prompts on stock)" +
                   ("; bench takes a comma-separated list and runs every speculative method on each (labels get [kernel] after the first)" if kernels else ""))


def build_parser() -> argparse.ArgumentParser:
    """The ``specheads`` parser: one sub-parser per command, each added by its own step."""
    from .loadgen import add_parser as add_loadgen_parser
    from .serve import add_parser as add_serve_parser

    parser = _Parser(prog="specheads", description="Self-speculative decoding with draft heads and tree verification.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in (_add_generate, _add_bench, _add_chat, _add_training, _add_export, _add_cost):
        add(sub)
    add_serve_parser(sub, _add_common, _add_placement)
    add_loadgen_parser(sub)
    _add_selfcheck(sub)
    return parser


def _add_generate(sub) -> None:
    g = sub.add_parser("generate", help="generate from a prompt")
    _add_common(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--acceptance", choices=("exact", "typical"), default="exact", help="'typical' is Medusa's lossy rule")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help='print one JSON object {"text", "token_ids", "stats"}')
    g.add_argument("--compare", action="store_true", help="also time plain HF greedy decoding and report the speedup")


def _add_bench(sub) -> None:
    b = sub.add_parser("bench", help="benchmark vanilla / HF prompt lookup / the engine on a prompt file")
    _add_common(b)
    b.add_argument("--prompts", required=True, help="JSONL with \"prompt\" or \"turns\", optional \"category\"")
    b.add_argument("--limit", type=int, default=None, help="at most this many prompts per category")
    b.add_argument("--group-mt-bench", action=argparse.BooleanOptionalAction, default=True,
                   help="report MT-bench's eight categories as one, 'mt_bench', as Spec-Bench does")
    b.add_argument("--methods", default="vanilla,hf-pld,spec")
    b.add_argument("--out", required=True, help="results JSON")
    b.add_argument("--plot", default=None, help="PNG of speedup, tau and accepted lengths")
    b.add_argument("--verify-cost", action="store_true", help="also measure the verify-cost curve, and each speculative method's ideal speedup and efficiency")
    b.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples (outputs are then not compared)")
    b.add_argument("--seed", type=int, default=0, help="seed of every sampled generation")


def _add_chat(sub) -> None:
    ch = sub.add_parser("chat", help="interactive chat with streamed replies and a tau / tokens-per-second status line")
    _add_common(ch)
    ch.add_argument("--system", default=None, help="system prompt")
    ch.add_argument("--temperature", type=float, default=0.0)
    ch.add_argument("--top-p", type=float, default=1.0)
    ch.add_argument("--top-k", type=int, default=0)
    ch.add_argument("--seed", type=int, default=None)


def _add_training(sub) -> None:
    """``distill``, ``train`` and ``push``."""
    d = sub.add_parser("distill", help="self-distil a verifier on prompts (runs train/distill.py)", add_help=False)
    d.add_argument("args", nargs=argparse.REMAINDER)
    t = sub.add_parser("train", help="train a draft head: accelerate launch train/train_heads.py --config RECIPE [key=value ...]")
    t.add_argument("--config", required=True, help="YAML recipe (configs/*.yaml)")
    t.add_argument("--accelerate-config", default=None, help="accelerate config (default: one CPU process)")
    t.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")
    t.add_argument("overrides", nargs="*", help="key=value overrides")
    pu = sub.add_parser("push", help="upload a trained head directory to the Hugging Face Hub")
    pu.add_argument("directory")
    pu.add_argument("repo_id")
    pu.add_argument("--private", action="store_true")
    pu.add_argument("--token", default=None)


def _add_export(sub) -> None:
    ex = sub.add_parser("export", help="write a trained head in the layout vLLM / SGLang load (speculators, eagle3, medusa, dflash), or as a smaller specheads checkpoint (specheads); draft-model: a trained draft model directory, checked and copied")
    ex.add_argument("--draft", required=True, help="a specheads head checkpoint (directory or Hub id)")
    ex.add_argument("--format", required=True, choices=("speculators", "eagle3", "medusa", "dflash", "specheads", "draft-model"))
    ex.add_argument("--out", required=True, help="a new or empty directory (see --force)")
    ex.add_argument("--force", action="store_true", help="replace a non-empty --out as a whole (never mixed with its old files)")
    ex.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ex.add_argument("--verifier", default=None, help="speculators: the verifier's Hub id or directory written into the export for vLLM "
                    "(default: the one recorded in the head; 'default' is written as HuggingFaceTB/SmolLM2-135M-Instruct); "
                    "medusa: the verifier whose LM head the heads share (default: the one recorded in the head)")
    ex.add_argument("--speculative-tokens", type=int, default=3, help="speculators: vLLM's default num_speculative_tokens for this head")


def _add_cost(sub) -> None:
    c = sub.add_parser("cost", help="time a verify pass over 1..64 tree nodes relative to one token")
    c.add_argument("--verifier", default="default")
    c.add_argument("--nodes", default="1,4,8,16,32,64")
    c.add_argument("--prefix-len", type=int, default=256)
    c.add_argument("--repeats", type=int, default=7)
    _add_placement(c)
    c.add_argument("--json", action="store_true")


def _add_selfcheck(sub) -> None:
    s = sub.add_parser("selfcheck", help="check the engine on a device and measure it (make gpu-check): one JSON and one PNG")
    s.add_argument("--device", default="cpu")
    s.add_argument("--out", required=True, help="output directory (selfcheck.json, selfcheck.png)")
    s.add_argument("--small", action="store_true", help="small shapes (a CPU dry run, as CI does)")
    s.add_argument("--parts", default="identity,speed,batch,cli",
                   help="comma-separated, run in this order: compiled, identity, speed, batch, cli (make gpu-check runs compiled first)")
    s.add_argument("--prompts", default=None, help="prompt file for the command-line part (default: the bundled unseen prompts)")


def bench_drafts(text: str) -> list[tuple[str, str | None]]:
    """``--draft`` of bench: comma-separated draft specs, each optionally ``spec@tree`` (a tree
    for that draft alone, e.g. ``default+pld@dynamic:7,4,16``) -> ``[(spec, tree or None)]``."""
    entries = re.findall(r"([^,@]+)(?:@(dynamic:[^,]*,[^,]*,[^,@]*|[^,@]*))?", text)
    out = [(d.strip(), t.strip() or None) for d, t in entries if d.strip()]
    if not out:
        raise UserError("--draft is empty: use auto, pld, none, a shipped head name or a head checkpoint")
    return out


def _params(args, **kw):
    from ..core.params import SamplingParams

    return SamplingParams(max_new_tokens=args.max_new_tokens, **kw)


def _check_prompt_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UserError("the prompt is not valid UTF-8 (it holds undecodable bytes): pass it as UTF-8 text") from None


def _fits_context(texts, chat, max_new_tokens: int, what):
    """A ``check(config, tokenizer)`` for :func:`~infer.core.models.load_verifier`: each prompt of
    ``texts`` (encoded as generation will) plus ``max_new_tokens`` fits the verifier's context
    (a one-line error naming ``what(i)`` otherwise)."""
    def check(config, tokenizer):
        if tokenizer is None:
            return  # refused after loading: the command needs text
        from ..core.text import encode_prompt
        from ..core.verifier import check_fits

        for i, text in enumerate(texts):
            check_fits(config, encode_prompt(tokenizer, text, chat=chat).numel() + max_new_tokens,
                       f"{what(i)} plus max_new_tokens")
    return check


def _verifier(args, model):
    from ..core.verifier import Verifier

    return Verifier(model, linear=args.linear)


def bench_kernels(text: str) -> list[str]:
    """``--linear`` of bench: comma-separated kernels, each once (checked: a one-line UserError)."""
    from ..core.kernels import KERNELS

    out = [k.strip() for k in text.split(",") if k.strip()]
    if not out or len(set(out)) != len(out) or any(k not in KERNELS for k in out):
        raise UserError(f"--linear {text!r}: give one or more of {', '.join(KERNELS)}, comma-separated, each once")
    return out


def cmd_generate(args) -> int:
    from ..core.engine import Engine
    from ..core.text import StreamDecoder, encode_prompt, eos_ids

    params = _params(args, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                     acceptance=args.acceptance)
    _check_prompt_text(args.prompt)
    if not args.prompt.strip():
        raise UserError("the prompt is empty: give some text")
    tree = tree_for(args)
    check_drafts(args.draft, trees=[tree])
    lv = verifier_for(args, "generate needs text (random shapes without one: use bench or cost)",
               _fits_context([args.prompt], args.chat, args.max_new_tokens, lambda i: "the prompt"))
    drafter = drafter_for(args, args.draft, lv.model, tree, tokenizer=lv.tokenizer)
    engine = Engine(_verifier(args, lv.model), drafter, budget=args.tree_budget, compile=args.compile)
    ids = encode_prompt(lv.tokenizer, args.prompt, chat=args.chat)
    if args.compare:  # warm both paths up so that the timings compare steady states
        import torch

        from .bench import hf_generate

        with torch.random.fork_rng(devices=[lv.model.device] if lv.model.device.type == "cuda" else []):
            hf_generate(lv.model, ids, 4, eos_ids(lv.model, lv.tokenizer), **_hf_like(args))
        from dataclasses import replace

        engine.add(ids, replace(params, max_new_tokens=4, seed=0))
        for _ in engine.run():
            pass
    engine.add(ids, params, eos_token_id=eos_ids(lv.model, lv.tokenizer), stop=args.stop, tokenizer=lv.tokenizer)
    chunks = engine.run()
    tokens: list[int] = []
    stats = None
    pieces = StreamDecoder(lv.tokenizer)
    for chunk in chunks:
        tokens.extend(chunk.token_ids)
        stats = chunk.stats
        if not args.json:
            sys.stdout.write(pieces.push(chunk.token_ids))
            sys.stdout.flush()
    if args.json:
        text = lv.tokenizer.decode(tokens, skip_special_tokens=True)
        print(json.dumps({"text": text, "token_ids": tokens, "stats": stats.as_dict()}))
    else:
        sys.stdout.write(pieces.flush() + "\n")
        print(
            f"[{stats.new_tokens} tokens, tau {stats.mean_accepted:.2f}, {stats.tokens_per_s:.1f} tokens/s, "
            f"{stats.verify_steps} verify steps, finish: {stats.finish_reason}]",
            file=sys.stderr,
        )
    if args.compare:
        _compare(lv, ids, tokens, stats, args)
    return 0


def _hf_like(args) -> dict:
    """HF ``generate`` arguments that decode as this run does: greedy, or sampling with the
    same temperature / top-p / top-k (like with like: sampling is timed against sampling)."""
    if args.temperature <= 0:
        return {}
    return {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}


def _compare(lv, ids, tokens, stats, args) -> None:
    """Time HF ``generate`` on the same prompt, decoding as this run did (greedy, or sampling
    with the same settings, seeded with ``--seed`` inside a forked RNG), and print the speedup."""
    import time

    import torch

    from ..core.text import eos_ids
    from .bench import hf_generate

    sampling = args.temperature > 0
    devices = [lv.model.device] if lv.model.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # HF samples with the global generators: leave them as they were
        if sampling and args.seed is not None:
            torch.manual_seed(args.seed)
        t0 = time.perf_counter()
        plain = hf_generate(lv.model, ids, args.max_new_tokens, eos_ids(lv.model, lv.tokenizer), **_hf_like(args))
        plain_s = time.perf_counter() - t0
    spec_s = stats.prefill_s + stats.decode_s
    plain_tps, spec_tps = len(plain) / plain_s, len(tokens) / spec_s
    same = "identical" if plain == tokens else ("differs (sampling)" if sampling else "DIFFERS")
    label = "plain sampling (HF generate, same settings)" if sampling else "plain greedy (HF generate)"
    report = {"plain": "sampling" if sampling else "greedy", "plain_tokens_per_s": plain_tps, "spec_tokens_per_s": spec_tps,
              "speedup": spec_tps / plain_tps, "tau": stats.mean_accepted, "output_vs_plain": same}
    if args.json:
        print(json.dumps({"compare": report}))
    else:
        print(f"{label}: {plain_tps:.1f} tokens/s | speculative: {spec_tps:.1f} tokens/s | "
              f"speedup {spec_tps / plain_tps:.2f}x | tau {stats.mean_accepted:.2f} | output {same}")


def cmd_bench(args) -> int:
    from pathlib import Path

    from heads.io import write_atomic

    from ..core.schedule import measure_verify_cost
    from ..core.tree import load_tree_spec
    from .bench import add_efficiency, check_methods, environment, plot_results, run_bench
    from .files import check_not_input, check_output_file
    from .prompts import MT_BENCH_GROUP, read_prompts

    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    check_methods(methods, args.temperature)
    if args.limit is not None and args.limit < 1:
        raise UserError("--limit must be >= 1")
    _params(args, temperature=args.temperature, seed=args.seed)
    out = check_output_file(args.out, "--out")
    partial = out.with_name(out.name + ".partial.jsonl")
    check_output_file(partial, "the progress file")
    if args.plot:
        check_output_file(args.plot, "--plot")
    entries = bench_drafts(args.draft)
    inputs = [("--prompts", args.prompts)] + [("the tree file", t) for t in sorted({args.tree, *(t for _, t in entries)} - {None})
                                                if Path(t).is_file()]
    for path, what in ((out, "--out"), (partial, "the progress file"), (args.plot, "--plot")):
        if path is not None:
            check_not_input(path, what, inputs)
    if args.plot:
        check_not_input(args.plot, "--plot", [("--out", out)])
    prompts = read_prompts(args.prompts, args.limit, MT_BENCH_GROUP if args.group_mt_bench else None)
    tree = tree_for(args)
    labels = [(Path(d).name or d) + (f"@{t}" if t else "") for d, t in entries]
    if len(set(labels)) != len(labels):
        raise UserError(f"--draft {args.draft!r}: give each draft once (labels are the last path component and the tree)")
    trees = [load_tree_spec(t) if t else tree for _, t in entries]  # bad trees fail before loading
    check_drafts(*(d for d, _ in entries), trees=trees)
    kernels = bench_kernels(args.linear)
    lv = verifier_for(args, "bench reads text prompts", _fits_context([p.text for p in prompts], args.chat is not False,
                                                                args.max_new_tokens, lambda i: f"prompt {i + 1} of {args.prompts}"))
    drafters, kernel_of = {}, {}
    for i, kernel in enumerate(kernels):  # each kernel its own drafters: their cost curves learn its times
        for label, (d, _), t in zip(labels, entries, trees):
            name = label if i == 0 else f"{label}[{kernel}]"
            drafters[name], kernel_of[name] = drafter_for(args, d, lv.model, t, tokenizer=lv.tokenizer), kernel
    config = bench_fingerprint(args)
    results = run_bench(lv.model, lv.tokenizer, drafters, prompts, methods=methods, kernels=kernel_of, budget=args.tree_budget, compile=args.compile,
                        max_new_tokens=args.max_new_tokens, chat=args.chat is not False,
                        temperature=args.temperature, seed=args.seed, partial=partial, fingerprint=config)
    results["config"] = {"command": "specheads " + " ".join(sys.argv[1:]), **config, "n_prompts": len(prompts), **environment()}
    if args.verify_cost:  # the curve of the first kernel, which the unsuffixed methods ran on
        results["verify_cost"] = measure_verify_cost(lv.model, linear=kernels[0])
        add_efficiency(results, results["verify_cost"])
    write_atomic(out, lambda p: p.write_text(json.dumps(results, indent=1, default=str)))
    if args.plot:
        plot_results(results, args.plot)
    partial.unlink(missing_ok=True)
    print(format_table(results))
    return 0


#: bench options that do not change the per-prompt results (where they go, what is added at the
#: end): every other option is part of the fingerprint a resumed run must match.
BENCH_NOT_IN_FINGERPRINT = ("command", "out", "plot", "verify_cost")


def bench_fingerprint(args) -> dict:
    """What defines a benchmark's per-prompt results: every bench option except
    :data:`BENCH_NOT_IN_FINGERPRINT` (a new option joins the fingerprint by default)."""
    return {k: v for k, v in sorted(vars(args).items()) if k not in BENCH_NOT_IN_FINGERPRINT}


def format_table(results: dict) -> str:
    """A plain-text table of the overall and per-category numbers (``speedup``: over stock HF
    ``generate``; ``same-k.``: over HF ``generate`` on the method's own linear kernel)."""
    width = max(10, *(len(m) for m in results["methods"]))
    lines = [f"{'method':{width}} {'category':16} {'n':>4} {'tok/s':>8} {'tau':>6} {'speedup':>8} {'same-k.':>8} {'identical':>10} {'ideal':>7} {'effic.':>7}"]
    for m, r in results["methods"].items():
        for cat, v in [("overall", r["overall"]), *r["categories"].items()]:
            ident = f"{v['identical']}/{v['n']}" if "identical" in v else ""
            sp = f"{v['speedup']:.2f}x" if v.get("speedup") else ""
            same = f"{v['speedup_same_kernel']:.2f}x" if v.get("speedup_same_kernel") else ""
            ideal = f"{v['ideal_speedup']:.2f}x" if v.get("ideal_speedup") else ""
            eff = f"{v['efficiency']:.2f}" if v.get("efficiency") else ""
            lines.append(f"{m:{width}} {cat:16} {v['n']:>4} {v['tokens_per_s']:8.1f} {v['tau']:6.2f} {sp:>8} {same:>8} {ident:>10} {ideal:>7} {eff:>7}")
    return "\n".join(lines)


def cmd_chat(args) -> int:
    from .chat import ChatSession, run_chat

    _params(args, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    tree = tree_for(args)
    check_drafts(args.draft, trees=[tree])
    lv = verifier_for(args, "chat needs text")
    drafter = drafter_for(args, args.draft, lv.model, tree, tokenizer=lv.tokenizer)
    gen = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
               top_k=args.top_k, seed=args.seed)
    return run_chat(ChatSession(lv.model, lv.tokenizer, drafter, args.system, gen, verifier=_verifier(args, lv.model),
                                budget=args.tree_budget, compile=args.compile))


def cmd_export(args) -> int:
    from pathlib import Path

    import torch

    from heads import CheckpointError, HeadMismatchError, load_head
    from heads.interop import export_eagle3, export_medusa

    from .files import check_output_dir

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    check_output_dir(args.out, "--out")  # before loading anything: an existing file or an unwritable place
    if Path(args.out).is_dir() and any(Path(args.out).iterdir()) and not args.force:
        raise UserError(f"--out {args.out} is not empty: export into a new directory, or add --force to replace it as a whole")
    if args.speculative_tokens < 1:
        raise UserError(f"--speculative-tokens must be >= 1, not {args.speculative_tokens}")
    if args.format == "draft-model":
        print(export_draft_model(args.draft, args.out, overwrite=args.force))
        return 0
    try:
        from heads.io import resolve, verifier_adapter

        head = load_head(args.draft)
        adapter = verifier_adapter(resolve(args.draft), head.config)  # Medusa-2: the verifier's LoRA adapter, declared
        if args.format == "specheads":
            import shutil

            from heads.io import ADAPTER, save_head, write_directory

            def fill(tmp):
                save_head(head, tmp, weights_dtype=dtype)
                if adapter is not None:
                    shutil.copytree(adapter, tmp / ADAPTER)

            out = write_directory(args.out, fill, overwrite=args.force)
        elif args.format == "eagle3":
            out = export_eagle3(head, args.out, dtype=dtype, overwrite=args.force)
        elif args.format == "dflash":
            from heads.dflash_export import export_dflash

            out = export_dflash(head, args.out, dtype=dtype, overwrite=args.force)
        elif args.format == "speculators":  # the verifier is loaded for its token embedding (and checked against the head)
            from heads.interop import export_speculators

            from ..core.models import DEFAULT_HUB_ID, load_verifier

            name = args.verifier or head.config.verifier.name
            model = load_verifier(name).model
            head = load_head(args.draft, verifier=model, dtype=torch.float32, device="cpu")
            out = export_speculators(head, args.out, embed_tokens=model.get_input_embeddings().weight,
                                     verifier=DEFAULT_HUB_ID if name == "default" else name,
                                     speculative_tokens=args.speculative_tokens, dtype=dtype, overwrite=args.force)
        else:
            if adapter is not None:
                print("specheads: warning: this is a Medusa-2 head: its LoRA adapter (adapter/) is not part of the medusa "
                      "export, so the verifier vLLM serves will lack it (merge the adapter into the verifier and serve that "
                      "as the target)", file=sys.stderr)
            verifier = None
            if head.config.head_type == "medusa" and head.lm_heads is None:
                from ..core.models import load_verifier

                verifier = load_verifier(args.verifier or head.config.verifier.name).model
            out = export_medusa(head, args.out, verifier, dtype=dtype, overwrite=args.force)
    except (CheckpointError, HeadMismatchError) as e:
        raise UserError(str(e)) from None
    print(out)
    return 0


def export_draft_model(draft: str, out: str, *, overwrite: bool = False):
    """A draft model directory (``DIR`` or ``model:DIR``), checked (transformers reads its config
    and finds safetensors weights; no specheads files needed) and copied to ``out``: what vLLM
    loads as ``speculative_config={"method": "draft_model", "model": out}`` (docs/draft-model.md)."""
    import shutil

    from heads.io import write_directory

    from ..drafting.draft_model import PREFIX, draft_model_path, read_draft_config

    path = draft_model_path(draft if draft.startswith(PREFIX) else PREFIX + draft)
    read_draft_config(path)
    if not any(path.glob("*.safetensors")):
        raise UserError(f"draft model {str(path)!r} has no safetensors weights (model.safetensors): export reads no pickles")

    def fill(tmp):
        for f in sorted(path.iterdir()):
            if f.is_file() and (f.suffix in (".json", ".safetensors", ".txt", ".model") or f.name == "README.md"):
                shutil.copy2(f, tmp / f.name)

    return write_directory(out, fill, overwrite=overwrite)


MAX_COST_PREFIX = 1 << 17
MAX_COST_REPEATS = 1000


def cmd_cost(args) -> int:
    from ..core.schedule import measure_verify_cost

    try:
        nodes = tuple(int(n) for n in args.nodes.split(","))
    except ValueError:
        raise UserError(f"--nodes must be comma-separated integers, not {args.nodes!r}") from None
    if not nodes or min(nodes) < 1 or args.prefix_len < 1 or args.repeats < 1:
        raise UserError("--nodes, --prefix-len and --repeats must be positive")
    from ..core.tree import MAX_TREE_NODES

    for what, value, limit in (("--nodes", max(nodes), MAX_TREE_NODES), ("--prefix-len", args.prefix_len, MAX_COST_PREFIX),
                               ("--repeats", args.repeats, MAX_COST_REPEATS)):
        if value > limit:
            raise UserError(f"{what} {value} is beyond the limit of {limit}")
    lv = verifier_for(args)
    cost = measure_verify_cost(lv.model, nodes, prefix_len=args.prefix_len, repeats=args.repeats, linear=args.linear)
    if args.json:
        print(json.dumps(cost))
    else:
        for n in nodes:
            print(f"{n:4d} nodes: {cost['seconds'][n] * 1000:8.1f} ms  {cost['relative'][n]:5.2f}x")
    return 0


def _run(cmd: list[str], *, launcher: bool = False) -> int:
    """Run a training-side program in a child process (infer never imports train); its exit status.

    ``launcher``: ``cmd`` is ``accelerate launch``, which ends a failed run with its own
    ``CalledProcessError`` traceback after the program's one-line error. Its stderr is streamed
    as it comes (progress bars' ``\\r`` lines too) up to the last traceback, which is dropped when
    it is the launcher's, and the program's own exit status (2 for a user error) is returned
    instead of accelerate's 1.

    The child imports this package whatever the working directory, and ends with this process
    (:mod:`infer.tools.procs`: a kill of the command, even SIGKILL, ends the child)."""
    import subprocess

    from .procs import child_env, exit_status, forward_signals, preexec_die_with_parent

    try:
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE if launcher else None, env=child_env(),
                                preexec_fn=preexec_die_with_parent())
    except FileNotFoundError as e:
        raise UserError(f"cannot run {cmd[0]}: {e.strerror}") from None
    with forward_signals(proc):
        return exit_status(proc.wait() if not launcher else _filter_launcher(proc))


def _filter_launcher(proc) -> int:
    import codecs
    import os
    import re

    marker = "Traceback (most recent call last):"
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    pending, held = "", None  # an incomplete last line; from the first traceback on, everything
    while chunk := os.read(proc.stderr.fileno(), 65536):
        text = pending + decoder.decode(chunk)
        pending = ""
        if held is not None:
            held += text
            continue
        lines = re.split(r"(?<=[\r\n])", text)
        pending = lines.pop()
        for i, line in enumerate(lines):
            if line.startswith(marker):
                held, pending = "".join(lines[i:]) + pending, ""
                break
            sys.stderr.write(line)
        sys.stderr.flush()
    proc.stderr.close()
    code = proc.wait()
    held = (held or "") + pending + decoder.decode(b"", final=True)
    start = held.rfind(marker)
    if start >= 0 and "CalledProcessError" in held[start:]:
        status = re.search(r"returned non-zero exit status (\d+)", held[start:])
        held, code = held[:start], int(status[1]) if status else code
    elif start >= 0 and held.rstrip().endswith("KeyboardInterrupt"):  # Ctrl-C: the program said so in one line
        held, code = held[:start], 130
    sys.stderr.write(held)
    sys.stderr.flush()
    return code


def cmd_distill(rest: list[str]) -> int:
    return _run([sys.executable, "-m", "train.distill", *rest])


def cmd_train(args) -> int:
    """Validate the recipe in a child process (``train_heads --check``: one line and exit 2 when it
    is bad, before accelerate starts), then ``accelerate launch`` it, without the launcher's traceback."""
    import os
    import shutil
    import subprocess

    resume = ["--resume"] if args.resume else []
    train_args = ["--config", args.config, *resume, *args.overrides]
    from .procs import child_env

    check = subprocess.run([sys.executable, "-m", "train.train_heads", "--check", *train_args], capture_output=True,
                           text=True, env=child_env())
    if check.returncode == 2:
        lines = check.stderr.strip().splitlines() or ["the training config is not valid"]
        raise UserError(lines[-1].removeprefix("train_heads: error: "))
    if check.returncode != 0:
        sys.stderr.write(check.stderr)
        return check.returncode
    accelerate = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or shutil.which("accelerate")
    if accelerate is None:
        raise UserError("accelerate is not installed: pip install accelerate")
    launch = ["--config_file", args.accelerate_config] if args.accelerate_config else ["--cpu", "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    return _run([accelerate, "launch", *launch, "-m", "train.train_heads", *train_args], launcher=True)


def cmd_push(args) -> int:
    from heads import CheckpointError, push_head

    try:
        url = push_head(args.directory, args.repo_id, token=args.token, private=args.private)
    except CheckpointError as e:
        raise UserError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - network and auth failures: one line
        raise UserError(f"upload to {args.repo_id} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    print(url)
    return 0


def cmd_selfcheck(args) -> int:
    from ..core.models import resolve_device
    from .files import check_output_dir
    from .selfcheck import run_selfcheck

    parts = tuple(p.strip() for p in args.parts.split(",") if p.strip())
    unknown = set(parts) - {"compiled", "identity", "speed", "batch", "cli"}
    if not parts or unknown:
        raise UserError(f"--parts: choose from compiled, identity, speed, batch, cli (got {args.parts!r})")
    resolve_device(args.device)
    out = check_output_dir(args.out, "--out")
    results = run_selfcheck(args.device, out, small=args.small, parts=parts, prompts=args.prompts)
    errors = [p for p in parts if isinstance(results.get(p), dict) and "error" in results[p]]
    print(f"{out / 'selfcheck.json'} and {out / 'selfcheck.png'} written" + (f"; parts with errors: {', '.join(errors)}" if errors else ""))
    return 1 if errors else 0


def cmd_loadgen(args) -> int:
    from .loadgen import cmd_loadgen as loadgen

    return loadgen(args)


def cmd_serve(args) -> int:
    from .serve import cmd_serve as serve

    return serve(args)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["distill"]:  # its options belong to train/distill.py
        return cmd_distill(argv[1:])
    args = build_parser().parse_args(argv)
    commands = {"generate": cmd_generate, "bench": cmd_bench, "cost": cmd_cost, "chat": cmd_chat, "train": cmd_train,
                "push": cmd_push, "export": cmd_export, "selfcheck": cmd_selfcheck, "serve": cmd_serve,
                "loadgen": cmd_loadgen}
    try:
        if hasattr(args, "linear"):  # a CPU kernel for a GPU run: refused before anything else
            from ..core.kernels import check_kernel_device

            check_kernel_device(args.linear, args.device)
        return commands[args.command](args)
    except UserError as e:
        print(f"specheads: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specheads: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
