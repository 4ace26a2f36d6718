"""Shared helpers for benchmarks: result files, tables, paired sign test."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Sequence

RESULTS = Path(__file__).parent / "results"


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask (taskset, a cgroup's cpuset), not every CPU
    the machine has, so a benchmark confined to 4 of 16 cores sizes its threads for 4."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def write_result(name: str, payload: dict[str, Any], path: str | Path | None = None) -> Path:
    """``payload`` with run metadata, to ``benchmarks/results/NAME.json`` or ``path``."""
    path = Path(path) if path is not None else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {**payload, "_meta": {"benchmark": name, "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                    "python": platform.python_version(), "machine": platform.machine()}}
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path


def table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    cells = [[str(h) for h in header]] + [[f"{c:.4f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]])


def start_loopback_s3(bucket: str, port: int = 0):
    """moto's S3 server on 127.0.0.1 and the environment child processes need to reach it.

    Returns ``(server, env)``; call ``server.stop()`` when done. Credentials are moto's fakes."""
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    host, real_port = server.get_host_and_port()
    url = f"http://{host}:{real_port}"
    env = {"MILES_S3_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket=bucket)
    return server, env
