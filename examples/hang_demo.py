"""A training loop with a classic hang: a collective inside ``if rank == 0``. It explains itself.

    DDPKIT_STALL_TIMEOUT=5 ddpkit run --nproc-per-node 2 examples/hang_demo.py

``ddpkit.save`` is collective (rank 0 writes, the others wait for it), but only rank 0 calls it here:
rank 0 waits in it while rank 1 goes on to the next step's gradient all-reduce. After 5 s
(60 by default) every rank prints the hang report, and the job ends with exit code 86
(``ddpkit.HANG_EXIT_CODE``) instead of waiting for the collective timeout.
"""
import os
import tempfile

import ddpkit  # before torch: see train_ddp.py

import torch

env = ddpkit.init()
checkpoint = os.path.join(tempfile.gettempdir(), "hang_demo.pt")
model = ddpkit.DistributedDataParallel(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(5):
    loss = model(torch.randn(16, 8)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if env.rank == 0 and step == 2:
        ddpkit.save(model.module.state_dict(), checkpoint)  # the bug: only rank 0 gets here
ddpkit.print("done")
