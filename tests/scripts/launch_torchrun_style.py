"""A script written for torchrun, knowing nothing of ddpkit: plain env:// init and an all-reduce.

    torchrun --nproc-per-node 2 tests/scripts/launch_torchrun_style.py OUT_DIR
    ddpkit run --nproc-per-node 2 tests/scripts/launch_torchrun_style.py OUT_DIR

Writes ``OUT_DIR/result_<rank>.json`` with the all-reduced sum of rank + 1.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    with open(os.path.join(sys.argv[1], f"result_{rank}.json"), "w") as f:
        json.dump({"sum": total.item(), "world_size": dist.get_world_size(),
                   "local_rank": int(os.environ["LOCAL_RANK"])}, f)
    dist.destroy_process_group()
