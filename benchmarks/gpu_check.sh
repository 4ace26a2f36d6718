#!/usr/bin/env bash
# The prepared check for a lent GPU: python -m benchmarks.gpu_check, one JSON.
# Random-init models at LLaDA-8B's and SDAR-4B's shapes in bf16, built on the device (nothing is
# downloaded): rollout tokens/s at batch 1 and 64, the LLaDA-style reference against Miles
# (NSD + KV cache), and one ADPO update (64 x 256 tokens, LoRA r=64): seconds and peak memory.
#
#   benchmarks/gpu_check.sh              # GPU: under 8 minutes on an H200
#   benchmarks/gpu_check.sh --cpu        # the same code path at toy sizes (about a minute)
#   benchmarks/gpu_check.sh --batch 32   # other options: see python -m benchmarks.gpu_check --help
#   benchmarks/gpu_check.sh --async-8b   # second command: async vs sync ADPO at the LLaDA-8B shape on the one
#                                        # GPU (writes gpu_check_async.json beside the first JSON)
#
# Writes benchmarks/results/gpu_check.json, or $OUT/gpu_check.json when $OUT is set (the device
# tool's folder that comes back). Record its figures, with this command, in the README.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python; fi
fi
if [ -n "${OUT:-}" ]; then
  exec "$PY" -u -m benchmarks.gpu_check --out "$OUT/gpu_check.json" "$@"
fi
exec "$PY" -u -m benchmarks.gpu_check "$@"
