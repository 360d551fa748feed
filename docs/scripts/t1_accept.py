"""Temperature 1.0: predicted against observed acceptance of the head's depth-1 drafts, per step."""
import json
import sys

import torch

from heads import load_head
from infer.core.accept import sample_accept, warp_probs
from infer.core.models import load_verifier
from infer.core.text import encode_prompt
from infer.core.tree import DynamicTreeSpec
from infer.core.verifier import Verifier
from infer.drafting.head_drafters import EagleDrafter

lv = load_verifier("default")
head_path = sys.argv[1] if len(sys.argv) > 1 else "default"
head = load_head(head_path, verifier=lv.model)
prompts = [json.loads(l)["turns"][0] for l in open("configs/prompts/spec_bench.jsonl")][::80][:6]
T = 1.0
rows = []
for pi, prompt in enumerate(prompts):
    d = EagleDrafter(head, lv.model, DynamicTreeSpec(5, 4, 16), adaptive=False)
    qs = []
    orig = d._logprobs
    def rec(hidden):
        lp = orig(hidden)
        qs.append(lp)
        return lp
    d._logprobs = rec
    v = Verifier(lv.model, d.feature_layers)
    ids = encode_prompt(lv.tokenizer, prompt)
    g = torch.Generator().manual_seed(pi)
    out = v.prefill(ids)
    d.begin(ids, out.features)
    root = int(torch.multinomial(warp_probs(out.logits[-1], T), 1, generator=g))
    n = 0
    while n < 96:
        qs.clear()
        draft = d.propose(root, max_depth=8, generator=g)
        vout = v.verify(draft.tokens, draft.tree)
        p = warp_probs(vout.logits, T)
        acc = sample_accept(draft.tokens, draft.tree, p, None, g)
        if draft.tree.num_nodes > 1:
            q_root = torch.zeros(p.shape[-1]).index_copy_(0, d.vocab_map, qs[0][0].exp())
            kids = (draft.tree.parents == 0).nonzero().flatten()
            x = draft.tokens[kids]
            first = x[0]
            rows.append({"overlap": float(torch.minimum(p[0], q_root).sum()),
                         "p_first": float(p[0, first]), "q_first": float(q_root[first]),
                         "p_kids": float(p[0, x].sum()), "q_kids": float(q_root[x].sum()),
                         "accepted": len(acc.node_ids) > 1, "first_accepted": len(acc.node_ids) > 1 and acc.node_ids[1] == int(kids[0])})
        v.commit(acc.nodes, acc.node_ids)
        d.update(torch.tensor((root,) + acc.tokens[:-1]), vout.features[acc.nodes])
        n += len(acc.tokens)
        root = acc.bonus
mean = lambda k: sum(float(r[k]) for r in rows) / len(rows)
print(json.dumps({k: round(mean(k), 4) for k in rows[0]} | {"steps": len(rows)}, indent=1))
