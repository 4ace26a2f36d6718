# Sourced by the infra/start-*.sh scripts: repo root, tools on PATH, and the bind address.
# Every server binds 127.0.0.1 unless MILES_BIND_HOST says otherwise (e.g. 0.0.0.0 on a
# private network); nothing is exposed by default.
MILES_REPO_DIR="${MILES_REPO_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
export MILES_REPO_DIR
if [ -x "$MILES_REPO_DIR/.venv/bin/python" ]; then
    PATH="$MILES_REPO_DIR/.venv/bin:$PATH"
fi
export PATH
MILES_BIND_HOST="${MILES_BIND_HOST:-127.0.0.1}"

need() {
    command -v "$1" >/dev/null 2>&1 || {
        echo "$(basename "$0"): '$1' not found; run 'make install' (or activate the venv) first" >&2
        exit 127
    }
}
