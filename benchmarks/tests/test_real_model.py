"""benchmarks.real_model at its smoke size on a tiny GGUF written in the test: every stage runs on
the path the real-model figures come from, the result has every field the issue asks for, and a
rerun reuses the cached stages."""

from __future__ import annotations

import json

import pytest

from tests.test_importer import write_tiny_gguf


@pytest.mark.e2e
@pytest.mark.bench  # this is benchmarks.real_model's smoke run in the lane (benchmarks/tests/test_smoke.py)
def test_every_stage_runs_and_reruns_from_cache(tmp_path, capsys, monkeypatch) -> None:
    from benchmarks.real_model import main

    monkeypatch.setenv("MILES_BENCH_RESULTS", str(tmp_path / "results"))

    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src)
    out = tmp_path / "real_model.json"
    args = ["--smoke", "--source", str(src), "--workdir", str(tmp_path / "work"), "--seeds", "0", "--out", str(out)]
    main(args)
    r = json.loads(out.read_text())
    for key in ("ar_pass1", "sft_pass1", "adpo_pass1", "continued_sft_pass1", "seeds", "paired_p", "latency",
                "nsd", "adaptation", "memory_mb"):
        assert key in r, key
    for mode in ("ar_generate", "miles_static", "miles_static_prefix", "miles_static_k4_prefix", "miles_nsd_prefix"):
        row = r["latency"][mode]
        assert row["seconds_per_answer"] > 0 and row["tokens_per_s"] > 0 and 0 <= row["pass1"] <= 1
    chosen = r["adaptation_default"]
    assert set(r["adaptation"]) == {"shift", "noshift", f"{chosen}_lora", f"{chosen}_block8"} and chosen in ("shift", "noshift")
    assert r["second_task"]["task"] == "countdown" and r["second_task"]["problems"] == 4 and 0 <= r["second_task"]["ar_pass1"] <= 1
    for arm in r["adaptation"].values():
        assert [c["step"] for c in arm["curve"]] == [0, 2]
        assert all(c["elbo_per_token"] > 0 and 0 <= c["masked_acc"] <= 1 for c in arm["curve"])
    assert r["nsd"]["static_flops"] > 0 and r["nsd"]["nsd_flops"] > 0
    assert r["memory_mb"]["learner_peak_rss"] > 0 and r["memory_mb"]["sampler_peak_rss"] > 0
    capsys.readouterr()
    main(args)  # every stage cached: nothing recomputed
    assert "running" not in capsys.readouterr().out
