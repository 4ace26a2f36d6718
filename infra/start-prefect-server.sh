#!/usr/bin/env bash
# Start a Prefect server (API + UI) for deployments, work pools and the run history.
#   infra/start-prefect-server.sh
# Env: MILES_BIND_HOST (127.0.0.1), PREFECT_PORT (4200), PREFECT_HOME (~/.prefect: Prefect's own
#      default, the database `miles demo`, the miles CLI and plain `prefect server start` use, so
#      this server shows their runs),
#      PREFECT_API_DATABASE_CONNECTION_URL (default: SQLite in PREFECT_HOME; use Postgres when
#      many workers write at once).
# Clients then use: export PREFECT_API_URL=http://<host>:<port>/api
set -euo pipefail
source "$(dirname "$0")/_common.sh"
need prefect
export PREFECT_HOME="${PREFECT_HOME:-$HOME/.prefect}"
export PREFECT_SERVER_ANALYTICS_ENABLED="${PREFECT_SERVER_ANALYTICS_ENABLED:-false}"
mkdir -p "$PREFECT_HOME"
port="${PREFECT_PORT:-4200}"
# The UI asks this URL for its API; left unset it assumes port 4200 ("Can't connect to Server API").
ui_host="$MILES_BIND_HOST"
[ "$ui_host" = "0.0.0.0" ] && ui_host="${MILES_PUBLIC_HOST:-127.0.0.1}"
export PREFECT_SERVER_UI_API_URL="${PREFECT_SERVER_UI_API_URL:-http://$ui_host:$port/api}"
echo "Prefect server on http://$MILES_BIND_HOST:$port (PREFECT_HOME=$PREFECT_HOME)" >&2
echo "  clients: export PREFECT_API_URL=http://$MILES_BIND_HOST:$port/api" >&2
exec prefect server start --host "$MILES_BIND_HOST" --port "$port"
