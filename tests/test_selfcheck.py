"""``specheads selfcheck`` (what ``make gpu-check`` runs on a GPU), CI-sized on the CPU."""

import json

import pytest

from infer.tools.cli import main


@pytest.mark.slow
@pytest.mark.early
def test_selfcheck_small_runs_every_part_and_writes_json_and_png(tmp_path, capsys):
    out = tmp_path / "check"
    assert main(["selfcheck", "--device", "cpu", "--small", "--out", str(out)]) == 0, capsys.readouterr().err
    r = json.loads((out / "selfcheck.json").read_text())
    assert (out / "selfcheck.png").stat().st_size > 1000
    assert r["identity"]["cpu_generator_sampling"] is True
    assert r["identity"]["fp32_all_identical"] is True and 0 <= r["identity"]["bf16_identical_share"] <= 1
    engine = r["speed"]["engine"]
    assert all(engine[k]["identical"] for k in engine), engine
    taus = [engine[f"oracle_chain{d}"]["tau"] for d in (1, 3, 5, 7)]
    assert taus == sorted(taus) and taus[0] > 1.5  # oracle drafts: a known tau, growing with the chain
    assert {"cost_prefix64", "cost_prefix128", "hf_generate_tok_s"} <= set(r["speed"])
    assert engine["eagle3_random_eagle2-32"]["host_reads"] > 0 and "draft_over_verify" in engine["eagle3_random_eagle2-32"]
    cli = r["cli"]
    assert cli["distill"]["rc"] == 0 and cli["distill"]["response_tokens"] > 0
    assert cli["train"]["rc"] == 0 and cli["train"]["median_step_s"] > 0
    assert cli["bench"]["rc"] == 0 and cli["bench"]["overall"]["spec:pld"]["identical"] > 0
