"""Collapse guard: health of a batch, change-not-level detection, rollback to the last healthy
weights, skip of the collapsed line's batches, CollapseError, and resume of the guard's state."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from miles_core.algo.guard import CollapseError, CollapseGuard, Health, batch_health
from miles_core.algo.rl import assign_advantages
from miles_core.config import ConfigError, GuardSettings, load_recipe
from miles_core.data.registry import build_task
from miles_core.learner.baseline import train_baseline
from miles_core.learner.policy import Learner
from miles_core.types import TrajectoryBatch


def _batch(completions: list[str], rewards: list[float], version: int = 0) -> TrajectoryBatch:
    b, L = len(completions), 4
    return TrajectoryBatch([[5, 6]] * b, torch.zeros(b, L, dtype=torch.long), torch.zeros(b, L, dtype=torch.long),
                           torch.zeros(b, L), torch.ones(b, dtype=torch.long), torch.arange(b) // 2,
                           torch.full((b,), version), reward=torch.tensor(rewards), completions=completions)


def test_batch_health_counts_empty_completions_and_ignores_unscored_rows():
    h = batch_health(_batch(["", "  ", "x+1", "2"], [0.0, float("nan"), 1.0, 1.0], version=7))
    assert h.empty_frac == 0.5 and math.isclose(h.reward_mean, 2 / 3, rel_tol=1e-6) and h.policy_version == 7 and h.rows == 4


def test_guard_reacts_to_a_change_never_to_a_weak_start():
    cfg = GuardSettings(min_rows=1, ema=0.5)
    weak = CollapseGuard(cfg, {"w": 0})
    for _ in range(5):  # empty and unrewarded from the start: nothing to roll back to, nothing collapsed
        h = Health(0.9, 0.0, 0, 8)
        assert weak.collapse_reason(h) is None
        weak.accept(h)
    g = CollapseGuard(cfg, {"w": 0})
    g.accept(Health(0.0, 0.6, 0, 8))
    g.accept(Health(0.1, 0.8, 0, 8))            # running: empty 0.05, reward 0.7
    assert "empty completions" in g.collapse_reason(Health(0.5, 0.6, 1, 8))
    assert "mean reward" in g.collapse_reason(Health(0.0, 0.06, 1, 8))   # 0.06 < 0.1 x 0.7
    assert g.collapse_reason(Health(0.0, 0.08, 1, 8)) is None             # a bad batch, not a collapse
    assert GuardSettings().min_rows == 64 and CollapseGuard(GuardSettings(), {}).collapse_reason(Health(1.0, 0.0, 1, 8)) is None


def test_candidate_becomes_the_target_only_when_a_batch_sampled_at_or_after_it_is_healthy():
    g = CollapseGuard(GuardSettings(min_rows=1, snapshot_every=2), {"w": 0})
    g.offer(1, lambda: {"w": 1})   # not a multiple of snapshot_every: not kept
    g.offer(2, lambda: {"w": 2})
    g.offer(4, lambda: {"w": 4})
    g.accept(Health(0.0, 0.5, 1, 8))            # sampled before either candidate: vouches for neither
    assert g.good == (0, {"w": 0})
    g.accept(Health(0.0, 0.5, 3, 8))            # sampled by version 3: vouches for 2, not 4
    assert g.good == (2, {"w": 2}) and list(g.candidates) == [4]


def test_a_reward_drop_rolls_back_only_when_confirmed_an_empty_collapse_at_once():
    g = CollapseGuard(GuardSettings(min_rows=1, ema=0.5, confirm=2), {"w": 0})
    g.accept(Health(0.0, 0.4, 0, 8))
    low = Health(0.0, 0.0, 1, 8)                 # 0 < 0.1 x 0.4: flagged
    assert g.collapse_reason(low) and not g.confirmed(low) and g.suspect == 1
    g.accept(Health(0.0, 0.4, 1, 8))             # a healthy batch: the dip was chance
    assert g.suspect == 0 and not g.confirmed(low)
    assert g.confirmed(low) and g.suspect == 2   # second unhealthy batch in a row
    g.rolled_back(2, "x")
    assert g.suspect == 0 and g.state()["suspect"] == 0
    assert g.confirmed(Health(0.9, 0.4, 3, 8))   # empty completions: no confirmation needed
    one = CollapseGuard(GuardSettings(min_rows=1, confirm=1), {"w": 0})
    one.accept(Health(0.0, 0.4, 0, 8))
    assert one.confirmed(low)


def _learner(tmp_path, extra: list[str]) -> tuple[Learner, object]:
    cfg = load_recipe("tiny", ["train.prompts_per_iter=3", "guard.min_rows=1", "guard.snapshot_every=1",
                               "guard.max_rollbacks=2", "train.seed=3", *extra])
    data = build_task(cfg)
    train_baseline(cfg, data, tmp_path / "sft")
    return Learner(cfg, tmp_path / "sft"), data


_SEQ = itertools.count()  # a fresh batch id per call: the learner samples batch seq of its run


def _scored(learner: Learner, data, rewards: torch.Tensor, empty: bool = False, version: int | None = None):
    b = learner.sample(data, next(_SEQ))
    b.reward = rewards[:len(b)].clone()
    if empty:
        b.completions = [""] * len(b)
    if version is not None:
        b.policy_version = torch.full((len(b),), version)
    return assign_advantages(b)


def _lora(learner: Learner) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in learner.model.state_dict().items() if "lora_" in k}


def test_learner_rolls_back_to_the_last_vouched_policy_then_skips_the_collapsed_line_then_gives_up(tmp_path):
    torch.set_num_threads(1)
    learner, data = _learner(tmp_path, [])
    good = (torch.arange(64) % 2).float()        # mean 0.5, signal in every group
    learner.update(_scored(learner, data, good))                  # v1, candidate 1
    v1 = _lora(learner)
    st = learner.update(_scored(learner, data, good, version=1))  # vouches for v1; v2
    assert "rolled_back" not in st and learner.guard.good[0] == 1 and learner.version == 2
    assert any(not torch.equal(v1[k], v) for k, v in _lora(learner).items())

    st = learner.update(_scored(learner, data, torch.zeros(64), empty=True, version=2))
    assert st["rolled_back"] == 1.0 and learner.version == 3 and "empty completions" in learner.guard_event
    assert all(torch.equal(v1[k], v) for k, v in _lora(learner).items())     # exactly the v1 weights
    saved = learner.state()

    st = learner.update(_scored(learner, data, torch.zeros(64), empty=True, version=2))  # the collapsed line, late
    assert st["guard_skipped"] == 1.0 and learner.version == 3
    learner.update(_scored(learner, data, torch.zeros(64), empty=True, version=3))      # restored policy bad too
    assert learner.version == 4 and learner.guard.rollbacks == 2
    with pytest.raises(CollapseError, match="collapsed 3 times in a row"):
        learner.update(_scored(learner, data, torch.zeros(64), empty=True, version=4))

    resumed = Learner(learner.cfg, tmp_path / "sft")
    resumed.load_state(saved)
    assert resumed.guard.state()["rollbacks"] == 1 and resumed.guard.good[0] == 1 and resumed.version == 3
    assert resumed.update(_scored(resumed, data, good, version=3)).get("rolled_back") is None


def test_learner_skips_one_low_reward_batch_and_rolls_back_on_the_second(tmp_path):
    torch.set_num_threads(1)
    learner, data = _learner(tmp_path, [])
    good = (torch.arange(64) % 2).float()
    learner.update(_scored(learner, data, good))                  # v1
    learner.update(_scored(learner, data, good, version=1))       # v2; v1 vouched for
    v2 = _lora(learner)
    st = learner.update(_scored(learner, data, torch.zeros(64), version=2))
    assert st["guard_skipped"] == 1.0 and "rolled_back" not in st and learner.version == 2
    assert "mean reward" in learner.guard_event and all(torch.equal(v2[k], v) for k, v in _lora(learner).items())
    st = learner.update(_scored(learner, data, torch.zeros(64), version=2))
    assert st["rolled_back"] == 1.0 and learner.version == 3 and learner.guard.rollbacks == 1
    learner.update(_scored(learner, data, good, version=3))      # healthy again: the count starts over
    st = learner.update(_scored(learner, data, torch.zeros(64), version=4))
    assert st["guard_skipped"] == 1.0 and learner.guard.rollbacks == 1


def test_guard_off_and_bad_settings(tmp_path):
    learner, data = _learner(tmp_path, ["guard.enabled=false"])
    assert learner.guard is None
    learner.update(_scored(learner, data, (torch.arange(64) % 2).float()))
    st = learner.update(_scored(learner, data, torch.zeros(64), empty=True))
    assert "rolled_back" not in st and learner.version == 2
    with pytest.raises(ConfigError, match="guard.max_empty_frac"):
        load_recipe("tiny", ["guard.max_empty_frac=0"])
    with pytest.raises(ConfigError, match="guard.reward_drop"):
        load_recipe("tiny", ["guard.reward_drop=1.5"])
    with pytest.raises(ConfigError, match="guard.min_rows"):
        load_recipe("tiny", ["guard.min_rows=0"])
    with pytest.raises(ConfigError, match="guard.confirm"):
        load_recipe("tiny", ["guard.confirm=0"])
