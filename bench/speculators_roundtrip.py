"""The speculators round trip on the default verifier, measured with the library itself (CPU, float32).

    pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0 && pip install openai loguru httpx aiohttp
    PYTHONPATH=. python bench/speculators_roundtrip.py [--out results/speculators-roundtrip.json]

1. The shipped default head exported as ``specheads export --format speculators --dtype fp32``
   does (``export_speculators``), loaded by speculators' ``Eagle3DraftModel.from_pretrained``: its
   next-token logits against ours, on the verifier's own hidden states for a prompt. The export
   names a temporary directory as its verifier (holding what speculators reads of it: config,
   embedding, LM head, final norm), since nothing here reaches the Hub.
2. A head speculators creates for the default verifier's shape (``from_training_args``, its own
   random init and default aux layers) and saves with its own ``save_pretrained``, imported by
   ``heads.load_head``: the same comparison.

Prints (and with ``--out`` writes) one JSON object: the max abs logit difference of each direction,
the logit scale and whether the argmax agrees at every position.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

PROMPT = "Explain in two sentences why the sky is blue, then give one everyday example."


def speculators_logits(directory: Path, aux: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[T, Vd]`` first-step logits of the speculators model in ``directory`` (eager attention, float32)."""
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(directory)
    config.transformer_layer_config._attn_implementation = "eager"
    model = Eagle3DraftModel.from_pretrained(directory, config=config).float().eval()
    seen = []
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: seen.append(out))
    with torch.no_grad():
        model(hidden_states=aux.flatten(-2), input_ids=ids, document_ids=torch.zeros_like(ids),
              position_ids=torch.arange(ids.shape[1])[None], ttt_steps=1)
    hook.remove()
    return seen[0][0].float()


def our_logits(head, model, aux: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    from heads.masks import causal_mask

    T = ids.shape[1]
    with torch.no_grad():
        hidden = head.fuse(aux)
        out = head(hidden, model.get_input_embeddings()(ids), torch.arange(T)[None], causal_mask(T, 0, 1, torch.float32, "cpu"))
        return head.logits(out)[0]


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    return {"max_abs_diff": float((a - b).abs().max()), "max_abs_logit": float(b.abs().max()),
            "argmax_agrees": bool(torch.equal(a.argmax(-1), b.argmax(-1))), "positions": int(a.shape[0])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from safetensors.torch import save_file
    from speculators.models.eagle3 import Eagle3DraftModel
    from transformers import LlamaConfig

    from heads import load_head
    from heads.interop import export_speculators
    from infer.core.models import load_verifier
    from infer.core.text import encode_prompt

    lv = load_verifier("default")
    model = lv.model
    ids = encode_prompt(lv.tokenizer, PROMPT)[None]
    result = {"prompt_tokens": int(ids.shape[1])}
    with tempfile.TemporaryDirectory() as tmp:
        vdir = Path(tmp) / "verifier"  # what speculators reads of a verifier: its config, embedding, LM head and final norm
        vdir.mkdir()
        cfg = {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"}  # the GGUF's, not serialisable
        (vdir / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
        save_file({"model.embed_tokens.weight": model.get_input_embeddings().weight.detach().contiguous(),
                   "lm_head.weight": model.get_output_embeddings().weight.detach().contiguous().clone(),
                   "model.norm.weight": model.model.norm.weight.detach().contiguous()}, vdir / "model.safetensors")
        head = load_head("default", verifier=model)
        with torch.no_grad():
            hs = model(ids, output_hidden_states=True).hidden_states
        aux = torch.stack([hs[i] for i in head.config.aux_layers], dim=2)[:, :-1]  # [1, T-1, 3, h]: state t with token t+1
        nxt = ids[:, 1:]
        # 1. ours -> speculators
        export_speculators(head, Path(tmp) / "ours", embed_tokens=model.get_input_embeddings().weight, verifier=str(vdir),
                           dtype=torch.float32)  # what `specheads export --format speculators --dtype fp32` writes
        result["export_loaded_by_speculators"] = compare(speculators_logits(Path(tmp) / "ours", aux, nxt), our_logits(head, model, aux, nxt))
        # 2. speculators -> ours
        c = model.config
        layer = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                            num_hidden_layers=1, num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                            head_dim=c.head_dim, max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                            rope_parameters=dict(c.rope_parameters), tie_word_embeddings=False)
        vocab = torch.arange(c.vocab_size)[: 8192]
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[vocab] = True
        torch.manual_seed(0)
        theirs = Eagle3DraftModel.from_training_args(
            layer, t2d=t2d, d2t=vocab - torch.arange(vocab.numel()), draft_vocab_size=vocab.numel(), norm_before_residual=False,
            ttt_steps=3, verifier_name_or_path=str(vdir), draft_attn_impl="eager")
        with torch.no_grad():  # its init leaves the layer near zero: scale it up so the comparison means something
            for name, p in theirs.named_parameters():
                if name.startswith(("fc.", "layers.")) and p.dim() > 1:
                    p.normal_(0, 0.05)
        theirs.save_pretrained(str(Path(tmp) / "theirs"))
        imported = load_head(Path(tmp) / "theirs", verifier=model)
        aux2 = torch.stack([hs[i] for i in imported.config.aux_layers], dim=2)[:, :-1]
        result["aux_layers_speculators_default"] = list(imported.config.aux_layers)
        result["speculators_head_imported"] = compare(our_logits(imported, model, aux2, nxt), speculators_logits(Path(tmp) / "theirs", aux2, nxt))
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
