"""moto's S3 server on 127.0.0.1, for runs whose store should be a real S3 endpoint without a
network: the reliability tests (an outage: stop it, start it again on the same port) and the
benchmarks that put an asynchronous run's store on S3 (chaos, components, async_vs_sync --s3)."""

from __future__ import annotations


def start_loopback_s3(bucket: str, port: int = 0):
    """moto's S3 server on 127.0.0.1 with ``bucket`` created, and the environment child processes
    need to reach it. Returns ``(server, env)``; call ``server.stop()`` when done. Credentials are
    moto's fakes."""
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
