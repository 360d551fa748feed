#!/usr/bin/env python3
"""Build train/data/chat_prompts.jsonl (chat, multi-turn chat, code, role-play writing).

Inputs: ONLY bare git snapshots fetched under /work/.mirror/ (read with `git --git-dir=<mirror>
show <commit>:<path>`, pinned below) and, to DROP overlapping prompts, the held-out Spec-Bench file
and HumanEval (never copied). The Spec-Bench check is the one of build_extra_prompts.py. No network,
no other files; deterministic.

Usage:  python3 train/data/build_chat_prompts.py [--out train/data/chat_prompts.jsonl]
            [--mirror DIR_OF_SNAPSHOTS] [--spec-bench SPEC_BENCH_JSONL]
Provenance, licenses and counts: train/data/EXTRA_SOURCES.md ("chat_prompts.jsonl").
"""
import argparse
import collections
import gzip
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import build_extra_prompts as extra  # noqa: E402  (same folder: norm, ngrams, the Spec-Bench check)

MAX_CHARS = extra.MAX_CHARS
MAX_TURNS = 3

COMMITS = {
    # a copy of anthropics/hh-rlhf's helpful-base/test.jsonl.gz, byte-identical: its sha256 is the
    # oid of the Git-LFS pointer at anthropics/hh-rlhf@354e5c3cb8960630860dd5774a6ac2a58313bf4d
    "DaehanKim/EasyRLHF": "45eccb72ddb8c18aa52dc2a184516380e06582fe",
    "teknium1/GPTeacher": "481075123c29854bddb82655badeef6a438f2436",
    "openai/human-eval": "6d43fb980f9fee3c892a914eda09951f772ad10d",
}
HH_SHA256 = "8be3fc1a13b27901631696f2be6f184c799f1baeaf145f53ac5db24960adc37b"


def git_show_bytes(mirror, repo, path):
    gd = f"{mirror}/{repo.replace('/', '+')}/repo"
    return subprocess.run(["git", "--git-dir", gd, "show", f"{COMMITS[repo]}:{path}"], check=True,
                          capture_output=True).stdout


def human_turns(conversation):
    """The Human turns of an hh-rlhf transcript ("\\n\\nHuman: ...\\n\\nAssistant: ..."), in order."""
    parts = re.split(r"\n\n(Human|Assistant): ", conversation)
    return [extra.clean(t) for role, t in zip(parts[1::2], parts[2::2]) if role == "Human"]


def build_hh(mirror):
    raw = git_show_bytes(mirror, "DaehanKim/EasyRLHF", "data/helpful-base/test.jsonl.gz")
    assert hashlib.sha256(raw).hexdigest() == HH_SHA256, "not the byte-identical copy of Anthropic's file"
    out = []
    for i, line in enumerate(gzip.decompress(raw).decode("utf-8").splitlines()):
        turns = human_turns(json.loads(line)["chosen"])[:MAX_TURNS]
        if len(turns) == 1:
            out.append({"id": f"hh_helpful-{i}", "source": "hh_helpful", "type": "chat", "prompt": turns[0]})
        elif turns:
            out.append({"id": f"hh_helpful-{i}", "source": "hh_helpful", "type": "multi_turn", "turns": turns})
    return out


def build_gpteacher(mirror, path, source, kind):
    rows = json.loads(git_show_bytes(mirror, "teknium1/GPTeacher", path).decode("utf-8"))
    out = []
    for i, r in enumerate(rows):
        text = extra.clean(r["instruction"]) + (f"\n\n{extra.clean(r['input'])}" if extra.clean(r.get("input", "")) else "")
        out.append({"id": f"{source}-{i}", "source": source, "type": kind, "prompt": text})
    return out


def humaneval_check(recs, mirror, stats):
    """Drop records sharing a word 8-gram with a HumanEval prompt (normalized as the Spec-Bench check;
    8-grams of numbers alone, such as "1 2 3 4 5 6 7 8", are common to any list example and not counted)."""
    data = gzip.decompress(git_show_bytes(mirror, "openai/human-eval", "data/HumanEval.jsonl.gz")).decode("utf-8")
    he8 = set()
    for line in data.splitlines():
        he8 |= {g for g in extra.ngrams(extra.norm(json.loads(line)["prompt"]).split(), 8) if not all(t.isdigit() for t in g)}
    kept, dropped = [], []
    for r in recs:
        if any(extra.ngrams(extra.norm(t).split(), 8) & he8 for t in extra.texts_of(r)):
            dropped.append((r["id"], "8gram with a HumanEval prompt"))
            stats["drop_humaneval", r["source"]] += 1
        else:
            kept.append(r)
    return kept, dropped


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="train/data/chat_prompts.jsonl")
    ap.add_argument("--mirror", default=extra.MIRROR, help="where the snapshots are: <mirror>/<owner>+<name>/repo")
    ap.add_argument("--spec-bench", default=extra.SPEC_BENCH, help="Spec-Bench question.jsonl (only to drop overlaps)")
    args = ap.parse_args()

    raw = (build_hh(args.mirror)
           + build_gpteacher(args.mirror, "Codegen/codegen-instruct.json", "gpteacher_code", "code")
           + build_gpteacher(args.mirror, "Roleplay/roleplay-simple-deduped-roleplay-instruct.json", "gpteacher_roleplay",
                             "writing"))
    stats = collections.Counter()
    seen, recs = set(), []
    for r in raw:  # length filter, exact dedup on normalized text (all turns joined)
        ts = extra.texts_of(r)
        if any(not t or len(t) > MAX_CHARS for t in ts):
            stats["drop_length_or_empty", r["source"]] += 1
            continue
        key = " || ".join(extra.norm(t) for t in ts)
        if key in seen:
            stats["drop_duplicate", r["source"]] += 1
            continue
        seen.add(key)
        recs.append(r)
    kept, dropped = extra.contamination_check(recs, stats, args.spec_bench)
    kept, dropped_he = humaneval_check(kept, args.mirror, stats)
    # any prefix mixes the sources: order by a hash of the id
    kept.sort(key=lambda r: hashlib.sha256(r["id"].encode()).hexdigest())
    for r in kept:
        assert r["type"] in {"chat", "multi_turn", "code", "writing"}
        assert ("prompt" in r) != ("turns" in r) and all(len(t) <= MAX_CHARS and "\r" not in t for t in extra.texts_of(r))
    assert len({r["id"] for r in kept}) == len(kept)
    with open(args.out, "w", encoding="utf-8") as f:
        for r in kept:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print("kept", len(kept), dict(collections.Counter((r["source"], r["type"]) for r in kept)))
    print("raw built per source:", dict(collections.Counter(r["source"] for r in raw)))
    print("drops:", {f"{a}/{b}": c for (a, b), c in sorted(stats.items())})
    for d in (dropped + dropped_he)[:40]:
        print("  ", d)
    print("multi_turn turn counts:", dict(collections.Counter(len(r["turns"]) for r in kept if "turns" in r)))


if __name__ == "__main__":
    sys.exit(main())
