"""check_devices reads device_ids and output_device with ddpkit's one device parser (dp.devices.as_device)."""
from __future__ import annotations

import pytest
import torch

from ddpkit.ddp.arguments import check_devices

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _params(device: str) -> list[torch.Tensor]:
    # meta tensors stand in for a module on one non-CPU device without needing a GPU
    return [torch.empty(3, device=device), torch.empty(2, device=device)]


@pytest.mark.parametrize("device_ids, error, match", [
    (["gpu7"], ValueError, r"device_ids\[0\] 'gpu7' is not a device name"),
    # as in torch, an int indexes the module's device type (here meta, on a GPU module CUDA)
    ([True], TypeError, r"device_ids\[0\] must be an int \(meta index\), a str or a torch.device, but found bool"),
    ([-1], ValueError, r"device_ids\[0\] must be a non-negative meta index, but found -1"),
    (["cuda:0"], ValueError, r"device_ids\[0\] must be a CPU or meta device, but found cuda:0"),
])
def test_device_ids_are_parsed_like_every_other_device_argument(device_ids, error, match):
    with pytest.raises(error, match=match):
        check_devices(_params("meta"), device_ids, None)


@needs_cuda
@pytest.mark.parametrize("name", [0, "cuda:0", torch.device("cuda", 0)])
def test_every_spelling_of_the_gpu_names_the_same_device(name):
    device, device_ids, output = check_devices(_params("cuda:0"), [name], None)
    assert device == torch.device("cuda", 0) and device_ids == [0] and output == device


@needs_cuda
def test_a_bare_cuda_means_the_current_device_and_output_device_is_parsed_too():
    torch.cuda.set_device(0)
    device, _, output = check_devices(_params("cuda:0"), ["cuda"], "cuda:0")
    assert device == output == torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"output_device 'gpu' is not a device name"):
        check_devices(_params("cuda:0"), [0], "gpu")


@pytest.mark.parametrize("device_ids, error, shown", [
    (0, TypeError, "the int 0"), (torch.device("cpu"), TypeError, "the device torch.device('cpu')"),
    ("cuda:0", ValueError, "the str 'cuda:0'"),  # torch's error read it letter by letter: ['c', 'u', ...]
])
def test_a_single_device_id_not_in_a_list_is_named_with_the_list_to_write(device_ids, error, shown):
    # DDP(model, device_ids=local_rank): torch says "object of type 'int' has no len()"
    with pytest.raises(error) as info:
        check_devices(_params("meta"), device_ids, None)
    assert f"device_ids must be a list of one device, but got {shown}." in str(info.value)
    assert "HINT: wrap it in a list, device_ids=[" in str(info.value)


def test_a_comm_hook_that_cannot_take_state_and_bucket_is_refused_at_registration():
    # it failed at the first backward with "<lambda>() takes 1 positional argument but 2 were given"
    from ddpkit.ddp.arguments import check_comm_hook
    from ddpkit.errors import CommHookError

    with pytest.raises(CommHookError, match=r"comm hook '<lambda>' cannot be called as hook\(state, bucket\)"):
        check_comm_hook(lambda bucket: bucket.buffer(), rank=1)
    check_comm_hook(lambda state, bucket, *rest: None, rank=1)  # these can
    check_comm_hook(lambda *args: None, rank=1)
