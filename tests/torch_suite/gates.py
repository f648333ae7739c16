"""torch's ``skip_if_lt_x_gpu`` gate on its distributed tests: read it, or take it off (for run.py).

The gate wraps a test function; on a machine with fewer GPUs the spawned ranks would start only to
skip. run.py reads the gate's own reason without spawning them, or (``--gpu-gated-only``) removes
the wrapper in every rank to see how far a gated test gets on CPU.
"""
from __future__ import annotations

import torch
from torch.testing._internal import common_distributed

__all__ = ["gpu_skip", "ungate"]


def _is_gate(fn: object) -> bool:
    code = getattr(fn, "__code__", None)
    return code is not None and code.co_qualname.startswith("skip_if_lt_x_gpu.<locals>")


def ungate(base: type) -> None:
    """Replace each skip_if_lt_x_gpu wrapper of ``base``'s tests by the function it wraps."""
    for name in [n for n in dir(base) if n.startswith("test_")]:
        fn, chain = getattr(base, name), []
        while fn is not None:
            chain.append(fn)
            fn = getattr(fn, "__wrapped__", None)
        for i, f in enumerate(chain[:-1]):
            if _is_gate(f):
                if i == 0:
                    setattr(base, name, chain[1])
                else:  # the wrapper above the gate calls it through a closure cell
                    outer = chain[i - 1]
                    for cell in dict(zip(outer.__code__.co_freevars, outer.__closure__)).values():
                        if cell.cell_contents is f:
                            cell.cell_contents = chain[i + 1]
                break


def gpu_skip(base: type, name: str) -> str | None:
    """torch's reason when ``base``'s test ``name`` is wrapped by skip_if_lt_x_gpu(x) and this machine
    has no GPU, else None."""
    fn = getattr(base, name)
    while fn is not None:
        if _is_gate(fn):
            code = fn.__code__
            cells = dict(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__)))
            if not cells.get("allow_cpu", False) and not torch.cuda.is_available():
                return common_distributed.TEST_SKIPS[f"multi-gpu-{cells['x']}"].message
        fn = getattr(fn, "__wrapped__", None)
    return None
