#!/usr/bin/env bash
# Start a Prefect worker that runs Miles flow runs from one work pool, creating the pool (with
# the matching base job template from infra/work-pools/) if it does not exist yet.
#   infra/start-worker.sh [POOL]        POOL: local-process (default) | gpu-k8s | gpu-docker
# Env: PREFECT_API_URL (http://127.0.0.1:4200/api), MLFLOW_TRACKING_URI, MILES_S3_ENDPOINT_URL and
#      AWS_* are passed on to the flow runs of a process worker. MILES_REPO_DIR (this checkout) is
#      where the process worker's flow runs import flows/ from (prefect.yaml's pull step).
# The gpu-k8s / gpu-docker workers need `pip install prefect-kubernetes` / `prefect-docker`.
set -euo pipefail
source "$(dirname "$0")/_common.sh"
need prefect
pool="${1:-local-process}"
case "$pool" in
    local-process) type=process; template="" ;;
    gpu-k8s)       type=kubernetes; template="$MILES_REPO_DIR/infra/work-pools/kubernetes-gpu.json" ;;
    gpu-docker)    type=docker; template="$MILES_REPO_DIR/infra/work-pools/docker-gpu.json" ;;
    *) echo "start-worker.sh: unknown pool '$pool' (local-process, gpu-k8s, gpu-docker)" >&2; exit 2 ;;
esac
export PREFECT_API_URL="${PREFECT_API_URL:-http://127.0.0.1:4200/api}"
if ! prefect work-pool inspect "$pool" >/dev/null 2>&1; then
    args=(work-pool create "$pool" --type "$type")
    [ -n "$template" ] && args+=(--base-job-template "$template")
    prefect "${args[@]}"
fi
cd "$MILES_REPO_DIR"
echo "worker for pool '$pool' ($type) against $PREFECT_API_URL" >&2
exec prefect worker start --pool "$pool" --type "$type" ${MILES_WORKER_ARGS:-}
