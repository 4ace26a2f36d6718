"""Real S3 endpoints for tests, one per test module, on 127.0.0.1.

``s3_server``: moto's threaded server (in process, starts in well under a second, in memory).
``seaweed_server``: SeaweedFS, a real object store in its own process group with data on disk;
it answers a lost ``If-None-Match: *`` race with a 412 the way S3 does. It is started by
``infra/s3server.py``, the same launcher ``infra/start-s3.sh`` and the benchmarks use.

Credentials are fake and passed through ``storage_options`` only, so nothing leaks into the
process environment. Import the fixtures into a test module: ``from s3_fixture import s3_server``.
"""

from __future__ import annotations

import importlib.util
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BUCKET = "miles-test"
LAUNCHER = Path(__file__).resolve().parent.parent / "infra" / "s3server.py"


@dataclass
class S3Endpoint:
    endpoint_url: str
    bucket: str = BUCKET
    storage_options: dict[str, Any] = field(default_factory=dict)

    def fresh_root(self) -> str:
        """A unique ``s3://`` prefix so tests sharing the server never see each other's objects."""
        return f"s3://{self.bucket}/{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Endpoint]:
    moto_server = pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    boto3 = pytest.importorskip("boto3")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        url = f"http://{host}:{port}"
        options = {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": url, "region_name": "us-east-1"},
            "skip_instance_cache": True,
        }
        client = boto3.client(
            "s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id="testing", aws_secret_access_key="testing"
        )
        client.create_bucket(Bucket=BUCKET)
        yield S3Endpoint(endpoint_url=url, storage_options=options)
    finally:
        server.stop()


def s3server() -> ModuleType:
    """``infra/s3server.py`` as a module (infra/ is not a package, so it is loaded by path)."""
    name = "miles_infra_s3server"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, LAUNCHER)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the class is created
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="module")
def seaweed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Endpoint]:
    pytest.importorskip("s3fs")
    launcher = s3server()
    try:
        launcher.weed_binary()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    server = launcher.start(tmp_path_factory.mktemp("seaweed"), bucket=BUCKET)
    try:
        yield S3Endpoint(endpoint_url=server.endpoint_url,
                         storage_options={**server.storage_options(), "skip_instance_cache": True})
    finally:
        server.stop(grace=1.0)
