"""Asynchronous ADPO training flow (ARCHITECTURE.md, "One asynchronous iteration"):

    SFT base (unless given) -> prepare the run in the store
    -> start N sampler runs and one learner run (deployments on work pools, or local processes)
    -> wait until the sample budget is consumed -> log the run to MLflow -> evaluate -> register

Samplers and the learner never talk to this flow or to each other: they share the store URI
(trajectory batches, adapter versions, the learner's checkpoint and status). So the same run can
be started here, from ``python -m miles_core.asyncrl``, or from a Kubernetes job, and a worker
that crashes is simply started again (its deployment's retries, or the launcher) and resumes.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any, Literal

from prefect import flow, get_run_logger

from flows.params import AsyncTrainParams, LearnerParams, SamplerParams, cli_main, documented, validate
from flows.sft import base_or_sft
from miles_core.config import load_recipe
import tracking
from flows import session
from tasks import asyncrun, evaluation

SAMPLER_DEPLOYMENT = "miles-async-sampler/miles-async-sampler"
LEARNER_DEPLOYMENT = "miles-async-learner/miles-async-learner"
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
HISTORY_METRICS = ("staleness", "reward_mean", "loss", "clip_frac", "approx_kl", "iw_mean", "iw_max", "update_s")
PLACEMENT_METRICS = ("sampler_idle", "learner_idle", "rollout_s_per_completion", "update_s_per_completion")
CURVE_PANELS = [("rollout reward (per update)", ["async/reward_mean"]), ("staleness", ["async/staleness"]),
                ("importance weight", ["async/iw_mean", "async/iw_max"])]


@flow(name="miles-async-sampler", persist_result=False)
@documented(SamplerParams)
def sampler_flow(run_uri: str, worker: str = "w0", index: int = 0) -> dict[str, Any]:
    """One sampler worker of an asynchronous run (started by miles-async-train)."""
    p: SamplerParams = validate(SamplerParams, dict(locals()))
    return asyncrun.run_sampler(p.run_uri, p.worker, p.index)


@flow(name="miles-async-learner", persist_result=False)
@documented(LearnerParams)
def learner_flow(run_uri: str) -> dict[str, Any]:
    """The learner of an asynchronous run (started by miles-async-train)."""
    p: LearnerParams = validate(LearnerParams, dict(locals()))
    return asyncrun.run_learner(p.run_uri)


def _run_deployments(run_uri: str, num_samplers: int, timeout_s: float) -> None:
    """Start the learner and samplers as flow runs of their deployments and wait for all of them."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    log = get_run_logger()
    runs = [run_deployment(LEARNER_DEPLOYMENT, parameters={"run_uri": run_uri}, timeout=0, as_subflow=False)]
    runs += [run_deployment(SAMPLER_DEPLOYMENT, parameters={"run_uri": run_uri, "worker": f"w{i}", "index": i},
                            timeout=0, as_subflow=False) for i in range(num_samplers)]
    log.info("started flow runs %s", [r.name for r in runs])
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            states = {r.name: client.read_flow_run(r.id).state for r in runs}
            bad = {n: s for n, s in states.items() if s is not None and s.type.value in TERMINAL - {"COMPLETED"}}
            if bad:
                raise RuntimeError(f"asynchronous run {run_uri}: worker flow runs ended badly: "
                                   + "; ".join(f"{n}: {s.type.value} {s.message or ''}" for n, s in bad.items()))
            if all(s is not None and s.type.value == "COMPLETED" for s in states.values()):
                return
            time.sleep(1.0)
    raise TimeoutError(f"asynchronous run {run_uri}: workers not finished after {timeout_s:.0f}s")


def _log_run(run_id: str, summ: dict[str, Any]) -> None:
    """Per-update metrics, the staleness histogram, idle fraction, throughput and sync cost."""
    for h in summ["history"]:
        tracking.log_metrics(run_id, {f"async/{k}": h.get(k) for k in HISTORY_METRICS}, int(h["update"]))
    wall = max(summ.get("wall_s", 0.0), 1e-9)
    tracking.log_metrics(run_id, {
        "async/learner_idle_fraction": summ.get("idle_fraction"), "async/dropped_batches": summ.get("dropped"),
        "async/quarantined_batches": summ.get("quarantined"), "async/max_staleness_seen": summ.get("max_staleness_seen"),
        "async/samples_per_s": summ.get("completions", 0) / wall, "async/updates": summ.get("updates"),
        "async/adapter_sync_bytes_mean": summ.get("adapter_sync_bytes_mean"),
        "async/adapter_sync_seconds_mean": summ.get("adapter_sync_seconds_mean"),
        "async/adapter_sync_lag_seconds_mean": summ.get("adapter_sync_lag_seconds_mean"),
        "async/resumes": summ.get("resumes"), "async/sampler_restarts": summ.get("sampler_restarts"),
        "async/learner_self_sampled_batches": summ.get("self_sampled_batches"),
        "async/learner_self_sample_fraction": summ.get("self_sample_fraction")},
        int(summ.get("updates") or 0))
    if summ.get("staleness_hist"):
        tracking.log_histogram(run_id, summ["staleness_hist"], "plots/staleness_histogram.png", "staleness",
                               f"staleness of consumed batches (bound S={summ.get('staleness_bound')})")
    tracking.log_curves(run_id, CURVE_PANELS, "plots/learning_curve.png", xlabel="update")


@flow(name="miles-async-train", persist_result=False)
@documented(AsyncTrainParams)
def async_train_flow(recipe: str = "arith", overrides: list[str] | None = None, run_dir: str | None = None,
                     experiment: str = "miles", tracking_uri: str | None = None, progress: bool = False,
                     store_uri: str | None = None, base_checkpoint: str | None = None,
                     num_samplers: int | None = None, batches_per_sampler: int | None = None,
                     learner_ranks: int | None = None, devices: int | None = None,
                     launcher: Literal["processes", "deployments"] = "processes", register_as: str | None = "miles-arith",
                     timeout_s: float = 3600.0) -> dict[str, Any]:
    """Asynchronous ADPO: decoupled sampler workers and one learner sharing a store, bounded staleness."""
    p: AsyncTrainParams = validate(AsyncTrainParams, dict(locals()))
    cfg = load_recipe(p.recipe, p.recipe_overrides())
    out = p.run_path("async")
    store = p.store_uri or str(out / "store")
    tracking.configure(p.tracking_uri)
    owner = session.claim(out)  # an async run restarted in its folder resumes (flow docstring): one MLflow run
    base, sft = base_or_sft(p, out, p.base_checkpoint)
    log = get_run_logger()
    plan = asyncrun.plan(store, cfg.to_dict(), str(base), p.devices)
    cfg = load_recipe(p.recipe, [*p.recipe_overrides(), *plan["overrides"]])
    log.info("placement%s: %s (measured per completion: rollout %.4f s, update %.4f s)",
             f" of {p.devices} devices" if p.devices else "", plan["describe"], plan["rollout_s_per_completion"],
             plan["update_s_per_completion"])
    tags = {"miles.kind": "async-train", "miles.recipe": p.recipe, "miles.run_dir": out, "miles.store_uri": store,
            "miles.base_checkpoint": Path(base).resolve(), "miles.launcher": p.launcher,
            "miles.sft_run_id": sft.get("mlflow_run_id", "")}
    reg: dict[str, Any] = {}
    name = session.run_name("async", cfg.name, out)
    with session.tracked(owner, p.experiment, name, cfg.flat(), tags, resume=True) as run_id:
        asyncrun.prepare(store, cfg.to_dict(), str(base))
        a = cfg.async_rl
        log.info("async run %s: %d samplers x %d batches, %d learner rank(s), S=%d, via %s", store, a.num_samplers,
                 a.batches_per_sampler, a.learner_ranks, cfg.async_rl.max_staleness, p.launcher)
        t0 = time.perf_counter()
        if p.launcher == "deployments":
            _run_deployments(store, a.num_samplers, p.timeout_s)
        else:
            asyncrun.run_processes(store, a.num_samplers, asyncrun.log_dir(str(out)), p.timeout_s)
        seconds = time.perf_counter() - t0
        summ = asyncrun.summary(store)
        _log_run(run_id, summ)
        tracking.log_metrics(run_id, {f"placement/{k}": float(plan[k]) for k in PLACEMENT_METRICS}, 0)
        tracking.log_metrics(run_id, {"async/seconds": seconds}, int(summ.get("updates") or 0))
        version = int(summ["version"])
        adapter_dir = evaluation.fetch_adapter(asyncrun.adapter_uri(store, version), str(out / "adapter"))
        ev = evaluation.evaluate_checkpoint(str(base), adapter_dir, cfg.to_dict(), str(out / "evals" / "final.json"),
                                          p.progress)
        tracking.log_eval(run_id, ev, int(summ.get("updates") or 0))
        tracking.log_artifact(run_id, ev["path"], "eval")
        if p.register_as:
            reg = evaluation.register_policy(run_id, p.register_as, str(Path(base).resolve()), adapter_dir, cfg.to_dict(),
                                           ev["pass1"], ev["fingerprint"],
                                           {"miles.adapter_uri": asyncrun.adapter_uri(store, version),
                                            "miles.policy_version": version, "miles.recipe": p.recipe},
                                           eval_record=ev["path"])
            tracking.set_tags(run_id, {"miles.model_uri": reg["model_uri"], "miles.promoted": reg["promoted"]})
    result = {"final_pass1": ev["pass1"], "seconds": seconds, "store_uri": store, "adapter_version": version,
              "adapter_dir": adapter_dir, "mlflow_run_id": run_id, "run_dir": str(out),
              "learner_idle_fraction": summ.get("idle_fraction"), "max_staleness_seen": summ.get("max_staleness_seen"),
              "dropped_batches": summ.get("dropped"), "consumed_batches": summ.get("consumed"),
              "model_uri": reg.get("model_uri"), "promoted": reg.get("promoted"),
              "placement": {k: plan[k] for k in ("samplers", "learner_ranks", "batches_per_update", "admitted",
                                                 "describe", *PLACEMENT_METRICS)}}
    log.info("async train done: %s", result)
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(cli_main(async_train_flow, AsyncTrainParams))
