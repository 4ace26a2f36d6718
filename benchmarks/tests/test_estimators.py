"""``benchmarks.estimators``' arms: each ADPO row design at its stated number of rows, and the
one-pass arms' mask draws matched to ADPO's update FLOPs by measurement."""

from __future__ import annotations

import json
import math

import pytest


@pytest.mark.parametrize("recipe", ["arith", "countdown"])
def test_the_estimators_benchmark_row_designs(recipe):
    """benchmarks.estimators' ADPO arms: the default's ceil(rho K) covering rows, exact steps on 3/4
    of them (adpo_sampled), the previous default (rho 0.5), every step (adpo_full), TraceRL's merged
    runs at the matched fraction; an arm without matched draws is refused."""
    from benchmarks.estimators import ADPO_DESIGNS, arm_overrides
    from miles_core.config import load_recipe

    cfg = load_recipe(recipe, [])
    k = cfg.sampler.steps
    want = {"adpo": math.ceil(0.625 * k), "adpo_sampled": math.ceil(0.75 * k), "adpo_cover50": math.ceil(0.5 * k),
            "adpo_full": k, "tracerl": math.ceil(0.5 * -(-k // 2))}
    for arm in ["adpo", "tracerl", *ADPO_DESIGNS]:
        arm_cfg = load_recipe(recipe, arm_overrides(cfg, arm, {"tracerl": 0.5}))
        a = arm_cfg.estimators.adpo
        assert arm_cfg.update.estimator == "adpo"
        assert math.ceil(a.step_fraction * -(-k // a.step_merge)) == want[arm], arm
        assert a.step_cover == (arm != "adpo_sampled")
    assert load_recipe(recipe, arm_overrides(cfg, "ebpo", {"ebpo": 3})).estimators.ebpo.timesteps == 3
    assert load_recipe(recipe, arm_overrides(cfg, "spg", {"spg": 2})).estimators.spg.copies == 2
    for arm in ("wd1", "tracerl"):
        with pytest.raises(ValueError, match=f"matched mask draws for '{arm}'"):
            arm_overrides(cfg, arm, {"ebpo": 3})


def test_the_estimators_benchmark_matches_each_arms_update_flops_to_adpos(tmp_path, monkeypatch):
    """The draws ``matched_draws`` measures cost ADPO's update FLOPs when the arm runs them: ADPO's
    update of a batch, measured here on its own, and each arm's update of the same batch at its
    matched draws differ by at most half a draw, and an arm's FLOPs are its draws x one draw's (a
    draw's cost does not depend on how many there are); draws follow forwards per draw (two for
    coupled and EBPO's two blocks). They are kept beside the seed's arms and measured again when
    the SFT weights change."""
    from benchmarks.estimators import ONE_PASS, arm_overrides, matched_draws, prepare_seed, table_draws
    from benchmarks.harness import checkpoint_path
    from miles_core.config import load_recipe
    from miles_core.data.registry import build_task
    from miles_core.flops import FlopMeter
    from miles_core.learner.policy import Learner

    small = ["sft.steps=30", "sft.eval_every=30", "task.num_train=64", "task.num_test=8", "task.num_val=8",
             "train.prompts_per_iter=8", "eval.num_problems=8", "sampler.temperature=1.5"]
    prepare_seed(0, small, str(tmp_path), None)
    ckpt = checkpoint_path(0, str(tmp_path), None)
    m = matched_draws(0, small, str(tmp_path), None)
    draws, flops = m["draws"], m["flops"]
    assert set(draws) == {*ONE_PASS, "tracerl"} and 0 < draws["tracerl"] <= 1
    cfg = load_recipe("arith", small + ["sft.seed=0", "train.seed=0"])
    batch = Learner(cfg, ckpt).sample(build_task(cfg), 0)

    def update_flops(arm: str) -> int:
        learner = Learner(load_recipe("arith", small + ["train.seed=0"] + arm_overrides(cfg, arm, draws)), ckpt)
        meter = FlopMeter()
        with meter.measure("update"):
            learner.update(batch)
        return meter.totals["update"]

    adpo = update_flops("adpo")
    assert adpo == flops["adpo"]
    for arm in ONE_PASS:
        got = update_flops(arm)
        assert abs(got - adpo) <= flops[arm] / 2, (arm, draws[arm])
        assert got == pytest.approx(draws[arm] * flops[arm], rel=0.02), arm
    assert draws["coupled"] < draws["meanfield"] and draws["ebpo"] < draws["meanfield"]
    runs = -(-cfg.sampler.steps // 2)                                  # TraceRL's merged runs of 2 steps
    assert runs * draws["tracerl"] == round(runs * draws["tracerl"])
    assert update_flops("tracerl") == pytest.approx(flops["tracerl"] * draws["tracerl"], rel=0.02)
    # kept: the same run again measures nothing; another ADPO config is measured again
    calls: list[int] = []
    real = Learner.update
    monkeypatch.setattr(Learner, "update", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    assert matched_draws(0, small, str(tmp_path), None) == m and not calls
    # one set for the whole table: the first seed's, kept at its root for any later seeds and order
    assert table_draws([0, 1], small, str(tmp_path), None)["draws"] == draws and not calls
    assert table_draws([1, 0], small, str(tmp_path), None)["seed"] == 0 and (tmp_path / "matched_draws.json").exists()
    kept = json.loads((tmp_path / "matched_draws.json").read_text())
    (tmp_path / "matched_draws.json").write_text(json.dumps(kept | {"sft_sha256": "other weights", "draws": {}}))
    assert table_draws([0], small, str(tmp_path), None)["draws"] == draws      # from seed 0's own kept result
    matched_draws(0, small + ["optim.lr=0.002"], str(tmp_path), None)
    assert len(calls) == len(ONE_PASS) + 2
