#!/usr/bin/env python3
"""Build train/data/extra_prompts.jsonl (translation, summarization, context QA, multi-turn).

Inputs: ONLY the bare git snapshots fetched under /work/.mirror/ (read with
`git --git-dir=<mirror> show <commit>:<path>`, pinned to the commits below) and,
for the contamination check, the held-out Spec-Bench file
/work/shared/data/spec_bench.jsonl (used only to DROP prompts, never copied).
No network access, no other files. Deterministic (fixed seeds).

Usage:  python3 train/data/build_extra_prompts.py [--out train/data/extra_prompts.jsonl]
            [--mirror DIR_OF_SNAPSHOTS] [--spec-bench SPEC_BENCH_JSONL]
Provenance, licenses and counts: train/data/EXTRA_SOURCES.md.
"""
import argparse
import collections
import hashlib
import json
import random
import re
import subprocess
import sys
import unicodedata

MIRROR = "/work/.mirror"
SPEC_BENCH = "/work/shared/data/spec_bench.jsonl"
MAX_CHARS = 2000

# repo -> pinned commit (HEAD of the fetched snapshot)
COMMITS = {
    "MicrosoftTranslator/NTREX": "8561f6a622db9edad1217683e5c83daefd8bb2bf",
    "google-deepmind/xquad": "7d30520c717524000f0d9d2f9c10a069acd9d285",
    "allenai/scitldr": "5ccad9c00a60ad75c9e04abf7f27d0f53f983b20",
    "pubmedqa/pubmedqa": "1cbae8e92f72f20c8d3747cbb3bf5bc53554d997",
    "TurkuNLP/oasst-fi": "45e9c4600eacf5844887e321ba3952befe9727dc",
}


def git_show(repo, path):
    gd = f"{MIRROR}/{repo.replace('/', '+')}/repo"
    out = subprocess.run(["git", "--git-dir", gd, "show", f"{COMMITS[repo]}:{path}"],
                         check=True, capture_output=True).stdout
    return out.decode("utf-8")


def clean(s):
    return s.replace("\r\n", "\n").replace("\r", "\n").strip()


def stable_rng(*parts):
    h = hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()
    return random.Random(int(h[:16], 16))


# ----------------------------------------------------------------- translation
NTREX_LANGS = {  # NTREX file code -> language name
    "deu": "German", "fra": "French", "spa": "Spanish", "ita": "Italian", "por": "Portuguese",
    "nld": "Dutch", "pol": "Polish", "rus": "Russian", "zho-CN": "Chinese", "jpn": "Japanese",
    "kor": "Korean", "arb": "Arabic", "hin": "Hindi", "tur": "Turkish",
}
# (source, target) -> how many sentence prompts
NTREX_QUOTA = [
    (("deu", "eng"), 130), (("fra", "eng"), 45), (("spa", "eng"), 45), (("rus", "eng"), 35),
    (("zho-CN", "eng"), 35), (("ita", "eng"), 25), (("por", "eng"), 25), (("jpn", "eng"), 25),
    (("nld", "eng"), 15), (("pol", "eng"), 15), (("kor", "eng"), 15), (("arb", "eng"), 15),
    (("hin", "eng"), 10), (("tur", "eng"), 10),
    (("eng", "deu"), 35), (("eng", "fra"), 20), (("eng", "spa"), 20),
]
NTREX_SUM_DOCS = 55          # documents kept aside for news summarization
NTREX_SUM_EXCLUDE = ("cnn.", "dailymail.")  # keep CNN / Daily Mail articles out of summarization
XQUAD_LANGS = {"de": "German", "es": "Spanish", "ru": "Russian", "zh": "Chinese", "ar": "Arabic",
               "el": "Greek", "hi": "Hindi", "ro": "Romanian", "th": "Thai", "tr": "Turkish",
               "vi": "Vietnamese"}
XQUAD_TR_CYCLE = ["de", "es", "zh", "ru", "de", "ar", "el", "hi", "ro", "th", "tr", "vi", "es", "zh", "ru", "de"]


def tr_prompt(src_lang, tgt_lang, text, key):
    r = stable_rng("tr", key)
    if r.random() < 0.7:
        return f"Translate {src_lang} to {tgt_lang}: {text}"
    return f"Translate the following {src_lang} text into {tgt_lang}:\n\n{text}"


def ntrex_data():
    ids = git_show("MicrosoftTranslator/NTREX", "DOCUMENT_IDS.tsv").split("\n")
    lines = {"eng": [clean(x) for x in git_show("MicrosoftTranslator/NTREX", "NTREX-128/newstest2019-src.eng.txt").split("\n")]}
    for code in NTREX_LANGS:
        lines[code] = [clean(x) for x in git_show("MicrosoftTranslator/NTREX", f"NTREX-128/newstest2019-ref.{code}.txt").split("\n")]
    n = 1997
    assert all(len(v) >= n for v in lines.values()) and len(ids) >= n
    docs = collections.OrderedDict()
    for i in range(n):
        docs.setdefault(ids[i].strip(), []).append(i)
    return ids, lines, docs


def build_ntrex(ids, lines, docs):
    rng = random.Random(20240611)
    eligible_sum = [d for d in docs if not d.startswith(NTREX_SUM_EXCLUDE)
                    and len(" ".join(lines["eng"][i] for i in docs[d])) >= 700]
    sum_docs = set(rng.sample(sorted(eligible_sum), NTREX_SUM_DOCS))
    # --- summarization: headline + leading sentences up to the length budget
    summ = []
    for d in docs:
        if d not in sum_docs:
            continue
        idx = docs[d]
        head, body = lines["eng"][idx[0]], []
        budget = MAX_CHARS - 120
        for i in idx[1:]:
            if len(head) + len(" ".join(body + [lines["eng"][i]])) > budget:
                break
            body.append(lines["eng"][i])
        truncated = len(body) < len(idx) - 1
        text = head + "\n\n" + " ".join(body)
        r = stable_rng("ntrex-sum", d)
        if truncated:
            instr = r.choice(["Summarize the following news article excerpt:",
                              "Summarize the key points of this news excerpt in a few sentences:"])
        else:
            instr = r.choice(["Summarize the following news article:",
                              "Summarize this news article in a few sentences:", "Summarize:"])
        prompt = f"{instr} {text}" if instr == "Summarize:" else f"{instr}\n\n{text}"
        summ.append({"id": f"ntrex_news_sum-{d}", "source": "ntrex_news_sum", "type": "summarization", "prompt": prompt})
    # --- translation: one sentence line per prompt, each line used at most once
    pool = [i for d in docs if d not in sum_docs for i in docs[d]
            if 40 <= len(lines["eng"][i]) <= 400]
    rng.shuffle(pool)
    trans, k = [], 0
    names = dict(NTREX_LANGS, eng="English")
    for (s, t), q in NTREX_QUOTA:
        got = 0
        while got < q and k < len(pool):
            i = pool[k]
            k += 1
            src = lines[s][i]
            if not src or not lines[t][i]:
                continue
            trans.append({"id": f"ntrex_tr-{s}-{t}-{i}", "source": "ntrex_tr", "type": "translation",
                          "prompt": tr_prompt(names[s], names[t], src, (s, t, i))})
            got += 1
    return trans, summ


def xquad_paragraphs(lang):
    d = json.loads(git_show("google-deepmind/xquad", f"xquad.{lang}.json"))
    return [(a["title"], p) for a in d["data"] for p in a["paragraphs"]]


def build_xquad():
    en = xquad_paragraphs("en")
    other = {lang: xquad_paragraphs(lang) for lang in XQUAD_LANGS}
    for ps in other.values():  # the files are aligned paragraph by paragraph
        assert len(ps) == len(en) and all(a[1]["qas"][0]["id"] == b[1]["qas"][0]["id"] for a, b in zip(ps, en))
    trans, qa = [], []
    for n, (_title, p) in enumerate(en):
        pid = p["qas"][0]["id"]
        if n % 2 == 1:   # odd paragraphs -> translation into English, one language each
            lang = XQUAD_TR_CYCLE[(n // 2) % len(XQUAD_TR_CYCLE)]
            src = clean(other[lang][n][1]["context"])
            trans.append({"id": f"xquad_tr-{lang}-{pid}", "source": "xquad_tr", "type": "translation",
                          "prompt": tr_prompt(XQUAD_LANGS[lang], "English", src, ("xq", lang, pid))})
        else:            # even paragraphs -> English reading comprehension, up to 3 questions
            ctx = clean(p["context"])
            for qa_item in p["qas"][:3]:
                q = clean(qa_item["question"])
                r = stable_rng("xq-qa", qa_item["id"])
                tpl = r.choice([
                    "Answer the question based on the passage.\n\nPassage: {c}\n\nQuestion: {q}",
                    "Read the following text and answer the question.\n\n{c}\n\nQuestion: {q}",
                    "{c}\n\nAccording to the passage above, answer this question: {q}",
                ])
                qa.append({"id": f"xquad_en_qa-{qa_item['id']}", "source": "xquad_en_qa", "type": "context_qa",
                           "prompt": tpl.format(c=ctx, q=q)})
    return trans, qa


# --------------------------------------------------------------- summarization
def build_scitldr(n_keep=400):
    rows = []
    for split in ("train", "dev"):   # the SciTLDR test split is left out
        for line in git_show("allenai/scitldr", f"SciTLDR-Data/SciTLDR-A/{split}.jsonl").splitlines():
            if line.strip():
                d = json.loads(line)
                rows.append((split, d["paper_id"], clean(" ".join(s.strip() for s in d["source"]))))
    rows = [r for r in rows if 400 <= len(r[2]) <= MAX_CHARS - 120]
    rng = random.Random(7)
    rng.shuffle(rows)
    out = []
    for _split, pid, text in rows[:n_keep]:
        r = stable_rng("scitldr", pid)
        instr = r.choice([
            "Summarize the following abstract in one sentence:",
            "Write a one-sentence TL;DR of this paper abstract:",
            "Summarize this research abstract in two or three sentences:",
            "Summarize the following text:",
        ])
        out.append({"id": f"scitldr-{pid}", "source": "scitldr", "type": "summarization",
                    "prompt": f"{instr}\n\n{text}"})
    return out


def build_pubmedqa(n_qa=300, n_sum=200):
    data = json.loads(git_show("pubmedqa/pubmedqa", "data/ori_pqal.json"))
    test = set(json.loads(git_show("pubmedqa/pubmedqa", "data/test_ground_truth.json")))
    pmids = sorted(k for k in data if k not in test)   # only the 500 non-test PQA-L items
    random.Random(11).shuffle(pmids)
    qa, summ = [], []
    for pmid in pmids:
        d = data[pmid]
        ctx = clean("\n\n".join(c.strip() for c in d["CONTEXTS"]))
        if len(ctx) > MAX_CHARS - 250:
            continue
        if len(qa) < n_qa:
            r = stable_rng("pqa-qa", pmid)
            tpl = r.choice([
                "Answer the question based on the abstract below.\n\nAbstract: {c}\n\nQuestion: {q}",
                "Read the following research abstract and answer the question (yes, no or maybe), then explain briefly.\n\n{c}\n\nQuestion: {q}",
            ])
            qa.append({"id": f"pubmedqa_qa-{pmid}", "source": "pubmedqa_qa", "type": "context_qa",
                       "prompt": tpl.format(c=ctx, q=clean(d["QUESTION"]))})
        elif len(summ) < n_sum:
            r = stable_rng("pqa-sum", pmid)
            instr = r.choice(["Summarize the following medical research abstract:",
                              "Summarize this study in plain language for a general reader:",
                              "Summarize the following text in a few sentences:"])
            summ.append({"id": f"pubmedqa_sum-{pmid}", "source": "pubmedqa_sum", "type": "summarization",
                         "prompt": f"{instr}\n\n{ctx}"})
    return qa, summ


# ------------------------------------------------------------------ multi-turn
def build_oasst(max_per_root=5):
    msgs = [json.loads(line) for line in git_show("TurkuNLP/oasst-fi", "original-data/en-validation.jsonl").splitlines() if line.strip()]
    kids = collections.defaultdict(list)
    for m in msgs:
        kids[m["parent_id"]].append(m)

    def lab(m, name):
        L = m.get("labels") or {}
        names = L.get("name") or []
        return L["value"][names.index(name)] if name in names else 0.0

    def ok(m):
        return (not m["deleted"] and m.get("review_result") is not False and m["lang"] == "en"
                and lab(m, "spam") < 0.5 and lab(m, "not_appropriate") < 0.5
                and (m.get("detoxify") or {}).get("toxicity", 0.0) < 0.5 and clean(m["text"]))

    def ranked(ms):
        return sorted(ms, key=lambda m: (m["rank"] if m["rank"] is not None else 99, m["created_date"]))

    out = []
    roots = sorted((m for m in msgs if m["parent_id"] is None and m["role"] == "prompter"), key=lambda m: m["created_date"])
    for root in roots:
        if not ok(root):
            continue
        n_root = 0
        for a1 in ranked(kids[root["message_id"]]):
            if a1["role"] != "assistant" or not ok(a1):
                continue
            for p2 in sorted(kids[a1["message_id"]], key=lambda m: m["created_date"]):
                if p2["role"] != "prompter" or not ok(p2) or n_root >= max_per_root:
                    continue
                turns, last = [clean(root["text"]), clean(p2["text"])], p2
                for a2 in ranked(kids[p2["message_id"]]):   # extend to a third user turn when there is one
                    p3s = [m for m in sorted(kids[a2["message_id"]], key=lambda m: m["created_date"])
                           if a2["role"] == "assistant" and ok(a2) and m["role"] == "prompter" and ok(m)]
                    if p3s:
                        turns.append(clean(p3s[0]["text"]))
                        last = p3s[0]
                        break
                out.append({"id": f"oasst1_en_val-{last['message_id']}", "source": "oasst1_en_val",
                            "type": "multi_turn", "turns": turns})
                n_root += 1
    return out


# ------------------------------------------------------ normalization & checks
def norm(s):
    s = unicodedata.normalize("NFKC", s).lower()
    return re.sub(r"[\W_]+", " ", s).strip()


def ngrams(toks, n):
    return {tuple(toks[i:i + n]) for i in range(len(toks) - n + 1)}


def texts_of(rec):
    return rec["turns"] if rec["type"] == "multi_turn" else [rec["prompt"]]


def contamination_check(recs, stats, spec_bench_path=SPEC_BENCH):
    """Drop records that overlap Spec-Bench (rules in EXTRA_SOURCES.md). Returns (kept, dropped)."""
    # Spec-Bench: all turns of all 480 questions
    sb = [json.loads(line) for line in open(spec_bench_path, encoding="utf-8")]
    sb_norm = [(q["question_id"], q["category"], norm(t)) for q in sb for t in q["turns"]]
    sb_exact = {t for _, _, t in sb_norm}
    sb6 = collections.defaultdict(set)   # 6-gram -> turn indices
    sb6_count = []
    for j, (_, _, t) in enumerate(sb_norm):
        g = ngrams(t.split(), 6)
        sb6_count.append(len(g))
        for x in g:
            sb6[x].add(j)
    SRC_CATS = {"translation", "summarization", "rag", "qa"}
    sb8 = set()
    for _, cat, t in sb_norm:
        if cat in SRC_CATS:
            sb8 |= ngrams(t.split(), 8)

    kept, dropped = [], []
    for r in recs:
        reason = None
        for t in texts_of(r):
            nt = norm(t)
            toks = nt.split()
            if nt in sb_exact:
                reason = "exact"
                break
            g6 = ngrams(toks, 6)
            hits = collections.Counter(j for x in g6 for j in sb6.get(x, ()))
            for j, c in hits.items():
                shorter = min(len(g6), sb6_count[j])
                if shorter and c / shorter >= 0.5:
                    reason = f"6gram>=50% (spec_bench q{sb_norm[j][0]} {sb_norm[j][1]})"
                    break
            if reason:
                break
            if ngrams(toks, 8) & sb8:
                reason = "8gram with translation/summarization/rag/qa turn"
                break
        if reason:
            dropped.append((r["id"], reason))
            stats["drop_contamination", r["source"]] += 1
        else:
            kept.append(r)
    return kept, dropped


def main():
    global MIRROR
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="train/data/extra_prompts.jsonl")
    ap.add_argument("--mirror", default=MIRROR, help="where the snapshots are: <mirror>/<owner>+<name>/repo")
    ap.add_argument("--spec-bench", default=SPEC_BENCH, help="Spec-Bench question.jsonl (only to drop overlaps)")
    args = ap.parse_args()
    MIRROR = args.mirror

    ids, lines, docs = ntrex_data()
    ntrex_tr, ntrex_sum = build_ntrex(ids, lines, docs)
    xq_tr, xq_qa = build_xquad()
    sci = build_scitldr()
    pqa_qa, pqa_sum = build_pubmedqa()
    oas = build_oasst()
    raw = ntrex_tr + xq_tr + sci + pqa_sum + ntrex_sum + xq_qa + pqa_qa + oas
    stats = collections.Counter()

    # length filter, exact dedup (normalized text; multi-turn: all turns joined)
    seen, recs = set(), []
    for r in raw:
        ts = [clean(t) for t in texts_of(r)]
        if r["type"] == "multi_turn":
            r["turns"] = ts
        else:
            r["prompt"] = ts[0]
        if any(not t or len(t) > MAX_CHARS for t in ts):
            stats["drop_length_or_empty", r["source"]] += 1
            continue
        key = (r["type"], " || ".join(norm(t) for t in ts))
        if key in seen:
            stats["drop_duplicate", r["source"]] += 1
            continue
        seen.add(key)
        recs.append(r)

    kept, dropped = contamination_check(recs, stats, args.spec_bench)

    # final assertions
    for r in kept:
        assert r["type"] in {"translation", "summarization", "context_qa", "multi_turn"}
        if r["type"] == "multi_turn":
            assert "prompt" not in r and 2 <= len(r["turns"]) <= 3
        assert all(len(t) <= MAX_CHARS and "\r" not in t for t in texts_of(r))
    assert len({r["id"] for r in kept}) == len(kept)

    with open(args.out, "w", encoding="utf-8") as f:
        for r in kept:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")

    by_src = collections.Counter((r["type"], r["source"]) for r in kept)
    by_type = collections.Counter(r["type"] for r in kept)
    print("kept", len(kept), dict(by_type))
    for (t, s), c in sorted(by_src.items()):
        print(f"  {t:14s} {s:16s} {c}")
    print("raw built per source:", dict(collections.Counter(r["source"] for r in raw)))
    print("drops:", {f"{a}/{b}": c for (a, b), c in sorted(stats.items())})
    print("contamination drops:", len(dropped))
    for d in dropped:
        print("  ", d)
    mt = collections.Counter(len(r["turns"]) for r in kept if r["type"] == "multi_turn")
    print("multi_turn turn counts:", dict(mt))


if __name__ == "__main__":
    sys.exit(main())
