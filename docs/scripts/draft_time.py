"""Draft time per verify step of the shipped EAGLE-3 head (fixed 16-node eagle2 trees), for
whichever specheads is on sys.path first: run once with the old code, once with the new."""
import json

import torch

from infer import generate
from infer.core.models import load_verifier
from infer.core.text import encode_prompt, eos_ids
from infer.core.tree import load_tree_spec

lv = load_verifier("default")
tree = load_tree_spec("eagle2-16")
try:
    from infer.drafting.loading import load_drafter
    drafter = load_drafter("default", lv.model, tree=tree, budget="fixed")
    which = "new"
except ImportError:
    from infer.tools.cli import make_drafter
    drafter = make_drafter("default", tree, lv.model, "fixed")
    which = "old"
prompts = [json.loads(l)["turns"][0] for l in open("configs/prompts/spec_bench.jsonl")][::80][:6]
eos = eos_ids(lv.model, lv.tokenizer)
ids0 = encode_prompt(lv.tokenizer, prompts[0])
generate(lv.model, drafter, ids0, max_new_tokens=16, eos_token_id=eos)  # warm-up
draft = verify = steps = toks = 0
for p in prompts:
    res = generate(lv.model, drafter, encode_prompt(lv.tokenizer, p), max_new_tokens=128, eos_token_id=eos)
    draft += res.stats.draft_s; verify += res.stats.verify_s; steps += res.stats.verify_steps; toks += res.stats.new_tokens
print(json.dumps({"code": which, "draft_ms_per_step": round(1e3 * draft / steps, 2), "verify_ms_per_step": round(1e3 * verify / steps, 2),
                  "steps": steps, "tokens": toks, "tau": round(toks / steps, 3), "threads": torch.get_num_threads()}))
