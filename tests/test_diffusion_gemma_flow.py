"""DiffusionGemma on the same path as every other family: the Prefect train flow samples
it with the renoising sampler, stores its batches in their own Parquet layout, updates the
decoder's LoRA through the one learner runtime, logs to MLflow and registers a champion that
``models:/name@champion`` serves."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import EXPERIMENT

from miles_core.models import diffusion_gemma as dg
from miles_core.storage.run import RunStore
from miles_core.tokenizer import CharTokenizer
from miles_core.types import RenoiseBatch

pytestmark = [pytest.mark.e2e, pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]
OVERRIDES = ["train.reward=math_exact:1.0,format:0.5", "renoise.max_steps=4", "renoise.confidence_threshold=0.5"]


def test_train_flow_runs_diffusion_gemma_and_registers_it(prefect_harness: None, tmp_project: Path) -> None:
    import mlflow
    from mlflow import MlflowClient

    from flows.train import train_flow
    from miles_core.config import load_recipe

    length = load_recipe("tiny").task.completion_len
    base = dg.write_tiny_checkpoint(tmp_project / "dgemma", CharTokenizer(), canvas_length=length, hidden=32, heads=2)
    store = str(tmp_project / "store")
    out = train_flow(recipe="tiny", overrides=OVERRIDES, run_dir=str(tmp_project / "train"), store_uri=store,
                     base_checkpoint=str(base), iterations=2, experiment=EXPERIMENT, register_as="miles-test-dgemma")
    rs = RunStore(store)
    ids = rs.trajectories.list_batches()
    assert len(ids) == 2
    for version, bid in enumerate(ids):
        batch = rs.trajectories.read_batch(bid)
        assert isinstance(batch, RenoiseBatch) and not batch.reward.isnan().any()
        assert batch.policy_version.tolist() == [version] * len(batch)
        assert batch.sampler["max_steps"] == 4 and int(batch.num_steps.max()) <= 4
        assert rs.trajectories.commit_info(bid)["kind"] == "renoise_trajectory"
    adapter = Path(out["adapter_dir"])
    from safetensors.torch import load_file

    keys = list(load_file(str(adapter / "adapter_model.safetensors")))
    assert keys and all(".decoder." in k and "lora_" in k for k in keys)
    run = MlflowClient().get_run(out["mlflow_run_id"])
    assert run.info.status == "FINISHED" and "eval/pass1" in run.data.metrics
    model = mlflow.pyfunc.load_model("models:/miles-test-dgemma@champion")
    answers = model.predict(["3+4*2", "9-1*5"])
    assert len(answers) == 2 and all(isinstance(a, str) for a in answers)
