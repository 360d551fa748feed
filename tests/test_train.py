"""Training: only head parameters change, accumulation and DDP equal a bigger batch, resume
reproduces an uninterrupted run, and the CLI recipe trains a head the engine can use."""

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from infer import generate
from infer.core.models import load_verifier
from infer.drafting.head_drafters import load_head_drafter
from train.config import ConfigError, load_config
from train.data import distill, load_prompts, load_records, record_source
from train.train_heads import train

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "tiny-cpu.yaml"


# accelerate's process-wide state is reset after every test of this file (conftest)
pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "distilled.jsonl"
    lv = load_verifier("tiny-random:llama")
    distill(lv.model, lv.tokenizer, load_prompts("synthetic:48"), path, max_new_tokens=32, batch_size=16, progress=False)
    return path


def run(tmp_path, distilled, name="run", **over):
    over = {"data": str(distilled), "prompts": "", "output_dir": str(tmp_path / name), "max_steps": 6,
            "save_every": 100, "eval_every": 100, "warmup_steps": 1, **over}
    cfg = load_config(RECIPE, [f"{k}={v}" for k, v in over.items()])
    return train(cfg)


def head_state(out_dir) -> dict:
    return load_file(str(Path(out_dir) / "model.safetensors"))


@pytest.mark.parametrize("head_type", ["medusa", "eagle1", "eagle3", "medusa2", "dflash"])
def test_training_changes_only_the_head(tmp_path, distilled, head_type):
    res = run(tmp_path, distilled, head_type=head_type, max_steps=12, lr=3e-3, medusa_num_heads=2)
    losses = [h["loss"] for h in res["history"]]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3  # it learns
    # every head parameter moved away from its initial value
    torch.manual_seed(0)
    from train.train_heads import build_draft_head

    fresh_model = load_verifier("tiny-random:llama").model
    cfg = load_config(RECIPE, [f"head_type={head_type}", "medusa_num_heads=2", f"data={distilled}", "prompts="])
    init = build_draft_head(cfg, fresh_model, load_records(distilled, cfg.max_seq_len))
    trained = dict(res["head"].named_parameters())
    for name, p0 in init.named_parameters():
        assert not torch.equal(p0, trained[name].detach().cpu()), f"{name} did not change"
    # the verifier's own weights are bit-identical (Medusa-2: only its LoRA adapters train)
    verifier = res["verifier"]
    for name, p in fresh_model.state_dict().items():
        key = name if head_type != "medusa2" else None
        if key is None:
            continue
        assert torch.equal(p, verifier.state_dict()[key]), name
    if head_type == "medusa2":
        base = {k.replace("base_model.model.", "").replace(".base_layer", ""): v
                for k, v in verifier.state_dict().items() if "lora_" not in k}
        for name, p in fresh_model.state_dict().items():
            assert torch.equal(p, base[name]), name
        assert any(p.requires_grad for n, p in verifier.named_parameters() if "lora_" in n)
        assert (tmp_path / "run" / "adapter" / "adapter_config.json").is_file()
        # at inference the adapters are merged into the verifier, and greedy output is its own
        model = load_verifier("tiny-random:llama").model
        drafter = load_head_drafter(str(tmp_path / "run"), model)
        assert not torch.equal(model.model.layers[0].self_attn.q_proj.weight, fresh_model.model.layers[0].self_attn.q_proj.weight)
        ids = torch.tensor([5, 6, 7, 8, 9])
        ref = model.generate(ids[None], attention_mask=torch.ones(1, 5, dtype=torch.long), max_new_tokens=16,
                             min_new_tokens=16, do_sample=False, pad_token_id=0)[0, 5:].tolist()
        assert generate(model, drafter, ids, max_new_tokens=16).token_ids == ref


# Adam's first steps move every weight by about +-lr whatever the gradient's size, so a weight
# whose gradient is ~0 flips with rounding noise; SGD compares the gradients themselves.
SGD = {"optimizer": "sgd", "lr": 0.5}


@pytest.mark.parametrize("window, head_type", [(0, "eagle3"), (16, "eagle3"), (16, "dflash")])
def test_grad_accumulation_matches_bigger_batch(tmp_path, distilled, window, head_type):
    """Also with length-sorted windows (batches of similar lengths): the windows do not depend
    on the batch size, so both runs see the same records in the same order (and the block
    drafter's random anchors, drawn per record, are the same blocks)."""
    run(tmp_path, distilled, "accum", batch_size=1, grad_accum=4, max_steps=3, length_window=window, head_type=head_type, **SGD)
    run(tmp_path, distilled, "big", batch_size=4, grad_accum=1, max_steps=3, length_window=window, head_type=head_type, **SGD)
    a, b = head_state(tmp_path / "accum"), head_state(tmp_path / "big")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=2e-5, rtol=1e-4)


def test_length_windows_sort_within_windows_only():
    from train.data import Record
    from train.train_heads import length_sorted_windows

    records = [Record([0] * n, [1] * n) for n in (5, 1, 4, 2, 9, 3)]
    assert length_sorted_windows([0, 1, 2, 3, 4, 5], records, 3) == [1, 2, 0, 3, 5, 4]
    assert length_sorted_windows([0, 1, 2, 3, 4, 5], records, 0) == [0, 1, 2, 3, 4, 5]


def test_bf16_autocast_on_a_cpu_without_native_bf16_is_warned_about(monkeypatch):
    import infer.drafting.head_drafters as hd
    from train.train_heads import slow_autocast_warning

    cpu = torch.device("cpu")
    monkeypatch.setattr(hd, "cpu_has_fast_bf16", lambda: False)
    warning = slow_autocast_warning(cpu, "bf16")
    assert warning and "mixed_precision=no" in warning and "\n" not in warning
    assert slow_autocast_warning(cpu, "no") is None and slow_autocast_warning(cpu, "fp16") is None
    assert slow_autocast_warning(torch.device("cuda"), "bf16") is None  # not a CPU question
    monkeypatch.setattr(hd, "cpu_has_fast_bf16", lambda: True)
    assert slow_autocast_warning(cpu, "bf16") is None


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, distilled):
    """8 steps in one go (checkpoints do not change the run): its history and final head."""
    tmp = tmp_path_factory.mktemp("full")
    res = run(tmp, distilled, "full", max_steps=8, save_every=2)
    return res["history"], head_state(tmp / "full")


def _assert_same_run(out_dir, uninterrupted) -> None:
    """``out_dir`` holds the whole history of the uninterrupted run and its head, bit for bit."""
    history, state = uninterrupted
    resumed = json.loads((Path(out_dir) / "train_history.json").read_text())
    assert [h["step"] for h in resumed] == [h["step"] for h in history]
    for x, y in zip(resumed, history):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-6), x["step"]
    head = head_state(out_dir)
    for k in state:
        assert torch.equal(head[k], state[k]), k


def _resume(tmp_path, distilled, name, **over):
    from train.train_heads import main

    over = {"max_steps": 8, "save_every": 4, "eval_every": 100, "warmup_steps": 1, **over}
    return main(["--config", str(RECIPE), "--resume", f"data={distilled}", "prompts=", f"output_dir={tmp_path / name}",
                 *(f"{k}={v}" for k, v in over.items())])


def test_resume_reproduces_an_uninterrupted_run(tmp_path, distilled, uninterrupted):
    """Resume takes the newest complete checkpoint (it has train_state.json): a kill during a
    checkpoint write leaves a torn directory, which is skipped; stale temporary ones are removed.
    The resumed run keeps the whole history and equals an uninterrupted one."""
    first = run(tmp_path, distilled, "killed", max_steps=8, save_every=4, interrupt_after=5)
    ckpts = tmp_path / "killed" / "checkpoints"
    assert first["interrupted"] and (ckpts / "step_4" / "train_state.json").is_file()
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_4"]  # written under a temporary name, then renamed
    assert not (tmp_path / "killed" / "model.safetensors").exists()
    torn = ckpts / "step_6"  # newer, but torn: 0-byte optimizer state, no train_state.json
    torn.mkdir()
    (torn / "optimizer.safetensors").write_bytes(b"")
    (ckpts / ".tmp-step_5").mkdir()
    (ckpts / ".tmp-step_5" / "model.safetensors").write_bytes(b"")
    assert _resume(tmp_path, distilled, "killed") == 0
    assert not (ckpts / ".tmp-step_5").exists()
    _assert_same_run(tmp_path / "killed", uninterrupted)  # steps 1-4 from the checkpoint, then 5-8


def test_resume_reproduces_an_uninterrupted_dflash_run(tmp_path, distilled):
    """The block drafter draws its anchors from the global RNG, which the checkpoint restores:
    stopped after step 5 and resumed from step 4, it ends bit-identical to an uninterrupted run."""
    full = run(tmp_path, distilled, "full", head_type="dflash", max_steps=8, save_every=2)
    first = run(tmp_path, distilled, "killed", head_type="dflash", max_steps=8, save_every=4, interrupt_after=5)
    assert first["interrupted"]
    assert _resume(tmp_path, distilled, "killed", head_type="dflash") == 0
    _assert_same_run(tmp_path / "killed", (full["history"], head_state(tmp_path / "full")))


KILLER = """
import os, signal, sys
import train.train_heads as th

write, calls = th.write_training_state, [0]
kill_at, mid_write = int(sys.argv[1]), sys.argv[2] == "mid-write"

def dying_write(path, *args, **kwargs):
    calls[0] += 1
    if calls[0] == kill_at and not mid_write:  # between checkpoints: steps done since the last one are lost
        os.kill(os.getpid(), signal.SIGKILL)
    out = write(path, *args, **kwargs)
    if calls[0] == kill_at:  # mid-write: the files are there, optimizer torn, no train_state.json yet
        open(os.path.join(path, "optimizer.safetensors"), "wb").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return out

th.write_training_state = dying_write
sys.exit(th.main(sys.argv[3:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("when", ["between", "mid-write"])
def test_sigkill_then_resume_is_bit_identical(tmp_path, distilled, uninterrupted, when):
    """A real SIGKILL of a training process at its third checkpoint (step 6): before writing it
    (between checkpoints), or while writing it. --resume continues from step 4 and the head
    equals an uninterrupted run's bit for bit."""
    args = ["--config", str(RECIPE), f"data={distilled}", "prompts=", f"output_dir={tmp_path / 'k'}", "max_steps=8",
            "save_every=2", "eval_every=100", "warmup_steps=1"]
    proc = subprocess.run([sys.executable, "-c", KILLER, "3", when, *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == -9, proc.stderr[-2000:]
    ckpts = tmp_path / "k" / "checkpoints"
    complete = sorted(p.name for p in ckpts.iterdir() if (p / "train_state.json").is_file())
    assert complete == ["step_2", "step_4"] and not (ckpts / "step_6").exists()
    assert (ckpts / ".tmp-step_6").is_dir() == (when == "mid-write")
    assert _resume(tmp_path, distilled, "k", save_every=2) == 0
    _assert_same_run(tmp_path / "k", uninterrupted)


def _launch(*args, procs=1, timeout=300):
    """One process through `accelerate launch --cpu`; several through torchrun, with accelerate
    doing DDP over gloo inside (accelerate's own launcher starts several CPU processes only
    through MPI)."""
    script = str(ROOT / "train" / "train_heads.py")
    bin_dir = Path(sys.executable).parent
    if procs == 1:
        cmd = [str(bin_dir / "accelerate"), "launch", "--cpu", "--num_processes", "1", "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", script, *args]
    else:
        cmd = [str(bin_dir / "torchrun"), "--nproc_per_node", str(procs), "--master_port", "29533", script, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.slow
def test_two_process_gloo_run_matches_one_process(tmp_path, distilled):
    common = ["--config", str(RECIPE), f"data={distilled}", "prompts=", "max_steps=3", "save_every=100", "eval_every=100",
              *(f"{k}={v}" for k, v in SGD.items())]
    two = _launch(*common, f"output_dir={tmp_path / 'ddp'}", "batch_size=2", procs=2)
    assert two.returncode == 0, two.stderr[-2000:]
    assert "2 process(es), DistributedType.MULTI_CPU" in two.stdout
    one = _launch(*common, f"output_dir={tmp_path / 'single'}", "batch_size=4", procs=1)
    assert one.returncode == 0, one.stderr[-2000:]
    a, b = head_state(tmp_path / "ddp"), head_state(tmp_path / "single")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=2e-5, rtol=1e-4)


@pytest.mark.slow
def test_cli_recipe_trains_a_head_that_generate_loads(tmp_path):
    out = tmp_path / "tiny"
    proc = _launch("--config", str(RECIPE), f"output_dir={out}", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    card = (out / "README.md").read_text()
    assert "eagle3" in card and "tiny-random:llama" in card and "estimated tau" in card
    exe = Path(sys.executable).parent / "specheads"
    gen = subprocess.run([str(exe), "generate", "--verifier", "tiny-random:llama", "--draft", str(out), "--prompt",
                          "Repeat: one two three one two three", "--max-new-tokens", "40", "--json",
                          "--tree-budget", "fixed"],  # a tiny model's sub-ms cost curve is timing noise
                         capture_output=True, text=True, timeout=120)
    assert gen.returncode == 0, gen.stderr[-2000:]
    spec = json.loads(gen.stdout)
    lv = load_verifier("tiny-random:llama")
    from infer.core.text import encode_prompt

    ids = encode_prompt(lv.tokenizer, "Repeat: one two three one two three")
    plain = generate(lv.model, None, ids, max_new_tokens=40, eos_token_id=lv.tokenizer.eos_token_id)
    assert spec["token_ids"] == plain.token_ids
    assert spec["stats"]["mean_accepted"] > 1.3
    # and through the Python API, greedy stays identical on other prompts too
    drafter = load_head_drafter(str(out), lv.model)
    for text in ("Repeat: red green blue red green blue", "Repeat: cat dog cat dog"):
        ids = encode_prompt(lv.tokenizer, text)
        assert generate(lv.model, drafter, ids, max_new_tokens=30).token_ids == generate(lv.model, None, ids, max_new_tokens=30).token_ids


def test_distill_resumes_and_writes_each_record_once(tmp_path):
    lv = load_verifier("tiny-random:llama")
    prompts = load_prompts("synthetic:10")
    path = tmp_path / "d.jsonl"
    distill(lv.model, lv.tokenizer, prompts[:4], path, max_new_tokens=8, batch_size=4, progress=False)
    with open(path, "a") as f:
        f.write('{"id": "synthetic-4", "input_')  # killed mid-write
    written = distill(lv.model, lv.tokenizer, prompts, path, max_new_tokens=8, batch_size=4, progress=False)
    assert written == 6
    header, *lines = path.read_text().splitlines()
    assert json.loads(header)["verifier"]["model_type"] == "llama"  # the header record comes first
    ids = [json.loads(line)["id"] for line in lines]
    assert sorted(ids) == sorted(p.id for p in prompts)
    for line in lines:
        rec = json.loads(line)
        assert len(rec["input_ids"]) == len(rec["loss_mask"]) and sum(rec["loss_mask"]) >= 1
        assert rec["loss_mask"] == sorted(rec["loss_mask"])  # prompt (0s) then response (1s)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
def test_batched_distill_answers_equal_each_prompt_alone(arch):
    """Left padding, explicit positions and rows leaving the batch as they end: every answer is the
    verifier's own greedy continuation of its prompt alone (HF ``generate``, one prompt)."""
    from train.data import _generate

    model = load_verifier(f"tiny-random:{arch}").model
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (3, 11, 6, 17)]
    with torch.inference_mode():
        alone = [model.generate(torch.tensor([e]), attention_mask=torch.ones(1, len(e), dtype=torch.long),
                                max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(e):].tolist()
                 for e in seqs]
    stop = alone[1][4]  # an end token that ends row 1 at step 5 and may end others earlier or never

    def cut(resp):
        return resp[: resp.index(stop) + 1] if stop in resp else resp

    with torch.inference_mode():
        got = _generate(model, seqs, pad=0, eos=[stop], max_new_tokens=12, temperature=0.0)
    assert got == [cut(r) for r in alone]
    assert min(map(len, got)) < 12 == max(map(len, got))  # rows did leave the batch early, and one ran to the end


@pytest.mark.slow
def test_sampled_distill_answers_follow_the_verifier_distribution():
    """Sampled distillation at temperature T draws each prompt's token from softmax(logits / T) of
    that prompt alone, left padding and all (two prompt lengths in one batch)."""
    from train.data import _generate

    model = load_verifier("tiny-random:llama").model
    prompts, n, temperature = [[5, 17, 42], [9, 3, 88, 120, 7, 61, 33]], 20000, 0.7
    with torch.inference_mode():
        got = _generate(model, [e for e in prompts for _ in range(n)], pad=0, eos=[], max_new_tokens=1,
                        temperature=temperature, generator=torch.Generator().manual_seed(1))
        for k, e in enumerate(prompts):
            logits = model(torch.tensor([e])).logits[0, -1].float()
            want, wrong = torch.softmax(logits / temperature, -1), torch.softmax(logits, -1)
            seen = torch.bincount(torch.tensor([a[0] for a in got[k * n : (k + 1) * n]]), minlength=len(want)) / n
            assert 0.5 * (seen - want).abs().sum() < 0.05  # sampling noise at n = 20,000: ~0.03
            assert 0.5 * (wrong - want).abs().sum() > 0.1  # the test would see a wrong temperature


def test_multi_turn_distillation_answers_each_turn_in_its_own_context(tmp_path):
    """A conversation batched with a one-turn prompt: the record holds every turn, and each answer
    (a run of 1s in the loss mask) is the verifier's greedy continuation of everything before it."""
    import itertools

    from infer.core.text import eos_ids

    lv = load_verifier("tiny-random:llama")
    (tmp_path / "p.jsonl").write_text('{"id": "mt-1", "turns": ["say hi", "and again", "a third"]}\n'
                                      '{"id": "one-1", "prompt": "one turn only"}\n')
    distill(lv.model, lv.tokenizer, load_prompts(str(tmp_path / "p.jsonl"), 0, 0), tmp_path / "d.jsonl",
            max_new_tokens=8, batch_size=4, progress=False)
    records = {r["id"]: r for r in map(json.loads, (tmp_path / "d.jsonl").read_text().splitlines()[1:])}
    eos = eos_ids(lv.model, lv.tokenizer)
    answers = 0
    for rec in records.values():
        ids, mask, pos = rec["input_ids"], rec["loss_mask"], 0
        for bit, run in itertools.groupby(mask):
            n = len(list(run))
            if bit:
                with torch.inference_mode():
                    alone = lv.model.generate(torch.tensor([ids[:pos]]), attention_mask=torch.ones(1, pos, dtype=torch.long),
                                              max_new_tokens=n, do_sample=False, eos_token_id=eos or None, pad_token_id=0)
                assert alone[0, pos:].tolist() == ids[pos : pos + n]
                answers += 1
            pos += n
    assert answers == 4 and sum(records["mt-1"]["loss_mask"]) > sum(records["one-1"]["loss_mask"])


def test_length_sorted_sorts_within_windows_only():
    from train.data import length_sorted

    assert length_sorted([5, 1, 3, 9, 2, 8, 7], 3) == [1, 2, 0, 4, 5, 3, 6]
    assert length_sorted([], 4) == []


def test_config_rejects_unknown_keys_and_bad_values(tmp_path):
    with pytest.raises(ConfigError, match="unknown config key 'learning_rate'"):
        load_config(RECIPE, ["learning_rate=1"])
    with pytest.raises(ConfigError, match="batch_size must be int"):
        load_config(RECIPE, ["batch_size=many"])
    with pytest.raises(ConfigError, match="head_type"):
        load_config(RECIPE, ["head_type=hydra"])
    bad = tmp_path / "r.yaml"
    bad.write_text("verifier: default\nprompts: x\nbogus_key: 1\n")
    with pytest.raises(ConfigError, match="bogus_key"):
        load_config(bad)


def test_shipped_recipes_parse():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        text = path.read_text()
        if path.name.startswith("accelerate"):
            continue
        assert text.lstrip().startswith("#") and "launch" in text.split("\n\n")[0], f"{path.name}: header must show the launch command"
        load_config(path)


def test_feature_cache_and_tensorboard_logging(tmp_path, distilled):
    online = run(tmp_path, distilled, "online", max_steps=3, **SGD)
    cached = run(tmp_path, distilled, "cached", max_steps=3, cache_features=True, log_with="tensorboard", **SGD)
    files = list((tmp_path / "cached" / "features").glob("*/*.safetensors"))
    assert len(files) >= 8  # the records seen so far, one file each, in the folder of this verifier and layer set
    again = run(tmp_path, distilled, "cached2", max_steps=3, cache_features=True,
                cache_dir=str(tmp_path / "cached" / "features"), **SGD)  # read back from disk
    for a, b, c in zip(online["history"], cached["history"], again["history"]):
        assert abs(a["loss"] - b["loss"]) < 1e-2 * abs(a["loss"])  # float16 storage
        assert b["loss"] == pytest.approx(c["loss"], rel=1e-5)
    assert list((tmp_path / "cached").rglob("events.out.tfevents*"))


@pytest.mark.slow
def test_specheads_train_wraps_accelerate_launch(tmp_path, distilled):
    exe = Path(sys.executable).parent / "specheads"
    proc = subprocess.run([str(exe), "train", "--config", str(RECIPE), f"data={distilled}", "prompts=",
                           "max_steps=2", f"output_dir={tmp_path / 'w'}"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "w" / "model.safetensors").is_file()
    bad = subprocess.run([str(exe), "train", "--config", str(RECIPE), "nonsense_key=1"], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert bad.returncode != 0 and "unknown config key 'nonsense_key'" in bad.stderr


def test_init_from_starts_where_a_checkpoint_ended(tmp_path, distilled):
    """A warm start: init_from= a trained head gives a head with its weights and draft vocabulary;
    a head of another type is refused in one line."""
    from train.train_heads import build_draft_head

    run(tmp_path, distilled, name="first", max_steps=4)
    first = head_state(tmp_path / "first")
    cfg = load_config(RECIPE, [f"data={distilled}", "prompts=", f"init_from={tmp_path / 'first'}"])
    model = load_verifier("tiny-random:llama").model
    head = build_draft_head(cfg, model, [])
    assert all(torch.equal(head.state_dict()[k].float(), v.float()) for k, v in first.items())
    res = run(tmp_path, distilled, name="second", max_steps=2, init_from=str(tmp_path / "first"))
    assert res["history"][0]["loss"] < json.loads((tmp_path / "first" / "train_history.json").read_text())[0]["loss"]
    # the second head's card names where it started and describes its own run, not the first's
    first_cfg = json.loads((tmp_path / "first" / "config.json").read_text())["training"]
    first_cfg["schedule"] = "the first run's schedule"
    conf = tmp_path / "first" / "config.json"
    conf.write_text(json.dumps({**json.loads(conf.read_text()), "training": first_cfg}))
    run(tmp_path, distilled, name="third", max_steps=1, init_from=str(tmp_path / "first"))
    third = json.loads((tmp_path / "third" / "config.json").read_text())["training"]
    assert third["init_from"] == str(tmp_path / "first") and third["steps"] == 1 and "schedule" not in third
    # the parent's weights by digest: its name may later hold another head
    assert third["init_from_sha256"] == hashlib.sha256((tmp_path / "first" / "model.safetensors").read_bytes()).hexdigest()
    assert "the first run's schedule" not in (tmp_path / "third" / "README.md").read_text()
    assert "ancestors" not in third  # the first head started from scratch
    run(tmp_path, distilled, name="fourth", max_steps=1, init_from=str(tmp_path / "third"))
    fourth = json.loads((tmp_path / "fourth" / "config.json").read_text())["training"]
    assert fourth["init_from"] == str(tmp_path / "third") and fourth["ancestors"] == [str(tmp_path / "first")]
    with pytest.raises(ConfigError, match="is a eagle3 head, not medusa"):
        build_draft_head(load_config(RECIPE, [f"data={distilled}", "prompts=", "head_type=medusa", f"init_from={tmp_path / 'first'}"]), model, [])


def test_warm_start_facts_chain_a_hand_written_ancestry_as_one_entry():
    """A shipped head's card once held ``ancestors`` as one hand-written string, which every head
    warm-started from it listed character by character."""
    from train.train_heads import warm_start_facts

    parent = {"init_from": "heads/b", "ancestors": "a, then the head before it"}
    assert warm_start_facts(parent, "heads/c") == {"init_from": "heads/c", "ancestors": ["heads/b", "a, then the head before it"]}
    parent = {"init_from": "heads/b", "ancestors": ["heads/a", "heads/0"]}
    assert warm_start_facts(parent, "heads/c")["ancestors"] == ["heads/b", "heads/a", "heads/0"]
    assert warm_start_facts({}, "heads/c") == {"init_from": "heads/c"}
    assert warm_start_facts({}, "heads/c", "ab12") == {"init_from": "heads/c", "init_from_sha256": "ab12"}


def test_eval_only_measures_a_head_on_the_held_out_split(tmp_path, distilled):
    run(tmp_path, distilled, name="first", max_steps=4, eval_every=4)
    trained = json.loads((tmp_path / "first" / "train_history.json").read_text())[-1]
    res = run(tmp_path, distilled, name="eval", init_from=str(tmp_path / "first"), eval_only=True)
    assert res["history"] == [] and abs(res["eval"]["eval_acc_1"] - trained["eval_acc_1"]) < 1e-6
    assert not (tmp_path / "eval" / "model.safetensors").exists()
    # measuring a head needs no training records: most of a small data set can be held out
    most = run(tmp_path, distilled, name="eval-most", init_from=str(tmp_path / "first"), eval_only=True, eval_fraction=0.95)
    assert 0 <= most["eval"]["eval_acc_1"] <= 1 and most["history"] == []
    with pytest.raises(ConfigError, match="eval_only needs init_from"):
        load_config(RECIPE, [f"data={distilled}", "prompts=", "eval_only=true"])


def test_eval_only_reports_each_prompt_source(tmp_path, distilled):
    """A head measured on data of several prompt sources gets a line per source (what would have
    shown v3c's loss on context QA before a bench did), and a source's figures are what the same
    head scores on that source's records alone."""
    run(tmp_path, distilled, name="first", max_steps=4, eval_every=4)
    mixed, alpha = _two_sources(tmp_path, distilled, "mixed"), _two_sources(tmp_path, distilled, "alpha", keep=("alpha",))
    common = dict(init_from=str(tmp_path / "first"), eval_only=True, eval_fraction=0.5, batch_size=64, eval_batches=1000)
    both = run(tmp_path, mixed, name="eval-mixed", **common)
    assert sorted(both["eval_by_source"]) == ["alpha", "beta"]
    alone = run(tmp_path, alpha, name="eval-alpha", **common)
    assert alone["eval_by_source"] == {}  # one source: the overall figures say it all
    got = both["eval_by_source"]["alpha"]
    assert abs(got["acc_1"] - alone["eval"]["eval_acc_1"]) < 1e-3 and abs(got["acc_3"] - alone["eval"]["eval_acc_3"]) < 1e-3
    assert got["records"] + both["eval_by_source"]["beta"]["records"] > 8


def _two_sources(tmp_path, distilled, name: str, keep=("alpha", "beta")) -> Path:
    """``distilled`` with its records' ids renamed alpha-<i> (odd lines) and beta-<i> (even), the
    sources in ``keep`` written out (the held-out split is by content, so each record keeps its side)."""
    head, *rows = distilled.read_text().splitlines(keepends=True)
    out = tmp_path / name / "d.jsonl"
    out.parent.mkdir()
    lines = []
    for i, line in enumerate(rows):
        row = json.loads(line)
        row["id"] = f"{'alpha' if i % 2 else 'beta'}-{i}"
        if row["id"].split("-")[0] in keep:
            lines.append(json.dumps(row) + "\n")
    out.write_text(head + "".join(lines))
    return out


def test_source_weights_weigh_each_source_per_epoch():
    """Each source's records are seen ``weight`` times an epoch: whole copies, then a fresh random
    part of them; the epoch has the same size every time; no weights: the records as they are."""
    from train.data import Record, source_weighted

    records = [Record([i, i + 1], [0, 1], src) for i, src in enumerate("aaaabbbbbbcc")]
    train_idx = list(range(12))
    gen = torch.Generator().manual_seed(0)
    state = gen.get_state()
    assert source_weighted(train_idx, records, {}, gen) == train_idx and torch.equal(gen.get_state(), state)
    halves, seen = set(), torch.zeros(12)
    for epoch in range(400):
        got = source_weighted(train_idx, records, {"a": 2.5, "b": 0.5, "c": 0}, torch.Generator().manual_seed(epoch))
        assert len(got) == 10 + 3  # round(2.5 * 4) + round(0.5 * 6) + 0
        counts = [got.count(i) for i in range(12)]
        assert sorted(counts[:4]) == [2, 2, 3, 3] and sorted(counts[4:10]) == [0, 0, 0, 1, 1, 1] and counts[10:] == [0, 0]
        halves.add(tuple(counts[4:10]))
        seen += torch.tensor(counts, dtype=torch.float)
    assert len(halves) > 10  # a fresh half of b each epoch, not always the same one
    mean = seen / 400
    assert torch.allclose(mean[:4], torch.full((4,), 2.5), atol=0.15) and torch.allclose(mean[4:10], torch.full((6,), 0.5), atol=0.1)


def test_source_weights_are_checked(tmp_path, distilled):
    """A weight that is not a number >= 0, and a source no training record comes from (a typo
    would weigh nothing), are refused by name."""
    for bad in ("{alpha: -1}", "{alpha: many}", "{alpha: true}", "[alpha]"):
        with pytest.raises(ConfigError, match="source_weights"):
            load_config(RECIPE, [f"source_weights={bad}"])
    data = _two_sources(tmp_path, distilled, "mixed")
    with pytest.raises(ConfigError, match="source_weights names 'gamma', which no training record comes from .*'alpha', 'beta'"):
        run(tmp_path, data, name="typo", source_weights={"gamma": 2})


def test_a_source_weighed_zero_is_never_trained_on(tmp_path, distilled):
    """Weight 0 drops a source from training: the head equals one trained on the data without
    that source's records (same held-out sides, same order of the rest)."""
    mixed = _two_sources(tmp_path, distilled, "mixed")
    beta = _two_sources(tmp_path, distilled, "beta", keep=("beta",))
    common = dict(head_type="eagle1", max_steps=4, eval_fraction=0.2)
    run(tmp_path, mixed, name="weighed", source_weights={"alpha": 0}, **common)
    run(tmp_path, beta, name="beta-only", **common)
    run(tmp_path, mixed, name="unweighed", **common)
    weighed, alone, both = (head_state(tmp_path / n) for n in ("weighed", "beta-only", "unweighed"))
    assert all(torch.equal(weighed[k], alone[k]) for k in alone)
    assert not all(torch.equal(weighed[k], both[k]) for k in both)
    card = json.loads((tmp_path / "weighed" / "config.json").read_text())
    assert card["training"]["source_weights"] == {"alpha": 0}


def test_the_manifest_and_the_evaluation_name_the_same_sources():
    """``pack_distilled.py`` (torch-free) counts records per source as training's per-source
    evaluation groups them: a multi-turn id holding a UUID is one source, not one per record."""
    spec = importlib.util.spec_from_file_location("pack_distilled", Path(__file__).parents[1] / "train/data/pack_distilled.py")
    pack = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pack)
    ids = ["dolly-123", "ntrex_tr-deu-eng-12", "oasst1_en_val-88fb828e-8d71-4786-a1df-e72310d4b07a", "7", "synthetic-3"]
    assert [pack._source(i) for i in ids] == [record_source(i) for i in ids] == ["dolly", "ntrex_tr", "oasst1_en_val", "", "synthetic"]


def test_split_keeps_each_record_on_its_side_when_data_grows():
    """The held-out split is decided per record by its content: appending and reordering data
    (the committed data grows part by part) moves no training record into the held-out set."""
    from train.data import Record, split_records

    old = [Record([1, 2 + i, 3 + i % 7], [0, 1, 1]) for i in range(500)]
    tr, ev = split_records(old, 0.1, seed=0)
    assert 30 <= len(ev) <= 70 and sorted(tr + ev) == list(range(500))
    grown = [Record([9, 2 + i, 4], [0, 1, 1]) for i in range(300)] + old[::-1]
    tr2, ev2 = split_records(grown, 0.1, seed=0)
    held = {old[i].key() for i in ev}
    assert {grown[i].key() for i in ev2} & {r.key() for r in old} == held
    assert split_records(old, 0.1, seed=1)[1] != ev  # the seed chooses another split
    assert len(split_records(old[:2], 0.9, seed=0)[1]) == 1  # never all held out, never none
    assert len(split_records(old[:2], 1e-9, seed=0)[1]) == 1


def test_feature_cache_is_named_by_content_and_source(tmp_path, llama, monkeypatch):
    """A record's cached features are found by its content, not its position (data reordered or
    grown reads the right file), and another verifier or layer set gets its own folder."""
    import train.features
    from train.data import Record, collate
    from train.features import FeatureCache

    recs = [Record([5, 6, 7, 8], [0, 0, 1, 1]), Record([9, 10, 11], [0, 1, 1])]
    first = FeatureCache(tmp_path, [r.key() for r in recs], "verifier A layers [0, 1]")
    a = first.get(llama, collate(recs, [0, 1]), (0, 1))
    swapped = recs[::-1]
    second = FeatureCache(tmp_path, [r.key() for r in swapped], "verifier A layers [0, 1]")
    calls, real = [], train.features.compute_features
    monkeypatch.setattr(train.features, "compute_features", lambda *x: calls.append(1) or real(*x))
    b = second.get(llama, collate(swapped, [0, 1]), (0, 1))
    assert not calls  # both read from disk
    torch.testing.assert_close(b.last[0, :3], a.last[1, :3])
    torch.testing.assert_close(b.aux[1, :4], a.aux[0, :4])
    other = FeatureCache(tmp_path, [r.key() for r in recs], "verifier A layers [1]")
    assert other.dir != first.dir and not list(other.dir.glob("*.safetensors"))
