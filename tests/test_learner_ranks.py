"""The asynchronous learner as D data-parallel ranks under torchrun (gloo on CPU): a global batch
read in shares gives the update one process reading it all gives, and a rank SIGKILLed mid-update
makes torchrun restart the group from the last checkpoint with every batch consumed once, and a
restarted group never joins through the addresses its dead predecessors published."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import train_tiny_base
from safetensors.torch import load_file

from miles_core.algo.rl import assign_advantages, batch_id
from miles_core.asyncrl.launch import prepare_run
from miles_core.asyncrl.learner import AsyncLearner
from miles_core.asyncrl.sampler import SamplerWorker
from miles_core.config import load_recipe
from miles_core.storage.run import RunStore

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
BASE = ["sft.steps=30", "train.prompts_per_iter=2", "train.group_size=4", "sampler.steps=4", "task.completion_len=16",
        "async_rl.poll_interval=0.01", "async_rl.max_staleness=10", "update.num_minibatches=2", "update.row_chunk=5",
        "estimators.adpo.step_fraction=0.5", "update.kl_coef=0.1"]

# Pauses rank MILES_TEST_RANK inside its second update (after its first chunk's backward, before the
# gradients' all-reduce), once: the flag file holds its pid, so the parent can SIGKILL it there.
HARNESS = textwrap.dedent("""
    import os, sys, time
    flag, rank = os.environ["MILES_TEST_FLAG"], os.environ["MILES_TEST_RANK"]
    if os.environ.get("RANK") == rank and not os.path.exists(flag):
        import miles_core.parallel as P
        real, calls = P.World.sync_grads, [0]
        def sync_grads(self, params):
            calls[0] += 1
            if calls[0] == 3:  # update 2 (num_minibatches=2: two syncs per update), mid-update
                with open(flag, "w") as f:
                    f.write(str(os.getpid()))
                time.sleep(600)
            return real(self, params)
        P.World.sync_grads = sync_grads
    from miles_core.asyncrl.__main__ import main
    sys.exit(main(sys.argv[1:]))
""")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_base(tmp_path_factory, BASE, "ranks")


def committed_run(tmp: Path, base: Path, batches: int, *overrides: str) -> str:
    """A run with ``batches`` sampler batches committed from v0, every group with a reward spread."""
    cfg = load_recipe("tiny", [*BASE, f"async_rl.batches_per_sampler={batches}", *overrides])
    run = str(tmp / "run")
    prepare_run(run, cfg, base)
    AsyncLearner(run, str(tmp / "lc0"))  # publishes v0
    sampler = SamplerWorker(run, "w0", 0, str(tmp / "sc"))
    sampler.sync_adapter()
    for seq in range(batches):
        b = sampler.make_batch(seq)
        b.reward = torch.arange(len(b), dtype=torch.float32) % 2
        sampler.batches.commit(assign_advantages(b), batch_id(seq, "w0"))
    return run


# Attempt 0: both ranks join and all-reduce, then rank 1 crashes. Attempt 1: rank 0 joins 3 s late,
# so rank 1 reads rank 0's key first: from the agent's store, which outlives attempts, that is the
# dead rank 0's address unless the keys are scoped per attempt (gloo then hangs or refuses).
REJOIN = textwrap.dedent("""
    import os, sys, time
    import torch
    from miles_core.parallel import close_world, init_world
    attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
    if attempt == 1 and rank == 0:
        time.sleep(3)
    world = init_world("gloo", timeout_s=60)
    total = world.all_reduce_(torch.tensor([float(rank + 1)]))
    assert float(total[0]) == 3.0, total
    if attempt == 0 and rank == 1:
        os._exit(1)
    if attempt == 1:
        close_world(world)
        with open(os.environ["MILES_TEST_FLAG"] + f".rejoined{rank}", "w") as f:  # a file each: the log interleaves
            f.write(str(attempt))
""")


def finish(proc: subprocess.Popen, log: Path, timeout: float) -> int:
    """``proc``'s exit code; on a timeout, kill it and fail with the end of its log."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"torchrun still running after {timeout:.0f} s:\n{log.read_text()[-4000:]}")


def torchrun(run: str, tmp: Path, nproc: int, *extra: str, restarts: int = 0,
             env: dict[str, str] | None = None, harness: str = HARNESS) -> subprocess.Popen:
    script = tmp / "harness.py"
    script.write_text(harness)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node",
           str(nproc), "--max-restarts", str(restarts), str(script), "learner", run, "--backend", "gloo",
           "--cache-dir", str(tmp / "cache"), *extra]
    full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "MILES_TEST_FLAG": str(tmp / "flag"),
            "MILES_TEST_RANK": "-1", **(env or {})}
    return subprocess.Popen(cmd, cwd=ROOT, env=full, stdout=open(tmp / "torchrun.log", "wb"), stderr=subprocess.STDOUT)


@pytest.mark.parametrize("ranks,batches,groups,speeds", [(2, 3, 3, ""), (3, 5, 2, ""), (3, 1, 2, ""),
                                                         (3, 5, 2, "1,3.5,0.6")])
def test_each_rank_updating_on_its_own_share_makes_the_one_process_update(ranks: int, batches: int,
                                                                           groups: int, speeds: str) -> None:
    """D gloo ranks, each building rows for and scoring only the trajectories it holds (uneven
    shares, a group without advantage among them), make one process's update of the whole global
    batch, in three minibatches, for adpo (covering rows; dealt single trajectories, so groups straddle
    ranks), espo (counts stratified over a group) and wd1 (weights softmaxed over a group), both
    dealt whole groups; no rank passes another's trajectories to the row builder. With
    fewer groups than ranks (a run's short last update) an espo or wd1 rank holding none joins with no rows.
    Dealt by uneven speeds (async_rl.deal=speed) the blocks follow them and the update is the same."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node",
           str(ranks), str(ROOT / "tests" / "helpers" / "shares_update.py"), str(batches), str(groups),
           *([speeds] if speeds else [])]
    out = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    lines = out.stdout.splitlines()
    for estimator in ("adpo", "espo", "wd1"):
        line = next(x for x in lines if x.startswith(f"estimator={estimator} "))
        fields = dict(f.split("=") for f in line.split())
        assert float(fields["max_abs_diff"]) < 1e-6 and float(fields["moved"]) > 1e-3, line
    built = sorted(tuple(map(int, x.split("=")[1].split(":"))) for x in lines if x.startswith("built="))
    total = batches * groups * 4
    assert [r for r, _, _ in built] == list(range(ranks))
    assert sum(h for _, _, h in built) == total  # a partition
    assert all(b <= h < total for _, b, h in built) and sum(b for _, b, _ in built) > 0  # its own only
    held = [h for _, _, h in built]
    if not speeds:  # adpo's equal blocks of trajectories: groups of 4 split between ranks
        assert held == [-(-(r + 1) * total // ranks) + (r * total // -ranks) for r in range(ranks)]
        assert any(h % 4 for h in held), held
    else:  # 40 trajectories dealt 1 : 3.5 : 0.6 (learner/shares.py::cuts)
        assert held == [8, 28, 4]


def test_a_global_batch_read_in_shares_by_two_ranks_is_the_one_process_update(tmp_path: Path, base_dir: Path) -> None:
    """Four sampler batches make one update (async_rl.global_batch=32): rank 0 reads batches 0 and
    1, rank 1 batches 2 and 3, and the adapter they publish equals one process's, which reads all."""
    run = committed_run(tmp_path / "one", base_dir, 4, "async_rl.global_batch=32")
    two = tmp_path / "two" / "run"
    shutil.copytree(run, two)
    read: list[str] = []
    from miles_core.storage.trajectories import TrajectoryStore

    real_read = TrajectoryStore.read_batch
    TrajectoryStore.read_batch = lambda self, bid: read.append(bid) or real_read(self, bid)  # type: ignore[method-assign]
    try:
        single = AsyncLearner(run, str(tmp_path / "one" / "lc")).run()
    finally:
        TrajectoryStore.read_batch = real_read  # type: ignore[method-assign]
    assert single["done"] and single["updates"] == 1 and len(read) == 4
    proc = torchrun(str(two), tmp_path / "two", 2)
    assert finish(proc, tmp_path / "two" / "torchrun.log", 300) == 0, (tmp_path / "two" / "torchrun.log").read_text()[-4000:]
    status = RunStore(str(two)).read_json("learner", "status.json")
    assert status["done"] and status["updates"] == 1 and status["consumed"] == 4
    ledger = RunStore(str(two)).read_json("learner", "history.json")["ledger"]["consumed"]
    assert [e["id"] for e in ledger] == [batch_id(s, "w0") for s in range(4)] and {e["update"] for e in ledger} == {1}
    a = load_file(str(RunStore(run).adapters.fetch(1, tmp_path / "a1") / "adapter_model.safetensors"))
    b = load_file(str(RunStore(str(two)).adapters.fetch(1, tmp_path / "b1") / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    moved = 0
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-6)
        moved += int(a[k].abs().sum() > 0 and "lora_B" in k)
    assert moved > 0  # the update moved the adapter: equality is not two zero LoRAs


def test_sigkill_of_one_learner_rank_mid_update_resumes_with_every_batch_consumed_once(tmp_path: Path,
                                                                                          base_dir: Path) -> None:
    run = committed_run(tmp_path, base_dir, 6, "async_rl.global_batch=16")  # 3 updates of 2 batches
    proc = torchrun(run, tmp_path, 2, restarts=3, env={"MILES_TEST_RANK": "1"})
    flag, deadline = tmp_path / "flag", time.monotonic() + 240
    while not (flag.exists() and flag.read_text()):
        assert proc.poll() is None, (tmp_path / "torchrun.log").read_text()[-4000:]
        assert time.monotonic() < deadline, "rank 1 never reached its second update"
        time.sleep(0.05)
    ckpt = RunStore(run).load_checkpoint()
    from miles_core.learner.ledger import stored_state

    assert [e["update"] for e in stored_state(RunStore(run), ckpt["ledger"])["consumed"]] == [1, 1]  # update 2 is in flight
    os.kill(int(flag.read_text()), 9)
    assert finish(proc, tmp_path / "torchrun.log", 300) == 0, (tmp_path / "torchrun.log").read_text()[-4000:]
    rs = RunStore(run)
    status = rs.read_json("learner", "status.json")
    ledger = rs.read_json("learner", "history.json")["ledger"]
    ids = [e["id"] for e in ledger["consumed"]]
    assert ids == [batch_id(s, "w0") for s in range(6)] and len(set(ids)) == 6  # each once, none lost
    assert [e["update"] for e in ledger["consumed"]] == [1, 1, 2, 2, 3, 3] and not ledger["dropped"]
    assert status["done"] and status["resumes"] >= 1 and status["version"] == 3
    assert json.loads(json.dumps(status))["max_staleness_seen"] <= 10


def test_fsdp_ranks_publish_and_resume_the_one_process_updates(tmp_path: Path, base_dir: Path) -> None:
    """async_rl.fsdp: two ranks each holding half of base and adapter (FSDP2 on gloo) publish the
    adapters one process publishes, update after update, across a resume from a checkpoint they
    gathered (shares of 16 rows in chunks of 5: ranks run unequal chunk counts, padded)."""
    over = ("async_rl.global_batch=16", "async_rl.fsdp=true", "async_rl.checkpoint_every=1")
    run = committed_run(tmp_path / "one", base_dir, 6, *over)            # 3 updates of 2 batches
    two = tmp_path / "two" / "run"
    shutil.copytree(run, two)
    single = AsyncLearner(run, str(tmp_path / "one" / "lc")).run()
    assert single["done"] and single["updates"] == 3
    first = torchrun(str(two), tmp_path / "two", 2, "--max-updates", "2")
    assert first.wait(timeout=300) == 0, (tmp_path / "two" / "torchrun.log").read_text()[-4000:]
    assert RunStore(str(two)).load_checkpoint()["version"] == 2
    rest = torchrun(str(two), tmp_path / "two", 2)                     # resumes: the checkpoint sharded again
    assert rest.wait(timeout=300) == 0, (tmp_path / "two" / "torchrun.log").read_text()[-4000:]
    status = RunStore(str(two)).read_json("learner", "status.json")
    assert status["done"] and status["resumes"] >= 1 and status["version"] == 3 and status["learner_ranks"] == 2
    for v in (1, 2, 3):
        a = load_file(str(RunStore(run).adapters.fetch(v, tmp_path / f"a{v}") / "adapter_model.safetensors"))
        b = load_file(str(RunStore(str(two)).adapters.fetch(v, tmp_path / f"b{v}") / "adapter_model.safetensors"))
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-6)
    assert any(a[k].abs().sum() > 0 for k in a if "lora_B" in k)       # v3 moved: not two zero LoRAs


# Rank 1 works 0.05 s per trajectory more after each update (a slower GPU), and every rank records
# how many trajectories it updated on.
SLOW = textwrap.dedent("""
    import os, sys, time
    import miles_core.learner.policy as P
    real, rank = P.Learner.update, os.environ["RANK"]
    def update(self, batch, world=None, keys=None, leads=None):
        out = real(self, batch, world=world, keys=keys, leads=leads)
        if rank == "1":
            time.sleep(0.05 * len(batch))
        with open(os.environ["MILES_TEST_FLAG"] + f".rows{rank}", "a") as f:
            f.write(f"{len(batch)}\\n")
        return out
    P.Learner.update = update
    from miles_core.asyncrl.__main__ import main
    sys.exit(main(sys.argv[1:]))
""")


def test_a_rank_measured_slower_is_dealt_fewer_rows_and_the_updates_stay_the_one_process_updates(
        tmp_path: Path, base_dir: Path) -> None:
    """async_rl.deal=speed with rank 1 slowed down: the first update is dealt equally, the next ones
    give rank 1 fewer trajectories (its measured speed), and the adapters published are one
    process's, update after update."""
    over = ("async_rl.global_batch=32", "async_rl.checkpoint_every=1", "async_rl.deal=speed")  # one process: no deal
    run = committed_run(tmp_path / "one", base_dir, 12, *over)            # 3 updates of 4 batches (8 groups)
    two = tmp_path / "two" / "run"
    shutil.copytree(run, two)
    single = AsyncLearner(run, str(tmp_path / "one" / "lc")).run()
    assert single["done"] and single["updates"] == 3
    proc = torchrun(str(two), tmp_path / "two", 2, harness=SLOW)
    assert finish(proc, tmp_path / "two" / "torchrun.log", 300) == 0, (tmp_path / "two" / "torchrun.log").read_text()[-4000:]
    rows = [[int(x) for x in (tmp_path / "two" / f"flag.rows{r}").read_text().split()] for r in (0, 1)]
    assert rows[0][0] == rows[1][0] == 16                                 # nothing measured yet: equal blocks
    assert all(a > b > 0 for a, b in zip(rows[0][1:], rows[1][1:])) and len(rows[0]) == 3, rows
    assert all(a + b == 32 for a, b in zip(*rows))
    for v in (1, 2, 3):
        a = load_file(str(RunStore(run).adapters.fetch(v, tmp_path / f"a{v}") / "adapter_model.safetensors"))
        b = load_file(str(RunStore(str(two)).adapters.fetch(v, tmp_path / f"b{v}") / "adapter_model.safetensors"))
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-6)
    assert any(a[k].abs().sum() > 0 for k in a if "lora_B" in k)


@pytest.mark.parametrize("minibatches,kl", [(1, 0.0), (2, 0.1)])
def test_an_fsdp_update_with_unequal_shares_is_the_one_process_update(tmp_path: Path, minibatches: int, kl: float) -> None:
    """FSDP2 needs every rank to run as many passes: rank 1, holding 4 of 12 trajectories, pads its
    chunks; the sharded update still equals one process's (and the KL's reference passes pad too)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
           str(ROOT / "tests" / "helpers" / "fsdp_update.py"), str(minibatches), str(kl)]
    out = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("max_abs_diff="))
    fields = dict(f.split("=") for f in line.split())
    assert float(fields["max_abs_diff"]) < 1e-6 and float(fields["moved"]) > 1e-4, line
    one, sharded = map(float, fields["grad_norm"].split(","))
    assert one == pytest.approx(sharded, rel=1e-5) and len(set(fields["tokens"].split(","))) == 1, line


def test_a_restarted_group_joins_through_its_own_attempts_addresses(tmp_path: Path) -> None:
    proc = torchrun("unused", tmp_path, 2, restarts=1, harness=REJOIN)
    log = tmp_path / "torchrun.log"
    assert finish(proc, log, 120) == 0, log.read_text()[-4000:]
    assert [(tmp_path / f"flag.rejoined{r}").read_text() for r in (0, 1)] == ["1", "1"]  # both ranks, attempt 1
