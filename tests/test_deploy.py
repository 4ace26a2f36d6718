"""prefect.yaml and infra/ against the real thing: a Prefect server, a process worker, a deployment.

Why a real server: prefect.yaml is only checked by Prefect when it is deployed, and the pull step,
work pool, parameter form and worker environment only meet when a worker runs a flow run. So the
end-to-end test starts ``infra/start-prefect-server.sh`` and ``infra/start-worker.sh`` as
subprocesses (PREFECT_HOME in a temp folder, SQLite), deploys ``miles-train`` with ``prefect
deploy``, creates a flow run through the REST endpoint the UI uses, and checks that the run
COMPLETED and that its MLflow run (tagged with the flow run id) exists in the SQLite store the
worker was given. It is required in CI and sized to a few minutes on two cores.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
TINY_OVERRIDES = ["sft.steps=10", "eval.num_problems=8", "train.prompts_per_iter=2", "train.group_size=2",
                  "train.eval_every=1", "sampler.steps=4", "eval.steps=4"]


# ----------------------------------------------------------------------------- static checks

def test_prefect_yaml_deployments_and_anchors() -> None:
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    deps = {d["name"]: d for d in spec["deployments"]}
    assert {"miles-train", "miles-sft", "miles-evaluate"} <= set(deps)
    for name in ("miles-train", "miles-sft", "miles-evaluate"):
        assert deps[name]["work_pool"]["name"] == "local-process", name
        path, func = deps[name]["entrypoint"].split(":")
        assert f"def {func}(" in (REPO / path).read_text(), f"{name}: {deps[name]['entrypoint']} not found"
    nightly = deps["miles-train"]["schedules"][0]
    assert nightly["active"] is False and len(nightly["cron"].split()) == 5
    step = spec["pull"][0]["prefect.deployments.steps.set_working_directory"]
    assert step["directory"] == "{{ $MILES_REPO_DIR }}"
    pools = spec["definitions"]["work_pools"]
    assert {p["name"] for p in pools.values()} == {"local-process", "gpu-k8s", "gpu-docker"}


@pytest.mark.parametrize("name", ["kubernetes-gpu.json", "docker-gpu.json"])
def test_gpu_base_job_templates_are_consistent(name: str) -> None:
    """Every {{ placeholder }} in job_configuration is a declared variable (else Prefect drops it)."""
    template = json.loads((REPO / "infra" / "work-pools" / name).read_text())
    declared = set(template["variables"]["properties"])
    used = set(PLACEHOLDER.findall(json.dumps(template["job_configuration"])))
    assert used - declared == set(), f"{name}: undeclared placeholders {sorted(used - declared)}"
    text = json.dumps(template["job_configuration"])
    assert ("nvidia.com/gpu" in text) if name.startswith("kubernetes") else ("device_requests" in text)


# ----------------------------------------------------------------------------- helpers

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def service_env(tmp: Path, port: int) -> dict[str, str]:
    """The environment a user would export: no inherited PREFECT_*/MLFLOW_* settings leak in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env.update({
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        "PREFECT_HOME": str(tmp / "prefect-home"), "PREFECT_PORT": str(port), "MILES_BIND_HOST": "127.0.0.1",
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlruns' / 'mlflow.db'}", "MILES_REPO_DIR": str(REPO),
        "PYTHONUNBUFFERED": "1",
    })
    return env


def start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """A service in its own process group, so cleanup reaches its children too."""
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    # a Prefect worker given SIGTERM waits out its own shutdown grace (~20 s) and nothing here needs
    # it to finish one: 5 s, then SIGKILL to the group
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def api(base: str, method: str, path: str, body: Any = None, ok404: bool = False) -> Any:
    """One REST call. A 502/503 (the server's SQLite busy under a loaded CI machine) is retried with
    backoff, as Prefect's own client does; the server rolls the failed request back."""
    data = json.dumps(body).encode() if body is not None else None
    for attempt in range(6):
        req = urllib.request.Request(f"{base}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            if ok404 and e.code == 404:
                return None
            if e.code in (502, 503) and attempt < 5:
                time.sleep(2 ** attempt)
                continue
            raise AssertionError(f"{method} {path} -> {e.code}: {e.read()[:500]!r}") from None


def wait_for(what: str, check: Any, timeout: float, logs: list[Path], every: float = 2.0,
             procs: Sequence[subprocess.Popen[bytes]] = ()) -> Any:
    """Poll ``check`` until truthy; fail early, with the logs, if a service process died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise AssertionError(f"{dead[0].args} exited with {dead[0].returncode} while waiting for {what}\n"
                                 + tails(logs))
        try:
            value = check()
        except (OSError, AssertionError):
            value = None
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n" + tails(logs))


def tails(logs: list[Path], n: int = 4000) -> str:
    return "\n".join(f"--- {p.name} ---\n{p.read_text(errors='replace')[-n:]}" for p in logs if p.exists())


@pytest.fixture()
def services(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Prefect server + process worker from infra/, torn down whatever happens."""
    port = free_port()
    env = service_env(tmp_path, port)
    base = env["PREFECT_API_URL"]
    logs = [tmp_path / "server.log", tmp_path / "worker.log"]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(start(["bash", "infra/start-prefect-server.sh"], env, logs[0]))
        wait_for("the Prefect server's /health", lambda: api(base, "GET", "/health") is True, 150, logs,
                 procs=procs)
        procs.append(start(["bash", "infra/start-worker.sh", "local-process"], env, logs[1]))
        wait_for("work pool local-process", lambda: api(base, "GET", "/work_pools/local-process", ok404=True), 120,
                 logs, procs=procs)
        yield {"env": env, "base": base, "logs": logs, "tmp": tmp_path, "procs": procs}
    finally:
        for proc in reversed(procs):
            stop(proc)


# ----------------------------------------------------------------------------- end to end

def test_deploy_and_run_miles_train_through_a_worker(services: dict[str, Any]) -> None:
    env, base, logs, tmp = services["env"], services["base"], services["logs"], services["tmp"]
    # the UI on this non-default port is told its own API, not http://127.0.0.1:4200/api
    with urllib.request.urlopen(f"{base.removesuffix('/api')}/ui-settings", timeout=30) as r:
        assert json.loads(r.read())["api_url"] == base
    names = ["miles-train", "miles-sft", "miles-evaluate", "miles-async-train", "miles-async-sampler",
             "miles-async-learner"]
    deploy = subprocess.run(["prefect", "--no-prompt", "deploy", *(a for n in names for a in ("--name", n))],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr[-3000:]
    deployed = api(base, "POST", "/deployments/filter", {"limit": 50})
    assert sorted(d["name"] for d in deployed) == sorted(names), deploy.stdout[-3000:]

    dep = api(base, "GET", "/deployments/name/miles-train/miles-train")
    assert dep["work_pool_name"] == "local-process"
    assert dep["pull_steps"][0]["prefect.deployments.steps.set_working_directory"]["directory"] == str(REPO)
    assert [s["active"] for s in dep["schedules"]] == [False]
    assert dep["parameters"]["recipe"] == "arith"  # the deployment default from prefect.yaml
    assert "iterations" in dep["parameter_openapi_schema"]["properties"]  # the UI form

    params = {"recipe": "tiny", "iterations": 1, "overrides": TINY_OVERRIDES, "run_dir": str(tmp / "run"),
              "experiment": "deploy-test", "register_as": None, "log_adapters": False}
    run = api(base, "POST", f"/deployments/{dep['id']}/create_flow_run", {"parameters": params})
    run_id = run["id"]

    def finished() -> dict[str, Any] | None:
        fr = api(base, "GET", f"/flow_runs/{run_id}")
        return fr if fr["state"] and fr["state"]["type"] in TERMINAL else None

    fr = wait_for(f"flow run {run_id}", finished, 360, logs, every=3.0, procs=services["procs"])
    assert fr["state"]["type"] == "COMPLETED", f"{fr['state']}\n" + tails(logs)

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    exp = client.get_experiment_by_name("deploy-test")
    assert exp is not None, "the worker's flow run did not write to MLFLOW_TRACKING_URI\n" + tails(logs)
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`prefect.flow_run_id` = '{run_id}'")
    assert len(runs) == 1, [r.info.run_name for r in runs]
    assert runs[0].info.status == "FINISHED"
    assert runs[0].data.params["train.iterations"] == "1"
    assert runs[0].data.tags["miles.kind"] == "train"

    # asynchronous training through deployments: the coordinator's flow run starts the learner and
    # a sampler as flow runs of their own deployments, which the same worker picks up
    dep = api(base, "GET", "/deployments/name/miles-async-train/miles-async-train")
    assert dep["parameters"]["launcher"] == "deployments"
    params = {"recipe": "tiny", "overrides": TINY_OVERRIDES + ["async_rl.poll_interval=0.05"],
              "run_dir": str(tmp / "async"), "base_checkpoint": str(tmp / "run" / "sft" / "base"),
              "num_samplers": 1, "batches_per_sampler": 2, "experiment": "deploy-test", "register_as": None,
              "timeout_s": 420}
    run_id = api(base, "POST", f"/deployments/{dep['id']}/create_flow_run", {"parameters": params})["id"]
    fr = wait_for(f"flow run {run_id}", finished, 480, logs, every=3.0, procs=services["procs"])
    assert fr["state"]["type"] == "COMPLETED", f"{fr['state']}\n" + tails(logs)
    workers = api(base, "POST", "/flow_runs/filter", {"limit": 20})
    by_flow = {api(base, "GET", f"/flows/{r['flow_id']}")["name"]: r["state"]["type"] for r in workers}
    assert by_flow.get("miles-async-learner") == by_flow.get("miles-async-sampler") == "COMPLETED", by_flow
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`prefect.flow_run_id` = '{run_id}'")
    assert len(runs) == 1 and runs[0].data.tags["miles.launcher"] == "deployments"
    assert runs[0].data.metrics["async/updates"] + runs[0].data.metrics["async/dropped_batches"] == 2


# ----------------------------------------------------------------------------- S3 endpoint script

def test_start_s3_script_serves_a_bucket(tmp_path: Path) -> None:
    """The default server (SeaweedFS): a real round trip with the printed credentials, a refusal
    without them, data under MILES_S3_DIR, and no weed process left once the script is stopped."""
    boto3 = pytest.importorskip("boto3")
    botocore_exceptions = pytest.importorskip("botocore.exceptions")
    port = free_port()
    data = tmp_path / "s3data"
    env = {**service_env(tmp_path, free_port()), "MILES_S3_PORT": str(port), "MILES_S3_BUCKET": "miles-ci",
           "MILES_S3_DIR": str(data)}
    log = tmp_path / "s3.log"
    proc = start(["bash", "infra/start-s3.sh"], env, log)
    try:
        wait_for("the bucket banner", lambda: "bucket 'miles-ci'" in log.read_text(), 90, [log, data / "weed.log"],
                 every=0.5, procs=[proc])
        assert "AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing" in log.read_text()
        url = f"http://127.0.0.1:{port}"
        s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
        s3.put_object(Bucket="miles-ci", Key="probe.txt", Body=b"ok")
        assert s3.get_object(Bucket="miles-ci", Key="probe.txt")["Body"].read() == b"ok"
        stranger = boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                                aws_access_key_id="testing", aws_secret_access_key="wrong")
        with pytest.raises(botocore_exceptions.ClientError):
            stranger.get_object(Bucket="miles-ci", Key="probe.txt")
        assert (data / "data").is_dir()
    finally:
        stop(proc)
    assert proc.returncode is not None
    left = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(data) in cmdline.read_bytes().decode(errors="replace"):
                left.append(cmdline)
        except OSError:  # the process ended while we looked
            continue
    assert not left, f"weed still running: {left}"


def test_prefect_script_uses_the_cli_home_and_tells_the_ui_its_port(tmp_path: Path) -> None:
    """With PREFECT_HOME unset the script uses Prefect's own default (~/.prefect), the database
    `miles demo` and the CLI write, and the UI's API URL follows PREFECT_PORT (a stand-in
    `prefect` on PATH prints what the real one would be started with)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "prefect").write_text('#!/bin/sh\necho "HOME=$PREFECT_HOME UI=$PREFECT_SERVER_UI_API_URL ARGS=$*"\n')
    (fake / "prefect").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update({"HOME": str(tmp_path), "PATH": f"{fake}{os.pathsep}{env['PATH']}", "PREFECT_PORT": "4321",
                "MILES_REPO_DIR": str(tmp_path)})
    r = subprocess.run(["bash", str(REPO / "infra" / "start-prefect-server.sh")], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [f"HOME={tmp_path}/.prefect", "UI=http://127.0.0.1:4321/api", "ARGS=server", "start",
                                "--host", "127.0.0.1", "--port", "4321"]


def test_real_prefect_server_tells_its_ui_the_chosen_port(tmp_path: Path) -> None:
    """The real server started by the script on a non-default port: the UI's settings endpoint (what
    the browser asks before any API call) names that port, so the UI does not look for 4200."""
    port = free_port()
    env = service_env(tmp_path, port)
    proc = start(["bash", str(REPO / "infra" / "start-prefect-server.sh")], env, tmp_path / "prefect.log")
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ui-settings", timeout=10) as r:
                    settings = json.loads(r.read())
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "prefect.log").read_text()[-3000:]
                time.sleep(1)
        assert settings["api_url"] == f"http://127.0.0.1:{port}/api"
        assert api(f"http://127.0.0.1:{port}/api", "GET", "/health") is True
    finally:
        stop(proc)
