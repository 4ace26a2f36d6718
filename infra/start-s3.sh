#!/usr/bin/env bash
# Start an S3-compatible endpoint (moto's server) for trying the many-machines layout on one
# host: trajectory batches, adapters and MLflow artifacts go through s3:// exactly as in a
# cluster. It keeps everything in memory (gone when it stops): use MinIO or real S3 for data you
# want to keep.
#   infra/start-s3.sh
# Env: MILES_BIND_HOST (127.0.0.1), MILES_S3_PORT (9000), MILES_S3_BUCKET (miles).
set -euo pipefail
source "$(dirname "$0")/_common.sh"
need moto_server
need python
port="${MILES_S3_PORT:-9000}"
bucket="${MILES_S3_BUCKET:-miles}"
url="http://$MILES_BIND_HOST:$port"
moto_server -H "$MILES_BIND_HOST" -p "$port" &
server=$!
trap 'kill "$server" 2>/dev/null || true' INT TERM
python - "$url" "$bucket" <<'PY'
import sys, time, urllib.request
import boto3
url, bucket = sys.argv[1], sys.argv[2]
for _ in range(150):
    try:
        urllib.request.urlopen(url, timeout=1)
        break
    except OSError:
        time.sleep(0.2)
else:
    sys.exit(f"start-s3.sh: no S3 endpoint at {url} after 30 s")
s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                  aws_access_key_id="testing", aws_secret_access_key="testing")
s3.create_bucket(Bucket=bucket)
PY
cat >&2 <<MSG
S3 endpoint on $url with bucket '$bucket'. Use it with:
  export MILES_S3_ENDPOINT_URL=$url MLFLOW_S3_ENDPOINT_URL=$url
  export AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing AWS_DEFAULT_REGION=us-east-1
  miles train arith --store s3://$bucket/runs/arith
MSG
wait "$server"
