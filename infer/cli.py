"""The ``specheads`` command line: ``generate``, ``chat``, ``bench``, ``cost``, ``distill``,
``train``, ``push`` and ``export``.

Every bad argument or input ends with one line on stderr (``specheads: error: ...``) and exit
status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

from .errors import UserError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        self.exit(2, f"specheads: error: {message}\n")


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verifier", default="default", help="'default' (SmolLM2-135M-Instruct), 'tiny-random:<arch>', a model directory or a Hub id")
    p.add_argument("--draft", default="auto", help="'auto' (the default: the heads shipped for this verifier, if any, together with prompt lookup; else prompt lookup), 'default' (the head shipped for --verifier default), 'pld' (prompt lookup), 'none' (plain decoding through the engine), a draft-head checkpoint directory / Hub id, or several joined by '+' (e.g. default+pld: verify the union of their drafts)")
    p.add_argument("--tree", default=None, help="tree preset name (configs/trees), a JSON file, chain:D or dynamic:D,K,N")
    p.add_argument("--tree-budget", choices=("auto", "fixed"), default="auto",
                   help="auto: measure the verify-cost curve at load; trained heads size each dynamic tree for the most tokens per second and prompt lookup sizes its drafts by it. fixed: heads always use the tree's num_nodes, prompt lookup the built-in curve")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None, help="apply the chat template (default: when the tokenizer has one)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--device", default="cpu")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specheads", description="Self-speculative decoding with draft heads and tree verification.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

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

    ch = sub.add_parser("chat", help="interactive chat with streamed replies and a tau / tokens-per-second status line")
    _add_common(ch)
    ch.add_argument("--system", default=None, help="system prompt")
    ch.add_argument("--temperature", type=float, default=0.0)
    ch.add_argument("--top-p", type=float, default=1.0)
    ch.add_argument("--top-k", type=int, default=0)
    ch.add_argument("--seed", type=int, default=None)

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

    ex = sub.add_parser("export", help="write a trained head in the layout vLLM / SGLang load (eagle3, medusa), or as a smaller specheads checkpoint (specheads)")
    ex.add_argument("--draft", required=True, help="a specheads head checkpoint (directory or Hub id)")
    ex.add_argument("--format", required=True, choices=("eagle3", "medusa", "specheads"))
    ex.add_argument("--out", required=True)
    ex.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ex.add_argument("--verifier", default=None, help="needed for Medusa heads that share the verifier's LM head (default: the one recorded in the head)")

    c = sub.add_parser("cost", help="time a verify pass over 1..64 tree nodes relative to one token")
    c.add_argument("--verifier", default="default")
    c.add_argument("--nodes", default="1,4,8,16,32,64")
    c.add_argument("--prefix-len", type=int, default=256)
    c.add_argument("--repeats", type=int, default=7)
    c.add_argument("--device", default="cpu")
    c.add_argument("--json", action="store_true")
    return parser


def make_drafter(name: str, tree, model, budget: str = "auto"):
    """``auto`` (the shipped heads trained for ``model``, with prompt lookup; else prompt lookup),
    ``pld``, ``none``, the name of a head shipped in the package (``default``), a draft-head
    checkpoint (directory or Hub id) for ``model``, or several of them joined by ``+`` (e.g.
    ``default+pld``: each step verifies the union of their drafts). ``tree`` shapes the first
    drafter; under ``auto``, the first one that grows that kind of tree (prompt lookup grows any).
    With ``budget="auto"`` the verifier's cost curve is measured (a second or two) and drafts are
    sized by it."""
    from pathlib import Path

    from heads.io import PRETRAINED_DIR, pretrained_for, pretrained_names

    from .drafters import NoDrafter, PromptLookupDrafter, UnionDrafter

    auto = name == "auto"
    if auto:  # explicit paths: a local directory that happens to share a shipped name is not picked up
        parts = [str(PRETRAINED_DIR / n) for n in pretrained_for(model)] + ["pld"]
    else:
        parts = [name] if Path(name).is_dir() else name.split("+")
    shipped = pretrained_names()
    for part in parts:
        is_head = part in shipped or Path(part).is_dir() or (part.count("/") == 1 and not Path(part).exists())
        if part not in ("pld", "none") and not is_head:
            names = ", ".join([*shipped, "pld", "none"])
            raise UserError(f"unknown draft {part!r}: use {names}, a draft-head checkpoint directory or Hub id, or several joined by +")
    if len(parts) > 1 and "none" in parts:
        raise UserError(f"--draft {name!r}: 'none' cannot be combined with other drafts")
    if parts == ["none"]:
        return NoDrafter()
    cost = None
    if budget == "auto":
        from .bench import measure_verify_cost
        from .cost import VerifyCost

        cost = VerifyCost.from_measurement(measure_verify_cost(model, (1, 2, 4, 8, 16, 32), prefix_len=128, repeats=3))
        if cost is None:
            import logging

            logging.getLogger("specheads").info("the verify-cost curve is within timing noise: using the fixed tree budget")

    def one(part: str, tree_):
        if part == "pld":
            return PromptLookupDrafter(tree=tree_) if cost is None else PromptLookupDrafter(tree=tree_, cost=cost)
        from .head_drafters import load_head_drafter

        return load_head_drafter(part, model, tree_, cost)

    target = 0  # the drafter that --tree shapes (the drafters carry their trees; none is passed per call)
    if auto and tree is not None:  # a head that grows this kind of tree, else prompt lookup (last)
        target = next((i for i, part in enumerate(parts) if part == "pld" or _tree_fits(part, tree)), len(parts) - 1)
    drafters = [one(part, tree if i == target else None) for i, part in enumerate(parts)]
    return drafters[0] if len(drafters) == 1 else UnionDrafter(drafters)


def _tree_fits(head_path: str, tree) -> bool:
    """Whether the head at ``head_path`` grows ``tree``'s kind of tree (Medusa: static, EAGLE: dynamic)."""
    from heads.io import read_config, resolve

    from .tree import StaticTreeSpec

    return (read_config(resolve(head_path)).head_type in ("medusa", "medusa2")) == isinstance(tree, StaticTreeSpec)


def _tree(args):
    from .tree import load_tree_spec

    return load_tree_spec(args.tree) if args.tree else None


def _load(args):
    from .models import load_verifier

    return load_verifier(args.verifier, device=args.device)


def cmd_generate(args) -> int:
    from .engine import stream
    from .text import encode_prompt, eos_ids

    tree = _tree(args)
    lv = _load(args)
    drafter = make_drafter(args.draft, tree, lv.model, args.tree_budget)
    ids = encode_prompt(lv.tokenizer, args.prompt, chat=args.chat)
    chunks = stream(
        lv.model, drafter, ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, seed=args.seed, eos_token_id=eos_ids(lv.model, lv.tokenizer),
        stop=args.stop, tokenizer=lv.tokenizer, acceptance=args.acceptance,
    )
    if args.compare:  # warm both paths up so that the timings compare steady states
        from .bench import hf_generate

        hf_generate(lv.model, ids, 4, eos_ids(lv.model, lv.tokenizer))
        for _ in stream(lv.model, drafter, ids, max_new_tokens=4):
            pass
    tokens: list[int] = []
    printed = ""
    stats = None
    for chunk in chunks:
        tokens.extend(chunk.token_ids)
        stats = chunk.stats
        if not args.json:
            text = lv.tokenizer.decode(tokens, skip_special_tokens=True)
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                sys.stdout.write(text[len(printed):])
                sys.stdout.flush()
                printed = text
    text = lv.tokenizer.decode(tokens, skip_special_tokens=True)
    if args.json:
        print(json.dumps({"text": text, "token_ids": tokens, "stats": stats.as_dict()}))
    else:
        sys.stdout.write(text[len(printed):] + "\n")
        print(
            f"[{stats.new_tokens} tokens, tau {stats.mean_accepted:.2f}, {stats.tokens_per_s:.1f} tokens/s, "
            f"{stats.verify_steps} verify steps, finish: {stats.finish_reason}]",
            file=sys.stderr,
        )
    if args.compare:
        _compare(lv, ids, tokens, stats, args)
    return 0


def _compare(lv, ids, tokens, stats, args) -> None:
    """Time HF ``generate`` (greedy) on the same prompt and print the speedup."""
    import time

    from .bench import hf_generate
    from .text import eos_ids

    t0 = time.perf_counter()
    plain = hf_generate(lv.model, ids, args.max_new_tokens, eos_ids(lv.model, lv.tokenizer))
    plain_s = time.perf_counter() - t0
    spec_s = stats.prefill_s + stats.decode_s
    plain_tps, spec_tps = len(plain) / plain_s, len(tokens) / spec_s
    same = "identical" if plain == tokens else ("differs (sampling)" if args.temperature > 0 else "DIFFERS")
    report = {"plain_tokens_per_s": plain_tps, "spec_tokens_per_s": spec_tps, "speedup": spec_tps / plain_tps,
              "tau": stats.mean_accepted, "output_vs_plain": same}
    if args.json:
        print(json.dumps({"compare": report}))
    else:
        print(f"plain greedy (HF generate): {plain_tps:.1f} tokens/s | speculative: {spec_tps:.1f} tokens/s | "
              f"speedup {spec_tps / plain_tps:.2f}x | tau {stats.mean_accepted:.2f} | output {same}")


def cmd_bench(args) -> int:
    from pathlib import Path

    from .bench import (
        MT_BENCH_GROUP,
        add_efficiency,
        environment,
        measure_verify_cost,
        plot_results,
        read_prompts,
        run_bench,
        write_json,
    )

    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    if not methods:
        raise UserError("--methods is empty: give a comma-separated subset of vanilla,hf-pld,spec")
    if args.limit is not None and args.limit < 1:
        raise UserError("--limit must be >= 1")
    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be >= 1")
    prompts = read_prompts(args.prompts, args.limit, MT_BENCH_GROUP if args.group_mt_bench else None)
    tree = _tree(args)
    if args.temperature < 0:
        raise UserError("--temperature must be >= 0")
    lv = _load(args)
    names = [d.strip() for d in args.draft.split(",") if d.strip()]
    drafters = {Path(d).name or d: make_drafter(d, tree, lv.model, args.tree_budget) for d in names}
    if len(drafters) != len(names):
        raise UserError(f"--draft {args.draft!r}: give each draft once (labels are the last path component)")
    results = run_bench(lv.model, lv.tokenizer, drafters, prompts, methods=methods,
                        max_new_tokens=args.max_new_tokens, chat=args.chat is not False,
                        temperature=args.temperature, seed=args.seed)
    results["config"] = {
        "command": "specheads " + " ".join(sys.argv[1:]), "verifier": args.verifier, "draft": args.draft,
        "tree": args.tree, "tree_budget": args.tree_budget, "temperature": args.temperature,
        "max_new_tokens": args.max_new_tokens, "prompts": args.prompts, "n_prompts": len(prompts), **environment(),
    }
    if args.verify_cost:
        results["verify_cost"] = measure_verify_cost(lv.model)
        add_efficiency(results, results["verify_cost"])
    write_json(results, args.out)
    if args.plot:
        plot_results(results, args.plot)
    print(format_table(results))
    return 0


def format_table(results: dict) -> str:
    """A plain-text table of the overall and per-category numbers."""
    width = max(10, *(len(m) for m in results["methods"]))
    lines = [f"{'method':{width}} {'category':16} {'n':>4} {'tok/s':>8} {'tau':>6} {'speedup':>8} {'identical':>10} {'ideal':>7} {'effic.':>7}"]
    for m, r in results["methods"].items():
        for cat, v in [("overall", r["overall"]), *r["categories"].items()]:
            ident = f"{v['identical']}/{v['n']}" if "identical" in v else ""
            sp = f"{v['speedup']:.2f}x" if v.get("speedup") else ""
            ideal = f"{v['ideal_speedup']:.2f}x" if v.get("ideal_speedup") else ""
            eff = f"{v['efficiency']:.2f}" if v.get("efficiency") else ""
            lines.append(f"{m:{width}} {cat:16} {v['n']:>4} {v['tokens_per_s']:8.1f} {v['tau']:6.2f} {sp:>8} {ident:>10} {ideal:>7} {eff:>7}")
    return "\n".join(lines)


def cmd_chat(args) -> int:
    from .chat import ChatSession, run_chat
    from .engine import _check_params

    _check_params(args.max_new_tokens, args.temperature, args.top_p, args.top_k, "exact")
    tree = _tree(args)
    lv = _load(args)
    drafter = make_drafter(args.draft, tree, lv.model, args.tree_budget)
    gen = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
               top_k=args.top_k, seed=args.seed)
    return run_chat(ChatSession(lv.model, lv.tokenizer, drafter, args.system, gen))


def cmd_export(args) -> int:
    import torch

    from heads import CheckpointError, load_head
    from heads.interop import export_eagle3, export_medusa

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    try:
        head = load_head(args.draft)
        if args.format == "specheads":
            import shutil

            from heads.io import resolve, save_head

            out = save_head(head, args.out, weights_dtype=dtype)
            adapter = resolve(args.draft) / "adapter"  # Medusa-2: the verifier's LoRA adapters
            if adapter.is_dir():
                shutil.copytree(adapter, out / "adapter", dirs_exist_ok=True)
        elif args.format == "eagle3":
            out = export_eagle3(head, args.out, dtype=dtype)
        else:
            verifier = None
            if head.config.head_type == "medusa" and head.lm_heads is None:
                from .models import load_verifier

                verifier = load_verifier(args.verifier or head.config.verifier.name).model
            out = export_medusa(head, args.out, verifier, dtype=dtype)
    except CheckpointError as e:
        raise UserError(str(e)) from None
    print(out)
    return 0


def cmd_cost(args) -> int:
    from .bench import measure_verify_cost

    try:
        nodes = tuple(int(n) for n in args.nodes.split(","))
    except ValueError:
        raise UserError(f"--nodes must be comma-separated integers, not {args.nodes!r}") from None
    if not nodes or min(nodes) < 1 or args.prefix_len < 1 or args.repeats < 1:
        raise UserError("--nodes, --prefix-len and --repeats must be positive")
    lv = _load(args)
    cost = measure_verify_cost(lv.model, nodes, prefix_len=args.prefix_len, repeats=args.repeats)
    if args.json:
        print(json.dumps(cost))
    else:
        for n in nodes:
            print(f"{n:4d} nodes: {cost['seconds'][n] * 1000:8.1f} ms  {cost['relative'][n]:5.2f}x")
    return 0


def _run(cmd: list[str]) -> int:
    """Run a training-side program in a child process (infer never imports train)."""
    import subprocess

    try:
        return subprocess.call(cmd)
    except FileNotFoundError as e:
        raise UserError(f"cannot run {cmd[0]}: {e.strerror}") from None


def cmd_distill(rest: list[str]) -> int:
    return _run([sys.executable, "-m", "train.distill", *rest])


def cmd_train(args) -> int:
    import os
    import shutil

    accelerate = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or shutil.which("accelerate")
    if accelerate is None:
        raise UserError("accelerate is not installed: pip install accelerate")
    launch = ["--config_file", args.accelerate_config] if args.accelerate_config else ["--cpu", "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    resume = ["--resume"] if args.resume else []
    return _run([accelerate, "launch", *launch, "-m", "train.train_heads", "--config", args.config, *resume, *args.overrides])


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


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["distill"]:  # its options belong to train/distill.py
        return cmd_distill(argv[1:])
    args = build_parser().parse_args(argv)
    commands = {"generate": cmd_generate, "bench": cmd_bench, "cost": cmd_cost, "chat": cmd_chat, "train": cmd_train,
                "push": cmd_push, "export": cmd_export}
    try:
        return commands[args.command](args)
    except UserError as e:
        print(f"specheads: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specheads: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
