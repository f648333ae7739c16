#!/usr/bin/env bash
# Train on one machine: one worker per GPU, or 2 CPU workers when there is no GPU.
#
#   launch/single_node.sh [SCRIPT [ARGS...]]
#   launch/single_node.sh examples/train_ddp.py --steps 50
#   NPROC=4 LOG_DIR=runs/logs launch/single_node.sh examples/train_ddp.py
#
# NPROC     workers on this machine: a number, or gpu / cpu / auto as in torchrun
#           (default: gpu if nvidia-smi sees one, else 2)
# LOG_DIR   if set, each rank's output is also written to LOG_DIR/<run>/attempt_<k>/rank_<r>.log
#           (a directory per run, printed when it starts)
# RESTARTS  restart the whole group up to this many times after a failure (default 0)
# PYTHON    the interpreter to run (default python3)
#
# No --master-port is needed: the launcher holds its own free loopback port, so two jobs on one
# machine never collide. The first failing worker stops the job; its traceback is in the summary.
set -euo pipefail

if [[ -z "${NPROC:-}" ]]; then
    if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then NPROC=gpu; else NPROC=2; fi
fi
case "$NPROC" in
    gpu | cpu | auto) ;;
    "" | *[!0-9]* | 0)
        echo "launch/single_node.sh: NPROC=$NPROC must be a number of workers (1 or more), or gpu, cpu or auto" >&2
        exit 2 ;;
esac
case "${RESTARTS:-0}" in
    "" | *[!0-9]*) echo "launch/single_node.sh: RESTARTS=$RESTARTS must be a whole number (0 or more)" >&2; exit 2 ;;
esac
# the example beside this script by default, from whatever directory it is started in
SCRIPT=${1:-"$(dirname "$0")/../examples/train_ddp.py"}
shift || true

exec "${PYTHON:-python3}" -m ddpkit run \
    --nproc-per-node "$NPROC" \
    --max-restarts "${RESTARTS:-0}" \
    ${LOG_DIR:+--log-dir "$LOG_DIR"} \
    "$SCRIPT" "$@"
