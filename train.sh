#!/usr/bin/env bash
# Environment-driven launcher around `torchrun ... distributed_train.py`.
#
#   ./train.sh                                  # CONFIG=default, one process per GPU (else 1)
#   USE_AMP=true NPROC=2 CONFIG=tiny ./train.sh # two processes, bf16 autocast
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 ./train.sh   # on each node, NODE_RANK 0 and 1
#   ./train.sh --lr=3e-5 --max_steps=500        # extra arguments go to distributed_train.py
#
# Feature switches (USE_AMP, MAX_STEPS, ...: `./train.sh --help` lists them all) are read by
# the config loader itself, in every rank; see README's table.
set -euo pipefail
# the repository, for the script and its interpreter; paths the user gives (CONFIG, out_dir,
# data_path) stay relative to where they ran this, as with distributed_train.py itself
HERE="$(cd "$(dirname "$0")" && pwd)"

default_nproc() {
    local n=0
    command -v nvidia-smi >/dev/null 2>&1 && n=$(nvidia-smi -L 2>/dev/null | grep -c GPU || true)
    [ "${n:-0}" -gt 0 ] && echo "$n" || echo 1
}

CONFIG=${CONFIG:-default}
NPROC=${NPROC:-$(default_nproc)}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
MAX_RESTARTS=${MAX_RESTARTS:-0}
PYTHON=${PYTHON:-$HERE/.venv/bin/python}
[ -x "$PYTHON" ] || command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3

if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
    echo "usage: [VAR=value ...] ./train.sh [--key=value ...]"
    echo
    echo "launcher variables (value now; unset ones show their default):"
    row() { printf '  %-24s %s\n' "$1=$2" "$3"; }
    row CONFIG "$CONFIG" "config name in configs/, or a path"
    row NPROC "$NPROC" "processes per node (default: visible GPUs, else 1)"
    row NNODES "$NNODES" "nodes; more than 1 uses c10d rendezvous at MASTER_ADDR:MASTER_PORT"
    row NODE_RANK "$NODE_RANK" "this node's rank (multi-node)"
    row MASTER_ADDR "$MASTER_ADDR" "rendezvous host (multi-node)"
    row MASTER_PORT "$MASTER_PORT" "rendezvous port (multi-node; one node picks a free port)"
    row MAX_RESTARTS "$MAX_RESTARTS" "restarts after a failure, each resuming from the last checkpoint"
    row PYTHON "$PYTHON" "interpreter"
    echo
    echo "feature switches, read by the config in every rank (unset: the config's value):"
    # the config's own list (the fields that declare a variable), never a copy of it
    for v in $(cd "$HERE" && "$PYTHON" -c "from mini_grpo.config import ENV_VARS; print(*ENV_VARS)"); do
        row "$v" "${!v:-}" ""
    done
    exit 0
fi

if [ "$NNODES" -gt 1 ]; then
    rdzv=(--nnodes="$NNODES" --node_rank="$NODE_RANK" --rdzv_backend=c10d
          --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv_id="${RDZV_ID:-mini-grpo}")
else
    rdzv=(--standalone)  # picks a free port: never collides with another job on 29500
fi
# the config first, in one process: a bad key or value is one line and exit 2 here, not one
# traceback per rank from torchrun (and MAX_RESTARTS tries of it)
"$PYTHON" "$HERE/distributed_train.py" --config "$CONFIG" "$@" --print-config >/dev/null
exec "$PYTHON" -m torch.distributed.run "${rdzv[@]}" --nproc_per_node="$NPROC" \
    --max_restarts="$MAX_RESTARTS" "$HERE/distributed_train.py" --config "$CONFIG" "$@"
