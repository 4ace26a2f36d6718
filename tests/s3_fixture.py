"""A real S3 endpoint for tests: moto's threaded server on 127.0.0.1, one per test module.

Credentials are fake and passed through ``storage_options`` only, so nothing leaks into the
process environment. Import the fixtures into a test module: ``from s3_fixture import s3_server``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

BUCKET = "miles-test"


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
