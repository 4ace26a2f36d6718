"""Prefect tasks of an asynchronous run (ARCHITECTURE.md, "One asynchronous iteration"): prepare the run in the
store, run a sampler or the learner (the bodies of the deployments the flow starts), or run them
all as local processes, and read back the run's summary. Arguments are URIs and small dicts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task

from miles_core.asyncrl.launch import prepare_run, run_local, summarize
from miles_core.storage.run import RunStore
from miles_core.config import load_recipe
from tasks.common import LIGHT, STORAGE


@task(name="prepare-async-run", **STORAGE, **LIGHT)
def prepare(run_uri: str, cfg: dict[str, Any], base_checkpoint: str) -> dict[str, Any]:
    """Write run.json and upload the base once; re-opening the same run is allowed, another recipe is not."""
    spec = prepare_run(run_uri, load_recipe(cfg), base_checkpoint)
    return {"run_uri": run_uri, "base_source": spec["base_source"]}


@task(name="async-sampler", **LIGHT)
def run_sampler(run_uri: str, worker: str, index: int) -> dict[str, Any]:
    """One sampler until its budget is committed or a stop is requested (resumes where it stopped)."""
    from miles_core.asyncrl.sampler import SamplerWorker

    st = SamplerWorker(run_uri, worker, index).run()
    return {k: v for k, v in st.items() if k != "sync_lag_seconds"}


@task(name="async-learner", **LIGHT)
def run_learner(run_uri: str) -> dict[str, Any]:
    """The learner until every committed batch of the budget is consumed, dropped or quarantined."""
    from miles_core.asyncrl.learner import AsyncLearner

    return AsyncLearner(run_uri).run()


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
