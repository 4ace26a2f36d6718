"""The benchmark harness's SFT checkpoint rule (benchmarks.code --checkpoint and every benchmark
that starts from one): arms start from one stored SFT baseline only when it was trained with this
run's model, task and sft settings; a mismatch names the differing fields and the file, and leaves
the stored checkpoint alone."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

from benchmarks.harness import sft_checkpoint
from miles_core.config import load_recipe
from miles_core.data.registry import build_task

SMALL = ["sft.steps=4", "sft.eval_every=2", "sft.batch_size=8", "task.num_train=16", "task.num_test=8",
         "task.num_val=8", "model.d_model=16", "model.n_layers=1", "model.d_ff=32"]


def test_sft_checkpoint_is_trained_once_then_reused_and_mismatch_is_refused(tmp_path: Path) -> None:
    cfg = load_recipe("code", SMALL)
    data = build_task(cfg)
    ckpt = tmp_path / "seed0" / "sft"
    seen: list[int] = []
    first = sft_checkpoint(cfg, 0, tmp_path, data=data, on_eval=lambda step, p, st: seen.append(step))
    curve, seconds = first["curve"], first["seconds"]
    assert first["trained"] and first["path"] == str(ckpt)
    assert [c["step"] for c in curve] == seen == [2, 4] and seconds > 0  # nothing stored yet: trained
    weights = ckpt / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    stored = json.loads((ckpt.parent / "sft_run.json").read_text())
    assert stored["key"]["sft"]["steps"] == 4 and stored["curve"] == curve

    again = sft_checkpoint(cfg, 0, tmp_path, checkpoint=tmp_path, data=data)  # same settings: reused, not retrained
    assert not again["trained"] and again["curve"] == curve and again["seconds"] == seconds
    assert weights.stat().st_mtime_ns == stamp

    other = load_recipe("code", SMALL + ["sft.lr=0.01", "task.num_train=12"])
    with pytest.raises(ValueError, match=r"sft_run\.json was trained with other settings") as e:
        sft_checkpoint(other, 0, tmp_path, data=build_task(other))
    assert "sft.lr" in str(e.value) and "task.num_train" in str(e.value)
    assert weights.stat().st_mtime_ns == stamp  # the stored baseline is untouched


def test_a_setting_added_after_the_checkpoint_counts_as_its_default(tmp_path: Path) -> None:
    """A record written before sft.lr_schedule existed matches a run at the default (constant),
    not one that asks for a cosine decay."""
    cfg = load_recipe("code", SMALL)
    data = build_task(cfg)
    ckpt = tmp_path / "seed0" / "sft"
    curve = sft_checkpoint(cfg, 0, tmp_path, data=data)["curve"]
    meta = ckpt.parent / "sft_run.json"
    stored = json.loads(meta.read_text())
    del stored["key"]["sft"]["lr_schedule"], stored["key"]["train_baseline"]  # a record from before both
    meta.write_text(json.dumps(stored))
    assert sft_checkpoint(cfg, 0, tmp_path, data=data)["curve"] == curve
    cosine = load_recipe("code", SMALL + ["sft.lr_schedule=cosine"])
    with pytest.raises(ValueError, match=r"\(sft\.lr_schedule\)"):
        sft_checkpoint(cosine, 0, tmp_path, data=build_task(cosine))


def test_problems_needed_for_a_paired_sign_test_against_a_hand_computed_value() -> None:
    """d = 0.18, g = 0.015, alpha 0.05, power 0.8: (1.95996 * 0.424264 + 0.841621 * 0.423999)^2 / 0.015^2
    = (0.831535 + 0.356846)^2 / 2.25e-4 = 1.412249 / 2.25e-4 = 6276.7 -> 6277; more discordance
    or a smaller gap needs more problems."""
    from benchmarks.harness import problems_needed

    assert problems_needed(0.18, 0.015) == 6277
    assert problems_needed(0.30, 0.015) > 6277 and problems_needed(0.18, 0.03) < 6277
    with pytest.raises(ValueError, match="discordance"):
        problems_needed(0.01, 0.015)


def test_an_estimator_arm_is_kept_and_an_eval_change_reevaluates_its_weights(tmp_path: Path, monkeypatch) -> None:
    """benchmarks.estimators keeps each (seed, arm) result and its trained weights: the same run again
    trains nothing; another eval section re-evaluates the kept weights without training; another
    training setting trains again."""
    from benchmarks.estimators import prepare_seed, run_arm
    from miles_core.learner.policy import Learner

    tiny = ["sft.steps=4", "sft.eval_every=2", "task.num_train=16", "task.num_test=12", "task.num_val=8",
            "train.iterations=2", "train.prompts_per_iter=2", "eval.num_problems=12"]
    prepare_seed(0, tiny, str(tmp_path), None)
    updates: list[int] = []
    real = Learner.update
    monkeypatch.setattr(Learner, "update", lambda self, *a, **k: updates.append(1) or real(self, *a, **k))
    first = run_arm((0, "adpo"), tiny, str(tmp_path), None)
    assert len(updates) == 2 and len(first["correct"]) == 12
    assert (tmp_path / "seed0" / "arms" / "adpo.pt").exists()
    assert run_arm((0, "adpo"), tiny, str(tmp_path), None) == first and len(updates) == 2
    fewer = run_arm((0, "adpo"), tiny + ["eval.num_problems=5"], str(tmp_path), None)
    assert len(updates) == 2 and len(fewer["correct"]) == 5 and fewer["eval_config"]["num_problems"] == 5
    assert fewer["update_flops"] == first["update_flops"]       # the training's record is kept
    run_arm((0, "adpo"), tiny + ["train.iterations=3"], str(tmp_path), None)
    assert len(updates) == 5


def _sleep(x: int) -> int:
    import time

    time.sleep(120)
    return x


def test_pool_workers_end_when_their_benchmark_is_killed(tmp_path: Path) -> None:
    """``over_seeds``'s spawned workers get SIGTERM from the kernel when the benchmark process dies
    (PR_SET_PDEATHSIG): a killed benchmark leaves no worker holding a core."""
    import os
    import signal
    import subprocess
    import sys
    import time

    code = ("import os, sys; sys.path.insert(0, os.getcwd()); from benchmarks.harness import over_seeds; "
            "from benchmarks.tests.test_harness import _sleep; over_seeds(_sleep, [1, 2])")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).parents[2])

    def children() -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(parent.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    deadline = time.monotonic() + 60
    while len(kids := [p for p in children() if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]) < 2:
        assert time.monotonic() < deadline and parent.poll() is None, "the pool never started"
        time.sleep(0.2)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 20
    while any(Path(f"/proc/{p}").exists() and b"Z" not in _state(p) for p in kids):
        assert time.monotonic() < deadline, f"workers {kids} outlived their benchmark"
        time.sleep(0.2)


def _state(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().split(b")")[-1].split()[0]
    except FileNotFoundError:
        return b"Z"


def test_an_arm_trains_through_the_run_a_user_trains(tmp_path: Path, monkeypatch) -> None:
    """``train_arm`` runs LearnerRun's collect and consume on a local store: every batch is
    committed and consumed once, each update checkpointed and published, as in ``miles train``;
    NSD's threshold schedule is the recipe's own (``sampler.threshold_start``)."""
    from benchmarks import harness
    from miles_core.learner.runtime import LearnerRun

    over = [*SMALL, "train.iterations=5", "train.prompts_per_iter=2", "train.group_size=4", "sampler.kind=nsd",
            "sampler.threshold=0.5", "sampler.threshold_start=0.9", "eval.num_problems=4"]
    cfg = load_recipe("arith", over)
    ckpt = Path(sft_checkpoint(cfg, 0, tmp_path, data=build_task(cfg), validate=False)["path"])
    seen: dict[str, list] = {"collect": [], "consume": [], "publish": []}
    for name in seen:
        real = getattr(LearnerRun, name)
        monkeypatch.setattr(LearnerRun, name, lambda self, *a, _r=real, _n=name: seen[_n].append(a) or _r(self, *a))
    from miles_core.samplers import sampler as sampler_module
    thresholds = []
    real_sample = sampler_module.sample
    threshold = lambda *a, **k: inspect.signature(real_sample).bind(*a, **k).arguments["threshold"]  # noqa: E731
    monkeypatch.setattr(sampler_module, "sample", lambda *a, **k: thresholds.append(threshold(*a, **k))
                        or real_sample(*a, **k))
    out = harness.train_arm(cfg, ckpt)
    assert [a[0] for a in seen["collect"]] == [0, 1, 2, 3, 4]
    assert [a[0] for a in seen["consume"]] == [f"{i:06d}-learner" for i in range(5)]
    assert len(seen["publish"]) == 6  # adapter v0 at the start, then one per update
    # from 0.9 to the threshold 0.5 by half the run's 5 updates, then 0.5 (evaluation samples after)
    assert thresholds[:5] == pytest.approx([0.9, 0.7, 0.5, 0.5, 0.5])
    assert out["completions"] == 5 * 8 and 0.0 <= out["pass1"] <= 1.0


def test_check_measured_refuses_a_result_that_measured_nothing(tmp_path, monkeypatch) -> None:
    """Dotted paths with ``*`` over dicts and lists; a 0, NaN, bool, string or missing key fails
    and nothing is written; a smoke payload goes to NAME_smoke.json in $MILES_BENCH_RESULTS."""
    import math

    from benchmarks.harness import MeasuredNothing, check_measured, write_result

    good = {"modes": {"a": {"calls": 3}, "b": {"calls": 1.5}}, "curve": [{"eff": 0.9}, {"eff": 0.8}], "p": 0.0}
    check_measured("x", good, positive=["modes.*.calls", "curve.*.eff"], present=["p"])
    for bad, path in (({**good, "modes": {"a": {"calls": 0}}}, "modes.*.calls"),
                      ({**good, "curve": [{"eff": math.nan}]}, "curve.*.eff"),
                      ({**good, "curve": [{"eff": True}]}, "curve.*.eff"),
                      ({**good, "curve": [{"eff": "1"}]}, "curve.*.eff"),
                      ({**good, "curve": []}, "curve.*.eff"),
                      ({**good, "modes": {}}, "modes.*.calls")):
        with pytest.raises(MeasuredNothing, match="benchmarks.x"):
            check_measured("x", bad, positive=[path])
    with pytest.raises(MeasuredNothing, match="no 'q'"):
        check_measured("x", good, present=["q"])
    monkeypatch.setenv("MILES_BENCH_RESULTS", str(tmp_path))
    with pytest.raises(MeasuredNothing):
        write_result("x", {**good, "smoke": True}, positive=["p"])
    assert not list(tmp_path.iterdir())
    assert write_result("x", {**good, "smoke": True}, positive=["modes.*.calls"]) == tmp_path / "x_smoke.json"
    assert write_result("x", good) == tmp_path / "x.json"
