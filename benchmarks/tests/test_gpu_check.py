"""The prepared check for a lent GPU (``benchmarks/gpu_check.sh``) runs once per lent device, so
its code paths run here at toy sizes on the CPU, where they cannot rot unseen."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.gpu_check import main


def test_the_gpu_check_runs_at_toy_sizes_on_the_cpu(tmp_path: Path) -> None:
    """benchmarks/speed/gpu_check.py is the script a lent GPU runs once: its code path runs here, at its
    smoke sizes (batch 2, 8 tokens a completion; --cpu is the same path at toy sizes)."""
    out = main(["--smoke", "--out", str(tmp_path / "gpu_check.json")])
    assert json.loads((tmp_path / "gpu_check.json").read_text())["models"].keys() == \
        {"llada_8b", "sdar_4b", "diffusion_gemma_5b"}
    assert out["models"]["diffusion_gemma_5b"]["update"]["rows"] == 2 * 7   # 8 steps: 7 carry actions
    for entry in (out["models"]["llada_8b"], out["models"]["sdar_4b"]):
        assert [r["batch"] for r in entry["rollouts"]] == [1, 2]
        assert all(r["miles_tokens_per_s"] > 0 and r["reference_steps_timed"] > 0 for r in entry["rollouts"])
    rows = out["models"]["llada_8b"]["update"]["rows"]
    ckpt = out["models"]["llada_8b"]["update_checkpointed"]
    assert rows > 0 and ckpt["rows"] == rows and ckpt["checkpointed_layers"] == 2    # the toy's two decoder layers


@pytest.mark.e2e
def test_the_gpu_checks_async_at_scale_path_runs_at_toy_sizes_on_the_cpu(tmp_path: Path) -> None:
    """``benchmarks/gpu_check.sh --async-8b`` (the lent GPU's second command): a checkpoint written
    in LLaDA's published layout, then async vs sync through benchmarks.async_vs_sync on it. Its code
    path runs here at toy sizes, so it cannot rot unseen."""
    out = main(["--cpu", "--async-8b", "--out", str(tmp_path / "gpu_check.json"), "--workdir", str(tmp_path / "w")])
    saved = json.loads((tmp_path / "gpu_check_async.json").read_text())
    assert saved["completions_consumed_async"] == saved["completions"] == 3 * 8   # toy: 3 batches of 2 x 4
    assert out["dropped_batches"] == 0 and out["max_staleness_seen"] <= out["staleness_bound"]
    assert json.loads((tmp_path / "w" / "llada_8b" / "config.json").read_text())["model_type"] == "llada"
    assert "model.backend=hf" in out["overrides"] and out["sync_seconds"] > 0 and out["async_seconds"] > 0
