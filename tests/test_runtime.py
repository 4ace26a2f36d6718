"""The one learner runtime (miles_core/learner/runtime.py) under the synchronous flow's tasks:
exactly-once consumption and bit-exact resume, the guarantees tests/test_async.py checks for the
asynchronous learner, on the same code path. The Prefect tasks are called as plain functions."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from conftest import train_tiny_base

from miles_core.config import ConfigError, load_recipe
from miles_core.data.registry import build_task
from miles_core.learner.ledger import stored_state
from miles_core.learner.run_folder import open_step_run, pointed_recipe, start_step_run
from miles_core.storage.run import RunStore
from tasks import training

# Trained enough (150 steps) that every batch has a reward spread, so every update moves the
# adapter: a resume that lost optimizer or RNG state could not hide behind updates that do nothing.
BASE = ["sft.steps=150", "sft.eval_every=50", "train.prompts_per_iter=2", "train.group_size=4", "sampler.steps=4",
        "task.completion_len=16", "train.reward=math_exact:1.0,format:0.5", "train.iterations=3"]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_base(tmp_path_factory, BASE, "sync")


def iterate(lr: training.LearnerSession, its: range) -> dict:
    out = {}
    for it in its:
        co = training.collect.fn(lr, it)
        out = training.update.fn(lr, co["batch_id"])
    return out


def test_sync_resume_is_bit_identical_and_consumes_each_batch_once(tmp_path: Path, base_dir: Path) -> None:
    """Stopped after iteration 2 (runtime dropped, as in a new process) and resumed, the synchronous
    run reaches the same adapter bytes as an uninterrupted one; the ledger lists each batch once."""
    cfg = load_recipe("tiny", BASE)
    finals = []
    for name, cuts in (("straight", [range(3)]), ("resumed", [range(2), range(2, 3)])):
        run_dir, store = tmp_path / name, str(tmp_path / name / "store")
        for i, its in enumerate(cuts):
            with training.learner(run_dir) as lr:  # its end drops the runtime, as a new process starts without it
                init = training.init_learner.fn(lr, cfg, str(base_dir), store, resume=i > 0)
                assert init["iteration"] == its.start and init["resumed"] == (i > 0)
                last = iterate(lr, its)
        assert last["version"] == 3 and last["iteration"] == 3 and last["stats"]["rows"] > 0  # the resumed update ran
        rs = RunStore(store)
        ledger = stored_state(rs, rs.load_checkpoint()["ledger"])
        assert [e["id"] for e in ledger["consumed"]] == [f"{i:06d}-learner" for i in range(3)]
        assert rs.trajectories.list_inbox() == []  # each batch retired from the inbox at its update's checkpoint
        finals.append(rs.adapters.fetch(3, tmp_path / name / "final"))
        assert not rs.exists("rollouts")  # one store folder of batches: what was sampled is what is consumed
    a, b = (Path(d, "adapter_model.safetensors").read_bytes() for d in finals)
    assert a == b


def test_sync_retry_reuses_the_batch_and_never_updates_twice(tmp_path: Path, base_dir: Path) -> None:
    cfg = load_recipe("tiny", BASE)
    run_dir, store = tmp_path / "r", str(tmp_path / "r" / "store")
    with training.learner(run_dir) as lr:
        training.init_learner.fn(lr, cfg, str(base_dir), store)
        first = iterate(lr, range(1))
        moved = pickle.loads(pickle.dumps(lr))  # the handle as another process gets it: no model inside
    with pytest.raises(RuntimeError, match="has ended"):
        training.collect.fn(lr, 0)  # a task on a closed block is an error, not a silent reload
    with training.learner(run_dir) as fresh, pytest.raises(RuntimeError, match="not started"):
        training.collect.fn(fresh, 0)
    # a retry in another process: the same batch id samples the same prompts; the stored batch counts
    assert moved._run is None
    again = training.collect.fn(moved, 0)
    assert again["reused"] and again["batch_id"] == "000000-learner"
    stored = RunStore(store).trajectories.read_batch("000000-learner")
    fresh = open_step_run(run_dir).learner.sample(build_task(cfg), 0)  # at version 1 now
    assert fresh.prompts == stored.prompts and fresh.group_id.tolist() == stored.group_id.tolist()
    update = training.update.fn(moved, again["batch_id"])
    assert update["version"] == first["version"] == 1 and training.checkpoint_meta(run_dir)["iteration"] == 1
    with pytest.raises(FileExistsError, match="resume=True"):
        training.init_learner.fn(training.LearnerSession(run_dir), cfg, str(base_dir), store)
    with pytest.raises(FileExistsError, match="another training run"):
        training.init_learner.fn(training.LearnerSession(tmp_path / "other"), cfg, str(base_dir), store)
    changed = load_recipe("tiny", BASE + ["optim.lr=0.1"])
    with pytest.raises(ConfigError, match="optim.lr"):
        training.init_learner.fn(training.LearnerSession(run_dir), changed, str(base_dir), store, resume=True)
    longer = load_recipe("tiny", BASE + ["train.iterations=5"])  # a resumable setting
    with training.learner(run_dir) as lr:
        assert training.init_learner.fn(lr, longer, str(base_dir), store, resume=True)["iteration"] == 1
    # the recipe is stored once, in the store's run.json; the folder keeps only what its resume changed
    meta = training.checkpoint_meta(run_dir)
    assert "cfg" not in meta and meta["resumed_settings"] == {"train.iterations": 5}
    assert RunStore(store).read_spec()["cfg"]["train"]["iterations"] == 3
    assert pointed_recipe(run_dir) == longer and open_step_run(run_dir).cfg == longer


def test_a_sync_iteration_writes_its_batch_once_and_never_reads_it_back(tmp_path: Path, base_dir: Path) -> None:
    """collect commits the scored batch (one write); consume in the same process updates on the
    batch collect holds (no read, no not-found probe). A consume in another process reads it once."""
    cfg = load_recipe("tiny", BASE)
    run, _ = start_step_run(str(tmp_path / "r"), cfg, str(base_dir), str(tmp_path / "store"))
    calls = {"write_batch": 0, "read_batch": 0}
    store = run.rs.trajectories
    for name in calls:
        def counted(*a, _f=getattr(store, name), _n=name, **k):
            calls[_n] += 1
            return _f(*a, **k)
        setattr(store, name, counted)
    bid, batch, reused = run.collect(0)
    assert not reused and not batch.reward.isnan().any() and batch.advantage is not None
    assert run.consume(bid)[0] == "consumed"
    assert calls == {"write_batch": 1, "read_batch": 0}
    assert store.list_batches() == [bid] and not run.rs.exists("rollouts")
    other = open_step_run(tmp_path / "r")  # the next batch, consumed by a learner that did not collect it
    bid1, _, _ = run.collect(1)
    other.rs.trajectories.read_batch = run.rs.trajectories.read_batch  # count its reads too
    assert other.consume(bid1)[0] == "consumed" and calls == {"write_batch": 2, "read_batch": 1}


def test_a_copied_run_folder_resumes_into_its_own_store(tmp_path: Path, base_dir: Path) -> None:
    """The store inside a run folder is recorded relative to it: a copy resumes into the copy's
    store and leaves the original's alone; a copy whose store is outside both folders is refused."""
    import shutil

    cfg = load_recipe("tiny", BASE)
    orig = tmp_path / "orig"
    with training.learner(orig) as lr:
        training.init_learner.fn(lr, cfg, str(base_dir), str(orig / "store"))
        iterate(lr, range(1))
    copy = tmp_path / "copy"
    shutil.copytree(orig, copy)
    with training.learner(copy) as lr:
        init = training.init_learner.fn(lr, cfg, str(base_dir), str(copy / "store"), resume=True)
        assert init["iteration"] == 1
        iterate(lr, range(1, 2))
    assert RunStore(str(copy / "store")).adapters.versions() == [0, 1, 2]
    assert RunStore(str(orig / "store")).adapters.versions() == [0, 1]  # untouched
    assert training.checkpoint_meta(copy)["store_uri"] == str(copy / "store")

    ext = tmp_path / "ext"
    with training.learner(ext) as lr:
        training.init_learner.fn(lr, cfg, str(base_dir), str(tmp_path / "ext-store"))
    shutil.copytree(ext, tmp_path / "ext-copy")
    with pytest.raises(ValueError, match="is a copy of .*write into the original's store"):
        training.checkpoint_meta(tmp_path / "ext-copy")
    shutil.rmtree(ext)  # moved, not copied: the original is gone, so the folder is the run
    assert training.checkpoint_meta(tmp_path / "ext-copy")["store_uri"] == str(tmp_path / "ext-store")


def test_a_start_that_failed_before_its_first_update_can_be_started_again(tmp_path: Path, base_dir: Path) -> None:
    """A run whose store got its run.json but no checkpoint (it died while starting, e.g. on a bad
    setting) is not "another training run": the corrected start clears its own store and runs."""
    from miles_core.storage.run import prepare_run

    run_dir = tmp_path / "r"
    prepare_run(str(run_dir / "store"), load_recipe("tiny", [*BASE, "optim.lr=0.5"]), base_dir)
    assert RunStore(str(run_dir / "store")).exists("run.json") and not (run_dir / "learner.json").exists()
    cfg = load_recipe("tiny", BASE)
    with training.learner(run_dir) as lr:
        init = training.init_learner.fn(lr, cfg, str(base_dir), str(run_dir / "store"))
        assert init["iteration"] == 0 and not init["resumed"]
        iterate(lr, range(1))
    assert RunStore(str(run_dir / "store")).read_spec()["cfg"]["optim"]["lr"] == cfg.optim.lr
    # a store outside the folder might be another run's: refused, naming it
    prepare_run(str(tmp_path / "shared"), load_recipe("tiny", BASE), base_dir)
    with pytest.raises(FileExistsError, match="another training run"):
        training.init_learner.fn(training.LearnerSession(tmp_path / "r2"), cfg, str(base_dir), str(tmp_path / "shared"))


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before_and_says_so(tmp_path: Path,
                                                                                caplog: pytest.LogCaptureFixture) -> None:
    """The pointer names the newest checkpoint and the two before it (older files are deleted); a
    resume skips a damaged or missing newest one for the newest intact one, warns naming both, and
    records the fallback; with none intact it fails naming every file."""
    rs = RunStore(str(tmp_path / "run"))
    for v in range(1, 6):
        rs.save_checkpoint({"version": v, "ledger": {"consumed": list(range(v))}}, v)
    ptr = rs.read_json("learner", "CHECKPOINT")
    assert [ptr["file"], *(e["file"] for e in ptr["previous"])] == ["v000005.pt", "v000004.pt", "v000003.pt"]
    assert sorted(p.name for p in (tmp_path / "run" / "learner" / "checkpoints").iterdir()) == [
        "v000003.pt", "v000004.pt", "v000005.pt"]
    assert rs.load_checkpoint()["version"] == 5 and "fallback" not in rs.load_checkpoint()
    newest = tmp_path / "run" / "learner" / "checkpoints" / "v000005.pt"
    newest.write_bytes(newest.read_bytes()[:-7] + b"garbage")
    with caplog.at_level("WARNING", logger="miles_core.storage.run"):
        got = rs.load_checkpoint()
    assert got["version"] == 4 and got["ledger"] == {"consumed": [0, 1, 2, 3]}
    assert got["fallback"]["used"] == "v000004.pt" and "v000005.pt: sha256" in got["fallback"]["skipped"][0]
    assert "v000004.pt" in caplog.text and "v000005.pt" in caplog.text
    (tmp_path / "run" / "learner" / "checkpoints" / "v000004.pt").unlink()
    assert rs.load_checkpoint()["version"] == 3
    (tmp_path / "run" / "learner" / "checkpoints" / "v000003.pt").write_bytes(b"x")
    with pytest.raises(ValueError, match="no intact learner checkpoint: .*v000005.pt: sha256.*v000004.pt: missing"
                                         ".*v000003.pt: sha256"):
        rs.load_checkpoint()


def test_a_sync_resume_past_a_damaged_checkpoint_redoes_only_the_lost_update(tmp_path: Path, base_dir: Path) -> None:
    """Three iterations, the newest checkpoint damaged: the resume starts from version 2's, records
    the fallback, and consumes batch 2 again (its update was lost with the checkpoint), each once."""
    cfg = load_recipe("tiny", BASE)
    run_dir, store = tmp_path / "run", str(tmp_path / "run" / "store")
    with training.learner(run_dir) as lr:
        training.init_learner.fn(lr, cfg, str(base_dir), store, resume=False)
        iterate(lr, range(3))
    newest = Path(store, "learner", "checkpoints", "v000003.pt")
    newest.write_bytes(b"\0" * 64)
    with training.learner(run_dir) as lr:
        init = training.init_learner.fn(lr, cfg, str(base_dir), store, resume=True)
        assert init["iteration"] == 2 and init["resumed"]
        last = iterate(lr, range(2, 3))
    assert last["iteration"] == 3
    ckpt = RunStore(store).load_checkpoint()
    assert [e["id"] for e in stored_state(RunStore(store), ckpt["ledger"])["consumed"]] == [f"{i:06d}-learner" for i in range(3)]
    assert ckpt["totals"]["checkpoint_fallbacks"][0]["used"] == "v000002.pt"
