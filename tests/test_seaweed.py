"""The storage layer against SeaweedFS, a real S3 server in its own process (tests/s3_fixture.py).

Why beside the moto tests: SeaweedFS answers a lost ``If-None-Match: *`` race with 412, which
s3fs turns into ``OSError(EINVAL)`` rather than FileExistsError; exclusive creates, commit
markers and adapter publishing must still come out right. It also gives the exact request counts
of one ``write_batch`` and one ``read_batch`` that runs report per committed batch.
Marked e2e: the server takes several seconds to start (its volume server joins the master on a
5-second heartbeat).
"""

from __future__ import annotations

import errno
import threading
from pathlib import Path
from typing import Any

import pytest

from miles_core.storage import AdapterRegistry, BatchExistsError, CorruptBatchError, TrajectoryStore, resolve
from miles_core.storage import uri as U
from miles_core.storage.requests import RequestCounter
from miles_core.storage.run import RunStore

try:
    from s3_fixture import seaweed_server  # noqa: F401  (pytest fixture)
    from test_storage import _adapter_dir, assert_same, make_batch
except ImportError:  # tests/ became a package
    from tests.s3_fixture import seaweed_server  # type: ignore[no-redef]  # noqa: F401
    from tests.test_storage import _adapter_dir, assert_same, make_batch  # type: ignore[no-redef]

pytestmark = pytest.mark.e2e

WRITERS = 8


def _race(n: int, fn: Any) -> list[Any]:
    """Run ``fn(i)`` in ``n`` threads released together; return each result or exception."""
    barrier = threading.Barrier(n)
    out: list[Any] = [None] * n

    def run(i: int) -> None:
        barrier.wait()
        try:
            out[i] = fn(i)
        except BaseException as e:  # noqa: BLE001 - the test inspects every outcome
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return out


def test_server_rejects_a_second_conditional_put_with_einval(seaweed_server: Any) -> None:
    """What the mapping in create_exclusive exists for: the server refuses the second
    ``If-None-Match: *`` PUT, and s3fs reports it as a generic OSError(EINVAL)."""
    fs, root = resolve(seaweed_server.fresh_root(), seaweed_server.storage_options)
    path = f"{root}/marker.json"
    fs.pipe_file(path, b"first", mode="create")
    with pytest.raises(OSError) as info:
        fs.pipe_file(path, b"second", mode="create")
    assert info.value.errno == errno.EINVAL and not isinstance(info.value, FileExistsError)
    assert "pre-condition" in str(info.value)
    assert fs.cat_file(path) == b"first"
    with pytest.raises(U.AlreadyExistsError):  # sequential: caught by the existence pre-check
        U.create_exclusive(fs, path, b"third")
    assert fs.cat_file(path) == b"first"


def test_create_exclusive_race_on_the_server(seaweed_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """8 writers all pass the existence pre-check (it is skipped once per thread, as if they all
    looked before anyone wrote), so the server alone decides: one PUT wins, every loser gets the
    412 (EINVAL) and create_exclusive reports AlreadyExistsError, and the winner's bytes stay."""
    fs, root = resolve(seaweed_server.fresh_root(), seaweed_server.storage_options)
    path = f"{root}/commits/race.json"
    real_exists, real_pipe = U.exists, fs.pipe_file
    seen = threading.local()
    put_errors: list[OSError] = []

    def exists_after_first_look(fs_: Any, p: str) -> bool:
        if not getattr(seen, "looked", False):
            seen.looked = True
            return False
        return real_exists(fs_, p)

    def recording_pipe(*args: Any, **kwargs: Any) -> Any:
        try:
            return real_pipe(*args, **kwargs)
        except OSError as e:
            put_errors.append(e)
            raise

    monkeypatch.setattr(U, "exists", exists_after_first_look)
    monkeypatch.setattr(fs, "pipe_file", recording_pipe)
    outcomes = _race(WRITERS, lambda i: U.create_exclusive(fs, path, f"writer {i}".encode()))
    winners = [i for i, o in enumerate(outcomes) if o is None]
    losers = [o for o in outcomes if o is not None]
    assert len(winners) == 1, outcomes
    assert all(isinstance(o, U.AlreadyExistsError) for o in losers), losers
    assert len(put_errors) == WRITERS - 1
    assert all(e.errno == errno.EINVAL and not isinstance(e, FileExistsError) for e in put_errors), put_errors
    assert real_exists(fs, path) and fs.cat_file(path) == f"writer {winners[0]}".encode()


def test_create_exclusive_unassisted_race(seaweed_server: Any) -> None:
    """The same race without help: some losers may stop at the pre-check, the rest at the server;
    either way exactly one writer wins and everyone else gets AlreadyExistsError."""
    fs, root = resolve(seaweed_server.fresh_root(), seaweed_server.storage_options)
    path = f"{root}/commits/plain.json"
    outcomes = _race(WRITERS, lambda i: U.create_exclusive(fs, path, f"writer {i}".encode()))
    winners = [i for i, o in enumerate(outcomes) if o is None]
    assert len(winners) == 1, outcomes
    assert all(isinstance(o, U.AlreadyExistsError) for i, o in enumerate(outcomes) if i != winners[0]), outcomes
    assert fs.cat_file(path) == f"writer {winners[0]}".encode()


def test_trajectory_store_round_trip(seaweed_server: Any) -> None:
    store = TrajectoryStore(seaweed_server.fresh_root(), seaweed_server.storage_options)
    assert store.list_batches() == []
    first = store.write_batch(make_batch(seed=1), batch_id="b-0001")
    second = store.write_batch(make_batch(seed=2, version=5))
    assert store.list_batches() == sorted([first, second])
    assert_same(make_batch(seed=1), store.read_batch(first))
    assert_same(make_batch(seed=2, version=5), store.read_batch(second))
    info = store.commit_info(second)
    assert info["rows"] == 4 and info["policy_version_max"] == 5
    # Data without a marker (a writer died before committing) stays invisible.
    store.fs.pipe_file(f"{store.root}/batches/b-orphan/deadwriter.parquet", b"half")
    fresh = TrajectoryStore(store.root_uri, seaweed_server.storage_options)
    assert fresh.list_batches() == sorted([first, second])
    with pytest.raises(BatchExistsError):
        store.write_batch(make_batch(seed=3), batch_id=first)
    assert_same(make_batch(seed=1), fresh.read_batch(first))


def _looks_before_commit(monkeypatch: pytest.MonkeyPatch, blind: int) -> None:
    """Make the next ``blind`` existence checks answer False: a second writer that looked before
    the first one wrote anything, replayed after it (a race, made deterministic)."""
    real, calls = U.exists, [0]

    def exists(fs: Any, path: str) -> bool:
        calls[0] += 1
        return False if calls[0] <= blind else real(fs, path)

    monkeypatch.setattr(U, "exists", exists)


def test_second_writer_of_a_batch_id_never_touches_the_winner(seaweed_server: Any,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Writer B looked for the marker before writer A committed (a race, made deterministic): B
    writes its own data object, the server refuses B's marker (412), B gets BatchExistsError and
    removes its object; A's batch reads back whole."""
    uri = seaweed_server.fresh_root()
    a, b = (TrajectoryStore(uri, seaweed_server.storage_options) for _ in range(2))
    batches = [make_batch(seed=10, version=3), make_batch(seed=11, version=4)]
    assert a.write_batch(batches[0], batch_id="same") == "same"
    _looks_before_commit(monkeypatch, blind=1)  # create_exclusive's pre-check of the marker
    with pytest.raises(BatchExistsError, match="already committed"):
        b.write_batch(batches[1], batch_id="same")
    monkeypatch.undo()
    reader = TrajectoryStore(uri, seaweed_server.storage_options)
    assert reader.list_batches() == ["same"]
    assert_same(batches[0], reader.read_batch("same"))
    files = reader.fs.find(f"{reader.root}/batches/same")
    assert [f.rsplit("/", 1)[-1] for f in files] == [reader.data_path("same").rsplit("/", 1)[-1]]


def test_adapter_registry_publish_and_fetch(seaweed_server: Any, tmp_path: Path) -> None:
    uri = seaweed_server.fresh_root()
    reg = AdapterRegistry(uri, seaweed_server.storage_options)
    assert reg.latest_version() is None
    v1 = reg.publish(_adapter_dir(tmp_path / "a1", 1.0), metadata={"step": 10})
    v2 = reg.publish(_adapter_dir(tmp_path / "a2", 2.0), metadata={"step": 20})
    assert (v1, v2) == (1, 2)
    other = AdapterRegistry(uri, seaweed_server.storage_options)
    assert other.versions() == [1, 2] and other.latest_version() == 2 and other.metadata(2) == {"step": 20}
    out = other.fetch(2, tmp_path / "fetched")
    for rel in ("adapter_config.json", "adapter_model.safetensors", "sub/extra.txt"):
        assert (out / rel).read_bytes() == (tmp_path / "a2" / rel).read_bytes()
    with pytest.raises(FileExistsError):
        reg.publish(tmp_path / "a1", version=2)


def test_request_counter_on_one_write_and_one_read(seaweed_server: Any) -> None:
    store = TrajectoryStore(seaweed_server.fresh_root(), seaweed_server.storage_options)
    counter = RequestCounter()
    assert counter.attach(store.fs) and counter.attach(store.fs)  # the second attach adds nothing
    bid = store.write_batch(make_batch())
    # write_batch: one PutObject of the writer's own data object; then the marker's exclusive
    # create: its pre-check (one HeadObject 404: uri.object_exists, not s3fs's exists, which then
    # LISTs to ask whether the path is a folder) and the conditional PutObject.
    assert counter.snapshot() == {"HeadObject": 1, "PutObject": 2}
    # control/STOP, which every waiting process checks on each poll: one request
    run = RunStore(seaweed_server.fresh_root(), seaweed_server.storage_options)
    counter.attach(run.fs)
    counter.reset()
    assert not run.stop_requested()
    assert counter.snapshot() == {"HeadObject": 1}
    counter.reset()
    counter.reset()
    store.read_batch(bid)
    # read_batch: cat_file of the marker and of the data; s3fs asks the size first (HeadObject,
    # to decide on concurrent ranged reads), then GetObject.
    assert counter.snapshot() == {"GetObject": 2, "HeadObject": 2}
    assert counter.total() == 4
    counter.reset()
    assert store.list_batches() == [bid]
    assert counter.snapshot() == {"ListObjectsV2": 1}


def test_the_inbox_on_a_real_server_costs_what_is_in_flight(seaweed_server: Any) -> None:
    """On SeaweedFS: an announcement is one PUT, listing the inbox one LIST whatever the store
    holds, and retiring 1,200 batches two bulk deletes (1,000 keys each at most); the markers stay."""
    store = TrajectoryStore(seaweed_server.fresh_root(), seaweed_server.storage_options)
    counter = RequestCounter()
    counter.attach(store.fs)
    ids = [f"{i:06d}-w0" for i in range(1200)]
    for bid in ids:
        store.announce(bid)
        store.fs.pipe_file(store.marker_path(bid), b"{}")  # markers alone: what list_batches sees
    assert store.list_inbox() == ids and store.list_batches() == ids
    counter.reset()
    store.retire(ids[:-3])
    assert counter.snapshot() == {"DeleteObjects": 2}
    counter.reset()
    assert store.list_inbox() == ids[-3:]
    assert counter.snapshot() == {"ListObjectsV2": 1}
    assert len(store.list_batches()) == 1200


def test_request_counter_ignores_local_folders(tmp_path: Path) -> None:
    store = TrajectoryStore(tmp_path / "store")
    counter = RequestCounter()
    assert not counter.attach(store.fs)
    assert "local" in counter.note
    store.read_batch(store.write_batch(make_batch()))
    assert counter.snapshot() == {} and counter.total() == 0


def _async_run_requests(server: Any, tmp: Path, base: Path, samplers: int, monkeypatch: pytest.MonkeyPatch) -> dict:
    """One asynchronous run of real worker processes on the server: each of ``samplers`` samplers
    commits 3 batches, the learner consumes one per update -> the run's summary."""
    from miles_core.asyncrl.launch import prepare_run, run_local
    from miles_core.config import load_recipe

    env = {"MILES_S3_ENDPOINT_URL": server.endpoint_url, "AWS_ACCESS_KEY_ID": server.storage_options["key"],
           "AWS_SECRET_ACCESS_KEY": server.storage_options["secret"], "AWS_DEFAULT_REGION": "us-east-1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    cfg = load_recipe("tiny", [f"async_rl.num_samplers={samplers}", "async_rl.batches_per_sampler=3",
                               "async_rl.poll_interval=0.02", "async_rl.poll_backoff=2", "async_rl.checkpoint_every=3"])
    run = server.fresh_root()
    prepare_run(run, cfg, base)
    return run_local(run, samplers, tmp / f"logs{samplers}", timeout=600, env=env, warm=True)


def test_requests_per_committed_batch_do_not_grow_with_the_samplers(seaweed_server: Any, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Counted on the wire in every process (status files): a waiting sampler reads one small pointer
    with back-off, so three samplers cost no more requests per committed batch than one."""
    from miles_core.config import load_recipe
    from miles_core.learner.baseline import new_model
    from miles_core.models.base import save_checkpoint
    from miles_core.tokenizer import CharTokenizer

    tok = CharTokenizer()
    save_checkpoint(new_model(load_recipe("tiny"), tok, 0), tok, tmp_path / "base")
    one, three = (_async_run_requests(seaweed_server, tmp_path, tmp_path / "base", n, monkeypatch) for n in (1, 3))
    assert (one["batches_committed"], three["batches_committed"]) == (3, 9)
    assert one["consumed"] + one["dropped"] == 3 and three["consumed"] + three["dropped"] == 9
    assert one["store_requests"] > 0 and three["store_requests"] > 0
    assert three["store_requests_per_batch"] <= 1.2 * one["store_requests_per_batch"], (one, three)
