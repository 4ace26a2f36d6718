"""Prefect tasks of an asynchronous run (ARCHITECTURE.md, "One asynchronous iteration"): prepare the run in the
store, run a sampler or the learner (the bodies of the deployments the flow starts), or run them
all as local processes, and read back the run's summary. Arguments are URIs and small dicts."""

from __future__ import annotations

import subprocess
from dataclasses import asdict
from pathlib import Path
from typing import Any

from prefect import task

from miles_core.asyncrl.launch import learner_command, local_env, prepare_run, run_local, summarize
from miles_core.asyncrl.placement import measure, place, predict
from miles_core.storage.run import RunStore
from miles_core.config import load_recipe
from tasks.common import LIGHT, STORAGE


@task(name="prepare-async-run", **STORAGE, **LIGHT)
def prepare(run_uri: str, cfg: dict[str, Any], base_checkpoint: str) -> dict[str, Any]:
    """Write run.json and upload the base once; re-opening the same run is allowed, another recipe is not."""
    spec = prepare_run(run_uri, load_recipe(cfg), base_checkpoint)
    return {"run_uri": run_uri, "base_source": spec["base_source"]}


@task(name="plan-async-placement", **LIGHT)
def plan(run_uri: str, cfg: dict[str, Any], base_checkpoint: str, devices: int | None) -> dict[str, Any]:
    """Seconds per completion measured with the base (asyncrl/placement.py::measure), then the split of
    ``devices`` that balances samplers and learner ranks for the recipe's global batch; without ``devices``,
    the recipe's own split judged. A run that already exists keeps the split it was started with.
    ``overrides``: what the recipe needs to run the planned split; ``describe``: its predicted idle."""
    recipe = load_recipe(cfg)
    spec = RunStore(run_uri).read_json("run.json")
    if spec is not None:  # a resumed run: its split is in run.json, whatever devices says now
        recipe, devices = load_recipe(spec["cfg"]), None
    costs = measure(recipe, base_checkpoint)
    a = recipe.async_rl
    b = recipe.batches_per_update()
    if devices:
        pl = place(devices, costs.rollout_s, costs.update_s, recipe.async_rl.max_staleness, b, recipe.train.prompts_per_iter)
        overrides = [f"async_rl.num_samplers={pl.samplers}", f"async_rl.learner_ranks={pl.learner_ranks}"]
    else:
        pl = predict(a.num_samplers, a.learner_ranks, costs.rollout_s, costs.update_s, recipe.async_rl.max_staleness, b,
                     b * recipe.train.prompts_per_iter)
        overrides = []
    return {**asdict(pl), "rollout_s_per_completion": costs.rollout_s, "update_s_per_completion": costs.update_s,
            "devices": devices, "overrides": overrides, "describe": pl.describe()}


@task(name="async-sampler", **LIGHT)
def run_sampler(run_uri: str, worker: str, index: int) -> dict[str, Any]:
    """One sampler until its budget is committed or a stop is requested (resumes where it stopped)."""
    from miles_core.asyncrl.sampler import SamplerWorker

    st = SamplerWorker(run_uri, worker, index).run()
    return {k: v for k, v in st.items() if k != "sync_lag_seconds"}


@task(name="async-learner", **LIGHT)
def run_learner(run_uri: str) -> dict[str, Any]:
    """The learner until every committed batch of the budget is consumed, dropped or quarantined:
    in this process, or with ``async_rl.learner_ranks`` > 1 as that many torchrun ranks on this
    worker's machine (a learner spanning machines is one torchrun per node: infra/README.md)."""
    from miles_core.asyncrl.learner import AsyncLearner

    ranks = int(RunStore(run_uri).read_spec()["cfg"]["async_rl"].get("learner_ranks", 1))
    if ranks == 1:
        return AsyncLearner(run_uri).run()
    subprocess.run(learner_command(run_uri, ranks), env=local_env(), check=True)
    return summarize(run_uri)


@task(name="async-local-processes", **LIGHT)
def run_processes(run_uri: str, num_samplers: int, log_dir: str, timeout_s: float) -> dict[str, Any]:
    """Learner + samplers as processes of this machine (no work pool needed), forked from one
    preloaded server so that each does not spend ~10 CPU-seconds importing torch and peft."""
    return run_local(run_uri, num_samplers, log_dir, timeout=timeout_s, warm=True)


@task(name="async-summary", **STORAGE, **LIGHT)
def summary(run_uri: str) -> dict[str, Any]:
    """Learner status, sampler sync stats and the per-update history written by the learner."""
    out = summarize(run_uri)
    hist = RunStore(run_uri).read_json("learner", "history.json") or {}
    out["history"] = hist.get("history", [])
    return out


def adapter_uri(run_uri: str, version: int) -> str:
    return f"{run_uri.rstrip('/')}/adapters/v{version:06d}"


def log_dir(run_dir: str) -> str:
    return str(Path(run_dir) / "logs")
