"""SFT baseline flow: masked-diffusion SFT on the recipe's scarce labelled demonstrations.

The RL flow starts from this checkpoint, and its pass@1 is the number RL has to beat, so the
plateau curve (held-out pass@1 every ``sft.eval_every`` steps) is logged to MLflow next to the
final evaluation with its full eval config.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from flows.params import SFTParams, cli_main, documented, validate
from miles_core.config import load_recipe
import tracking
from flows import session
from tasks import evaluation


@flow(name="miles-sft", persist_result=False)
@documented(SFTParams)
def sft_flow(recipe: str = "arith", overrides: list[str] | None = None, run_dir: str | None = None,
             experiment: str = "miles", tracking_uri: str | None = None, progress: bool = False,
             eval_problems: int | None = None, register_as: str | None = None) -> dict[str, Any]:
    """Train the SFT baseline and save its checkpoint folder (``<run_dir>/base``)."""
    p: SFTParams = validate(SFTParams, dict(locals()))
    cfg = load_recipe(p.recipe, p.overrides)
    out = p.run_path("sft")
    log = get_run_logger()
    tracking.configure(p.tracking_uri)
    tags = {"miles.kind": "sft", "miles.recipe": p.recipe, "miles.run_dir": out}
    owner = session.claim(out)
    with session.tracked(owner, p.experiment, session.run_name("sft", cfg.name, out), cfg.flat(), tags) as run_id:
        log.info("SFT %s for %d steps -> %s (MLflow run %s)", cfg.name, cfg.sft.steps, out / "base", run_id)
        res = evaluation.sft_baseline(cfg.to_dict(), str(out / "base"), run_id, p.eval_problems, p.progress)
        ev = res["eval"]
        tracking.log_eval(run_id, ev, cfg.sft.steps, prefix="sft_final")
        tracking.log_metrics(run_id, {"time/sft_s": res["seconds"]}, cfg.sft.steps)
        tracking.log_params(run_id, {f"eval_config.{k}": v for k, v in ev["config"].items()})
        tracking.log_artifact(run_id, ev["path"], "eval")
        tracking.log_table(run_id, ev["samples"], "samples/sft_eval.json")
        tracking.log_curves(run_id, [("SFT held-out pass@1", ["sft/pass1"]), ("SFT loss", ["sft/loss"])],
                            "plots/sft_curve.png", xlabel="SFT step")
        tracking.log_artifacts(run_id, res["base_checkpoint"], "base_checkpoint")
        reg: dict[str, Any] = {}
        if p.register_as:
            reg = evaluation.register_policy(run_id, p.register_as, res["base_checkpoint"], None, cfg.to_dict(),
                                           ev["pass1"], ev["fingerprint"], {"miles.kind": "sft"},
                                           eval_record=ev["path"])
    summary = {"sft_pass1": ev["pass1"], "base_checkpoint": res["base_checkpoint"], "run_dir": str(out),
               "mlflow_run_id": run_id, "eval_fingerprint": ev["fingerprint"],
               "model_uri": reg.get("model_uri"), "promoted": reg.get("promoted")}
    log.info("SFT done: %s", summary)
    return summary



def base_or_sft(p: Any, out: Path, base: str | None) -> tuple[str, dict[str, Any]]:
    """The checkpoint a post-training flow starts from: ``base`` when given, else one trained by
    :func:`sft_flow` as a subflow under ``out/sft`` -> (base checkpoint, the SFT summary or {})."""
    if base is not None:
        return base, {}
    sft = sft_flow(recipe=p.recipe, overrides=p.overrides, run_dir=str(out / "sft"), experiment=p.experiment,
                   tracking_uri=p.tracking_uri, progress=p.progress)
    return sft["base_checkpoint"], sft

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(cli_main(sft_flow, SFTParams))
