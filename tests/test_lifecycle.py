"""A run's life at its edges: a process that dies without cleanup, the next start in its folder,
a resume that continues the same MLflow run, a folder someone else is still writing.

The record (flows/session.py) is checked with real MLflow runs and real processes; the kill test
runs ``miles train`` as a user does, kills it with SIGKILL mid-run, and resumes it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

import tracking
from flows import session

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def store(tmp_path: Path) -> str:
    return tracking.configure(f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _record(run_dir: Path, pid: int, run_id: str | None, host: str | None = None) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    started = session._started(pid) if host is None else "1"
    (run_dir / session.RECORD).write_text(json.dumps({
        "host": host or socket.gethostname(), "pid": pid, "started": started, "run_dir": str(run_dir.resolve()),
        "mlflow_run_id": run_id, "prefect_flow_run_id": None, "ended": None}))


def test_a_dead_owner_is_reaped_and_its_runs_marked_killed(tmp_path: Path, store: str) -> None:
    run_dir, sub = tmp_path / "train", tmp_path / "train" / "sft"
    top, child = tracking.start_run("e", "train"), tracking.start_run("e", "sft")
    pid = _dead_pid()
    _record(run_dir, pid, top)
    _record(sub, pid, child)
    claim = session.claim(run_dir)
    client = MlflowClient()
    assert client.get_run(top).info.status == "KILLED" and client.get_run(child).info.status == "KILLED"
    assert claim.previous["ended"] == "reaped" and session.read(sub)["ended"] == "reaped"
    now = session.read(run_dir)
    assert now["pid"] == os.getpid() and now["mlflow_run_id"] == top  # the folder's run carries over
    with session.tracked(claim, "e", "train", {"a": 1}, resume=True) as run_id:
        assert run_id == top and client.get_run(top).info.status == "RUNNING"
    assert client.get_run(top).info.status == "FINISHED" and session.read(run_dir)["ended"] == "exited"
    assert client.get_run(top).data.tags["miles.resumes"] == "1"


def test_a_live_owner_refuses_a_second_start_and_a_reused_pid_is_not_the_owner(tmp_path: Path, store: str) -> None:
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _record(tmp_path / "a", live.pid, None)
        with pytest.raises(session.RunInUse, match=f"process {live.pid}"):
            session.claim(tmp_path / "a")
        rec = json.loads((tmp_path / "a" / session.RECORD).read_text())
        (tmp_path / "a" / session.RECORD).write_text(json.dumps({**rec, "started": "0"}))  # same pid, other process
        assert session.claim(tmp_path / "a").previous["ended"] == "reaped"
    finally:
        live.kill()
        live.wait()
    run_id = tracking.start_run("e", "elsewhere")
    _record(tmp_path / "b", 1, run_id, host="another-host")  # cannot know: never reaped from here
    session.claim(tmp_path / "b")
    assert MlflowClient().get_run(run_id).info.status == "RUNNING"


def test_a_resumed_run_keeps_its_first_params_and_records_the_changed_ones(tmp_path: Path, store: str) -> None:
    run_id = tracking.start_run("e", "r", {"train.iterations": 2, "optim.lr": 0.01})
    tracking.end_run(run_id, "KILLED")
    with tracking.run("e", "r", {"train.iterations": 4, "optim.lr": 0.01, "new": "x"}, resume_run_id=run_id):
        pass
    run = MlflowClient().get_run(run_id)
    assert run.data.params == {"train.iterations": "2", "optim.lr": "0.01", "new": "x"}
    assert json.loads(run.data.tags["miles.changed_params"]) == {"train.iterations": ["2", "4"]}
    assert run.info.status == "FINISHED"


def test_a_failed_resume_leaves_a_finished_run_finished(tmp_path: Path, store: str) -> None:
    """A resume of a FINISHED run (it may back a registered version) that fails keeps the run
    FINISHED and says what happened in ``miles.last_resume``; a resume of a KILLED run that fails
    ends FAILED, as any run does."""
    done = tracking.start_run("e", "done", {"a": 1})
    tracking.end_run(done, "FINISHED")
    with pytest.raises(ValueError):
        with tracking.run("e", "done", {"a": 1}, resume_run_id=done):
            raise ValueError("learner/checkpoints/v000003.pt: sha256 does not match")
    run = MlflowClient().get_run(done)
    assert run.info.status == "FINISHED" and run.data.tags["miles.last_resume"].startswith("FAILED: ValueError: learner")
    dead = tracking.start_run("e", "dead", {"a": 1})
    tracking.end_run(dead, "KILLED")
    with pytest.raises(ValueError):
        with tracking.run("e", "dead", {"a": 1}, resume_run_id=dead):
            raise ValueError("x")
    assert MlflowClient().get_run(dead).info.status == "FAILED"


WRITER = """
import sys, time
from pathlib import Path
import tracking
from flows import session
tracking.configure(sys.argv[1])
run_dir = Path(sys.argv[2])
with session.tracked(session.claim(run_dir), "e", "writer", {"a": 1}) as run_id:
    print(run_id, flush=True)
    for step in range(10**6):
        tracking.log_metrics(run_id, {"loss": 1.0 / (step + 1)}, step)
        time.sleep(0.2)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.e2e
def test_a_tracking_server_killed_mid_run_ends_the_run_within_budget_and_gc_marks_it(tmp_path: Path) -> None:
    """A real MLflow server, killed while a run logs to it (the run's code path: session.tracked,
    tracking.run, log_metrics): the process ends within tracking.HTTP_BUDGET's bound (a refused
    connection: ~10 s per call, two calls), its record keeps the status it could not write, and
    ``miles runs gc`` on the server's store marks the run FAILED, never leaving it RUNNING."""
    port, store = _free_port(), f"sqlite:///{tmp_path / 'srv' / 'mlflow.db'}"
    (tmp_path / "srv").mkdir()
    env = _env(tmp_path)
    server = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port",
                               str(port), "--workers", "1", "--backend-store-uri", store, "--artifacts-destination",
                               str(tmp_path / "srv" / "artifacts")], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    writer = None
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                tracking.check_server(f"http://127.0.0.1:{port}", timeout_s=2)
                break
            except ConnectionError:
                time.sleep(0.5)
        writer = subprocess.Popen([sys.executable, "-c", WRITER, f"http://127.0.0.1:{port}", str(tmp_path / "run")],
                                  cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        run_id = writer.stdout.readline().strip()
        assert run_id, writer.stderr.read()[-2000:]
        time.sleep(2)  # a few metrics logged
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        t0 = time.monotonic()
        rc = writer.wait(timeout=150)
        took = time.monotonic() - t0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        if writer is not None and writer.poll() is None:
            writer.kill()
    err = writer.stderr.read()
    print(f"the run's process ended {took:.1f} s after its tracking server died (rc {rc})")
    assert rc != 0 and took < 60, (rc, took, err[-2000:])
    assert "could not be marked FAILED" in err and "miles runs gc" in err, err[-2000:]
    record = session.read(tmp_path / "run")
    assert record["ended"] == "exited" and record["end_pending"] == "FAILED", record
    tracking.configure(store)
    assert MlflowClient().get_run(run_id).info.status == "RUNNING"  # what the dead server kept
    gc = subprocess.run([sys.executable, "-m", "miles.cli", "runs", "gc", str(tmp_path), "--tracking-uri", store],
                        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert gc.returncode == 0 and f"MLflow run {run_id} FAILED" in gc.stdout, gc.stdout + gc.stderr[-2000:]
    assert MlflowClient().get_run(run_id).info.status == "FAILED"
    assert "end_pending" not in session.read(tmp_path / "run")


def test_a_status_the_store_missed_is_written_by_the_next_start(tmp_path: Path, store: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The unit under the e2e test: ``tracking.run`` tells ``unended`` when it cannot write the
    final status and re-raises the body's own error; the next claim of the folder writes it."""
    from mlflow.exceptions import MlflowException

    claim = session.claim(tmp_path / "r")
    real_end = tracking.end_run
    monkeypatch.setattr(tracking, "end_run", lambda *a, **k: (_ for _ in ()).throw(MlflowException("down")))
    with pytest.raises(KeyError):
        with session.tracked(claim, "e", "r") as run_id:
            raise KeyError("the body's own error")
    monkeypatch.setattr(tracking, "end_run", real_end)
    assert session.read(tmp_path / "r")["end_pending"] == "FAILED"
    assert MlflowClient().get_run(run_id).info.status == "RUNNING"
    assert session.claim(tmp_path / "r") and MlflowClient().get_run(run_id).info.status == "FAILED"


def test_tracking_uris_that_cannot_work_fail_fast_naming_themselves(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        tracking.check_uri(f"sqlite:///{tmp_path}/no/such/mlflow.db")
    assert not (tmp_path / "no").exists()
    assert tracking.check_uri(f"sqlite:///{tmp_path}/mlruns/mlflow.db")  # the database's own folder is made
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens here once closed
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}"):
        tracking.check_uri(f"http://127.0.0.1:{port}")
    assert time.monotonic() - t0 < 30


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    # the temporary Prefect server a fresh process starts gets CI's start-up allowance (.ci/run): the
    # default 20 s is not enough on two busy cores
    env.update({"PYTHONPATH": str(REPO), "PREFECT_HOME": str(tmp / "prefect"),
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
                "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlruns' / 'mlflow.db'}"})
    return env


@pytest.mark.e2e
def test_kill_9_then_resume_marks_the_dead_run_and_continues_the_same_mlflow_run(tmp_path: Path) -> None:
    """``miles train`` killed with SIGKILL after its first update: nothing it started outlives it (the
    temporary Prefect server included: miles/reaper.py); the rerun without --resume is refused
    naming --resume; a resume changing an evaluation setting is refused naming it; a bare ``--resume``
    (none of the start's overrides typed again) marks the dead flow run Crashed and continues the
    same MLflow run with the run's own recipe (its update steps 1..3 each once, not the recipe's
    default length; one evaluation fingerprint) and ends FINISHED."""
    from miles.reaper import _start_time, descendants

    env, run_dir = _env(tmp_path), tmp_path / "run"
    args = [sys.executable, "-m", "miles.cli", "train", "tiny", "--run-dir", str(run_dir), "--no-progress",
            "--register-as", "", "sft.steps=5", "sft.eval_every=5", "eval.num_problems=4",
            "train.prompts_per_iter=2", "train.group_size=2", "train.eval_every=10"]
    proc = subprocess.Popen([*args, "--iterations", "3"], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            meta = run_dir / "learner.json"
            if meta.exists() and json.loads(meta.read_text()).get("iteration", 0) >= 1:
                break
            time.sleep(0.5)
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        kids = descendants(proc.pid)
        cmdlines = [Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode() for p in kids]
        assert any("uvicorn" in c for c in cmdlines), cmdlines  # Prefect's temporary server is among them
        proc.send_signal(signal.SIGKILL)  # the CLI alone, as the OOM killer does: not its process group
        proc.wait()
        # nothing the CLI started outlives it by 5 s (miles/reaper.py), the server included
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_start_time(p) == t for p, t in kids.items()):
            time.sleep(0.1)
        assert not [c for (p, t), c in zip(kids.items(), cmdlines) if _start_time(p) == t]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    first = json.loads((run_dir / session.RECORD).read_text())
    tracking.configure(env["MLFLOW_TRACKING_URI"])
    assert MlflowClient().get_run(first["mlflow_run_id"]).info.status == "RUNNING"  # what kill -9 leaves

    again = subprocess.run([*args, "--iterations", "3"], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode != 0 and "--resume" in again.stderr, again.stderr[-2000:]
    assert MlflowClient().get_run(first["mlflow_run_id"]).info.status == "KILLED"  # reaped by that start
    bare = [sys.executable, "-m", "miles.cli", "train", "tiny", "--run-dir", str(run_dir), "--no-progress",
            "--register-as", "", "--resume"]
    refused = subprocess.run([*bare, "eval.num_problems=8"], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=300)
    assert refused.returncode != 0 and "eval.num_problems 4 -> 8" in refused.stderr, refused.stderr[-2000:]
    # the documented resume, with none of the start's overrides: the run continues as it was started
    resumed = subprocess.run(bare, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    run = MlflowClient().get_run(first["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["miles.resumes"] == "1"
    assert [s for s, _ in tracking.metric_history(run.info.run_id, "reward/reward_mean")] == [1, 2, 3]
    assert run.data.params["eval.num_problems"] == "4" and "miles.changed_params" not in run.data.tags
    trains = MlflowClient().search_runs([run.info.experiment_id], "tags.`miles.kind` = 'train'")
    assert [r.info.run_id for r in trains] == [run.info.run_id]
    code = ("import sys\nfrom prefect.client.orchestration import get_client\n"
            "with get_client(sync_client=True) as c:\n    print(c.read_flow_run(sys.argv[1]).state.type.value)")
    state = subprocess.run([sys.executable, "-c", code, first["prefect_flow_run_id"]], env=env, capture_output=True,
                           text=True, timeout=180)
    assert state.stdout.strip() == "CRASHED", state.stdout + state.stderr[-2000:]


@pytest.mark.e2e
def test_sigterm_ends_the_run_killed(tmp_path: Path) -> None:
    """A scheduler's SIGTERM (Kubernetes, ``kill``) to the CLI mid-flow ends the MLflow run KILLED,
    as Ctrl-C does, not FAILED: during a flow Prefect's engine raises its own TerminationSignal for
    SIGTERM, and the run's context manager counts it as a stop. The CLI says so and exits 128 + N."""
    env, run_dir = _env(tmp_path), tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "miles.cli", "sft", "tiny", "--run-dir", str(run_dir), "--no-progress",
                             "sft.steps=100000", "sft.eval_every=100000"], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        rec = run_dir / session.RECORD
        while time.monotonic() < deadline and proc.poll() is None:
            if rec.exists() and json.loads(rec.read_text()).get("mlflow_run_id"):
                break
            time.sleep(0.5)
        time.sleep(3)  # inside the training loop
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    err = proc.stderr.read().decode()
    assert rc == 128 + signal.SIGTERM, (rc, err[-3000:])
    tracking.configure(env["MLFLOW_TRACKING_URI"])
    run_id = json.loads((run_dir / session.RECORD).read_text())["mlflow_run_id"]
    assert MlflowClient().get_run(run_id).info.status == "KILLED", err[-3000:]


def test_corrupted_checkpoints_and_adapters_fail_naming_the_file(tmp_path: Path) -> None:
    """The sha256 recorded when Miles wrote a tensor file is checked when it is read back: a changed
    or truncated file is an error naming the file, not safetensors' bare "invalid header length"."""
    import torch

    from miles_core.models.lora import add_lora, load_adapter, save_adapter
    from miles_core.models.tiny import TinyConfig, TinyDenoiser
    from miles_core.tokenizer import CharTokenizer

    tok = CharTokenizer()
    torch.manual_seed(0)
    model = TinyDenoiser(TinyConfig(vocab_size=tok.vocab_size, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_len=32))
    model.save_pretrained(tmp_path / "base")
    TinyDenoiser.from_pretrained(tmp_path / "base")  # intact: loads
    adapter = save_adapter(add_lora(TinyDenoiser.from_pretrained(tmp_path / "base"), r=2, alpha=4), tmp_path / "adapter")
    load_adapter(TinyDenoiser.from_pretrained(tmp_path / "base"), adapter)

    weights = tmp_path / "base" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit in a tensor: safetensors itself would load it silently
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"{weights}: sha256 .* does not match"):
        TinyDenoiser.from_pretrained(tmp_path / "base")
    tensors = adapter / "adapter_model.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:7])  # truncated
    (tmp_path / "base" / "miles_sha256.json").unlink()  # a folder from elsewhere: no record, still named
    weights.write_bytes(weights.read_bytes()[:5])
    with pytest.raises(ValueError, match=f"{weights}: not a readable safetensors file"):
        TinyDenoiser.from_pretrained(tmp_path / "base")
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=f"{tensors}: sha256"):
        load_adapter(TinyDenoiser(model.config), adapter)
