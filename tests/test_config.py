"""The recipe schema: its sections (optimiser, update engine, asynchronous runs, one per estimator),
each estimator's settings checked without importing torch, and the old single ``adpo`` section
read into today's sections with a warning."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from miles_core.config import ConfigError, SpgSettings, load_recipe
from miles_core.config.legacy import MOVED

REPO = Path(__file__).resolve().parents[1]


def test_every_old_key_loads_where_it_now_lives_and_says_so() -> None:
    """Each adpo.KEY, set to a value unlike its default, lands in every key that now holds it."""
    new = load_recipe("arith")
    values = {"lr": 0.02, "warmup": 7, "lr_schedule": "cosine", "estimator": "spg", "clip_eps": 0.3, "is_cap": 3.0,
              "kl_coef": 0.05, "entropy_floor": 0.1, "entropy_coef": 0.01, "std_normalize": True,
              "skip_zero_variance": False, "loss_norm": "batch", "num_minibatches": 3, "epochs": 2, "row_chunk": 9,
              "chunk_tokens": 100, "grad_checkpointing": True, "max_grad_norm": 0.5, "step_fraction": 0.25,
              "step_cover": False, "step_merge": 1, "step_sampling": "uncertainty", "step_floor": 0.1,
              "renoise_output": True, "max_staleness": 2, "mask_samples": 3, "prompt_mask_prob": 0.4,
              "mask_block": 4, "eubo_beta": 2.0, "spg_mix": 0.25}
    assert set(values) == set(MOVED)
    with pytest.warns(FutureWarning, match=r"adpo.mask_samples -> estimators.meanfield.mask_draws and .*estimators.spg.copies"):
        old = load_recipe({"adpo": values})
    flat = old.flat()
    for key, v in values.items():
        for dotted in MOVED[key]:
            assert flat[dotted] == v, (key, dotted)
            # step_merge stays 1: uncertainty sampling (tested here) draws single steps
            assert flat[dotted] != load_recipe(None).flat()[dotted] or key == "step_merge", dotted
    assert not any(k.startswith("adpo.") for k in flat) and new.flat().keys() == flat.keys()
    with pytest.warns(FutureWarning):
        assert load_recipe({"adpo": {"step_merge": 3}}).estimators.adpo.step_merge == 3


def test_old_overrides_apply_in_order_and_a_key_set_both_ways_is_refused() -> None:
    with pytest.warns(FutureWarning, match=r"override 'adpo.lr=0.02'.*adpo.lr -> optim.lr"):
        cfg = load_recipe("arith", ["optim.lr=0.01", "adpo.lr=0.02"])
    assert cfg.optim.lr == 0.02
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # today's keys load without a warning
        assert load_recipe("arith", ["adpo.lr=0.02", "optim.lr=0.01"][1:]).optim.lr == 0.01
    with pytest.raises(ConfigError, match="adpo.lr and optim.lr are both set"):
        load_recipe({"adpo": {"lr": 0.01}, "optim": {"lr": 0.02}})
    with pytest.raises(ConfigError, match=r"unknown config key 'adpo.lrr' \(did you mean 'optim.lr'\?\)"):
        load_recipe("arith", ["adpo.lrr=1"])


def test_a_stored_run_recipe_of_the_old_shape_is_the_same_recipe() -> None:
    """run.json of a run started before the split: its recipe, read again, trains identically."""
    new = load_recipe("gsm8k", ["estimators.spg.copies=4", "async_rl.max_staleness=2"])
    d = new.to_dict()
    old = {k: v for k, v in d.items() if k not in ("optim", "update", "estimators")}
    old["async_rl"] = {k: v for k, v in d["async_rl"].items() if k != "max_staleness"}
    old["adpo"] = {**d["optim"], **d["update"], **d["estimators"]["adpo"], "max_staleness": 2, "mask_samples": 4,
                   "prompt_mask_prob": 0.15, "mask_block": 0, "eubo_beta": 1.5, "spg_mix": 0.5}
    with pytest.warns(FutureWarning):
        again = load_recipe(old)
    assert again.estimators.spg == new.estimators.spg == SpgSettings(copies=4)
    assert again.estimators.meanfield.mask_draws == 4  # mask_samples meant each one-pass estimator's count
    assert {k: v for k, v in again.flat().items() if not k.startswith("estimators.")} == \
        {k: v for k, v in new.flat().items() if not k.startswith("estimators.")}


def test_estimator_sections_are_read_only_and_named_in_errors() -> None:
    cfg = load_recipe("arith", ["update.estimator=espo", "estimators.espo.pairs=2"])
    assert cfg.own().pairs == 2 and cfg.estimators["espo"] is cfg.estimators.espo
    with pytest.raises(TypeError, match="read-only"):
        cfg.estimators["espo"] = None
    with pytest.raises(ConfigError, match=r"estimators.espp: no estimator 'espp'.*did you mean 'estimators.espo'"):
        load_recipe("arith", ["estimators.espp.pairs=2"])
    with pytest.raises(ConfigError, match=r"unknown config key 'estimators.espo.mask_samples'"):
        load_recipe("arith", ["estimators.espo.mask_samples=2"])
    hash(cfg)  # frozen, so usable as a key


def test_every_estimator_setting_is_checked_without_importing_torch() -> None:
    """A fresh process: the command line's recipe check reaches each estimator's fields with no torch."""
    code = ("import sys\nfrom miles_core.config import ConfigError, load_recipe\n"
            "cfg = load_recipe('arith', ['update.estimator=spg', 'estimators.spg.copies=3', 'estimators.ebpo.mask_block=8'])\n"
            "assert cfg.own().copies == 3 and cfg.estimators.ebpo.mask_block == 8\n"
            "try:\n    load_recipe('arith', ['estimators.spg.copies=0'])\nexcept ConfigError as e:\n    print(e)\n"
            "print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["estimators.spg.copies: 0 is out of bounds [1, 64]", "False"]


def test_nsd_threshold_schedule_by_hand_and_an_unscheduled_hash_is_unchanged() -> None:
    """``sampler.threshold_start``: linear from it to ``threshold`` by half the run's updates."""
    from miles_core.config import SamplerConfig

    s = SamplerConfig(kind="nsd", threshold=0.8, threshold_start=0.96)
    assert [s.threshold_at(v, 9) for v in (0, 1, 2, 4, 8)] == pytest.approx([0.96, 0.92, 0.88, 0.8, 0.8])
    assert SamplerConfig(kind="nsd").threshold_at(3, 9) is None and SamplerConfig(threshold_start=0.9).threshold_at(0, 9) is None
    # the hash recorded with every batch stays what it was for a sampler without a schedule
    assert SamplerConfig().hash(16) == "12cb671825d3bbd2" and s.hash(16) != SamplerConfig(kind="nsd", threshold=0.8).hash(16)


def test_champion_alpha_accepts_its_documented_bounds_and_nothing_the_registry_refuses() -> None:
    """eval.champion_alpha's bounds are the levels promote_if_better takes: each bound loads and
    is a valid level there; 0 and 1 (which the registry refuses after training) fail at load."""
    import dataclasses

    from miles_core.config import ConfigError, load_recipe
    from miles_core.config.sections import EvalSettings

    lo, hi = next(f for f in dataclasses.fields(EvalSettings) if f.name == "champion_alpha").metadata["bounds"]
    for ok in (lo, hi):
        assert 0.0 < load_recipe("arith", [f"eval.champion_alpha={ok}"]).eval.champion_alpha < 1.0
    for bad in ("0", "1.0", "0.6"):
        with pytest.raises(ConfigError, match="champion_alpha"):
            load_recipe("arith", [f"eval.champion_alpha={bad}"])
