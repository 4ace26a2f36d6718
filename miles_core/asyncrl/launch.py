"""Prepare an asynchronous run and, on one machine, run its processes.

``prepare_run`` (miles_core/storage/run.py) writes the spec and uploads the base once; from then on any process anywhere
that can reach the store URI can join as a sampler or the learner
(``python -m miles_core.asyncrl sampler|learner RUN_URI``). At scale the Prefect flow
``flows/async_train.py`` starts them as deployments on work pools; ``run_local`` starts them as
local subprocesses, which is what the benchmarks and the CLI use on a single machine.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from miles_core.storage.run import RunStore, prepare_run  # noqa: F401  (prepare_run: the entry point of a run)


def worker_names(n: int) -> list[str]:
    return [f"w{i}" for i in range(n)]


def command(role: str, run_uri: str, worker: str | None = None, index: int = 0,
            cache_dir: str | os.PathLike[str] | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "miles_core.asyncrl", role, run_uri]
    if role == "sampler":
        cmd += ["--worker", str(worker), "--index", str(index)]
    if cache_dir is not None:
        cmd += ["--cache-dir", str(cache_dir)]
    return cmd


def learner_command(run_uri: str, ranks: int, cache_dir: str | os.PathLike[str] | None = None,
                    max_restarts: int = 3) -> list[str]:
    """The learner as ``ranks`` data-parallel processes of this machine under torchrun (one
    process when ``ranks`` is 1). torchrun restarts the whole group when a rank dies, and the group
    resumes from the last checkpoint; ``--standalone`` picks a free rendezvous port, so two runs
    on one machine do not meet."""
    if ranks == 1:
        return command("learner", run_uri, cache_dir=cache_dir)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc-per-node", str(ranks), "--max-restarts", str(max_restarts), "-m", "miles_core.asyncrl",
           "learner", run_uri]
    return cmd + (["--cache-dir", str(cache_dir)] if cache_dir is not None else [])


class Proc(Protocol):
    """What LocalRun needs of a worker process (``subprocess.Popen`` has it; so does WarmProcess)."""

    pid: int

    def poll(self) -> int | None: ...
    def kill(self) -> None: ...
    def wait(self, timeout: float | None = None) -> int | None: ...


def _warm_child(argv: list[str], log_path: str, env: dict[str, str]) -> None:
    """Entry of a forked worker: its own environment and log file, then the usual ``main``."""
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    from miles_core.asyncrl.__main__ import main

    code = main(argv)
    sys.stdout.flush()
    sys.exit(code)


class WarmProcess:
    """A worker forked from a server process that imported torch, peft and Miles once.

    Each fresh interpreter spends ~10 CPU-seconds importing torch + peft (transformers comes with
    peft); four workers starting together on a 2-core machine lose ~20 s of wall clock to it. A
    ``forkserver`` with those modules preloaded pays that once; each worker is then a fork (no torch
    thread pool exists in the server yet, so forking is safe). The worker is still a separate OS
    process with its own pid: it can be SIGKILLed and restarted like a subprocess.
    """

    _ctx: Any = None

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str]):
        if WarmProcess._ctx is None:
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(["miles_core.asyncrl.warm"])  # torch, peft, Miles, pyarrow's lazy pandas
            WarmProcess._ctx = ctx
        self._p = WarmProcess._ctx.Process(target=_warm_child, args=(argv, str(log_path), env), daemon=False)
        self._p.start()
        self.pid = int(self._p.pid)

    def poll(self) -> int | None:
        return self._p.exitcode

    def kill(self) -> None:
        self._p.kill()

    def wait(self, timeout: float | None = None) -> int | None:
        self._p.join(timeout)
        return self._p.exitcode


@dataclass
class LocalRun:
    """Worker processes of one run on this machine: ``procs[name]`` (``learner``, ``w0``, ``w1`` ...).

    ``warm=True`` forks them from a preloaded server (:class:`WarmProcess`) instead of starting a
    fresh interpreter each time; same command line, same logs, same crash/restart behaviour.

    Each worker downloads the base and adapters into ``cache_root/<name>``, a folder this object
    owns: a restarted worker finds its base already there, and a SIGKILLed one (which cannot
    clean up after itself) leaves nothing behind once :meth:`close` removes the folder.
    """

    run_uri: str
    num_samplers: int
    env: dict[str, str]
    log_dir: Path
    warm: bool = False
    learner_ranks: int = 1
    procs: dict[str, Proc] = field(default_factory=dict)
    starts: dict[str, int] = field(default_factory=dict)
    cache_root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="miles-local-")))

    def start(self, name: str) -> Proc:
        cache = self.cache_root / name
        if name == "learner":
            cmd = learner_command(self.run_uri, self.learner_ranks, cache)
        else:
            cmd = command("sampler", self.run_uri, name, int(name[1:]), cache_dir=cache)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{name}.log"
        if self.warm and cmd[2] == "miles_core.asyncrl":
            self.procs[name] = WarmProcess(cmd[3:], log, self.env)  # argv after "python -m miles_core.asyncrl"
        else:  # its own process group: stop() takes torchrun's ranks down with their agent
            out = open(log, "ab")
            self.procs[name] = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                                start_new_session=True)
            out.close()
        self.starts[name] = self.starts.get(name, 0) + 1
        return self.procs[name]

    def start_all(self) -> None:
        self.start("learner")
        for w in worker_names(self.num_samplers):
            self.start(w)

    def failed(self) -> dict[str, int]:
        return {n: p.poll() for n, p in self.procs.items() if p.poll() not in (None, 0)}

    def wait(self, timeout: float, max_restarts: int = 0) -> dict[str, int]:
        """Wait until every process exited 0, restarting a crashed one up to ``max_restarts`` times
        (it resumes from the store); then fail with the tail of its log."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, code in self.failed().items():
                if self.starts[name] > max_restarts:
                    self.stop()
                    raise RuntimeError(f"{name} exited with {code}; see {self.log_dir / (name + '.log')}:\n"
                                       + self.tail(name))
                self.start(name)
            if all(p.poll() == 0 for p in self.procs.values()):
                return {n: 0 for n in self.procs}
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"asynchronous run {self.run_uri} did not finish within {timeout:.0f}s")

    def tail(self, name: str, n: int = 3000) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-n:] if path.exists() else ""

    def stop(self) -> None:
        for p in self.procs.values():
            if isinstance(p, subprocess.Popen):
                try:
                    os.killpg(p.pid, signal.SIGKILL)  # the group: torchrun's ranks too, even if the agent exited
                except ProcessLookupError:
                    pass
            if p.poll() is None:
                p.kill()
            p.wait()

    def close(self) -> None:
        """Stop every worker and remove the workers' download cache."""
        self.stop()
        shutil.rmtree(self.cache_root, ignore_errors=True)


def local_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Child environment: the repo importable, one OpenMP thread unless told otherwise."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


def run_local(run_uri: str, num_samplers: int, log_dir: str | os.PathLike[str], timeout: float = 3600.0,
              env: dict[str, str] | None = None, max_restarts: int = 3, warm: bool = False) -> dict[str, Any]:
    """Run the learner and ``num_samplers`` samplers as local processes until the sample budget is
    spent; a process that crashes is started again (up to ``max_restarts`` times) and resumes.
    ``warm``: fork them from one preloaded server instead of fresh interpreters (LocalRun)."""
    ranks = int(RunStore(run_uri).read_spec()["cfg"]["async_rl"].get("learner_ranks", 1))
    run = LocalRun(run_uri, num_samplers, local_env(env), Path(log_dir), warm=warm, learner_ranks=ranks)
    run.start_all()
    try:
        run.wait(timeout, max_restarts)
    finally:
        run.close()
    return summarize(run_uri)


def summarize(run_uri: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Learner status + sampler sync stats + store counts: the figures a run is judged by."""
    rs = RunStore(run_uri, storage_options)
    status = rs.read_json("learner", "status.json") or {}
    samplers = [rs.read_json("samplers", f"{w}.json") or {} for w in worker_names(
        load_num_samplers(rs))]
    committed = rs.retry(rs.trajectories.list_batches, "listing trajectories")
    quarantined = rs.retry(rs.trajectories.list_quarantined, "listing quarantine")
    lags = [x for s in samplers for x in s.get("sync_lag_seconds", [])]
    syncs = sum(s.get("syncs", 0) for s in samplers)
    ranks = [rs.read_json("learner", f"rank{r}.json") or {} for r in range(1, int(status.get("learner_ranks", 1)))]
    # S3 requests of every process, counted on the wire (storage/requests.py; 0 on a local folder)
    requests = sum(sum(x.get("requests", {}).values()) for x in [status, *samplers, *ranks])
    n = len(committed) + len(quarantined)
    return {**status, "batches_committed": n, "store_requests": requests,
            "store_requests_per_batch": requests / max(n, 1),
            "adapter_sync_bytes": sum(s.get("sync_bytes", 0) for s in samplers), "adapter_syncs": syncs,
            "adapter_sync_bytes_mean": sum(s.get("sync_bytes", 0) for s in samplers) / max(syncs, 1),
            "adapter_sync_seconds_mean": sum(s.get("sync_seconds", 0.0) for s in samplers) / max(syncs, 1),
            "adapter_sync_lag_seconds_mean": sum(lags) / max(len(lags), 1),
            "sampler_restarts": sum(s.get("restarts", 0) for s in samplers),
            "refreshes": sum(s.get("refreshes", 0) for s in samplers)}  # adapters swapped in mid-rollout


def load_num_samplers(rs: RunStore) -> int:
    return int(rs.read_spec()["cfg"]["async_rl"]["num_samplers"])
