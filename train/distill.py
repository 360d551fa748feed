"""Self-distillation from the command line (``specheads distill`` runs this).

    python -m train.distill --verifier default --prompts train/data/train_prompts.jsonl \\
        --out runs/distilled-default.jsonl --shuffle --limit 4000 --max-new-tokens 256

Resumable: run the same command again after a stop and it continues where it left off. The
output's first line records the verifier and the generation settings; continuing it with another
verifier or other settings is refused, as is a second run writing the same file at once.
Data distilled before that header existed: ``--write-header-only`` with the options it was made
with prepends it (nothing is generated).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from train.data import distill, load_prompts, record_source

#: the generation settings distill() uses beyond the command line's (recorded in the header)
MAX_PROMPT_TOKENS, MAX_CONVERSATION_TOKENS = 768, 1536


def _stop_on_sigterm(signum, frame):
    """Stop as Ctrl-C does, once: a second SIGTERM (the command forwards one and, as it ends, the
    kernel sends another) must not break the clean-up into a traceback."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def prompts_of_sources(prompts: list, sources: list[str]) -> list:
    """The prompts whose id names one of ``sources`` (:func:`train.data.record_source`), in order;
    a source none of ``prompts`` comes from is refused by name (a typo would distil nothing)."""
    from infer.core.errors import UserError

    there = {record_source(q.id) for q in prompts}
    unknown = [x for x in sources if x not in there]
    if unknown or not sources:
        raise UserError(f"--sources {','.join(unknown) or '(empty)'}: no prompt in this range comes from it (sources "
                        f"there: {', '.join(sorted(there)) or 'none'})")
    wanted = set(sources)
    return [q for q in prompts if record_source(q.id) in wanted]


def _parser() -> argparse.ArgumentParser:
    """``specheads distill``'s arguments (errors: one line, exit 2)."""
    p = argparse.ArgumentParser(prog="specheads distill", description="Generate the verifier's own responses to prompts.")
    p.error = lambda message: p.exit(2, f"specheads distill: error: {message}\n")  # one line, exit 2
    p.add_argument("--verifier", default="default")
    p.add_argument("--prompts", default=None, help="JSONL (prompt, or turns: a conversation played out turn by turn), hf:NAME[:SPLIT], or synthetic:N")
    p.add_argument("--out", required=True, help="output JSONL (appended to; resumable)")
    p.add_argument("--limit", type=int, default=0, help="first N prompts only (0 = all)")
    p.add_argument("--skip", type=int, default=0,
                   help="leave out the first N prompts (after --shuffle, before --limit): distill a later range first")
    p.add_argument("--sources", default="",
                   help="only prompts of these prompt sources (comma-separated id prefixes, e.g. "
                        "oasst_en_100_text,self_instruct_seed), after --skip and --limit: one kind of prompt first")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shuffle", action="store_true", help="shuffle the prompts (seeded) before --limit")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp16", "fp32"), default="auto")
    p.add_argument("--write-header-only", action="store_true",
                   help="prepend the header record (this verifier and these settings) to an --out made before headers "
                        "existed, and stop (no --prompts; stop any run still writing it first)")
    return p


def _prompts(args) -> list:
    """The prompts ``args`` select: read, shuffled, skipped, limited and filtered by source."""
    from infer.core.errors import UserError
    from train.datafile import DataError

    try:
        prompts = load_prompts(args.prompts, args.limit and args.skip + args.limit, args.seed, shuffle=args.shuffle)[args.skip:]
    except DataError:
        raise
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read prompts {args.prompts}: {e}") from None
    if args.sources:
        prompts = prompts_of_sources(prompts, [x.strip() for x in args.sources.split(",") if x.strip()])
    return prompts


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if os.environ.get("SPECHEADS_DIE_WITH_PARENT"):  # run by `specheads distill`: end with it
        from infer.tools.procs import die_with_parent

        die_with_parent()
    from infer.core.errors import UserError
    from infer.core.models import load_verifier, resolve_device
    from infer.core.params import SamplingParams
    from infer.tools.files import check_output_file
    from train.datafile import (
        DataError,
        check_output_name,
        headerless_message,
        lock_file,
        make_header,
        open_elsewhere,
        scan_output,
        write_header,
    )

    out = Path(args.out)
    try:  # every argument and input is checked before the verifier loads
        SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
        if args.batch_size < 1 or args.limit < 0 or args.skip < 0:
            raise UserError("--batch-size must be >= 1, --limit and --skip >= 0")
        if args.prompts is None and not args.write_header_only:
            raise UserError("the following arguments are required: --prompts")
        check_output_file(args.out, "--out")
        check_output_name(out)
        resolve_device(args.device)
        prompts = [] if args.write_header_only else _prompts(args)
        lock = lock_file(out, f"--out {out}")  # held until this process ends
        scan = scan_output(out)  # a damaged file or one without a header: refused before loading
        if args.write_header_only and scan.header is not None:
            raise UserError(f"{out} already has a header: nothing to do")
        if args.write_header_only and open_elsewhere(out):
            raise UserError(f"{out} is open in process {', '.join(map(str, open_elsewhere(out)))}: stop it first (its later "
                            f"lines would go to the replaced file), then add the header")
        if not args.write_header_only and scan.header is None and scan.records:
            raise UserError(headerless_message(out))
        lv = load_verifier(args.verifier, dtype=args.dtype, device=args.device)
        settings = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                        max_prompt_tokens=MAX_PROMPT_TOKENS, max_conversation_tokens=MAX_CONVERSATION_TOKENS)
        if args.write_header_only:
            write_header(out, make_header(lv.model, args.verifier, **settings))
            print(f"wrote the header ({args.verifier}, {settings}) into {out} ({scan.records} records)")
            return 0
        if lv.tokenizer is None:
            raise UserError(f"verifier {args.verifier!r} has no tokenizer: distillation needs one")
        n = distill(lv.model, lv.tokenizer, prompts, out, batch_size=args.batch_size, verifier_name=args.verifier,
                    lock=False, **settings)
    except (UserError, DataError) as e:
        print(f"specheads: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C (or a forwarded SIGTERM): the file is consistent (no torn line)
        held = scan_output(out, repair=False).records if out.is_file() else 0
        print(f"specheads distill: interrupted; {out} holds {held} records: run the same command to continue",
              file=sys.stderr)
        return 130
    lock.release()
    print(f"wrote {n} records to {args.out}")
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _stop_on_sigterm)  # a kill stops as Ctrl-C does: the output stays consistent
    sys.exit(main())
