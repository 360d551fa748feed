"""Pack distilled JSONL files (what ``specheads distill`` writes) into committed, xz-compressed parts.

    python train/data/pack_distilled.py train/data/distilled balanced=runs/distilled-v3.jsonl \
        extra=runs/distilled-v3-extra.jsonl

Each ``NAME=FILE`` becomes the series ``NAME-000.jsonl.xz``, ``NAME-001.jsonl.xz``, ...: part ``k``
holds records ``k*part_size .. (k+1)*part_size - 1`` of the file in its order, after the file's
header line (the verifier's fingerprint and the generation settings), so every part
checks on its own. Parts already packed with the same content are left untouched (xz output is
deterministic), so packing a growing distillation again only rewrites its last part, and a
commit after each pack adds what is new. ``MANIFEST.json`` lists each series with its header, per-source
record counts and parts (counts, sha256). ``--unpack`` writes a series back into one JSONL
(header once), which ``specheads distill --out`` then continues on a fresh machine. Training reads the directory directly
(``data: train/data/distilled``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import sys
from collections import Counter
from pathlib import Path


def _split(lines: list[str]) -> tuple[str | None, list[str]]:
    """``(header line or None, record lines)``; a torn last line (a running distillation) is left out."""
    lines = [ln for ln in lines if ln.strip()]
    header = lines[0] if lines and "id" not in json.loads(lines[0]) else None
    records = lines[1:] if header else lines
    if records:
        try:
            json.loads(records[-1])
        except json.JSONDecodeError:
            records = records[:-1]
    return header, records


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _source(record_id: str) -> str:
    """A record's prompt source: its id up to the first ``-`` (``dolly-123`` -> ``dolly``;
    ``oasst1_en_val-88fb828e-8d71-...`` -> ``oasst1_en_val``), as training's per-source evaluation
    groups them (``train.data.record_source``; this script stays free of torch, so it keeps its
    own copy, and a test holds the two together)."""
    head, dash, _ = str(record_id).partition("-")
    return head if dash else ""


def pack(src: Path, out: Path, name: str, part_size: int) -> dict:
    """Writes ``out/NAME-kkk.jsonl.xz`` for the records of ``src``; returns the series' manifest entry."""
    text = src.read_bytes().decode("utf-8")
    if not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
    header, records = _split(text.split("\n"))
    out.mkdir(parents=True, exist_ok=True)
    parts, sources = [], Counter()
    tokens = response = 0
    for k in range(0, len(records), part_size):
        chunk = records[k : k + part_size]
        body = "".join(ln + "\n" for ln in ([header] if header else []) + chunk).encode("utf-8")
        blob = lzma.compress(body, preset=9 | lzma.PRESET_EXTREME)
        path = out / f"{name}-{k // part_size:03d}.jsonl.xz"
        if not path.exists() or path.read_bytes() != blob:
            _write_atomic(path, blob)
        n_tok = n_resp = 0
        for ln in chunk:
            r = json.loads(ln)
            n_tok += len(r["input_ids"])
            n_resp += sum(r["loss_mask"])
            sources[_source(r["id"])] += 1
        tokens += n_tok
        response += n_resp
        parts.append({"file": path.name, "records": len(chunk), "tokens": n_tok, "response_tokens": n_resp,
                      "sha256": hashlib.sha256(blob).hexdigest()})
    return {
        "header": json.loads(header) if header else None,
        "records": len(records),
        "tokens": tokens,
        "response_tokens": response,
        "records_per_source": dict(sorted(sources.items(), key=lambda kv: -kv[1])),
        "parts": parts,
    }


def unpack(out: Path, name: str, dest: Path) -> int:
    """The series ``NAME`` of ``out`` back into one JSONL ``dest`` (header once); returns its records."""
    header, records = None, []
    for part in sorted(out.glob(f"{name}-[0-9][0-9][0-9].jsonl.xz")):
        h, recs = _split(lzma.decompress(part.read_bytes()).decode("utf-8").split("\n"))
        header = header or h
        records += recs
    _write_atomic(dest, "".join(ln + "\n" for ln in ([header] if header else []) + records).encode("utf-8"))
    return len(records)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path, help="the data directory (train/data/distilled)")
    p.add_argument("series", nargs="+", help="NAME=FILE: pack FILE as the series NAME (with --unpack: write it to FILE)")
    p.add_argument("--part-size", type=int, default=1000)
    p.add_argument("--unpack", action="store_true", help="write each series back into its FILE")
    a = p.parse_args(argv)
    pairs = [s.split("=", 1) for s in a.series]
    if any(len(x) != 2 or not x[0] or not x[1] for x in pairs):
        p.error("each series is NAME=FILE")
    if a.unpack:
        for name, file in pairs:
            print(f"{name}: {unpack(a.out, name, Path(file))} records -> {file}")
        return 0
    path = a.out / "MANIFEST.json"
    manifest = json.loads(path.read_text()) if path.exists() else {}
    for name, file in pairs:
        m = manifest[name] = pack(Path(file), a.out, name, a.part_size)
        print(f"{name}: {m['records']} records, {m['response_tokens']} response tokens in {len(m['parts'])} parts")
    _write_atomic(path, (json.dumps(dict(sorted(manifest.items())), indent=1) + "\n").encode("utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
