"""The scale model against the emulated runs (benchmarks/scale/emulate.py): its inputs that this
2-core machine changes with the process count fitted on the small runs, the larger run predicted
out of sample, and the straggler runs predicted before they ran (``python -m
benchmarks.scale_model --predict`` writes :data:`PREDICTIONS`, committed before those runs).
benchmarks/scale/scale_model.py reports them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dataclasses import replace

from benchmarks.sim import Params, refresh_delay, simulate

# the model's predictions for straggler_configs() and refresh_configs(), written by --predict before
# those runs (committed)
RECORDS = Path(__file__).resolve().parents[2] / "docs" / "results" / "records"
PREDICTIONS = RECORDS / "predictions-stragglers.json"
REFRESH_PREDICTIONS = RECORDS / "predictions-refresh.json"
TRAJECTORY_PREDICTIONS = RECORDS / "predictions-trajectories.json"
EMULATE_GROUP = 2  # emulate.py's train.group_size: the unit its runs were dealt before single trajectories

CALIBRATED = ("measured_rollout_s", "measured_update_s", "learner_host_s", "sampler_host_s", "learner_start_s",
              "startup_poll_interval_s")


def startup_poll_interval(run: dict) -> float:
    """The mean interval of a run's samplers' polls for version 0 (their requests during start-up)."""
    return run["learner_start_s"] / run["startup_polls"] if run.get("startup_polls") else 0.0


def deal_unit(run: dict) -> int:
    """Rows per unit the run's learner ranks were dealt: as recorded, else (a record from before
    the learner dealt single trajectories) a whole group."""
    return run.get("deal_unit", run.get("group_size", EMULATE_GROUP))


def emulated_params(run: dict) -> Params:
    """The model of one emulated run from its (measured or fitted) costs, split, global batch,
    budget and the store latency that run measured on SeaweedFS."""
    return Params(samplers=run["samplers"], learner_ranks=run["learner_ranks"], batches=run["batches"],
                  completions_per_batch=run["completions_per_batch"], deal_unit=deal_unit(run),
                  minibatches=run.get("minibatches", 1), rollout_s=run["measured_rollout_s"], rollout_cv=0.05,
                  rollout_tail_p=run.get("rollout_tail", (0.0, 1.0))[0], rollout_tail_x=run.get("rollout_tail", (0.0, 1.0))[1],
                  update_s=run["measured_update_s"],
                  allreduce_bytes=run["allreduce_bytes"], link_bytes_s=run["link_bytes_s"], link_latency_s=2e-4,
                  adapter_bytes=run["adapter_bytes"], batch_bytes=run["batch_bytes"], checkpoint_every=1,
                  store_latency_s=run["store_latency_s"], store_bytes_s=run["store_bytes_s"],
                  put_rate=run["store_rate"], get_rate=run["store_rate"], poll_s=run["poll_s"],
                  poll_backoff=run["poll_backoff"], poll_max_s=run["poll_max_s"], max_staleness=run["max_staleness"],
                  learner_samples=False, shared_budget=False, batches_per_update=run["batches_per_update"],
                  sampler_host_s=run.get("sampler_host_s", 0.0), learner_host_s=run.get("learner_host_s", 0.0),
                  learner_start_s=run.get("learner_start_s", 0.0), deal=run.get("deal", "even"),
                  rank_slowness=tuple(run.get("rank_slowness", ())),
                  startup_poll_s=run.get("startup_poll_interval_s", startup_poll_interval(run)),
                  **({"wire": run["wire"]} if "wire" in run else {}))


def calibrate(runs: list[dict], at: int) -> dict:
    """``at`` processes' inputs from the calibration ``runs``: each of :data:`CALIBRATED` a line
    in the process count through them (the last run's value when only one), the wire costs their
    mean; the run's own split, batch and budget are the design's, not fitted."""
    runs = [{**r, "startup_poll_interval_s": startup_poll_interval(r)} for r in runs]
    xs = [r["processes"] for r in runs]
    fitted: dict[str, Any] = {}
    for key in CALIBRATED:
        ys = [r.get(key, 0.0) for r in runs]
        if len(runs) >= 2 and xs[-1] != xs[0]:
            slope = (ys[-1] - ys[0]) / (xs[-1] - xs[0])
            fitted[key] = max(ys[0] + slope * (at - xs[0]), 0.0)
        else:
            fitted[key] = ys[-1]
    wires = [r["wire"] for r in runs if "wire" in r]
    if wires:
        fitted["wire"] = {k: sum(w[k] for w in wires) / len(wires) for k in wires[0]}
    return fitted


def validation(runs: list[dict], calibrate_on: tuple[int, ...] = (4, 16)) -> list[dict[str, Any]]:
    """Every emulated run (emulate.json's ``runs``) predicted: from a fit on ``calibrate_on`` (out
    of sample for the others)."""
    cal = [r for r in runs if r["processes"] in calibrate_on]
    out: list[dict[str, Any]] = []
    for run in runs:
        sample = "in sample" if run["processes"] in calibrate_on else "out of sample"
        r = simulate(emulated_params({**run, **calibrate(cal, run["processes"])}))
        pred = r["after_two_updates_completions_per_s"] / run["ideal_completions_per_s"]  # as emulate.py measures
        name = f"emulated, {run['processes']} processes ({sample})"
        out.append({"run": name, "metric": "efficiency", "predicted": pred, "measured": run["efficiency"],
                    "error": pred / run["efficiency"] - 1, "out_of_sample": sample == "out of sample"})
        out.append({"run": name, "metric": "requests per batch", "predicted": r["requests_per_batch"],
                    "measured": run["requests_per_batch"], "error": r["requests_per_batch"] / run["requests_per_batch"] - 1,
                    "out_of_sample": sample == "out of sample"})
    return out


def tail_share(samplers: int, per_sampler: int, p: float) -> float:
    """The share of an emulated run's rollouts its seeded draw puts in the tail (standin.in_tail:
    known before the run; 2 of 32 where 0.1 was asked, in the run of 6364dbd)."""
    from benchmarks.standin import in_tail

    n = samplers * per_sampler
    return sum(in_tail(f"w{i}", seq, p) for i in range(samplers) for seq in range(per_sampler)) / n if n else 0.0


def is_plain(run: dict[str, Any]) -> bool:
    """An emulated run of equal ranks dealt evenly, without a rollout tail, at its admitting batch
    and without refresh (what calibrates)."""
    return (run.get("slow_rank", 1.0) == 1.0 and not run.get("rank_spread") and run.get("deal", "even") == "even"
            and tuple(run.get("rollout_tail", (0.0, 1.0)))[0] == 0.0 and not run.get("global_batch")
            and not run.get("refresh"))


def straggler_configs(prompts: int = 32) -> list[dict[str, Any]]:
    """The emulated configurations whose efficiency the model predicts before they run: 16
    processes with one learner rank 10% slower, and with every rank's speed spread 5%, each dealt
    evenly and by speed; and the spread dealt by speed with a tenth of the rollouts taking 3x
    (``python -m benchmarks.emulate --processes 16 --prompts 32 --rank-spread 0.05 --rollout-tail
    0.1:3 --deal speed``). ``prompts`` per sampler batch: 32 make 16 groups a rank at 16 processes
    (the 4,096-GPU shape has 10), so a deal by speed has groups to move."""
    plain = (0.0, 1.0)
    out = [{"processes": 16, "prompts": prompts, "slow_rank": slow, "rank_spread": spread, "rollout_tail": plain,
            "deal": deal} for slow, spread in ((1.1, 0.0), (1.0, 0.05)) for deal in ("even", "speed")]
    return out + [{"processes": 16, "prompts": prompts, "slow_rank": 1.0, "rank_spread": 0.05, "rollout_tail": (0.1, 3.0),
                   "deal": "speed"}]


def trajectory_configs(prompts: int = 32) -> list[dict[str, Any]]:
    """The straggler runs dealt by speed again, now that the learner deals single trajectories
    (learner/shares.py): one rank 10% slower, and every rank spread 5% (``python -m
    benchmarks.emulate --processes 16 --prompts 32 --slow-rank 1.1 --deal speed``). In whole
    groups the slow rank could not be fully made up (16 groups: 15 x 1.1 > 16); in 32 trajectories
    it can, to 1 / 32."""
    return [{**c, "deal_unit": 1} for c in straggler_configs(prompts)
            if c["deal"] == "speed" and c["rollout_tail"] == (0.0, 1.0)]


def refresh_configs(batches: int = 4) -> list[dict[str, Any]]:
    """The emulated strong-scaling pairs whose figures the model predicts before they run: 16 and
    64 processes, a fixed global batch of one sampler batch per 8 processes (admission holds
    samplers back, and a rollout spans updates), S = 6, without and with in-flight refresh
    (``python -m benchmarks.emulate --processes 16 --global-batch 2 --refresh 1``; 64: 8)."""
    return [{"processes": n, "prompts": 4, "slow_rank": 1.0, "rank_spread": 0.0, "rollout_tail": (0.0, 1.0),
             "deal": "even", "global_batch": n // 8, "staleness": 6, "refresh": r, "batches": batches}
            for n in (16, 64) for r in (0, 1)]


def _fixed_split(like: dict, c: dict[str, Any]) -> dict[str, Any]:
    """The split, batch and budget emulate.py gives a fixed global batch (``c["global_batch"]``), and
    the refresh model's delay (half the polls' cap to discover a version, then its fetch)."""
    from miles_core.asyncrl.placement import place

    n = like["completions_per_batch"]
    pl = place(c["processes"], like["rollout_s"] / n, like["update_s"] / n, c["staleness"], c["global_batch"],
               c["prompts"], 0.0)
    return {"samplers": pl.samplers, "learner_ranks": pl.learner_ranks, "batches_per_update": pl.batches_per_update,
            "batches": pl.samplers * c["batches"], "max_staleness": c["staleness"], "refresh": bool(c["refresh"]),
            "refresh_delay_s": refresh_delay(emulated_params(like))}


def predict(runs: list[dict], configs: list[dict[str, Any]], calibrate_on: tuple[int, ...] = (4, 16)) -> list[dict]:
    """Each configuration's efficiency as emulate.py measures it, from the model calibrated on the
    plain runs of ``calibrate_on`` processes: the run of its size gives the split, the batch and
    the ideal (placement decides them, not the slowness), emulate.py's seeded draws the ranks'
    slowness and which rollouts are in the tail (:func:`tail_share`), which lengthens the plain
    runs' mean rollout by 1 + share (X - 1)."""
    from benchmarks.emulate import slowness

    plain = [r for r in runs if is_plain(r)]
    out = []
    for c in configs:
        size = [r for r in plain if r["completions_per_batch"] == 2 * c.get("prompts", 4)]  # groups of 2 (emulate.py)
        cal = [r for r in size if r["processes"] in calibrate_on]
        like = next(r for r in size if r["processes"] == c["processes"])
        slow = slowness(like["learner_ranks"], c["rank_spread"], c["slow_rank"], c["processes"])
        fit = calibrate(cal, c["processes"])
        p, x = c.get("rollout_tail", (0.0, 1.0))
        share = tail_share(like["samplers"], like["batches"] // like["samplers"], p)
        fit["measured_rollout_s"] *= 1 + share * (x - 1)
        fixed = _fixed_split(like, c) if c.get("global_batch") else {}
        params = emulated_params({**like, **fit, "deal": c["deal"], "rank_slowness": slow, "rollout_tail": (share, x),
                                  "deal_unit": deal_unit(c), **fixed})
        r = simulate(replace(params, refresh=fixed.get("refresh", False), refresh_delay_s=fixed.get("refresh_delay_s", 0.0)))
        out.append({**c, "predicted": r["after_two_updates_completions_per_s"] / like["ideal_completions_per_s"],
                    "predicted_step_age": r["step_age_mean"], "predicted_dropped": r["dropped"],
                    "tail_share": share,
                    "plain_measured": like["efficiency"], "learner_ranks": like["learner_ranks"],
                    "units_per_rank": like["batches_per_update"] * like["completions_per_batch"]
                    / deal_unit(c) / like["learner_ranks"]})
    return out


def checked(predictions: list[dict], runs: list[dict]) -> list[dict[str, Any]]:
    """Predictions written before their runs against the emulated runs that match them, error with sign."""
    key = ("processes", "slow_rank", "rank_spread", "deal", "global_batch", "refresh")
    UNSET = {"global_batch": 0, "refresh": 0}  # runs and predictions from before those options
    out = []
    for pr in predictions:
        run = next((r for r in runs if all(r.get(k, UNSET.get(k)) == pr.get(k, UNSET.get(k)) for k in key)
                    and r["completions_per_batch"] == 2 * pr.get("prompts", 4) and deal_unit(r) == deal_unit(pr)
                    and list(r.get("rollout_tail", (0.0, 1.0))) == list(pr.get("rollout_tail", (0.0, 1.0)))), None)
        if run is not None:
            out.append({**pr, "measured": run["efficiency"], "error": pr["predicted"] / run["efficiency"] - 1,
                        "measured_step_age": run.get("step_age_mean"), "measured_dropped": run.get("dropped")})
    return out
