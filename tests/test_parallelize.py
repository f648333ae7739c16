"""ddpkit.parallelize picks DDP, DataParallel or the model itself from how the process was launched."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks
from torch import nn

import ddpkit
from ddpkit.parallelize import local_devices, parallelize


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _parallelize_and_step() -> dict:
    """One SGD step on rank-specific data; DDP must leave identical parameters on every rank.

    The DataParallel options (devices, output_device) of the same script line are ignored here."""
    torch.manual_seed(ddpkit.get_rank())  # different initial weights: DDP must broadcast rank 0's
    model = parallelize(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
                               bucket_cap_mb=1, devices=["cpu", "cpu"], output_device="cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.full((3, 4), float(ddpkit.get_rank() + 1))
    model(x).square().sum().backward()
    optimizer.step()
    refused = []  # devices is ignored under a launcher, but not a malformed one: it fails alone too
    for devices in ("cpu", [], ["tpu"]):
        try:
            parallelize(nn.Linear(2, 2), devices=devices)
        except ValueError as e:
            refused.append(str(e))
    return {"type": type(model).__name__, "is_ddpkit": isinstance(model, ddpkit.DistributedDataParallel),
            "params": [p.detach().clone() for p in model.parameters()], "refused": refused}


@pytest.mark.timeout(10)
def test_single_process_without_gpus_returns_the_module_itself_and_ignores_ddp_options(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    model = _model()
    assert parallelize(model) is model
    assert parallelize(model, bucket_cap_mb=1, find_unused_parameters=True,
                              broadcast_buffers=False, static_graph=True) is model


@pytest.mark.timeout(10)
def test_world_of_one_after_init_is_still_the_single_process_path():
    try:
        ddpkit.init(backend="gloo")  # the CPU, also on a GPU machine
        model = _model()
        assert parallelize(model, bucket_cap_mb=1) is model
    finally:
        ddpkit.shutdown()


@pytest.mark.timeout(10)
def test_unknown_option_is_a_type_error_naming_it_and_the_valid_ones():
    with pytest.raises(TypeError, match=r"unexpected option 'bucket_cap_mbb'\. Valid for a single "
                                        r"process \(DataParallel\), .*: devices, dim, output_device\. "
                                        r"Accepted but ignored here: .*bucket_cap_mb"):
        parallelize(_model(), bucket_cap_mbb=1)


@pytest.mark.timeout(10)
def test_device_ids_is_refused_with_a_pointer_to_devices():
    with pytest.raises(TypeError, match=r"chooses device_ids itself.*devices=\['cpu', 'cpu'\]"):
        parallelize(_model(), device_ids=[0])


@pytest.mark.timeout(10)
def test_launched_with_several_ranks_but_no_init_says_to_call_init(launched_as_rank_1_of_2):
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"rank 1 of WORLD_SIZE=2 .*call ddpkit.init\(\) first"):
        parallelize(_model())


@pytest.mark.timeout(10)
def test_local_devices_prefers_named_devices_then_all_gpus_then_none():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 1)
    assert local_devices(["cpu", 1], cuda_count=0) == [cpu, cuda]
    assert local_devices(None, cuda_count=3) == [torch.device("cuda", i) for i in range(3)]
    assert local_devices(None, cuda_count=1) is None
    assert local_devices(None, cuda_count=0) is None
    with pytest.raises(ValueError, match="non-empty list"):
        local_devices([], cuda_count=0)
    with pytest.raises(TypeError, match=r"devices\[0\] must be an int \(CUDA index\), a str or a torch.device, "
                                        r"but found float 1.5"):
        local_devices([1.5], cuda_count=0)


@pytest.mark.timeout(10)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
def test_gpus_named_without_cuda_are_refused_before_the_model_moves():
    model = _model()
    with pytest.raises(ValueError, match=r"devices\[0\] is cuda:0, but CUDA is not available.*HINT: use 'cpu'"):
        parallelize(model, devices=[0, 1])
    assert next(model.parameters()).device.type == "cpu"


@pytest.mark.timeout(30)
def test_devices_on_cpu_gives_data_parallel_with_the_module_output():
    model = _model()
    wrapped = parallelize(model, devices=["cpu", "cpu"], bucket_cap_mb=1)
    assert isinstance(wrapped, ddpkit.DataParallel) and wrapped.module is model
    x = torch.randn(6, 4)
    torch.testing.assert_close(wrapped(x), model(x))


@pytest.mark.timeout(60)
def test_two_ranks_get_ddpkit_ddp_and_stay_in_sync():
    results = run_ranks(_parallelize_and_step, world_size=2)
    assert all(r["is_ddpkit"] for r in results), [r["type"] for r in results]
    assert all(len(r["refused"]) == 3 for r in results), results[0]["refused"]
    assert "devices='cpu' must be a non-empty list" in results[0]["refused"][0]
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)


def _deprecated_option_worker() -> list:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parallelize(nn.Linear(2, 2), broadcast_buffers=False)
    return [(w.category.__name__, w.filename) for w in caught if "broadcast_buffers" in str(w.message)]


def test_torchs_deprecation_warning_points_at_the_users_parallelize_call():
    for seen in run_ranks(_deprecated_option_worker, world_size=2):
        assert seen == [("FutureWarning", __file__)]
