"""Every published family trains end to end through the Prefect flows (SFT, then 3 ADPO iterations
with LoRA), writes its SFT checkpoint back in its own published layout, and its registered model
serves ``predict`` from a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles_core.models.hf import init_tiny, read_tensors

pytestmark = pytest.mark.e2e

FAMILIES = ("llada", "dream", "sdar", "bidir_qwen3", "modernbert")
SMALL = ["sft.steps=4", "sft.eval_every=2", "sft.batch_size=4", "task.completion_len=8", "task.min_ops=1",
         "task.max_ops=1", "task.num_train=16", "task.num_test=8", "task.num_val=8", "train.prompts_per_iter=2",
         "train.group_size=2", "eval.num_problems=4", "eval.batch_size=4"]
CHILD = """
import json, sys
import mlflow.pyfunc

print(json.dumps(list(mlflow.pyfunc.load_model(sys.argv[1]).predict(["1+2", "3*4"]))))
"""


@pytest.mark.parametrize("family", FAMILIES)
def test_family_trains_through_the_flows_and_serves(family: str, prefect_harness: None, tmp_project: Path) -> None:
    from flows.sft import sft_flow
    from flows.train import train_flow

    ckpt = init_tiny(family, tmp_project / "published")
    ov = ["model.backend=hf", f"model.path={ckpt}", *SMALL]
    sft = sft_flow(recipe="tiny", overrides=ov, run_dir=str(tmp_project / "sft"), experiment="families")
    base = Path(sft["base_checkpoint"])
    assert json.loads((base / "config.json").read_text())["model_type"] == json.loads(
        (ckpt / "config.json").read_text())["model_type"]
    assert set(read_tensors(base)) == set(read_tensors(ckpt))  # the SFT'd base is again a published folder
    res = train_flow(recipe="tiny", overrides=ov, run_dir=str(tmp_project / "train"),
                     store_uri=str(tmp_project / "store"), base_checkpoint=str(base), iterations=3,
                     experiment="families", register_as=f"miles-{family.replace('_', '-')}")
    assert res["iterations"] == 3 and res["adapter_version"] == 3
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = subprocess.run([sys.executable, "-c", CHILD, res["model_uri"]], cwd=tmp_project, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(out) == 2 and all(isinstance(s, str) for s in out)


def test_block_causal_family_trains_asynchronously(prefect_harness: None, tmp_project: Path) -> None:
    """SDAR through the asynchronous flow: sampler processes load the published folder, hot-swap
    the LoRA adapters the learner publishes, and every committed batch is consumed once."""
    from flows.async_train import async_train_flow
    from flows.sft import sft_flow

    from miles_core.storage import AdapterRegistry

    ckpt = init_tiny("sdar", tmp_project / "published")
    ov = ["model.backend=hf", f"model.path={ckpt}", *SMALL, "async_rl.poll_interval=0.02"]
    sft = sft_flow(recipe="tiny", overrides=ov, run_dir=str(tmp_project / "sft"), experiment="families")
    store = str(tmp_project / "store")
    out = async_train_flow(recipe="tiny", overrides=ov, run_dir=str(tmp_project / "async"), store_uri=store,
                           base_checkpoint=sft["base_checkpoint"], num_samplers=2, batches_per_sampler=2,
                           experiment="families", register_as="miles-sdar-async", timeout_s=600)
    assert out["consumed_batches"] + out["dropped_batches"] == 4 and out["adapter_version"] == out["consumed_batches"]
    assert AdapterRegistry(store).latest_version() == out["adapter_version"] >= 1
