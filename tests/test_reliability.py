"""Storage outages: transient errors are retried with backoff, permanent ones are not, and a real
S3 endpoint (moto on 127.0.0.1) that goes down and comes back mid-run costs nothing committed."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from miles_core.storage.run import RunStore
from miles_core.storage.retry import StorageUnavailableError, call_with_retry, is_transient


def test_retry_policy() -> None:
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("connection reset by peer")
        return "ok"
    slept: list[float] = []
    assert call_with_retry(flaky, "writing x", budget_s=10, sleep=slept.append) == "ok"
    assert len(calls) == 3 and len(slept) == 2 and slept[1] > slept[0] * 0.9  # backoff grows
    with pytest.raises(FileNotFoundError):  # permanent: raised at once, never retried
        call_with_retry(lambda: (_ for _ in ()).throw(FileNotFoundError("gone")), "reading y", sleep=slept.append)
    assert not is_transient(ValueError("bug")) and is_transient(TimeoutError()) and not is_transient(FileExistsError())

    def down() -> None:
        raise ConnectionRefusedError("connection refused")
    with pytest.raises(StorageUnavailableError, match=r"retry budget 0s.*while committing batch 7 to s3://b/run"):
        call_with_retry(down, "committing batch 7 to s3://b/run", budget_s=0.2, base_delay=0.05)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_s3_outage_on_loopback_recovers_within_the_retry_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    from tools.loopback_s3 import start_loopback_s3

    port = _free_port()
    server, env = start_loopback_s3("miles-outage", port)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    opts = {"skip_instance_cache": True, "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1,
                                                           "read_timeout": 2}}
    try:
        rs = RunStore("s3://miles-outage/run", opts, retry_budget_s=30)
        rs.write_json({"n": 1}, "state.json")
        rs.write_json({"committed": True}, "before-outage.json")
        server.stop()  # the endpoint goes away: nothing listens on the port any more
        with pytest.raises(StorageUnavailableError, match="writing state.json"):
            RunStore("s3://miles-outage/run", opts, retry_budget_s=0.5).write_json({"n": 2}, "state.json")

        def come_back() -> None:
            time.sleep(2.0)
            nonlocal server
            server, _ = start_loopback_s3("miles-outage", port)
        t = threading.Thread(target=come_back)
        t.start()
        t0 = time.monotonic()
        rs.write_json({"n": 3}, "state.json")  # retried until the server is back
        t.join()
        assert time.monotonic() - t0 >= 1.5
        assert rs.read_json("state.json") == {"n": 3}
        assert rs.read_json("before-outage.json") == {"committed": True}  # nothing committed was lost
    finally:
        server.stop()
