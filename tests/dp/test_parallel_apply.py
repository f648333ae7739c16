"""parallel_apply: one thread per replica, caller's grad/autocast state, errors that name replica and device."""
from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from ddpkit.dp.parallel_apply import parallel_apply

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICES = [pytest.param(["cpu"] * n, id=f"{n}xcpu") for n in (1, 2, 3, 8)] + [
    pytest.param(["cuda:0"] * n, id=f"{n}xcuda0", marks=needs_cuda) for n in (2, 3)
]


class Recorder(nn.Module):
    """Scales its input and records the thread and torch state it ran under."""

    def __init__(self, scale: float = 2.0) -> None:
        super().__init__()
        self.scale = scale
        self.seen: dict[str, object] = {}

    def forward(self, x: torch.Tensor, shift: float = 0.0) -> torch.Tensor:
        self.seen.update(thread=threading.current_thread(), grad=torch.is_grad_enabled())
        return x * self.scale + shift


class Fails(nn.Module):
    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error = error

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise self.error


class NeedsTwoArguments(Exception):
    def __init__(self, code: int, detail: str) -> None:
        super().__init__(code, detail)


@pytest.mark.parametrize("devices", DEVICES)
def test_outputs_come_back_in_replica_order(devices):
    modules = [Recorder(scale=i + 1) for i in range(len(devices))]
    inputs = [(torch.full((2,), float(i), device=d),) for i, d in enumerate(devices)]
    outputs = parallel_apply(modules, inputs, devices=devices)
    for i, out in enumerate(outputs):
        torch.testing.assert_close(out, torch.full((2,), float(i * (i + 1)), device=devices[i]))


def test_each_replica_runs_in_its_own_thread():
    modules = [Recorder() for _ in range(3)]
    parallel_apply(modules, [torch.zeros(1)] * 3)
    threads = {id(m.seen["thread"]) for m in modules}
    assert len(threads) == 3 and id(threading.current_thread()) not in threads


def test_a_single_replica_runs_in_the_callers_thread():
    module = Recorder()
    parallel_apply([module], [torch.zeros(1)])
    assert module.seen["thread"] is threading.current_thread()


def test_a_lone_tensor_input_is_one_argument_and_kwargs_are_passed():
    outputs = parallel_apply([Recorder(), Recorder()], [torch.ones(3), (torch.ones(3),)], [{"shift": 1.0}, {}])
    torch.testing.assert_close(outputs[0], torch.full((3,), 3.0))
    torch.testing.assert_close(outputs[1], torch.full((3,), 2.0))


def test_grad_mode_of_the_caller_is_used_in_every_thread():
    modules = [Recorder() for _ in range(2)]
    x = torch.ones(2, requires_grad=True)
    with torch.no_grad():
        outputs = parallel_apply(modules, [x, x])
    assert [m.seen["grad"] for m in modules] == [False, False]
    assert not any(o.requires_grad for o in outputs)
    outputs = parallel_apply(modules, [x, x])
    assert [m.seen["grad"] for m in modules] == [True, True] and all(o.requires_grad for o in outputs)


def test_inference_mode_of_the_caller_is_used_in_every_thread():
    # torch carries only grad mode: a training BatchNorm's in-place update of an inference buffer fails
    layers = [nn.BatchNorm1d(4) for _ in range(3)]
    with torch.inference_mode():
        inputs = [torch.randn(2, 4) for _ in layers]  # inference tensors, made in the caller's mode
        outputs = parallel_apply(layers, inputs)
    assert all(o.is_inference() for o in outputs)
    assert [int(b.num_batches_tracked) for b in layers] == [1, 1, 1]
    assert not parallel_apply(layers, [torch.randn(2, 4)] * 3)[0].is_inference()


def test_cpu_autocast_of_the_caller_is_used_in_every_thread():
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4) for _ in range(2)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = parallel_apply(layers, [torch.randn(2, 4)] * 2)
    assert [o.dtype for o in outputs] == [torch.bfloat16, torch.bfloat16]


def test_an_error_keeps_its_type_and_names_the_replica_and_device():
    modules = [Recorder(), Recorder(), Fails(ValueError("bad batch")), Recorder()]
    with pytest.raises(ValueError, match=r"replica 2 on device cpu raised ValueError: bad batch") as info:
        parallel_apply(modules, [torch.zeros(1)] * 4, devices=["cpu"] * 4)
    assert "Original traceback in replica 2" in str(info.value)
    assert "raise self.error" in str(info.value)  # the replica's own traceback text
    assert isinstance(info.value.__cause__, ValueError) and str(info.value.__cause__) == "bad batch"


def test_the_first_failing_replica_is_reported():
    modules = [Recorder(), Fails(TypeError("first")), Fails(ValueError("second"))]
    with pytest.raises(TypeError, match="replica 1 on device cpu raised TypeError: first"):
        parallel_apply(modules, [torch.zeros(1)] * 3)


def test_a_key_error_stays_a_readable_key_error():
    with pytest.raises(KeyError, match="replica 1 on device cpu raised KeyError: 'missing'") as info:
        parallel_apply([Recorder(), Fails(KeyError("missing"))], [torch.zeros(1)] * 2)
    assert "\\n" not in str(info.value)


def test_an_error_that_cannot_be_rebuilt_is_reraised_itself_with_a_note():
    error = NeedsTwoArguments(3, "detail")
    with pytest.raises(NeedsTwoArguments) as info:
        parallel_apply([Recorder(), Fails(error)], [torch.zeros(1)] * 2)
    assert info.value is error
    assert "(raised in replica 1 on device cpu)" in info.value.__notes__


def test_the_device_defaults_to_that_of_the_replicas_first_tensor():
    with pytest.raises(RuntimeError, match="replica 0 on device cpu raised RuntimeError: boom"):
        parallel_apply([Fails(RuntimeError("boom"))], [{"x": torch.zeros(1)}])


@pytest.mark.parametrize(
    "kwargs, name",
    [({"inputs": [torch.zeros(1)]}, "inputs"), ({"kwargs_tup": [{}]}, "kwargs_tup"), ({"devices": ["cpu"]}, "devices")],
)
def test_mismatched_lengths_are_rejected_naming_the_argument(kwargs, name):
    arguments = {"inputs": [torch.zeros(1)] * 2, **kwargs}
    with pytest.raises(ValueError, match=rf"{name} must have one entry per module") as raised:
        parallel_apply([Recorder(), Recorder()], **arguments)
    assert isinstance(raised.value, AssertionError)  # torch's type, and its words
    assert f"The number of modules 2 is not equal to the number of {name} 1" in str(raised.value)
    assert (raised.value.argument, raised.value.expected, raised.value.found) == (name, 2, 1)


@needs_cuda
def test_an_error_on_cuda_names_the_cuda_device():
    x = torch.zeros(1, device="cuda:0")
    with pytest.raises(ValueError, match="replica 1 on device cuda:0 raised ValueError"):
        parallel_apply([Recorder(), Fails(ValueError("x"))], [x, x], devices=[0, 0])
