"""Child for test_checkpoint: save a checkpoint, then start overwriting it and stop half way.

    python tests/scripts/ckpt_killed_writer.py PATH

Saves ``{"version": 1}`` to PATH with ddpkit.save, then saves a large ``{"version": 2}`` with
torch.save patched to write half of its bytes, flush, say ``writing`` on stdout and block on stdin.
The parent SIGKILLs it at that point: a writer killed mid-write, made deterministic.
"""
from __future__ import annotations

import io
import sys

import torch

import ddpkit

_real_save = torch.save


def _half_then_block(obj, f, *args, **kwargs) -> None:
    buffer = io.BytesIO()
    _real_save(obj, buffer, *args, **kwargs)
    data = buffer.getvalue()
    f.write(data[: len(data) // 2])
    f.flush()
    sys.stdout.write("writing\n")
    sys.stdout.flush()
    sys.stdin.read()  # blocks until the parent kills this process


def main(path: str) -> None:
    ddpkit.save({"version": 1, "weights": torch.arange(10)}, path)
    torch.save = _half_then_block
    ddpkit.save({"version": 2, "weights": torch.zeros(1 << 20)}, path)
    sys.stdout.write("finished\n")  # never reached


if __name__ == "__main__":
    main(sys.argv[1])
