"""End to end through real Prefect (test server), real MLflow (SQLite) and real S3 (moto):
SFT -> ADPO training -> evaluation, what gets logged, committed and registered, resume, and the
champion rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import EXPERIMENT, TINY_OVERRIDES, TrainedProject
from mlflow import MlflowClient
from prefect import flow, task
from pydantic import ValidationError

from flows.evaluate import evaluate_flow
from flows.params import EvalParams, SFTParams, TrainParams, check_signature
from flows.sft import sft_flow
from flows import train as train_mod
from flows.train import train_flow
from miles_core.config import ConfigError, load_recipe
from miles_core.learner.run_folder import pointed_recipe
from miles_core.storage import AdapterRegistry, TrajectoryStore
from miles_core.storage.run import RunStore
import tracking
from tracking import registry
from tasks import common, training

pytestmark = pytest.mark.e2e

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _artifact_files(client: MlflowClient, run_id: str, path: str | None = None) -> set[str]:
    out: set[str] = set()
    for f in client.list_artifacts(run_id, path):
        out |= _artifact_files(client, run_id, f.path) if f.is_dir else {f.path}
    return out


def _prefect_flow_name(flow_run_id: str) -> str:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run_id)
        return client.read_flow(run.flow_id).name


def test_flow_signatures_match_their_parameter_models() -> None:
    check_signature(sft_flow.fn, SFTParams)
    check_signature(train_flow.fn, TrainParams)
    check_signature(evaluate_flow.fn, EvalParams)


def test_parameter_models_reject_bad_input_by_name() -> None:
    with pytest.raises(ValidationError, match="must look like key.sub=value"):
        TrainParams(overrides=["train.iterations"])
    with pytest.raises(ValidationError, match="iterations"):
        TrainParams(iterations=-1)
    with pytest.raises(ValidationError, match="either model_uri or adapter"):
        EvalParams(model_uri="models:/m@champion", adapter="a", base_checkpoint="b")
    with pytest.raises(ValidationError, match="base_checkpoint is required"):
        EvalParams(adapter="some/adapter")
    with pytest.raises(ValidationError, match="not with model_uri"):
        EvalParams(model_uri="models:/m@champion", base_checkpoint="b")
    with pytest.raises(ValidationError, match="resume needs run_dir"):
        TrainParams(resume=True)
    with pytest.raises(ValidationError, match="stepz"):
        SFTParams(recipe="tiny", stepz=3)


def test_bad_recipe_fails_before_any_run(prefect_harness: None, tmp_project: Path) -> None:
    with pytest.raises(ConfigError, match="optim.lr"):
        train_flow(recipe="tiny", overrides=["optim.lr=-1"], run_dir=str(tmp_project / "bad"))
    assert not (tmp_project / "bad").exists()
    assert not (tmp_project / "mlruns").exists()  # nothing was logged either


def test_sft_run_logs_plateau_curve_and_checkpoint(trained: TrainedProject) -> None:
    client = MlflowClient()
    run = client.get_run(trained.sft["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert _prefect_flow_name(run.data.tags["prefect.flow_run_id"]) == "miles-sft"
    assert run.data.params["sft.steps"] == "150"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "sft/pass1")]
    assert steps == [50, 100, 150]
    assert run.data.metrics["sft_final/pass1"] == trained.sft["sft_pass1"]
    files = _artifact_files(client, run.info.run_id)
    assert {"plots/sft_curve.png", "base_checkpoint/model.safetensors", "eval/sft.json"} <= files
    assert (Path(trained.sft["base_checkpoint"]) / "config.json").exists()


def test_train_run_logs_params_metrics_and_artifacts(trained: TrainedProject) -> None:
    client = MlflowClient()
    rid = trained.train["mlflow_run_id"]
    run = client.get_run(rid)
    assert run.info.status == "FINISHED"
    assert run.data.tags["miles.sft_run_id"] == ""  # base checkpoint given: no SFT subflow
    # the MLflow UI opens the experiment on its runs table (not MLflow 3's GenAI overview)
    assert client.get_experiment(run.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    assert _prefect_flow_name(run.data.tags["prefect.flow_run_id"]) == "miles-train"
    cfg = load_recipe("tiny", [*TINY_OVERRIDES, "train.iterations=2"])
    for key, value in cfg.flat().items():
        assert run.data.params[key] == str(value), key
    assert run.data.params["eval_config.steps"] == str(cfg.eval.steps)
    for key in ("reward/reward_mean", "reward/reward_std", "rollout/nfe_mean", "rollout/tokens_per_s",
                "update/approx_kl", "update/clip_frac", "update/policy_version", "time/collect_s",
                "time/update_s"):
        assert [m.step for m in client.get_metric_history(rid, key)] == [1, 2], key
    evals = sorted((m.step, m.value) for m in client.get_metric_history(rid, "eval/pass1"))
    assert [s for s, _ in evals] == [0, 1, 2]  # start, then every iteration (tiny: eval_every=1)
    assert evals[0][1] == trained.train["sft_pass1"] == trained.sft["sft_pass1"]  # zero LoRA == SFT base
    assert evals[-1][1] == trained.train["final_pass1"]
    files = _artifact_files(client, rid)
    for expected in ("plots/learning_curve.png", "samples/rollouts.json", "samples/eval.json", "eval/v000002.json",
                     "adapters/v000001/adapter_config.json", "adapters/v000002/adapter_model.safetensors"):
        assert expected in files, expected
    # the registered model is the run's LoggedModel output (tests/test_registry.py checks it whole)
    outputs = client.get_run(rid).outputs.model_outputs
    assert len(outputs) == 1 and client.get_logged_model(outputs[0].model_id).source_run_id == rid
    png = Path(client.download_artifacts(rid, "plots/learning_curve.png", str(trained.root / "dl")))
    assert png.read_bytes()[:8] == PNG_MAGIC
    table = json.loads(Path(client.download_artifacts(rid, "samples/rollouts.json", str(trained.root / "dl"))).read_text())
    assert "completion" in table["columns"] and len(table["data"]) == 2 * common.SAMPLE_ROWS


def test_batches_committed_and_adapters_published(trained: TrainedProject) -> None:
    meta = training.checkpoint_meta(trained.train["run_dir"])
    assert meta is not None and meta["iteration"] == 2
    ids = [f"{i:06d}-learner" for i in range(2)]
    rs = RunStore(trained.store_uri)
    scored = rs.trajectories
    assert scored.list_batches() == ids and not rs.exists("rollouts")
    assert meta["consumed"] == ids  # each batch used exactly once
    ckpt = rs.load_checkpoint()  # the ledger inside the learner checkpoint is the source of truth
    from miles_core.learner.ledger import stored_state

    assert [e["id"] for e in stored_state(rs, ckpt["ledger"])["consumed"]] == ids and ckpt["version"] == 2
    for bid, version in zip(ids, (0, 1)):
        batch = scored.read_batch(bid)
        assert len(batch) == 4 * 4 and not batch.reward.isnan().any()
        assert batch.policy_version.tolist() == [version] * len(batch)
        for g in batch.group_id.unique():  # group-relative advantages are mean-centred
            assert abs(float(batch.advantage[batch.group_id == g].sum())) < 1e-5
    reg = AdapterRegistry(trained.store_uri)
    assert reg.versions() == [0, 1, 2] and reg.latest_version() == 2
    assert trained.train["adapter_uri"] == f"{trained.store_uri}/adapters/v000002"


def test_final_adapter_registered_as_champion(trained: TrainedProject) -> None:
    client = MlflowClient()
    assert trained.train["model_uri"] == f"models:/{trained.model_name}/1" and trained.train["promoted"] is True
    champ = client.get_model_version_by_alias(trained.model_name, "champion")
    assert int(champ.version) == 1 and champ.run_id == trained.train["mlflow_run_id"]
    assert float(champ.tags[registry.PASS1_TAG]) == trained.train["final_pass1"]
    assert champ.tags[registry.FINGERPRINT_TAG] == trained.train["eval_fingerprint"]
    assert champ.tags["miles.adapter_uri"] == trained.train["adapter_uri"]


def test_evaluate_flow_reproduces_the_champion_and_the_stored_adapter(trained: TrainedProject) -> None:
    by_alias = evaluate_flow(model_uri=f"models:/{trained.model_name}@champion", run_dir=str(trained.root / "ev1"),
                             experiment=EXPERIMENT)
    assert by_alias["model_version"] == 1 and by_alias["registered_pass1"] == trained.train["final_pass1"]
    # greedy decoding with the recipe's own eval config: the same number as the training run
    assert by_alias["pass1"] == trained.train["final_pass1"]
    assert by_alias["eval_fingerprint"] == trained.train["eval_fingerprint"]
    from_s3 = evaluate_flow(adapter=trained.train["adapter_uri"], base_checkpoint=trained.sft["base_checkpoint"],
                            recipe="tiny", overrides=TINY_OVERRIDES, run_dir=str(trained.root / "ev2"))
    assert from_s3["pass1"] == trained.train["final_pass1"]
    assert (Path(from_s3["adapter_dir"]) / "adapter_config.json").exists()
    run = MlflowClient().get_run(by_alias["mlflow_run_id"])
    assert run.data.tags["miles.registered_version"] == "1"
    assert run.data.params["eval_config.temperature"] == "0.0" and run.data.metrics["eval/pass1"] == by_alias["pass1"]


def test_a_run_no_better_does_not_move_the_champion(trained: TrainedProject) -> None:
    """A weak base with one RL iteration must not take the alias from the trained champion. On 16 toy
    problems the champion itself may score 0, so the candidate may tie or even edge it: only a
    significant paired win on the same evaluation moves the alias, and 16 problems cannot give one."""
    weak = sft_flow(recipe="tiny", overrides=["sft.steps=1", "sft.seed=1"], run_dir=str(trained.root / "weak-sft"),
                    experiment=EXPERIMENT)
    res = train_flow(recipe="tiny", overrides=TINY_OVERRIDES, run_dir=str(trained.root / "weak"),
                     base_checkpoint=weak["base_checkpoint"], iterations=1, experiment=EXPERIMENT,
                     register_as=trained.model_name)
    champ = MlflowClient().get_model_version_by_alias(trained.model_name, "champion")
    assert res["model_version"] == 2 and res["eval_fingerprint"] == champ.tags[registry.FINGERPRINT_TAG]
    assert res["promoted"] is False and res["promotion_reason"].startswith(
        ("not better", "not significant")), res["promotion_reason"]
    assert int(champ.version) == 1 and res["champion_version"] == 1


def _eval_record(path: Path, solved: range, n: int = 40) -> tuple[str, float, str]:
    """An eval record as eval_summary writes it (problems ``solved`` of ``n``): path, pass@1, fingerprint."""
    from miles_core.eval.passk import EvalConfig, EvalResult

    res = EvalResult(pass_at={"pass@1": len(solved) / n}, num_problems=n, config=EvalConfig(num_problems=n),
                     correct=[[i in solved] for i in range(n)], problems_digest="d1")
    path.write_text(json.dumps(res.to_dict()))
    return str(path), res.pass_at["pass@1"], res.config.fingerprint()


def test_champion_moves_only_on_a_significant_paired_win(trained: TrainedProject) -> None:
    """Through register_model: each version keeps its outcomes (a run artifact named by a tag) and the
    rule reads them. v2 solves 30 more of the same 40 problems (p < 1e-8); v3 ties v2; v4 loses."""
    name, base = "miles-test-promotion", trained.sft["base_checkpoint"]
    cfg = load_recipe("tiny").to_dict()
    evals = [_eval_record(trained.root / f"promotion-{i}.json", r)
             for i, r in enumerate((range(5), range(35), range(35), range(5)))]
    with tracking.run(EXPERIMENT, "promotion-rule") as run_id:
        results = [registry.register_model(run_id, name, base, None, cfg, p1, fp, eval_record=path)
                   for path, p1, fp in evals]
    assert [r["promoted"] for r in results] == [True, True, False, False]
    assert [r["champion_version"] for r in results] == [1, 2, 2, 2]
    assert results[1]["comparison"]["wins"] == 30 and results[1]["comparison"]["losses"] == 0
    assert results[2]["reason"].startswith("not better than champion v2: +0/-0")
    assert results[3]["reason"].startswith("not better than champion v2: +0/-30")
    mv = MlflowClient().get_model_version_by_alias(name, "champion")
    assert int(mv.version) == 2 and json.loads(mv.tags[registry.COMPARISON_TAG])["decision"] == "promoted"
    assert f"registry/{results[1]['model_id']}/outcomes.json" in _artifact_files(MlflowClient(), run_id)


def test_resume_continues_the_checkpoint_and_tasks_are_idempotent(trained: TrainedProject) -> None:
    """No base checkpoint: SFT runs first as a subflow; the resumed run then finds base and store
    in the checkpoint, and refuses changed training settings."""
    run_dir = trained.root / "resumable"
    overrides = [*TINY_OVERRIDES, "sft.steps=5", "sft.eval_every=5"]
    common = dict(recipe="tiny", overrides=overrides, run_dir=str(run_dir), experiment=EXPERIMENT,
                  register_as=None, log_adapters=False)
    first = train_flow(iterations=1, store_uri=str(trained.root / "resumable-store"), **common)
    assert first["adapter_version"] == 1 and first["model_uri"] is None
    assert first["base_checkpoint"] == str(run_dir / "sft" / "base")
    sft_run = MlflowClient().get_run(first["mlflow_run_id"]).data.tags["miles.sft_run_id"]
    assert MlflowClient().get_run(sft_run).data.tags["miles.kind"] == "sft"
    with pytest.raises(FileExistsError, match="pass --resume"):
        train_flow(iterations=2, **common)
    with pytest.raises(ConfigError, match="optim.lr"):
        train_flow(iterations=2, resume=True, **{**common, "overrides": [*overrides, "optim.lr=0.1"]})
    second = train_flow(iterations=2, resume=True, **common)
    assert second["iterations"] == 1 and second["adapter_version"] == 2 and second["sft_pass1"] is None
    assert second["store_uri"] == first["store_uri"] and second["base_checkpoint"] == first["base_checkpoint"]
    # the same MLflow run, continued: one curve, its steps in order, the resume counted
    assert second["mlflow_run_id"] == first["mlflow_run_id"]
    run = MlflowClient().get_run(first["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["miles.resumes"] == "2"  # the refused lr change was one
    assert [s for s, _ in tracking.metric_history(run.info.run_id, "reward/reward_mean")] == [1, 2]
    assert run.info.run_name.startswith("train-tiny ") and run.info.run_name.endswith("resumable")
    meta = training.checkpoint_meta(run_dir)
    assert meta is not None and meta["iteration"] == 2 and len(meta["consumed"]) == 2
    store = first["store_uri"]
    assert RunStore(store).trajectories.list_batches() == meta["consumed"]
    assert AdapterRegistry(store).versions() == [0, 1, 2]
    # a retried task finds its work done: the committed batch is reused, the update not applied twice
    with training.learner(run_dir) as lr:
        training.init_learner.fn(lr, pointed_recipe(run_dir), meta["base_checkpoint"], meta["store_uri"], resume=True)
        again = training.collect.fn(lr, 1)
        assert again["reused"] and again["batch_id"] == meta["consumed"][1]
        update = training.update.fn(lr, meta["consumed"][1])
        assert update["version"] == 2 and training.checkpoint_meta(run_dir)["iteration"] == 2
    # a crash between an update's checkpoint and its log_metrics: the resumed run backfills the hole
    # from the store (the consumed batch read back, the update's history row), same values
    hole = MlflowClient().create_run(run.info.experiment_id).info.run_id
    with training.learner(run_dir) as lr:
        training.init_learner.fn(lr, pointed_recipe(run_dir), meta["base_checkpoint"], meta["store_uri"], resume=True)
        train_mod._backfill(lr, hole, 2)
    want = dict(tracking.metric_history(run.info.run_id, "reward/reward_mean"))
    assert dict(tracking.metric_history(hole, "reward/reward_mean")) == want
    assert dict(tracking.metric_history(hole, "update/loss")) == dict(tracking.metric_history(run.info.run_id,
                                                                                           "update/loss"))


def test_only_transient_failures_are_retried(prefect_harness: None) -> None:
    assert common.is_transient(TimeoutError("slow S3"))
    assert not common.is_transient(FileExistsError("adapter version 3 belongs to another run"))
    assert not common.is_transient(ConfigError("optim.lr: must be > 0"))
    calls = {"io": 0, "bug": 0}
    policy = {**common.STORAGE, **common.LIGHT, "retry_delay_seconds": 0}

    @task(**policy)
    def flaky_io() -> str:
        calls["io"] += 1
        if calls["io"] < 3:
            raise ConnectionResetError("connection reset by peer")
        return "ok"

    @task(**policy)
    def buggy() -> None:
        calls["bug"] += 1
        raise ValueError("a bug is not fixed by retrying")

    @flow
    def storage_flow() -> str:
        out = flaky_io()
        with pytest.raises(ValueError):
            buggy()
        return out

    assert storage_flow() == "ok"
    assert calls == {"io": 3, "bug": 1}


def test_async_train_flow_runs_workers_logs_and_registers(trained: TrainedProject) -> None:
    """miles-async-train with local processes on the moto S3 store: every committed batch consumed
    once within the staleness bound, the run's figures and plots in MLflow, the adapter registered."""
    from flows.async_train import async_train_flow, learner_flow, sampler_flow
    from flows.params import AsyncTrainParams, LearnerParams, SamplerParams

    check_signature(async_train_flow.fn, AsyncTrainParams)
    check_signature(sampler_flow.fn, SamplerParams)
    check_signature(learner_flow.fn, LearnerParams)
    with pytest.raises(ValidationError, match="launcher"):
        AsyncTrainParams(launcher="threads")
    store = f"{trained.store_uri}-async"
    out = async_train_flow(recipe="tiny", overrides=TINY_OVERRIDES + ["async_rl.poll_interval=0.02"],
                           run_dir=str(trained.root / "async"), store_uri=store,
                           base_checkpoint=trained.sft["base_checkpoint"], num_samplers=2, batches_per_sampler=2,
                           experiment=EXPERIMENT, register_as=trained.model_name + "-async", timeout_s=600)
    assert out["consumed_batches"] + out["dropped_batches"] == 4 and out["adapter_version"] == out["consumed_batches"]
    assert out["max_staleness_seen"] <= load_recipe("tiny").async_rl.max_staleness
    committed = TrajectoryStore(f"{store}/trajectories").list_batches()
    assert len(committed) == 4 and AdapterRegistry(store).latest_version() == out["adapter_version"]
    client = MlflowClient()
    run = client.get_run(out["mlflow_run_id"])
    m = run.data.metrics
    for key in ("async/learner_idle_fraction", "async/dropped_batches", "async/samples_per_s",
                "async/adapter_sync_bytes_mean", "async/adapter_sync_seconds_mean", "eval/pass1"):
        assert key in m, key
    assert 0.0 <= m["async/learner_idle_fraction"] <= 1.0 and m["async/adapter_sync_bytes_mean"] > 0
    assert len(client.get_metric_history(run.info.run_id, "async/staleness")) == out["consumed_batches"]
    files = _artifact_files(client, run.info.run_id)
    assert {"plots/staleness_histogram.png", "plots/learning_curve.png", "plots/staleness_histogram.json"} <= files
    assert run.data.tags["miles.launcher"] == "processes" and out["model_uri"].startswith("models:/")
    pl = out["placement"]  # the recipe's split judged from measured seconds per completion
    assert (pl["samplers"], pl["learner_ranks"]) == (2, 1)
    # one side saturated, unless the recipe's global batch admits fewer samplers than run (they wait)
    assert min(pl["sampler_idle"], pl["learner_idle"]) == 0.0 or (pl["samplers"] > pl["admitted"]
                                                                   and "admits" in pl["describe"])
    assert pl["rollout_s_per_completion"] > 0 and pl["update_s_per_completion"] > 0
    assert m["placement/learner_idle"] == pytest.approx(pl["learner_idle"])


@pytest.mark.e2e
def test_async_train_flow_places_devices_and_runs_a_torchrun_learner(trained: TrainedProject) -> None:
    """--devices splits by measured costs for the recipe's global batch; --ranks 2 runs the learner as two
    gloo ranks under torchrun inside the local run, consuming every batch once."""
    from flows.async_train import async_train_flow

    ov = TINY_OVERRIDES + ["async_rl.poll_interval=0.02"]
    placed = async_train_flow(recipe="tiny", overrides=ov, run_dir=str(trained.root / "placed"),
                              base_checkpoint=trained.sft["base_checkpoint"], devices=3, batches_per_sampler=1,
                              experiment=EXPERIMENT, register_as=None, timeout_s=600)
    pl = placed["placement"]
    # one side saturated, unless the recipe's global batch admits fewer samplers than placed (they wait)
    assert pl["samplers"] + pl["learner_ranks"] == 3 and pl["batches_per_update"] == 1
    assert min(pl["sampler_idle"], pl["learner_idle"]) == 0.0 or (pl["samplers"] > pl["admitted"]
                                                                   and "admits" in pl["describe"])
    assert placed["consumed_batches"] + placed["dropped_batches"] == pl["samplers"]
    out = async_train_flow(recipe="tiny", overrides=ov, run_dir=str(trained.root / "ranks"),
                           base_checkpoint=trained.sft["base_checkpoint"], num_samplers=1, learner_ranks=2,
                           batches_per_sampler=2, experiment=EXPERIMENT, register_as=None, timeout_s=600)
    assert out["placement"]["learner_ranks"] == 2 and out["consumed_batches"] == out["adapter_version"] == 2
    assert RunStore(out["store_uri"]).read_json("learner", "status.json")["learner_ranks"] == 2  # the world it ran as
