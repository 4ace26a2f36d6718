"""Synchronous ADPO training flow (ARCHITECTURE.md, "One synchronous iteration"):

    with learner(run_dir) as lr:   per iteration: collect (sample, score, commit) -> update (+ publish) -> evaluate every N

A sampler and a learner in one process; tasks hand each other batch ids, never tensors. One MLflow run
per flow run, tagged with the Prefect flow run id: the resolved recipe as params, per-iteration
metrics, adapters, sample completions and the learning curve. At the end the final adapter is
registered as a pyfunc model version, and alias ``champion`` moves only if its pass@1 beats the
current champion's.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from flows.params import TrainParams, cli_main, documented, validate
from flows.sft import base_or_sft
from miles_core.config import ConfigError, load_recipe
from miles_core.progress import Progress
import tracking
from flows import session
from tasks import evaluation, training

CURVE_PANELS = [("rollout reward", ["reward/reward_mean"]), ("held-out pass@1", ["eval/pass1"])]


REWARD_KEYS = ("reward_mean", "reward_std", "zero_variance_frac", "distinct_frac")


def _iteration_metrics(co: dict[str, Any], up: dict[str, Any]) -> dict[str, float]:
    """Flatten the two tasks' stats into MLflow metric names (reward/, rollout/, update/, time/<task>_s)."""
    out = {f"{'reward' if k in REWARD_KEYS else 'rollout'}/{k}": v for k, v in co["stats"].items() if k != "seconds"}
    out.update({f"update/{k}": v for k, v in up["stats"].items() if k != "seconds"})
    out.update({"time/collect_s": co["stats"]["seconds"], "time/update_s": up["stats"].get("seconds")})
    if "approx_kl" not in up["stats"]:  # every group had equal rewards: no gradient, policy unchanged
        out.update({"update/approx_kl": 0.0, "update/clip_frac": 0.0})
    return out


def _backfill(run: training.LearnerSession, run_id: str, start: int) -> None:
    """Log the per-iteration metrics of committed iterations the MLflow run lacks: a crash between an
    update's checkpoint and its ``log_metrics`` would otherwise leave a hole in the resumed curve. The
    batch and the update's history row are in the store, so nothing is recomputed."""
    logged = {s for s, _ in tracking.metric_history(run_id, "reward/reward_mean")}
    for it in (i for i in range(start) if i + 1 not in logged):
        co = training.collect(run, it)  # consumed: read back, not sampled
        up = training.update(run, co["batch_id"], local_copy=False)  # in the ledger: its history row
        tracking.log_metrics(run_id, _iteration_metrics(co, up), it + 1)


def _loop(p: TrainParams, cfg: Any, run: training.LearnerSession, run_id: str, init: dict[str, Any]) -> dict[str, Any]:
    """Iterations ``init['iteration']..train.iterations`` of the learner ``run``; returns first/last
    eval and last adapter."""
    log = get_run_logger()
    start, total = init["iteration"], cfg.train.iterations
    every = cfg.train.eval_every if cfg.train.eval_every > 0 else max(total, 1)
    ev = first = training.evaluate_policy(run, init["version"], p.progress)
    tracking.log_eval(run_id, ev, start)
    tracking.log_params(run_id, {f"eval_config.{k}": v for k, v in ev["config"].items()})
    _backfill(run, run_id, start)
    adapter = init
    bar = Progress(total - start, "rl", enabled=p.progress)  # a bar with ETA on a terminal, plain lines elsewhere
    bar.figures["pass@1"] = first["pass1"]
    curve = [(start, first["pass1"])]
    for it in range(start, total):
        step = it + 1
        co = training.collect(run, it)
        adapter = training.update(run, co["batch_id"], local_copy=p.log_adapters or step == total)
        tracking.log_metrics(run_id, _iteration_metrics(co, adapter), step)
        tracking.log_table(run_id, [{"iteration": step, **s} for s in co["samples"]], "samples/rollouts.json")
        if p.log_adapters:
            tracking.log_artifacts(run_id, adapter["adapter_dir"], f"adapters/v{adapter['version']:06d}")
        log.info("iteration %d/%d: reward %.3f, adapter v%d", step, total, co["stats"]["reward_mean"], adapter["version"])
        if adapter.get("guard_event"):  # the collapse guard skipped this batch (and may have rolled back)
            log.warning("iteration %d: collapse guard: %s", step, adapter["guard_event"])
        if step % every == 0 or step == total:
            ev = training.evaluate_policy(run, adapter["version"], p.progress)
            tracking.log_eval(run_id, ev, step)
            curve.append((step, ev["pass1"]))
            log.info("iteration %d: held-out pass@1 %.3f (%+.3f since iteration %d)", step, ev["pass1"],
                     ev["pass1"] - first["pass1"], start)
            bar.figures["pass@1"] = ev["pass1"]
        bar.update(1, reward=float(co["stats"]["reward_mean"]))
    bar.close()
    tracking.log_metrics(run_id, {"final/pass1": ev["pass1"], "final/start_pass1": first["pass1"]}, total)
    tracking.log_artifact(run_id, ev["path"], "eval")
    tracking.log_table(run_id, [{"version": adapter["version"], **s} for s in ev["samples"]], "samples/eval.json")
    tracking.log_curves(run_id, CURVE_PANELS, "plots/learning_curve.png")
    return {"first": first, "last": ev, "adapter": adapter, "curve": curve}


@flow(name="miles-train", persist_result=False)
@documented(TrainParams)
def train_flow(recipe: str = "arith", overrides: list[str] | None = None, run_dir: str | None = None,
               experiment: str = "miles", tracking_uri: str | None = None, progress: bool = False,
               store_uri: str | None = None, base_checkpoint: str | None = None, iterations: int | None = None,
               register_as: str | None = "miles-arith", resume: bool = False,
               log_adapters: bool = True) -> dict[str, Any]:
    """ADPO post-training of a LoRA adapter on an SFT checkpoint (trained first when not given)."""
    p: TrainParams = validate(TrainParams, dict(locals()))
    cfg = load_recipe(p.recipe, p.recipe_overrides())
    out = p.run_path("train")
    tracking.configure(p.tracking_uri)
    owner = session.claim(out)
    previous = training.existing_run(out, p.resume)
    store = p.store_uri or (previous or {}).get("store_uri") or str(out / "store")
    if previous:  # the run as it was started, the overrides given now on top (only resumable ones)
        named = cfg.name
        cfg, changed = training.resumed_recipe(store, p.recipe_overrides())
        if cfg.name != named:
            raise ConfigError(f"cannot resume {out} as recipe {named!r}: it trains {cfg.name!r}")
        get_run_logger().info("resume: the run's recipe as started%s", "; changed now: " + ", ".join(
            f"{k} {a} -> {b}" for k, (a, b) in changed.items()) if changed else ", unchanged")
    base, sft = base_or_sft(p, out, p.base_checkpoint or (previous or {}).get("base_checkpoint"))
    tags = {"miles.kind": "train", "miles.recipe": p.recipe, "miles.run_dir": out, "miles.store_uri": store,
            "miles.base_checkpoint": Path(base).resolve(), "miles.sft_run_id": sft.get("mlflow_run_id", "")}
    reg: dict[str, Any] = {}
    name = session.run_name("train", cfg.name, out)
    with training.learner(out) as lr, session.tracked(owner, p.experiment, name, cfg.flat(), tags, p.resume) as run_id:
        init = training.init_learner(lr, cfg, str(base), store, p.resume)
        tracking.set_tags(run_id, {"miles.run_key": init["run_key"], "miles.resumed_from": init["iteration"]})
        get_run_logger().info("train %s: iterations %d..%d, store %s, MLflow run %s", cfg.name,
                              init["iteration"], cfg.train.iterations, store, run_id)
        res = _loop(p, cfg, lr, run_id, init)
        ev, adapter = res["last"], res["adapter"]
        if p.register_as:
            reg = evaluation.register_policy(
                run_id, p.register_as, init["base_checkpoint"], adapter["adapter_dir"], cfg.to_dict(),
                ev["pass1"], ev["fingerprint"],
                {"miles.adapter_uri": adapter["adapter_uri"], "miles.policy_version": adapter["version"],
                 "miles.recipe": p.recipe, "miles.run_key": init["run_key"]}, eval_record=ev["path"])
            tracking.set_tags(run_id, {"miles.model_uri": reg["model_uri"], "miles.promoted": reg["promoted"]})
    summary = {"sft_pass1": res["first"]["pass1"] if init["iteration"] == 0 else None,
               "start_pass1": res["first"]["pass1"], "final_pass1": ev["pass1"], "curve": res["curve"],
               "start_eval": res["first"]["path"], "final_eval": ev["path"],
               "iterations": cfg.train.iterations - init["iteration"], "mlflow_run_id": run_id, "run_dir": str(out),
               "store_uri": store, "base_checkpoint": init["base_checkpoint"], "adapter_dir": adapter["adapter_dir"],
               "adapter_uri": adapter["adapter_uri"], "adapter_version": adapter["version"],
               "eval_fingerprint": ev["fingerprint"], "model_uri": reg.get("model_uri"),
               "model_version": reg.get("version"), "promoted": reg.get("promoted"),
               "champion_version": reg.get("champion_version"), "promotion_reason": reg.get("reason")}
    get_run_logger().info("train done: %s", summary)
    return summary


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(cli_main(train_flow, TrainParams))
