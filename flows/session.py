"""Who is writing a run folder now: its process, MLflow run and Prefect flow run (``RUN_DIR/session.json``).

Why a record of its own: a process killed without cleanup (``kill -9``, the OOM killer, a
preempted node) leaves its MLflow run RUNNING and its Prefect flow run Running forever, and a
resume started a second MLflow run, splitting the learning curve in two. The next flow that starts
in the folder reads the record: a dead owner's MLflow run is marked KILLED and its flow run
Crashed (and those of the subflows in its direct subfolders, e.g. ``train/sft``); a live owner
refuses the start; a resume of the same folder reopens the same MLflow run. A copied folder is
not the same folder (the record names the folder it was written in), so its resume gets a new
MLflow run, linked to the original by a tag.

Liveness is (host, pid, the pid's start time): a pid the kernel reused for another process is not
the owner. Records from another host are never reaped from here (that process may be alive).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tracking

RECORD = "session.json"
log = logging.getLogger("miles.session")


class RunInUse(RuntimeError):
    """Another live process is writing this run folder."""


def _started(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (``/proc/PID/stat`` field 22), or None if no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        if not Path("/proc/self/stat").exists():  # no procfs: fall back to "a process with this pid exists"
            try:
                os.kill(pid, 0)
                return "unknown"
            except ProcessLookupError:
                return None
            except PermissionError:
                return "unknown"
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # fields after the command name; 22nd overall


def _me() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": _started(os.getpid())}


def _prefect_flow_run_id() -> str | None:
    from prefect.runtime import flow_run

    return str(flow_run.id) if flow_run.id else None


def read(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / RECORD
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError:
        log.warning("%s is unreadable; treating the folder as unowned", path)
        return None


def _write(run_dir: Path, record: Mapping[str, Any]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".{RECORD}.{os.getpid()}"
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, run_dir / RECORD)


def owner_alive(record: Mapping[str, Any]) -> bool | None:
    """True/False for a record of this host; None when it was written on another host (unknowable)."""
    if record.get("host") != socket.gethostname():
        return None
    started = _started(int(record.get("pid") or 0))
    return started is not None and (started == record.get("started") or "unknown" in (started, record.get("started")))


def _crash_flow_run(flow_run_id: str, why: str) -> bool:
    """Mark a Prefect flow run Crashed unless it already reached a final state; False if unknown to this API."""
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.states import Crashed

    with get_client(sync_client=True) as client:
        try:
            run = client.read_flow_run(UUID(flow_run_id))
        except ObjectNotFound:
            return False
        if run.state is not None and run.state.is_final():
            return False
        client.set_flow_run_state(run.id, Crashed(message=why), force=True)
        return True


def _settle(folder: Path, seen_from: Path) -> list[str]:
    """Close what a dead owner of ``folder``'s record left open, or apply a final status its process
    could not write (``end_pending``: the tracking server was away) -> what was marked."""
    rec = read(folder)
    if rec and rec.get("end_pending") and rec.get("mlflow_run_id"):  # its process ended, the server was away
        marked = [f"MLflow run {rec['mlflow_run_id']} {rec['end_pending']}"] if tracking.end_if_running(
            rec["mlflow_run_id"], rec["end_pending"]) else []
        _write(folder, {k: v for k, v in rec.items() if k != "end_pending"})
        return marked
    if not rec or rec.get("ended") or owner_alive(rec) is not False:
        return []
    why = (f"process {rec.get('pid')} on {rec.get('host')} died without ending the run (found by pid "
           f"{os.getpid()} in {seen_from})")
    marked = []
    if rec.get("mlflow_run_id") and tracking.end_if_running(rec["mlflow_run_id"], "KILLED"):
        marked.append(f"MLflow run {rec['mlflow_run_id']} KILLED")
    if rec.get("prefect_flow_run_id"):
        try:
            if _crash_flow_run(rec["prefect_flow_run_id"], why):
                marked.append(f"Prefect flow run {rec['prefect_flow_run_id']} Crashed")
        except Exception as e:  # noqa: BLE001 - another Prefect API than the one that ran it
            log.warning("could not mark Prefect flow run %s crashed: %s", rec["prefect_flow_run_id"], e)
    _write(folder, {**rec, "ended": "reaped", "reaped_by": _me(), "reaped_unix": time.time()})
    return marked


def reap(run_dir: Path) -> list[str]:
    """:func:`_settle` ``run_dir`` and its direct subfolders (a flow's subflows) -> what was marked."""
    marked = [m for path in [run_dir / RECORD, *sorted(run_dir.glob(f"*/{RECORD}"))]
              for m in _settle(path.parent, run_dir)]
    if marked:
        log.warning("%s: its previous process died; marked %s", run_dir, "; ".join(marked))
    return marked


@dataclass
class Claim:
    run_dir: Path
    previous: dict[str, Any] | None  # the record found at the start (reaped if its owner had died)


def claim(run_dir: Path) -> Claim:
    """Take ``run_dir`` for this process at a flow's start: a live owner elsewhere refuses, a dead
    one is reaped; this process and its Prefect flow run are recorded before any work starts."""
    run_dir = run_dir.resolve()
    prev = read(run_dir)
    me = _me()
    if prev and not prev.get("ended") and prev.get("pid") != me["pid"] and owner_alive(prev):
        raise RunInUse(f"{run_dir} is being written by process {prev['pid']} on {prev['host']} (MLflow run "
                       f"{prev.get('mlflow_run_id')}); stop it first (`miles stop` for async runs, or kill it), "
                       "or choose another --run-dir")
    reap(run_dir)
    prev = read(run_dir)
    # the folder's MLflow run carries over (a start refused before its run began must not lose it);
    # a copy's record names another folder, whose run is not this folder's
    mine = (prev or {}).get("mlflow_run_id") if (prev or {}).get("run_dir") == str(run_dir) else None
    _write(run_dir, {**me, "run_dir": str(run_dir), "prefect_flow_run_id": _prefect_flow_run_id(),
                     "mlflow_run_id": mine, "started_unix": time.time(), "ended": None})
    return Claim(run_dir, prev)


def run_name(kind: str, recipe: str, run_dir: Path) -> str:
    """An MLflow run name a user can tell apart in the runs table: the flow, the recipe and the
    folder (``train-arith runs/demo-20261204-1310/train``), relative to the working folder when inside it."""
    try:
        where = run_dir.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        where = Path(*run_dir.resolve().parts[-2:])
    return f"{kind}-{recipe} {where}"


@contextlib.contextmanager
def tracked(c: Claim, experiment: str, name: str, params: Mapping[str, Any] | None = None,
            tags: Mapping[str, Any] | None = None, resume: bool = False) -> Iterator[str]:
    """``tracking.run`` for a claimed folder: a resume of the same folder continues its MLflow run
    (one curve); the record names the run and is marked ended however the block exits."""
    prev = c.previous or {}
    same_folder = prev.get("run_dir") == str(c.run_dir)
    reopen = prev.get("mlflow_run_id") if resume and same_folder and prev.get("mlflow_run_id") else None
    if reopen and not tracking.run_exists(reopen):
        log.warning("MLflow run %s of %s is not in this tracking store; starting a new run", reopen, c.run_dir)
        reopen = None
    extra = {"miles.copied_from_run": prev["mlflow_run_id"]} if resume and prev.get("mlflow_run_id") and not same_folder else {}
    record = {**(read(c.run_dir) or {})}
    pending: dict[str, str] = {}
    try:
        with tracking.run(experiment, name, params, {**(tags or {}), **extra}, resume_run_id=reopen,
                          unended=lambda run_id, status: pending.update(end_pending=status)) as run_id:
            record["mlflow_run_id"] = run_id
            _write(c.run_dir, record)
            yield run_id
    finally:
        _write(c.run_dir, {**record, "ended": "exited", "ended_unix": time.time(), **pending})
        if pending:
            log.error("%s: its MLflow run stays RUNNING until the tracking server answers again; the next start "
                      "in this folder or `miles runs gc` marks it %s", c.run_dir, pending["end_pending"])


def collect(root: Path) -> list[str]:
    """:func:`_settle` every run folder under ``root``, once each (``miles runs gc``) -> what was marked."""
    return [f"{folder}: {m}" for folder in sorted({p.parent for p in root.rglob(RECORD)})
            for m in _settle(folder, root)]
