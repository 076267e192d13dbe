#!/usr/bin/env bash
# Environment-driven launcher: CONFIG=tiny USE_AMP=true ./train.sh [--key=value ...]
# Feature switches (USE_AMP, AMP_DTYPE, USE_TF32, ...) are read by the config loader itself;
# see README's environment table. Multi-process torchrun launching arrives with the DDP trainer.
set -euo pipefail
cd "$(dirname "$0")"
if [ "${1:-}" = "--help" ]; then
    sed -n '2,4p' "$0" | sed 's/^# //'
    echo "CONFIG=${CONFIG:-default}"
    exit 0
fi
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
exec "$PY" distributed_train.py --config "${CONFIG:-default}" "$@"
