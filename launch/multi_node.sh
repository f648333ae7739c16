#!/usr/bin/env bash
# Train on several machines: run this once on every node, with the same NNODES, MASTER_ADDR and
# MASTER_PORT everywhere and a different NODE_RANK on each.
#
# GPU nodes (one worker per GPU, the default):
#   JOB_ID=run7 NNODES=2 NODE_RANK=0 MASTER_ADDR=node0.cluster launch/multi_node.sh examples/train_ddp.py
#   JOB_ID=run7 NNODES=2 NODE_RANK=1 MASTER_ADDR=node0.cluster launch/multi_node.sh examples/train_ddp.py
# CPU nodes: NPROC=cpu (one worker per core) or a number, e.g.
#   NPROC=2 JOB_ID=run7 NNODES=2 NODE_RANK=0 MASTER_ADDR=node0.cluster launch/multi_node.sh ...
#
# NNODES       number of nodes (required)
# NODE_RANK    this node's rank, 0 .. NNODES-1 (required); node 0 hosts the rendezvous
# MASTER_ADDR  address of node 0 that every node can reach (required)
# MASTER_PORT  rendezvous port on node 0 (default 29500); the workers use it too (MASTER_PORT, as
#              in torchrun), so it is the only port of node 0 the other nodes must reach
# JOB_ID       this run's name, the same on every node and different from any other run's
#              (--rdzv-id; required). A node of another run that reaches the port is refused
# NPROC        workers per node: a number or gpu / cpu / auto (default gpu where nvidia-smi sees a
#              GPU; on CPU nodes it must be set, as one worker per core is rarely what a job wants)
# RDZV_TIMEOUT seconds to wait for all nodes to join (default 900); a node that never comes is
#              named in the error
# NODE_TIMEOUT seconds without a heartbeat from a node's launcher before the others count it as
#              lost and stop (default 30)
# RESTARTS     restart every node's workers up to this many times after a failure (default 0)
# PYTHON       the interpreter to run (default python3)
#
# A failure on any node stops the workers on every node; each launcher exits with the failing
# worker's exit code, and the failing node prints its traceback.
set -euo pipefail
: "${NNODES:?set NNODES}" "${NODE_RANK:?set NODE_RANK}" "${MASTER_ADDR:?set MASTER_ADDR}"
# unnamed, two runs on one node 0 and port could not be told apart: one would take the other's nodes
: "${JOB_ID:?set JOB_ID to the name of this run, the same on every node and unique to this run (e.g. run7)}"

SCRIPT=${1:?usage: launch/multi_node.sh SCRIPT [ARGS...]}
shift
if [[ -z "${NPROC:-}" ]]; then
    if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
        NPROC=gpu
    else
        echo "launch/multi_node.sh: no GPU on $(hostname): set NPROC, the workers per node (a number, or cpu)" >&2
        exit 2
    fi
fi

whole_number() {  # NAME VALUE [ALSO]: a whole number, or one of the words ALSO allows
    if [[ -n "${3:-}" && " $3 " == *" $2 "* ]]; then return; fi
    if [[ -z "$2" || "$2" == *[!0-9]* ]]; then
        echo "launch/multi_node.sh: $1=$2 must be a whole number${3:+ (or one of: $3)}" >&2
        exit 2
    fi
}
whole_number NNODES "$NNODES"
whole_number NODE_RANK "$NODE_RANK"
whole_number RESTARTS "${RESTARTS:-0}"
whole_number NPROC "$NPROC" "gpu cpu auto"

exec "${PYTHON:-python3}" -m ddpkit run \
    --nnodes "$NNODES" \
    --node-rank "$NODE_RANK" \
    --master-addr "$MASTER_ADDR" \
    --master-port "${MASTER_PORT:-29500}" \
    --rdzv-id "$JOB_ID" \
    --nproc-per-node "$NPROC" \
    --rdzv-timeout "${RDZV_TIMEOUT:-900}" \
    --node-timeout "${NODE_TIMEOUT:-30}" \
    --max-restarts "${RESTARTS:-0}" \
    "$SCRIPT" "$@"
