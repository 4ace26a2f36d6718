"""Shared test fixtures: one Prefect test server per session, throw-away projects with their own
MLflow store, and (lazily, for the tests that ask) one trained tiny project.

The environment is set at import time, before any test module imports Prefect, because Prefect
reads its settings once: a private PREFECT_HOME (never the developer's profile or server), no
analytics, and a generous start-up timeout for the temporary server on a loaded 2-core machine.
MLflow defaults to a session-private SQLite file, so a test that forgets ``tmp_project`` still
never writes into the checkout.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

_SESSION_DIR = Path(tempfile.mkdtemp(prefix="miles-tests-"))
atexit.register(shutil.rmtree, _SESSION_DIR, ignore_errors=True)
os.environ["PREFECT_HOME"] = str(_SESSION_DIR / "prefect")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.pop("PREFECT_API_URL", None)
SESSION_MLFLOW_URI = f"sqlite:///{_SESSION_DIR / 'mlruns' / 'mlflow.db'}"
os.environ["MLFLOW_TRACKING_URI"] = SESSION_MLFLOW_URI
os.environ.pop("MLFLOW_REGISTRY_URI", None)

# The `tiny` recipe, trained just enough that rollouts get some reward (so ADPO updates move the
# adapter) while the whole SFT -> train -> eval chain stays within seconds.
TINY_OVERRIDES = ["sft.steps=150", "sft.eval_every=50", "train.reward=math_exact:1.0,format:0.5"]
MODEL_NAME = "miles-test-arith"
EXPERIMENT = "miles-test"
S3_BUCKET = "miles-flows"


@pytest.fixture(scope="session")
def prefect_harness() -> Iterator[None]:
    """One temporary Prefect server (fresh database) for the whole session; request it explicitly."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


def _point_mlflow(uri: str) -> None:
    import mlflow

    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)


@pytest.fixture
def tmp_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A temp working directory with ``MLFLOW_TRACKING_URI`` on a SQLite file inside it."""
    uri = f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    _point_mlflow(uri)
    yield tmp_path
    _point_mlflow(SESSION_MLFLOW_URI)


@dataclass
class TrainedProject:
    """What the session's SFT -> train chain produced (flow summaries and where things live)."""

    root: Path
    tracking_uri: str
    store_uri: str
    model_name: str
    sft: dict[str, Any]
    train: dict[str, Any]
    env: dict[str, str]

    def activate(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Point this test's environment (MLflow, S3 endpoint, cwd) at the project."""
        for k, v in self.env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.chdir(self.root)
        _point_mlflow(self.tracking_uri)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 server on 127.0.0.1 for the session, with bucket ``S3_BUCKET``; yields its URL."""
    from moto.server import ThreadedMotoServer

    import boto3

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        url = f"http://{host}:{port}"
        boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket=S3_BUCKET)
        yield url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def trained_project(prefect_harness: None, s3_endpoint: str,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[TrainedProject]:
    """SFT then 2 ADPO iterations of the tiny recipe, trajectories and adapters on (moto) S3, the
    final adapter registered as ``MODEL_NAME``. Runs once per session, for the tests that ask."""
    root = tmp_path_factory.mktemp("trained")
    uri = f"sqlite:///{root / 'mlruns' / 'mlflow.db'}"
    env = {"MLFLOW_TRACKING_URI": uri, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "MILES_S3_ENDPOINT_URL": s3_endpoint}
    store = f"s3://{S3_BUCKET}/trained"
    project = TrainedProject(root, uri, store, MODEL_NAME, {}, {}, env)
    with pytest.MonkeyPatch.context() as mp:  # the environment is only changed while the flows run
        project.activate(mp)
        from flows.sft import sft_flow
        from flows.train import train_flow

        project.sft = sft_flow(recipe="tiny", overrides=TINY_OVERRIDES, run_dir=str(root / "sft"),
                               experiment=EXPERIMENT)
        project.train = train_flow(recipe="tiny", overrides=TINY_OVERRIDES, run_dir=str(root / "train"),
                                   store_uri=store, base_checkpoint=project.sft["base_checkpoint"], iterations=2,
                                   experiment=EXPERIMENT, register_as=MODEL_NAME)
    _point_mlflow(SESSION_MLFLOW_URI)
    yield project


@pytest.fixture
def trained(trained_project: TrainedProject, monkeypatch: pytest.MonkeyPatch) -> Iterator[TrainedProject]:
    """``trained_project`` with this test's environment pointed at it (undone after the test)."""
    trained_project.activate(monkeypatch)
    yield trained_project
    _point_mlflow(SESSION_MLFLOW_URI)


def train_tiny_base(tmp_path_factory: pytest.TempPathFactory, overrides: list[str], name: str) -> Path:
    """A tiny SFT checkpoint of the ``tiny`` recipe with ``overrides``, in a fresh temp folder."""
    import torch

    from miles_core.config import load_recipe
    from miles_core.data.registry import build_task
    from miles_core.learner.baseline import train_baseline

    torch.set_num_threads(1)
    cfg = load_recipe("tiny", overrides)
    out = tmp_path_factory.mktemp(name) / "sft"
    train_baseline(cfg, build_task(cfg), out)
    return out
