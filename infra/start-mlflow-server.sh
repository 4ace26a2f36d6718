#!/usr/bin/env bash
# Start an MLflow tracking server + model registry that serves artifacts itself, so runs on
# other machines only need MLFLOW_TRACKING_URI=http://<host>:<port>.
#   infra/start-mlflow-server.sh
# Env: MILES_BIND_HOST (127.0.0.1), MLFLOW_PORT (5000),
#      MLFLOW_BACKEND_STORE_URI (sqlite:///<repo>/mlruns/mlflow.db, the same file the embedded
#      defaults write, so local runs show up), MLFLOW_ARTIFACTS_DESTINATION (<repo>/mlruns/artifacts,
#      or s3://bucket/mlflow with MLFLOW_S3_ENDPOINT_URL for an S3-compatible store).
set -euo pipefail
source "$(dirname "$0")/_common.sh"
need mlflow
port="${MLFLOW_PORT:-5000}"
mkdir -p "$MILES_REPO_DIR/mlruns"
backend="${MLFLOW_BACKEND_STORE_URI:-sqlite:///$MILES_REPO_DIR/mlruns/mlflow.db}"
artifacts="${MLFLOW_ARTIFACTS_DESTINATION:-$MILES_REPO_DIR/mlruns/artifacts}"
extra=()
if [ "$MILES_BIND_HOST" != "127.0.0.1" ] && [ -n "${MLFLOW_ALLOWED_HOSTS:-}" ]; then
    extra+=(--allowed-hosts "$MLFLOW_ALLOWED_HOSTS")
fi
echo "MLflow server on http://$MILES_BIND_HOST:$port (store $backend, artifacts $artifacts)" >&2
echo "  clients: export MLFLOW_TRACKING_URI=http://$MILES_BIND_HOST:$port" >&2
exec mlflow server --host "$MILES_BIND_HOST" --port "$port" --workers "${MLFLOW_WORKERS:-1}" \
    --backend-store-uri "$backend" --artifacts-destination "$artifacts" --serve-artifacts "${extra[@]}"
