"""What ``ddpkit.comm``'s collectives accept: the reductions by name, the dtypes they go with, tensors.

Checked on every world size, a world of one included, so that a script that runs alone fails the
same way as at eight ranks.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ddpkit.errors import explain

__all__ = ["REDUCE_OPS", "DTYPES", "DTYPE_CODES", "parse_reduce_op", "check_op_dtype", "check_tensor",
           "widens"]

REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,  # summed, then divided by the world size
    "avg": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
    "prod": dist.ReduceOp.PRODUCT,
    "band": dist.ReduceOp.BAND,  # bitwise, of integer and bool tensors, as torch's
    "bor": dist.ReduceOp.BOR,
    "bxor": dist.ReduceOp.BXOR,
}
_BITWISE = ("band", "bor", "bxor")
_ORDERED = ("max", "min", "product", "prod")  # complex numbers have no order, and Gloo no complex product


# every dtype torch has, by a code that is the same in every process (sorted by name)
DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
DTYPE_CODES = {d: i for i, d in enumerate(DTYPES)}


def parse_reduce_op(op: Any) -> tuple[str, Any]:
    # torch's own dist.ReduceOp.SUM etc., so that code written for dist.all_reduce ports unchanged
    if isinstance(op, dist.ReduceOp) and not isinstance(op, dist.ReduceOp.RedOpType):  # ReduceOp(ReduceOp.SUM)
        op = op.op
    torch_name = getattr(op, "name", None) if isinstance(op, dist.ReduceOp.RedOpType) else None
    if isinstance(torch_name, str) and torch_name.lower() in REDUCE_OPS:
        op = torch_name
    if not isinstance(op, str) or op.lower() not in REDUCE_OPS:
        raise ValueError(f"op={op!r} is not a reduction ddpkit knows: use one of "
                         f"{sorted(set(REDUCE_OPS) - {'avg', 'prod'})}.")
    return op.lower(), REDUCE_OPS[op.lower()]


def check_op_dtype(function: str, op_name: str, tensor: torch.Tensor, given: Any = None) -> None:
    """A mean divides in place, which an integer tensor cannot hold, a bitwise reduction needs bits to
    combine, and torch neither orders nor multiplies complex tensors: refuse these on every world size (torch
    refuses the complex ones in a world of one too), naming the op as ``given``."""
    written = _as_written(given, op_name)
    if op_name in ("mean", "avg") and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(explain(f"{function}({written}) averages, which needs a floating-point tensor, got "
                                f"{tensor.dtype}.", "convert with .float(), or reduce with op='sum'."))
    if op_name in _BITWISE and (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(explain(f"{function}({written}) is bitwise and needs an integer or bool tensor, "
                                f"got {tensor.dtype}.", "reduce with op='max' or 'min', or convert the tensor."))
    if op_name in _ORDERED and tensor.is_complex():  # torch's type and words: "does not support ... on complex"
        raise ValueError(explain(f"{function} does not support {written} on complex tensors ({tensor.dtype}).",
                                 "reduce torch.view_as_real(tensor) or tensor.abs() instead."))


def _as_written(given: Any, op_name: str) -> str:
    """``op='avg'`` or ``op=ReduceOp.AVG``, as the caller wrote it (else the parsed name)."""
    if isinstance(given, str):
        return f"op={given!r}"
    torch_name = getattr(given, "name", None)
    return f"op=ReduceOp.{torch_name}" if isinstance(torch_name, str) else f"op={op_name!r}"


def check_tensor(name: str, tensor: Any) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}.")


def widens(name: str, tensor: torch.Tensor) -> bool:
    """A 16-bit float's sum may overflow where its mean does not (fp16 tops out at 65504, bfloat16
    at float32's largest), and dividing first in 16 bits would lose its small values: such a mean is
    divided, then summed, in float32."""
    return name in ("mean", "avg") and tensor.is_floating_point() and tensor.element_size() <= 2
