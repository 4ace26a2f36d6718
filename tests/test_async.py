"""Asynchronous ADPO and its reliability: staleness, exactly-once, hot-swap,
resume, kills, corrupt batches, config errors. Samplers and the learner run in-process where the
property is about logic, and as real subprocesses killed with SIGKILL where it is about crashes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from conftest import train_tiny_base
import torch

from miles_core.algo.rl import assign_advantages
from miles_core.asyncrl.launch import command, local_env, prepare_run
from miles_core.storage.run import RunSpecMismatch, RunStore
from miles_core.asyncrl.learner import AsyncLearner
from miles_core.asyncrl.sampler import SamplerWorker, batch_id
from miles_core.learner.channels import admits
from miles_core.learner.ledger import stored_state
from miles_core.config import ConfigError, load_recipe
from miles_core.models.base import load_checkpoint
from miles_core.models.lora import load_adapter

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
BASE = ["sft.steps=30", "train.prompts_per_iter=2", "train.group_size=4", "sampler.steps=4",
        "task.completion_len=16", "async_rl.poll_interval=0.01", "train.reward=math_exact:1.0,format:0.5,arith_steps:0.5"]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_base(tmp_path_factory, BASE, "async")


@pytest.fixture(scope="module")
def signal_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Trained enough that every batch has a reward spread, so every update moves the adapter."""
    return train_tiny_base(tmp_path_factory, [*BASE, "sft.steps=150"], "async-signal")


def make_run(tmp: Path, base: Path, *overrides: str) -> tuple[str, object]:
    cfg = load_recipe("tiny", BASE + list(overrides))
    run = str(tmp / "run")
    prepare_run(run, cfg, base)
    return run, cfg


def lora_state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}


def test_the_learner_still_drops_what_admission_let_go_stale(tmp_path: Path, base_dir: Path) -> None:
    # batches admission would never let start (5 sampled from v0 with S=1) committed by hand: the
    # learner must use the first S+1 (staleness 0..S) and drop the rest, counting them
    run, _ = make_run(tmp_path, base_dir, "async_rl.max_staleness=1", "async_rl.batches_per_sampler=5")
    learner = AsyncLearner(run, str(tmp_path / "lc"))  # publishes v0
    sampler = SamplerWorker(run, "w0", 0, str(tmp_path / "sc"))
    sampler.sync_adapter()
    for seq in range(5):
        sampler.batches.commit(sampler.make_batch(seq), batch_id(seq, "w0"))
    out = learner.run()
    consumed, dropped = learner.ledger.consumed, learner.ledger.dropped
    assert [e["staleness"] for e in consumed] == [0, 1]
    assert [e["id"] for e in dropped] == [batch_id(s, "w0") for s in (2, 3, 4)]
    assert all(e["staleness"] > 1 for e in dropped)
    assert out["max_staleness_seen"] <= out["staleness_bound"] == 1 and out["dropped"] == 3 and out["done"]
    assert learner.policy.admission() == (learner.learner.version, 3)  # each drop freed its slot of the window


def test_the_learner_reads_the_inbox_and_lists_the_markers_only_when_stuck(tmp_path: Path, base_dir: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The learner finds batches through the inbox, whatever the store holds; a batch committed
    but never announced (its writer died in between) is found by one listing of the markers once
    the learner is stuck waiting, and every taken batch leaves the inbox at the checkpoint."""
    import miles_core.asyncrl.learner as learner_module
    from miles_core.storage import TrajectoryStore

    run, _ = make_run(tmp_path, base_dir, "async_rl.batches_per_sampler=4", "async_rl.max_staleness=8")
    learner = AsyncLearner(run, str(tmp_path / "lc"))
    sampler = SamplerWorker(run, "w0", 0, str(tmp_path / "sc"))
    sampler.sync_adapter()
    for seq in range(4):
        sampler.batches.commit(sampler.make_batch(seq), batch_id(seq, "w0"))
    store = learner.rs.trajectories
    store.retire([batch_id(3, "w0")])  # as if its writer died between its commit and its announcement
    listings: list[int] = []
    real = TrajectoryStore.list_batches
    monkeypatch.setattr(TrajectoryStore, "list_batches", lambda self: listings.append(1) or real(self))
    monkeypatch.setattr(learner_module, "UNANNOUNCED_SCAN_S", 0.0)
    out = learner.run()
    assert out["done"] and out["consumed"] + out["dropped"] == 4
    assert listings == [1]  # the one scan, after batches 0-2 were taken and nothing more came
    assert store.list_inbox() == [] and len(store.list_batches()) == 4


def test_every_batch_consumed_exactly_once_and_hot_swap_keeps_the_base(tmp_path: Path, base_dir: Path) -> None:
    run, cfg = make_run(tmp_path, base_dir, "async_rl.num_samplers=2", "async_rl.batches_per_sampler=2", "async_rl.max_staleness=8")
    learner = AsyncLearner(run, str(tmp_path / "lc"))
    samplers = [SamplerWorker(run, f"w{i}", i, str(tmp_path / f"sc{i}")) for i in range(2)]
    base_ptrs = [s.base_ptr for s in samplers]
    # interleave by hand: each sampler commits one batch, then the learner drains
    for _ in range(2):
        for s in samplers:
            seq = s.stats["next_seq"]
            s.sync_adapter()
            b = s.make_batch(seq)
            b.reward = torch.arange(len(b), dtype=torch.float32) % 2  # signal in every group, whatever the toy model says
            s.batches.commit(assign_advantages(b), batch_id(seq, s.worker))
            s.stats["next_seq"] = seq + 1
        learner.max_updates = len(learner.ledger.consumed) + 2
        learner.run()
    ids = [e["id"] for e in learner.ledger.consumed]
    assert sorted(ids) == sorted(learner.rs.trajectories.list_batches()) and len(ids) == len(set(ids)) == 4
    # the second round was sampled with a newer adapter, hot-swapped into the resident base
    s = samplers[0]
    assert s.sync_adapter() and s.version == learner.learner.version == 4
    assert [x.base_ptr for x in samplers] == base_ptrs
    assert next(iter(s.model.get_base_model().parameters())).data_ptr() == s.base_ptr
    published = load_adapter(load_checkpoint(base_dir)[0], learner.rs.adapters.fetch(4, tmp_path / "v4"))
    x = torch.randint(5, 20, (2, 12))
    s.model.eval()
    assert torch.equal(s.model(x), published.eval()(x))
    assert any(v.abs().sum() > 0 for k, v in lora_state(s.model).items() if "lora_B" in k)


def test_importance_weights_are_one_on_policy(tmp_path: Path, base_dir: Path) -> None:
    run, _ = make_run(tmp_path, base_dir, "async_rl.batches_per_sampler=1", "update.num_minibatches=2",
                      "sampler.temperature=1.0")
    learner = AsyncLearner(run, str(tmp_path / "lc"))
    sampler = SamplerWorker(run, "w0", 0, str(tmp_path / "sc"))
    sampler.sync_adapter()
    batch = sampler.make_batch(0)
    batch.reward = torch.arange(len(batch), dtype=torch.float32) % 2  # signal in every group
    from miles_core.algo.rl import assign_advantages

    assign_advantages(batch)
    sampler.batches.commit(batch, "000000-w0")
    stored = learner.rs.trajectories.read_batch("000000-w0")
    assert torch.equal(stored.logp, batch.logp)  # behaviour log-probs survive storage bit-exactly
    stats = learner.learner.update(stored)
    assert stats["iw_mean"] == pytest.approx(1.0, abs=1e-5) and stats["iw_max"] == pytest.approx(1.0, abs=1e-5)


def test_corrupt_batch_is_quarantined_and_the_run_continues(tmp_path: Path, base_dir: Path) -> None:
    run, _ = make_run(tmp_path, base_dir, "async_rl.batches_per_sampler=3")
    learner = AsyncLearner(run, str(tmp_path / "lc"))
    SamplerWorker(run, "w0", 0, str(tmp_path / "sc")).run()
    store = learner.rs.trajectories
    bad = batch_id(1, "w0")
    Path(store.data_path(bad)).write_bytes(b"PAR1 this is not parquet")
    out = learner.run()
    assert out["done"] and out["quarantined"] == 1 and out["consumed"] == 2
    assert learner.ledger.quarantined[0]["id"] == bad and "sha256" in learner.ledger.quarantined[0]["reason"]
    assert bad in store.list_quarantined() and bad not in store.list_batches()


def test_run_spec_and_async_config_errors_name_the_field(tmp_path: Path, base_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"async_rl.num_samplers: 0 is out of bounds \[1, 4096\]"):
        load_recipe("tiny", ["async_rl.num_samplers=0"])
    with pytest.raises(ConfigError, match=r"async_rl.global_batch: 24 is not a whole number of sampler batches of 16"):
        load_recipe("tiny", ["async_rl.global_batch=24"])
    with pytest.raises(ConfigError, match="unknown config key 'async_rl.samplers'"):
        load_recipe("tiny", ["async_rl.samplers=2"])
    run, _ = make_run(tmp_path, base_dir)
    with pytest.raises(RunSpecMismatch, match="different recipe"):
        prepare_run(run, load_recipe("tiny", BASE + ["optim.lr=0.5"]), base_dir)
    with pytest.raises(FileNotFoundError, match="run.json does not exist"):
        RunStore(str(tmp_path / "nowhere")).read_spec()
    with pytest.raises(ConfigError, match="renoise.output: 'sample' needs estimators.adpo.renoise_output=true"):
        load_recipe("tiny", ["renoise.output=sample"])


def test_a_run_recorded_before_a_field_existed_resumes_with_its_default(tmp_path: Path) -> None:
    """run.json written by a version without some recipe field (here renoise.output) describes a run
    that ran with that field's default: the same recipe resumes it; a different value does not."""
    from miles_core.storage.run import changed_settings

    cfg = load_recipe("tiny", []).to_dict()
    old = {**cfg, "renoise": {k: v for k, v in cfg["renoise"].items() if k != "output"}}
    assert changed_settings(old, cfg) == []
    other = load_recipe("tiny", ["renoise.output=sample", "estimators.adpo.renoise_output=true"]).to_dict()
    assert changed_settings(old, other) == ["estimators.adpo.renoise_output", "renoise.output"]
    store = RunStore(str(tmp_path / "run"))
    store.write_spec({"cfg": old})
    assert store.write_spec({"cfg": cfg}) == {"cfg": old}
    with pytest.raises(RunSpecMismatch, match="renoise.output: None -> 'sample'"):
        store.write_spec({"cfg": other})


def test_async_learner_resume_is_bit_identical(tmp_path: Path, signal_base: Path) -> None:
    """Stopped after update 2 and resumed in a new object (fresh RNGs), the learner reaches the
    same adapter as an uninterrupted one over the same committed batches."""
    adapters = []
    for name, stops in (("straight", [None]), ("resumed", [2, None])):
        run, _ = make_run(tmp_path / name, signal_base, "async_rl.batches_per_sampler=4",
                          "async_rl.max_staleness=10", "async_rl.checkpoint_every=3")
        AsyncLearner(run, str(tmp_path / name / "lc0"))  # v0
        SamplerWorker(run, "w0", 0, str(tmp_path / name / "sc")).run()
        for i, stop in enumerate(stops):
            out = AsyncLearner(run, str(tmp_path / name / f"lc{i}"), max_updates=stop).run()
        assert out["done"] and out["consumed"] == 4
        hist = RunStore(run).read_json("learner", "history.json")["history"]
        assert any(h["rows"] > 0 for h in hist[2:]), hist  # an update after the resume moved the adapter
        adapters.append(RunStore(run).adapters.fetch(4, tmp_path / name / "final"))
    a, b = (Path(d, "adapter_model.safetensors").read_bytes() for d in adapters)
    assert a == b


# ----------------------------------------------------------------- real processes, SIGKILL

HARNESS = textwrap.dedent("""
    # test harness: pause at a chosen point so the parent can SIGKILL this process exactly there
    import os, sys, time
    flag, point = os.environ["MILES_TEST_FLAG"], os.environ["MILES_TEST_POINT"]
    def pause():
        open(flag, "w").close()
        time.sleep(600)
    if point == "marker":  # sampler: data object written, commit marker not yet
        import miles_core.storage.trajectories as T
        real = T.U.create_exclusive
        def create_exclusive(fs, path, data):
            if "/commits/" in path:
                pause()
            return real(fs, path, data)
        T.U.create_exclusive = create_exclusive
    if point == "checkpoint":  # learner: update applied in memory, checkpoint not yet written
        import miles_core.asyncrl.learner as L
        real_ckpt = L.AsyncLearner.checkpoint
        def checkpoint(self):
            if len(self.ledger.consumed) == 2:
                pause()
            return real_ckpt(self)
        L.AsyncLearner.checkpoint = checkpoint
    from miles_core.asyncrl.__main__ import main
    sys.exit(main(sys.argv[1:]))
""")


def run_until_paused(cmd: list[str], tmp: Path, point: str) -> None:
    flag = tmp / f"paused-{point}"
    env = local_env({"MILES_TEST_FLAG": str(flag), "MILES_TEST_POINT": point})
    log = open(tmp / f"{point}.log", "wb")
    proc = subprocess.Popen([sys.executable, "-c", HARNESS] + cmd[3:], env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    while not flag.exists():
        assert proc.poll() is None, (tmp / f"{point}.log").read_text()[-2000:]
        assert time.monotonic() < deadline, "process never reached the kill point"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL


def test_sigkill_during_batch_write_and_mid_update_loses_and_duplicates_nothing(tmp_path: Path, base_dir: Path) -> None:
    run, _ = make_run(tmp_path, base_dir, "async_rl.batches_per_sampler=4",
                      "async_rl.max_staleness=10")
    rs = RunStore(run)
    AsyncLearner(run, str(tmp_path / "lc0"))  # v0, so the sampler can start
    # (caches under tmp_path: a SIGKILLed worker cannot remove a temp cache of its own)
    # 1. sampler killed between its data object and its commit marker: nothing visible
    run_until_paused(command("sampler", run, "w0", 0, cache_dir=tmp_path / "sc"), tmp_path, "marker")
    first = batch_id(0, "w0")
    assert list((Path(rs.trajectories.root) / "batches" / first).glob("*.parquet")) and rs.trajectories.list_batches() == []
    # restarted, it rewrites that batch and finishes the budget, each sequence number once
    subprocess.run(command("sampler", run, "w0", 0, cache_dir=tmp_path / "sc"), env=local_env(), check=True,
                   capture_output=True, timeout=300)
    assert rs.trajectories.list_batches() == [batch_id(s, "w0") for s in range(4)]
    # 2. learner killed after its second update, before that update's checkpoint
    run_until_paused(command("learner", run, cache_dir=tmp_path / "lc"), tmp_path, "checkpoint")
    ckpt = rs.load_checkpoint()
    assert [e["id"] for e in stored_state(rs, ckpt["ledger"])["consumed"]] == [first]  # the killed update left no trace
    subprocess.run(command("learner", run, cache_dir=tmp_path / "lc"), env=local_env(), check=True,
                   capture_output=True, timeout=300)
    hist = rs.read_json("learner", "history.json")
    ids = [e["id"] for e in hist["ledger"]["consumed"]]
    assert ids == rs.trajectories.list_batches()  # every committed batch exactly once, in order
    status = rs.read_json("learner", "status.json")
    assert status["done"] and status["resumes"] == 1 and status["version"] == 4
    assert json.loads(json.dumps(status))["max_staleness_seen"] <= 10


def test_warm_local_run_forks_preloaded_workers_that_finish_and_restart_after_sigkill(tmp_path: Path, base_dir: Path) -> None:
    # the benchmarks' launcher: workers forked from a preloaded server are still separate processes
    # with their own pid and log; one SIGKILLed mid-run is restarted and the run completes exactly once
    from miles_core.asyncrl.launch import LocalRun, summarize

    # staleness bound 1: admission holds w0's third batch until the learner's first update, so w0
    # is still running when it is killed (with a loose bound it could finish all three first)
    run, cfg = make_run(tmp_path, base_dir, "async_rl.batches_per_sampler=3",
                        "async_rl.max_staleness=1", "async_rl.sampler_nice=5", "async_rl.pin_samplers=true")
    lr = LocalRun(run, 1, local_env(), tmp_path / "logs", warm=True)
    lr.start_all()
    try:
        assert len({p.pid for p in lr.procs.values()} | {os.getpid()}) == 3
        deadline = time.monotonic() + 120
        while not RunStore(run).trajectories.list_batches():
            assert time.monotonic() < deadline, "no batch was committed"
            time.sleep(0.05)
        assert os.sched_getaffinity(lr.procs["w0"].pid) == {sorted(os.sched_getaffinity(0))[0]}  # pinned
        assert os.getpriority(os.PRIO_PROCESS, lr.procs["w0"].pid) == 5
        os.kill(lr.procs["w0"].pid, signal.SIGKILL)
        lr.procs["w0"].wait()
        assert lr.failed() == {"w0": -signal.SIGKILL}
        assert (lr.cache_root / "w0").is_dir()  # the killed worker's downloads, reused by its restart
        lr.wait(timeout=180, max_restarts=1)
    finally:
        lr.close()
    assert lr.starts == {"learner": 1, "w0": 2}
    assert not lr.cache_root.exists()  # a SIGKILLed worker cannot clean up; its launcher did
    out = summarize(run)
    assert out["consumed"] + out["dropped"] == 3 and out["done"]
    assert (tmp_path / "logs" / "w0.log").read_text().count('"worker": "w0"') == 1  # the restarted one finished
    assert os.getpriority(os.PRIO_PROCESS, os.getpid()) == 0  # niceness applied in the worker only


def test_shared_budget_lets_a_fast_sampler_take_a_slow_ones_share_exactly_once(tmp_path: Path, base_dir: Path) -> None:
    # budget 2 samplers x 2 batches = 4 slots. w1 claimed slot 0 for its seq 0 and died before
    # committing; w0 then runs alone and takes every free slot (3); w1 restarts, redoes its claimed
    # batch and finds no slot left. The learner gets exactly the 4 batches it expects.
    run, cfg = make_run(tmp_path, base_dir, "async_rl.num_samplers=2", "async_rl.batches_per_sampler=2",
                        "async_rl.shared_budget=true", "async_rl.max_staleness=8")
    learner = AsyncLearner(run, str(tmp_path / "lc"))
    rs = RunStore(run)
    from miles_core.storage import uri as U

    U.create_exclusive(rs.fs, rs.path("samplers", "claims", "slot-000000"), U.dumps({"batch": batch_id(0, "w1")}))
    fast = SamplerWorker(run, "w0", 0, str(tmp_path / "s0")).run()
    slow = SamplerWorker(run, "w1", 1, str(tmp_path / "s1")).run()
    assert (fast["committed"], slow["committed"]) == (3, 1)
    assert sorted(rs.trajectories.list_batches()) == sorted([batch_id(s, "w0") for s in range(3)] + [batch_id(0, "w1")])
    out = learner.run()
    assert out["consumed"] + out["dropped"] == 4 and out["done"]
    assert SamplerWorker(run, "w1", 1, str(tmp_path / "s1b")).run()["committed"] == 1  # a rerun adds nothing
    assert len(rs.trajectories.list_batches()) == 4


def test_learner_samples_instead_of_waiting_within_the_shared_budget(tmp_path: Path, base_dir: Path) -> None:
    # budget 1 sampler x 3 batches = 3 slots. A learner killed earlier claimed slot 0 for its own seq 0
    # and never committed it; the sampler then took the 2 free slots. The restarted learner redoes its
    # claimed batch with the current policy, consumes all 3 exactly once and never sleeps.
    run, _ = make_run(tmp_path, base_dir, "async_rl.batches_per_sampler=3", "async_rl.shared_budget=true",
                      "async_rl.learner_samples=true", "async_rl.max_staleness=8")
    rs = RunStore(run)
    from miles_core.storage import uri as U

    U.create_exclusive(rs.fs, rs.path("samplers", "claims", "slot-000000"), U.dumps({"batch": batch_id(0, "learner")}))
    learner = AsyncLearner(run, str(tmp_path / "lc"))
    assert SamplerWorker(run, "w0", 0, str(tmp_path / "s0")).run()["committed"] == 2
    out = learner.run()
    assert out["done"] and out["consumed"] == 3 and out["self_sampled_batches"] == 1
    assert sorted(e["id"] for e in learner.ledger.consumed) == [batch_id(0, "learner"), batch_id(0, "w0"), batch_id(1, "w0")]
    assert out["idle_s"] == 0.0 and out["self_sample_s"] > 0


def test_a_self_sampling_learner_reserves_no_stripe_so_a_samplers_slots_stay_dense(tmp_path: Path,
                                                                                      base_dir: Path) -> None:
    """With async_rl.learner_samples one sampler's batches take slots 0, 1, 2, 3 (not every other
    slot, 0, 2, ..., which version v admits only up to S + v: the learner then had to sample half
    the budget itself before the sampler could go on); an idle learner takes the lowest free slot."""
    run, _ = make_run(tmp_path, base_dir, "async_rl.batches_per_sampler=5", "async_rl.shared_budget=true",
                      "async_rl.learner_samples=true", "async_rl.max_staleness=8")
    rs = RunStore(run)
    from miles_core.storage import uri as U

    folder = rs.path("samplers", "claims")
    U.create_exclusive(rs.fs, U.join(folder, "slot-000004"), U.dumps({"batch": "placeholder"}))  # the last slot taken
    learner = AsyncLearner(run, str(tmp_path / "lc"))
    assert SamplerWorker(run, "w0", 0, str(tmp_path / "s0")).run()["committed"] == 4
    claims = {name: U.read_json(rs.fs, U.join(folder, name))["batch"] for name in sorted(U.list_names(rs.fs, folder))}
    assert claims == {**{f"slot-{k:06d}": batch_id(k, "w0") for k in range(4)}, "slot-000004": "placeholder"}
    rs.fs.rm(U.join(folder, "slot-000001"))                     # a free slot below the others
    assert learner.sample_self() is True and learner._next_seq == 1  # the learner takes it: the lowest free
    assert U.read_json(rs.fs, U.join(folder, "slot-000001"))["batch"] == batch_id(0, "learner")


def test_a_sampler_starts_only_the_slots_the_learners_version_admits(tmp_path: Path, base_dir: Path) -> None:
    """AReaL's rule k < (S + v + 1) B: with B = 2 sampler batches per update and S = 0, version 0
    admits slots 0-1 only; each update admits two more, so every batch is used at staleness 0 and
    none is dropped. The learner updates once per two batches (global batch), the ledger says which."""
    assert [k for k in range(8) if admits(k, 0, 2, 1)] == [0, 1, 2, 3]
    assert [k for k in range(8) if admits(k, 1, 1, 0)] == [0, 1]
    run, cfg = make_run(tmp_path, base_dir, "async_rl.batches_per_sampler=6", "async_rl.max_staleness=0",
                        "async_rl.global_batch=32", "train.prompts_per_iter=4", "train.group_size=4")
    assert cfg.batches_per_update() == 2
    rs = RunStore(run)
    learner = AsyncLearner(run, str(tmp_path / "lc"), max_updates=1)  # publishes v0
    sampler = SamplerWorker(run, "w0", 0, str(tmp_path / "sc"))
    thread = threading.Thread(target=sampler.run, daemon=True)
    thread.start()

    def committed_settles_at(n: int) -> None:
        deadline = time.monotonic() + 120
        while len(rs.trajectories.list_batches()) < n:
            assert thread.is_alive() and time.monotonic() < deadline, rs.trajectories.list_batches()
            time.sleep(0.05)
        time.sleep(1.0)  # the sampler keeps polling: it must not start the next slot
        assert len(rs.trajectories.list_batches()) == n

    committed_settles_at(2)
    learner.run()  # one update on both batches: version 1 admits slots 2-3
    committed_settles_at(4)
    out = AsyncLearner(run, str(tmp_path / "lc2")).run()
    thread.join(timeout=120)
    assert not thread.is_alive() and out["done"]
    assert out["updates"] == 3 and out["consumed"] == 6 and out["dropped"] == 0 and out["max_staleness_seen"] == 0
    assert [e["update"] for e in rs.read_json("learner", "history.json")["ledger"]["consumed"]] == [1, 1, 2, 2, 3, 3]
    assert rs.read_json("samplers", "w0.json")["wait_s"] > 0


def test_learner_alone_samples_the_whole_budget_on_policy(tmp_path: Path, base_dir: Path) -> None:
    run, _ = make_run(tmp_path, base_dir, "async_rl.batches_per_sampler=3", "async_rl.shared_budget=true",
                      "async_rl.learner_samples=true")
    learner = AsyncLearner(run)  # no cache folder given: it makes a temp one and removes it at the end
    assert learner.owns_cache and learner.cache.is_dir()
    out = learner.run()
    assert out["done"] and out["consumed"] == 3 and out["self_sampled_batches"] == 3
    assert out["staleness_hist"] == {"0": 3} and out["idle_s"] == 0.0
    assert not learner.cache.exists()
    sampler = SamplerWorker(run, "w9", 0)
    assert sampler.run()["committed"] == 0 and not sampler.cache.exists()  # budget spent: nothing to do
    with pytest.raises(ConfigError, match="async_rl.learner_samples: needs shared_budget=true"):
        load_recipe("tiny", ["async_rl.learner_samples=true"])


def test_bfloat16_adapter_sync_halves_the_bytes_and_samplers_run_the_rounded_policy(tmp_path: Path, base_dir: Path) -> None:
    run, _ = make_run(tmp_path, base_dir, "async_rl.batches_per_sampler=2", "async_rl.sync_dtype=bfloat16")
    learner = AsyncLearner(run, str(tmp_path / "lc"))
    sampler = SamplerWorker(run, "w0", 0, str(tmp_path / "sc"))
    sampler.run()
    learner.run()
    sampler.sync_adapter()
    v = learner.learner.version
    m = learner.rs.adapters.manifest(v)
    from safetensors.torch import load_file

    from miles_core.models.lora import ADAPTER_WEIGHTS

    published = load_file(str(learner.rs.adapters.fetch(v, tmp_path / "pub") / ADAPTER_WEIGHTS))
    assert {t.dtype for t in published.values()} == {torch.bfloat16}
    ours = {k: v for k, v in lora_state(learner.learner.model).items()}
    theirs = lora_state(sampler.model)
    assert ours.keys() == theirs.keys()
    for k in ours:  # the sampler holds exactly the learner's weights rounded to bfloat16, in float32
        assert theirs[k].dtype == torch.float32 and torch.equal(theirs[k], ours[k].to(torch.bfloat16).float())
    n_params = sum(t.numel() for t in published.values())
    assert int(m["files"][ADAPTER_WEIGHTS]["bytes"]) < 2 * n_params + 4096  # 2 bytes a parameter, plus the header


def test_restarted_learner_numbers_its_own_batches_after_the_ones_it_claimed(tmp_path: Path, base_dir: Path) -> None:
    # a learner stopped after one update (its own batch 0) resumes from its checkpoint; its next own
    # batches are 1 and 2, never a reuse of 0, and the budget of 3 is consumed exactly once
    run, _ = make_run(tmp_path, base_dir, "async_rl.batches_per_sampler=3", "async_rl.shared_budget=true",
                      "async_rl.learner_samples=true")
    first = AsyncLearner(run, str(tmp_path / "l1"), max_updates=1).run()
    assert not first["done"] and first["consumed"] == 1
    second = AsyncLearner(run, str(tmp_path / "l2"))
    assert second._next_seq == 1 and second._redo == []
    out = second.run()
    ids = [e["id"] for e in second.ledger.consumed]
    assert out["done"] and ids == [batch_id(s, "learner") for s in range(3)]
    with pytest.raises(ValueError, match="reserved for the learner"):
        SamplerWorker(run, "learner", 0, str(tmp_path / "s"))


def test_miles_stop_ends_samplers_and_learner_cleanly_and_the_run_resumes(tmp_path: Path, base_dir: Path,
                                                                            capsys: pytest.CaptureFixture) -> None:
    """`miles stop RUN` writes control/STOP: a sampler commits nothing more and the learner exits
    with its checkpoint; once the file is gone the same run resumes and finishes exactly once."""
    from miles.cli import main

    run, _ = make_run(tmp_path, base_dir, "async_rl.batches_per_sampler=2")
    assert main(["stop", str(tmp_path / "nowhere")]) == 2  # not a run: a usage error, nothing written
    first = AsyncLearner(run, str(tmp_path / "l1"))
    assert main(["stop", run, "--reason", "maintenance"]) == 0 and "stop requested" in capsys.readouterr().out
    assert SamplerWorker(run, "w0", 0, str(tmp_path / "s0")).run()["committed"] == 0
    out = first.run()
    assert not out["done"] and out["consumed"] == 0
    from miles_core.storage.run import RunStore

    rs = RunStore(run)
    assert rs.read_json("control", "STOP") == {"reason": "maintenance"}
    rs.fs.rm(rs.path("control", "STOP"))
    assert SamplerWorker(run, "w0", 0, str(tmp_path / "s1")).run()["committed"] == 2
    done = AsyncLearner(run, str(tmp_path / "l2")).run()
    assert done["done"] and done["consumed"] == 2


def test_in_flight_refresh_commits_steps_of_two_versions_that_the_learner_learns_from(
        tmp_path: Path, base_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sampler with ``async_rl.refresh_every=1`` whose rollout starts on v0 while the learner has
    published v1 swaps v1 in between two steps: the committed batch records both versions per
    step, the sampler holds v1 after it, and the learner's update reports the steps' mean age."""
    from miles_core.asyncrl.refresh import InFlightRefresh

    run, _ = make_run(tmp_path, base_dir, "async_rl.refresh_every=1", "async_rl.batches_per_sampler=2",
                      "async_rl.max_staleness=4", "sampler.steps=8")
    learner = AsyncLearner(run, str(tmp_path / "lc"))  # publishes v0
    sampler = SamplerWorker(run, "w0", 0, str(tmp_path / "sc"))
    sampler.sync_adapter()
    first = sampler.make_batch(0)  # nothing newer while it runs: one version, no step versions stored
    first.reward = torch.arange(len(first), dtype=torch.float32) % 2
    sampler.batches.commit(assign_advantages(first), batch_id(0, "w0"))
    learner.max_updates = 1
    learner.run()  # publishes v1; the sampler still holds v0
    assert first.step_version is None and sampler.version == 0 and learner.learner.version == 1
    real = InFlightRefresh.__call__

    def at_step_two_wait_for_the_fetch(self, forwards: int):  # the fetch races a 8-step toy rollout
        deadline = time.time() + 30
        while forwards == 2 and self._ready is None and time.time() < deadline:
            time.sleep(0.01)
        return real(self, forwards)
    monkeypatch.setattr(InFlightRefresh, "__call__", at_step_two_wait_for_the_fetch)
    second = sampler.make_batch(1)
    assert set(second.step_version.unique().tolist()) == {0, 1} and second.policy_version.unique().tolist() == [0]
    assert sampler.version == 1 and sampler.span == 1 and sampler.stats["refreshes"] == 1
    second.reward = torch.arange(len(second), dtype=torch.float32) % 2
    sampler.batches.commit(assign_advantages(second), batch_id(1, "w0"))
    stored = learner.rs.trajectories.read_batch(batch_id(1, "w0"))
    assert torch.equal(stored.step_version, second.step_version)
    learner.max_updates = 2
    learner.run()
    age = learner.history[-1]["step_age"]
    assert learner.ledger.consumed[-1]["staleness"] == 1 and 0.0 < age < 1.0
