"""Evaluation flow: pass@k of a registered model, an adapter, or a bare base checkpoint.

Sources: ``model_uri`` (``models:/NAME@champion``, ``models:/NAME/3``, ``runs:/ID/model``), an
``adapter`` (PEFT folder or ``<store_uri>/adapters/vNNNNNN``) on ``base_checkpoint``, or
``base_checkpoint`` alone. The recipe defaults to the one the model was trained with, so the task
format and sampling settings match; every number is logged with the full eval config, because
scores of diffusion LMs move with sampling settings.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from flows.params import EvalParams, cli_main, documented, validate
from miles_core.config import load_recipe
import tracking
from flows import session
from tracking import registry
from tasks import evaluation

DEFAULT_RECIPE = "arith"
BENCH_RECIPE = "bench_instruct"  # an instruct model of the hf backend on the field's benchmarks


@flow(name="miles-evaluate", persist_result=False)
@documented(EvalParams)
def evaluate_flow(recipe: str | None = None, overrides: list[str] | None = None, run_dir: str | None = None,
                  experiment: str = "miles", tracking_uri: str | None = None, progress: bool = False,
                  model_uri: str | None = None, adapter: str | None = None, base_checkpoint: str | None = None,
                  num_problems: int | None = None, tasks: str | None = None, data_dir: str | None = None,
                  preset: str | None = None) -> dict[str, Any]:
    """Evaluate a model on the recipe's held-out problems (or on each of ``tasks``' test files)
    with pinned sampling settings."""
    p: EvalParams = validate(EvalParams, dict(locals()))
    out = p.run_path("eval")
    tracking.configure(p.tracking_uri)
    log = get_run_logger()
    source: dict[str, Any] = {"name": None, "version": None, "registered_pass1": None, "recipe": None}
    base, adapter_dir = p.base_checkpoint, None
    if p.model_uri:
        source = registry.resolve_model(p.model_uri, out / "model")
        base, adapter_dir = source["base_dir"], source["adapter_dir"]
    elif p.adapter:
        adapter_dir = evaluation.fetch_adapter(p.adapter, str(out / "adapter"))
    assert base is not None  # EvalParams guarantees a base checkpoint or a model URI
    if p.tasks:
        return evaluate_tasks(p, str(base), adapter_dir, out)
    overrides = [*p.recipe_overrides(), *([f"eval.num_problems={p.num_problems}"] if p.num_problems else [])]
    cfg = load_recipe(p.recipe or source["recipe"] or DEFAULT_RECIPE, overrides)
    described = p.model_uri or p.adapter or str(Path(base).resolve())
    tags = {"miles.kind": "eval", "miles.model": described, "miles.base_checkpoint": Path(base).resolve(),
            "miles.adapter": adapter_dir or "", "miles.registered_model": source["name"] or "",
            "miles.registered_version": source["version"] or ""}
    owner = session.claim(out)
    with session.tracked(owner, p.experiment, session.run_name("eval", cfg.name, out), cfg.flat(), tags) as run_id:
        log.info("evaluating %s on %d %s problems (MLflow run %s)", described, cfg.eval.num_problems, cfg.name, run_id)
        ev = evaluation.evaluate_checkpoint(str(base), adapter_dir, cfg.to_dict(), str(out / "eval.json"), p.progress)
        tracking.log_params(run_id, {f"eval_config.{k}": v for k, v in ev["config"].items()})
        tracking.set_tags(run_id, {"miles.eval_fingerprint": ev["fingerprint"]})
        tracking.log_eval(run_id, ev, 0)
        tracking.log_artifact(run_id, ev["path"], "eval")
        tracking.log_table(run_id, ev["samples"], "samples/eval.json")
    summary = {"pass1": ev["pass1"], "pass_at": ev["pass_at"], "num_problems": ev["num_problems"],
               "eval_fingerprint": ev["fingerprint"], "mlflow_run_id": run_id, "model_uri": p.model_uri,
               "model_name": source["name"], "model_version": source["version"],
               "registered_pass1": source["registered_pass1"], "base_checkpoint": str(base),
               "adapter_dir": adapter_dir, "run_dir": str(out), "samples": ev["samples"]}
    log.info("eval done: pass@1 %.4f (%s)", ev["pass1"], described)
    return summary


def evaluate_tasks(p: EvalParams, base: str, adapter_dir: str | None, out: Path) -> dict[str, Any]:
    """One model on several benchmarks: a row per task (DARE's table shape), one MLflow run, each
    cell logged with the config fingerprint that produced it."""
    log = get_run_logger()
    described = p.model_uri or p.adapter or str(Path(base).resolve())
    cells: list[dict[str, Any]] = []
    tags = {"miles.kind": "eval-benchmarks", "miles.model": described, "miles.tasks": p.tasks or "",
            "miles.preset": p.preset or ""}
    owner = session.claim(out)
    name = session.run_name("eval", p.tasks or "", out)
    with session.tracked(owner, p.experiment, name, {"preset": p.preset or "", "tasks": p.tasks}, tags) as run_id, \
            evaluation.model_cache() as models:  # one model, several benchmarks: loaded once
        for name in (p.tasks or "").split(","):
            test_file = evaluation.find_test_file(p.data_dir or "", name)
            over = [f"task.name={name}", f"task.test_path={test_file}", "task.num_val=0",
                    f"task.num_test={p.num_problems or 1_000_000}", f"eval.num_problems={p.num_problems or 1_000_000}",
                    *p.recipe_overrides()]
            cfg = load_recipe(p.recipe or BENCH_RECIPE, over)
            log.info("evaluating %s on %s (%s)", described, name, test_file)
            ev = evaluation.evaluate_checkpoint(base, adapter_dir, cfg.to_dict(), str(out / f"{name}.json"), p.progress,
                                                models)
            cells.append({"task": name, "pass1": ev["pass1"], "reward_mean": ev["metrics"].get("reward_mean"),
                          "num_problems": ev["num_problems"], "fingerprint": ev["fingerprint"], "config": ev["config"],
                          "file": test_file})
            tracking.log_metrics(run_id, {f"{name}/pass1": ev["pass1"], f"{name}/reward_mean": ev["metrics"].get("reward_mean")})
            tracking.set_tags(run_id, {f"miles.eval_fingerprint.{name}": ev["fingerprint"]})
            tracking.log_artifact(run_id, ev["path"], "eval")
        results = out / "benchmarks.json"
        results.write_text(json.dumps({"model": described, "preset": p.preset, "cells": cells}, indent=2))
        tracking.log_artifact(run_id, results)
    return {"table": benchmark_table(described, cells), "results": str(results), "mlflow_run_id": run_id,
            "cells": [{k: c[k] for k in ("task", "pass1", "num_problems", "fingerprint")} for c in cells]}


def benchmark_table(model: str, cells: list[dict[str, Any]]) -> str:
    """Rows of tasks, one column per model, pass@1 in percent (d1 and DARE report percentages)."""
    name = Path(model).name or model
    width = max(len(name), 8)
    lines = [f"| {'task':<10} | {name:>{width}} | {'n':>5} | config |", f"|{'-' * 12}|{'-' * (width + 2)}|{'-' * 7}|--------|"]
    for c in cells:
        lines.append(f"| {c['task']:<10} | {100 * c['pass1']:>{width}.1f} | {c['num_problems']:>5} | {c['fingerprint']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(cli_main(evaluate_flow, EvalParams))
