#!/usr/bin/env bash
# The same job under PyTorch's own launcher: ddpkit scripts run under torchrun unchanged
# (ddpkit.init() reads torchrun's variables), which is handy to compare or where torchrun is required.
#
#   launch/torchrun.sh examples/train_ddp.py --steps 50                   # one node
#   NPROC=4 launch/torchrun.sh examples/train_ddp.py
#   JOB_ID=run7 NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 launch/torchrun.sh examples/train_ddp.py   # each node
#
# NPROC (default gpu if nvidia-smi sees one, else 2), NNODES (default 1), NODE_RANK (default 0),
# MASTER_ADDR / MASTER_PORT (several nodes only; default port 29500), PYTHON (default python3).
# JOB_ID (several nodes only; required): this run's name, the same on every node and unique to the
# run, passed as --rdzv-id. Two unnamed runs that reach one MASTER_PORT train as one; a node of
# another named run waits in torchrun's rendezvous, silently, until torchrun's timeout, without
# starting a worker (launch/multi_node.sh, under 'ddpkit run', refuses it at once, with the reason).
# 'ddpkit run' takes the same flags; swap 'python -m torch.distributed.run' for 'python -m ddpkit run'.
set -euo pipefail

if [[ -z "${NPROC:-}" ]]; then
    if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then NPROC=gpu; else NPROC=2; fi
fi
SCRIPT=${1:?usage: launch/torchrun.sh SCRIPT [ARGS...]}
shift

if [[ "${NNODES:-1}" == 1 ]]; then
    exec "${PYTHON:-python3}" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" "$SCRIPT" "$@"
fi
: "${NODE_RANK:?set NODE_RANK}" "${MASTER_ADDR:?set MASTER_ADDR}"
: "${JOB_ID:?set JOB_ID to the name of this run, the same on every node and unique to this run (e.g. run7)}"
exec "${PYTHON:-python3}" -m torch.distributed.run \
    --nnodes "$NNODES" --node-rank "$NODE_RANK" --rdzv-id "$JOB_ID" \
    --master-addr "$MASTER_ADDR" --master-port "${MASTER_PORT:-29500}" \
    --nproc-per-node "$NPROC" "$SCRIPT" "$@"
