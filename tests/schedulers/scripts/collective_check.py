"""Every rank prints its place and the all-reduced sum of (rank + 1) and of its job's marker.

    srun -n3 python tests/schedulers/scripts/collective_check.py [MARKER [TIMEOUT [HOLD]]]

MARKER (default 1) is added into the sum by every rank: two jobs with different markers that formed
one group would print a sum neither expects. TIMEOUT: the rendezvous's, in seconds (default 60).
HOLD: seconds to keep the group (and rank 0's store) up afterwards, so that a second job started at
the same time surely meets this one.
"""
from __future__ import annotations

import sys
import time

import torch

import ddpkit

marker = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
env = ddpkit.init(backend="gloo", timeout=float(sys.argv[2]) if len(sys.argv) > 2 else 60)
total = ddpkit.all_reduce(torch.tensor([env.rank + 1.0, marker]))
print(f"rank {env.rank}/{env.world_size} local {env.local_rank}/{env.local_world_size} "
      f"launcher {env.launcher} port {env.master_port} threads {torch.get_num_threads()} "
      f"sum {total[0].item():g} markers {total[1].item():g}", flush=True)
time.sleep(float(sys.argv[3]) if len(sys.argv) > 3 else 0)
ddpkit.shutdown()
