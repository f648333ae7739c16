"""DataParallel / data_parallel against the full-batch module, and against torch.nn.DataParallel on CUDA."""
from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.util
from collections import Counter, namedtuple
from pathlib import Path

import pytest
import torch
from torch import nn

from ddpkit.dp.data_parallel import DataParallel, data_parallel
from ddpkit.errors import EmptyListError

dp_module = importlib.import_module("ddpkit.dp.data_parallel")  # the package attribute is the function

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
DEVICES = [pytest.param(["cpu"] * n, id=f"{n}xcpu") for n in (1, 2, 3, 8)] + [
    pytest.param(["cuda:0"] * n, id=f"{n}xcuda0", marks=needs_cuda) for n in (2, 3)
]
Out = namedtuple("Out", ["y", "norm"])


@dataclasses.dataclass
class Result:
    y: torch.Tensor
    loss: torch.Tensor


def _mlp(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2)).double().to(device)


class Nested(nn.Linear):
    """Takes nested positional and keyword inputs, returns a namedtuple and a dataclass."""

    def forward(self, batch: dict, pair: tuple, *, scale: torch.Tensor, mode: str = "sum") -> tuple:
        y = super().forward(batch["x"]) * scale[:, None] + pair[0]
        assert mode == "sum" and pair[1] == "tag"
        return Out(y, y.norm(dim=1)), Result(y, (y**2).sum())


class SumOf(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).sum()


class CountsCalls(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 2)
        self.sizes: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.sizes.append(len(x))
        return self.fc(x)


class FailsOnSecondReplica(CountsCalls):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x[0, 0] > 0.5:  # only the second chunk starts with a 1
            raise ValueError("no good")
        return self.fc(x)


@pytest.mark.parametrize("devices", DEVICES)
def test_outputs_and_gradients_equal_the_full_batch_module(devices):
    model, reference = _mlp(devices[0]), _mlp(devices[0])
    x = torch.randn(30, 5, dtype=torch.float64, device=devices[0])
    out = DataParallel(model, device_ids=devices)(x)
    expected = reference(x)
    torch.testing.assert_close(out, expected)
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("devices", DEVICES)
def test_data_parallel_function_equals_the_module(devices):
    model = _mlp(devices[0])
    x = torch.randn(10, 5, dtype=torch.float64, device=devices[0])
    torch.testing.assert_close(data_parallel(model, x, devices), model(x))


def test_training_steps_match_full_batch_training():
    model, reference = _mlp(), _mlp()
    wrapped = DataParallel(model, device_ids=["cpu"] * 3)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    for _ in range(3):
        x, target = torch.randn(12, 5, dtype=torch.float64), torch.randn(12, 2, dtype=torch.float64)
        for net, optimizer in ((wrapped, opt), (reference, ref_opt)):
            optimizer.zero_grad()
            nn.functional.mse_loss(net(x), target).backward()
            optimizer.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)


def test_a_batch_smaller_than_the_device_count_uses_fewer_replicas():
    model = CountsCalls()
    out = DataParallel(model, device_ids=["cpu"] * 8)(torch.randn(10, 5))
    assert out.shape == (10, 2)
    # replicas share the original's python attributes (a shallow copy, as in torch), so the list sees all
    assert model.sizes == [2] * 5


def test_nested_inputs_kwargs_namedtuple_and_dataclass_outputs():
    model = Nested(5, 2).double()
    x, bias, scale = (torch.randn(9, 5, dtype=torch.float64), torch.randn(9, 2, dtype=torch.float64),
                      torch.rand(9, dtype=torch.float64))
    with pytest.warns(UserWarning, match="scalars"):
        out, result = DataParallel(model, device_ids=["cpu"] * 3)({"x": x}, (bias, "tag"), scale=scale, mode="sum")
    ref_out, ref_result = model({"x": x}, (bias, "tag"), scale=scale)
    assert isinstance(out, Out) and isinstance(result, Result)
    torch.testing.assert_close(out.y, ref_out.y)
    torch.testing.assert_close(out.norm, ref_out.norm)
    torch.testing.assert_close(result.y, ref_result.y)
    # a 0-dim loss per replica comes back as a vector, one entry per replica
    assert result.loss.shape == (3,)
    torch.testing.assert_close(result.loss.sum(), ref_result.loss)


@dataclasses.dataclass
class Features:
    x: torch.Tensor
    scale: float


class TakesFeatures(nn.Linear):
    def forward(self, features: Features) -> Result:
        y = super().forward(features.x) * features.scale
        return Result(y, y.sum(dim=1))


def test_a_dataclass_input_is_split_and_its_output_joined():
    model = TakesFeatures(5, 2).double()
    x = torch.randn(9, 5, dtype=torch.float64)
    out = DataParallel(model, device_ids=["cpu"] * 3)(Features(x, 2.0))
    expected = model(Features(x, 2.0))
    assert isinstance(out, Result)
    torch.testing.assert_close(out.y, expected.y)
    torch.testing.assert_close(out.loss, expected.loss)


def test_forward_does_not_check_the_devices_again(monkeypatch):
    """device_ids are checked once, at construction; the four steps trust them."""
    wrapped = DataParallel(_mlp(), device_ids=["cpu"] * 3)
    calls = []
    for name in ("data_parallel", "scatter_gather", "replicate", "parallel_apply"):
        monkeypatch.setattr(importlib.import_module(f"ddpkit.dp.{name}"), "check_available",
                            lambda device, what: calls.append(what))
    wrapped(torch.randn(6, 5, dtype=torch.float64))
    data_parallel(_mlp(), torch.randn(6, 5, dtype=torch.float64), ["cpu"] * 3)
    assert calls == ["device_ids[0]", "device_ids[1]", "device_ids[2]"]  # data_parallel's own, once


def test_a_scalar_output_becomes_one_entry_per_replica_with_torchs_warning():
    model = _mlp()
    x = torch.randn(8, 5, dtype=torch.float64)
    with pytest.warns(UserWarning, match="all input tensors were scalars"):
        per_replica = data_parallel(SumOf(model), x, ["cpu"] * 4)
    assert per_replica.shape == (4,)
    torch.testing.assert_close(per_replica, torch.stack([model(c).sum() for c in x.chunk(4)]))


def test_batchnorm_keeps_the_first_replicas_running_stats_as_torch_does():
    torch.manual_seed(0)
    bn, reference = nn.BatchNorm1d(4).double(), nn.BatchNorm1d(4).double()
    x = torch.randn(12, 4, dtype=torch.float64)
    out = DataParallel(bn, device_ids=["cpu"] * 3)(x)
    per_chunk = torch.cat([copy.deepcopy(reference)(c) for c in x.chunk(3)])
    torch.testing.assert_close(out, per_chunk)
    reference(x.chunk(3)[0])
    torch.testing.assert_close(bn.running_mean, reference.running_mean)
    torch.testing.assert_close(bn.running_var, reference.running_var)
    assert bn.num_batches_tracked == 1


def test_attributes_and_state_dict_look_like_torchs():
    model = _mlp()
    wrapped = DataParallel(model, device_ids=["cpu", torch.device("cpu"), "cpu:0"], dim=0)
    assert wrapped.module is model
    assert wrapped.device_ids == [torch.device("cpu")] * 3
    assert wrapped.output_device == torch.device("cpu") and wrapped.dim == 0
    assert list(wrapped.state_dict()) == [f"module.{k}" for k in model.state_dict()]
    fresh = _mlp()
    fresh.load_state_dict({k.removeprefix("module."): v for k, v in wrapped.state_dict().items()})


def test_no_grad_forward_builds_no_graph():
    with torch.no_grad():
        out = DataParallel(_mlp(), device_ids=["cpu"] * 2)(torch.randn(4, 5, dtype=torch.float64))
    assert not out.requires_grad


def test_a_single_device_calls_the_module_directly():
    model = CountsCalls()
    DataParallel(model, device_ids=["cpu"])(torch.randn(6, 5))
    assert model.sizes == [6]


def test_a_forward_without_inputs_runs_once():
    class Constant(nn.Module):
        def forward(self) -> torch.Tensor:
            return torch.ones(3)

    torch.testing.assert_close(DataParallel(Constant(), device_ids=["cpu"] * 2)(), torch.ones(3))


def test_the_four_steps_can_be_overridden():
    calls = []

    class Traced(DataParallel):
        pass

    for step in ("scatter", "replicate", "parallel_apply", "gather"):
        def traced(self, *args, _step=step):
            calls.append(_step)
            return getattr(DataParallel, _step)(self, *args)

        setattr(Traced, step, traced)
    Traced(_mlp(), device_ids=["cpu"] * 2)(torch.randn(4, 5, dtype=torch.float64))
    assert calls == ["scatter", "replicate", "parallel_apply", "gather"]


@pytest.mark.parametrize("devices", [["cpu"] * n for n in (1, 2, 3)], ids=lambda d: f"{len(d)}xcpu")
def test_a_replica_may_change_its_input_in_place(devices):
    backbone, head = nn.Linear(5, 8), nn.Sequential(nn.ReLU(inplace=True), nn.Linear(8, 2))
    x = torch.randn(12, 5)
    want = head(backbone(x))
    got = DataParallel(head, device_ids=devices)(backbone(x))
    torch.testing.assert_close(got, want)
    got.sum().backward()


def test_on_cpu_devices_the_output_is_bit_for_bit_the_module_on_torch_chunks_pieces():
    """Each chunk is copied at its own alignment: in a fresh block, CPU matrix kernels rounded some
    rows an ulp otherwise (14 of these 60 cases differed before)."""
    generator = torch.Generator().manual_seed(0)
    differing = []
    for case in range(60):
        batch, features = torch.randint(1, 70, (2,), generator=generator).tolist()
        replicas = int(torch.randint(2, 5, (1,), generator=generator))
        torch.manual_seed(case)
        model = nn.Sequential(nn.Linear(features, 37), nn.ReLU(inplace=True), nn.Linear(37, 5))
        x = torch.randn(batch, features, generator=generator, requires_grad=bool(case % 2))
        got = DataParallel(model, device_ids=["cpu"] * replicas)(x)
        if not torch.equal(got, torch.cat([model(chunk) for chunk in x.chunk(replicas)])):
            differing.append((batch, features, replicas))
    assert differing == []


def test_after_set_num_threads_the_output_is_still_bit_for_bit_the_module_on_the_chunks():
    # a replica thread's first matmul used the default thread count, not the caller's: an ulp off
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        torch.manual_seed(0)
        model, x = nn.Linear(33, 17), torch.randn(37, 33)
        want = torch.cat([model(chunk) for chunk in x.chunk(4)])
        assert torch.equal(DataParallel(model, device_ids=["cpu"] * 4)(x), want)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)



def test_on_cpu_devices_the_gradients_are_the_chunks_gradients_added_in_device_order():
    """As torch's Broadcast backward adds them: ((g0 + g1) + g2) + ..., bit for bit at every step.
    Added in the order autograd ran the replicas, they differed by an ulp in all 12 of these cases."""
    generator = torch.Generator().manual_seed(0)
    differing = []
    for case in range(12):
        batch = int(torch.randint(8, 70, (1,), generator=generator))
        replicas = int(torch.randint(3, 6, (1,), generator=generator))
        torch.manual_seed(case)
        model = nn.Sequential(nn.Linear(24, 37), nn.Tanh(), nn.Linear(37, 5))
        x = torch.randn(batch, 24, generator=generator)
        per_chunk = []
        for chunk in x.chunk(replicas):
            model.zero_grad(set_to_none=True)
            model(chunk).pow(2).sum().backward()
            per_chunk.append([p.grad.clone() for p in model.parameters()])
        want = [sum(grads[1:], grads[0]) for grads in zip(*per_chunk)]  # left to right, as listed
        dp = DataParallel(model, device_ids=["cpu"] * replicas)
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            dp(x).pow(2).sum().backward()
            if not all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), want)):
                differing.append((case, batch, replicas))
    assert differing == []

@pytest.mark.parametrize("make", [lambda: DataParallel(nn.Linear(3, 2), ["cpu"] * 2, dim="0"),
                                  lambda: data_parallel(nn.Linear(3, 2), torch.ones(4, 3), ["cpu"] * 2, dim=0.0)],
                         ids=["DataParallel", "data_parallel"])
def test_a_dim_that_is_not_an_int_is_named_at_once(make):
    with pytest.raises(TypeError, match=r"^argument 'dim' must be int, not (str|float): dim=('0'|0\.0) is the "
                                        r"batch dimension .* HINT: pass an int"):
        make()


def test_a_meta_parameter_gets_a_hint_that_can_work():
    with pytest.raises(RuntimeError, match=r"found parameter 'weight' on device meta\. HINT: materialize it "
                                           r"first, e\.g\. module\.to_empty\(device='cpu'\)"):
        DataParallel(nn.Linear(3, 2).to("meta"), ["cpu"] * 2)(torch.ones(4, 3))


def test_a_replica_may_change_its_own_input_chunk_in_place():
    class Doubles(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.mul_(2).sum(1)

    x = torch.randn(7, 4, requires_grad=True)
    got = DataParallel(Doubles(), ["cpu"] * 3)(x)
    torch.testing.assert_close(got, x.detach().mul(2).sum(1))
    got.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((7, 4), 2.0))


def test_a_time_major_module_may_view_its_dim_1_chunk():
    class TimeMajor(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            steps, batch, features = x.shape
            return x.view(steps * batch, features).sum(1).view(steps, batch)

    x = torch.randn(4, 6, 3)
    torch.testing.assert_close(DataParallel(TimeMajor(), ["cpu"] * 3, dim=1)(x), TimeMajor()(x))


def test_an_error_in_a_replica_names_it_and_its_device():
    x = torch.zeros(4, 5)
    x[2:, 0] = 1.0
    with pytest.raises(ValueError, match="replica 1 on device cpu raised ValueError: no good"):
        DataParallel(FailsOnSecondReplica(), device_ids=["cpu"] * 2)(x)


@no_cuda
def test_without_cuda_and_device_ids_the_module_is_called_directly():
    model = CountsCalls()
    wrapped = DataParallel(model)
    assert wrapped.device_ids == []
    wrapped(torch.randn(7, 5))
    assert model.sizes == [7]
    assert data_parallel(model, torch.randn(3, 5)).shape == (3, 2)


@no_cuda
def test_without_cuda_gpu_device_ids_are_ignored_as_torch_does_with_a_warning():
    with pytest.warns(UserWarning, match=r"device_ids=\[0, 1\] names cuda:0, but CUDA is not available.*"
                                         r"called as it is.*HINT: name CPU devices"):
        assert DataParallel(_mlp(), device_ids=[0, 1]).device_ids == []


@no_cuda
def test_without_cuda_the_function_refuses_gpu_device_ids_as_torchs_does():
    # torch's data_parallel raises "device type could not be determined"; the class ignores them
    with pytest.raises(RuntimeError, match=r"device type could not be determined: device_ids=\[0, 1\] "
                                           r"names cuda:0, but CUDA is not available.*HINT"):
        data_parallel(_mlp(), torch.randn(4, 5), device_ids=[0, 1])


def test_a_parameter_on_another_device_is_named():
    model = nn.Sequential(nn.Linear(5, 2), nn.Linear(2, 2, device="meta"))
    expected = r"device cpu \(device_ids\[0\]\) but found parameter '1.weight' on device meta"
    with pytest.raises(RuntimeError, match=expected):
        DataParallel(model, device_ids=["cpu"] * 2)(torch.randn(4, 5))


def test_an_empty_device_list_is_rejected_with_torchs_types_too(monkeypatch):
    # torch: RuntimeError("device type could not be determined") without CUDA, IndexError with it
    with pytest.raises(EmptyListError, match="device_ids is empty.*HINT") as raised:
        data_parallel(_mlp(), torch.randn(4, 5), device_ids=[])
    assert all(isinstance(raised.value, t) for t in (ValueError, RuntimeError, IndexError))
    assert raised.value.argument == "device_ids"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(IndexError, match="device_ids is empty.*HINT"):
        DataParallel(_mlp(), device_ids=[])


def test_an_empty_device_list_without_cuda_calls_the_module_as_torchs_does(monkeypatch, recwarn):
    # torch's DataParallel ignores device_ids on a machine without a GPU, an empty list too
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model, x = _mlp(), torch.randn(4, 5, dtype=torch.float64)
    for device_ids in ([], ()):
        dp = DataParallel(model, device_ids=device_ids)
        assert dp.device_ids == [] and torch.equal(dp(x), model(x))
    assert not [w for w in recwarn if "device_ids" in str(w.message)]


def test_is_a_torch_data_parallel_to_code_that_unwraps_it():
    model = DataParallel(_mlp(), device_ids=["cpu"] * 2)
    assert isinstance(model, nn.DataParallel) and isinstance(model, nn.parallel.DataParallel)
    unwrapped = model.module if isinstance(model, nn.DataParallel) else model
    assert unwrapped is model.module
    # torch's own checks see it too: the stateless API refuses a DataParallel, as torch's
    with pytest.raises(RuntimeError, match="stateless API can't be used with nn.DataParallel"):
        torch.func.functional_call(model, dict(model.named_parameters()), (torch.randn(4, 5),))


def test_a_batch_dim_out_of_range_names_dim_and_shape():
    with pytest.raises(ValueError, match=r"dim=2.*shape \(30, 5\)"):
        DataParallel(_mlp(), device_ids=["cpu"] * 2, dim=2)(torch.randn(30, 5, dtype=torch.float64))


@pytest.mark.parametrize(
    "output_device, error, pattern",
    [("cuda:99", ValueError, r"output_device is cuda:99, but"), (1.5, TypeError, r"output_device must be an int"),
     ("tpu", ValueError, r"output_device 'tpu' is not a device name"), ("meta", ValueError, "CPU or CUDA device")],
)
def test_an_unusable_output_device_is_rejected(output_device, error, pattern):
    with pytest.raises(error, match=pattern):
        DataParallel(_mlp(), device_ids=["cpu"] * 2, output_device=output_device)


def test_imbalanced_gpus_give_torchs_warning(monkeypatch):
    class Props:
        def __init__(self, memory: int) -> None:
            self.total_memory, self.multi_processor_count = memory, 100

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props(80 if i == 0 else 40))
    with pytest.warns(UserWarning, match="exclude GPU 1 which\n    has less than 75% of the memory"):
        dp_module._check_balance([torch.device("cuda", 0), torch.device("cuda", 1)])


def _tutorial():
    spec = importlib.util.spec_from_file_location(
        "data_parallel_tutorial", Path(__file__).parents[2] / "examples" / "data_parallel_tutorial.py"
    )
    tutorial = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tutorial)
    return tutorial


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_the_tutorial_asked_for_gpus_without_cuda_names_the_cpu_devices_to_use(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _tutorial().main(["--devices", "0,1"])
    assert exit_info.value.code == 2
    assert "--devices 0,1 names GPUs, but CUDA is not available here" in capsys.readouterr().err


def test_the_tutorial_prints_the_chunk_sizes_torch_prints(capsys):
    _tutorial().main(["--devices", "cpu,cpu,cpu"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "Let's use 3 devices!"
    inside = Counter(line for line in lines if line.startswith("\tIn Model"))
    assert inside == {
        "\tIn Model: input size torch.Size([10, 5]) output size torch.Size([10, 2])": 9,
        "\tIn Model: input size torch.Size([4, 5]) output size torch.Size([4, 2])": 2,
        "\tIn Model: input size torch.Size([2, 5]) output size torch.Size([2, 2])": 1,
    }
    outside = [line for line in lines if line.startswith("Outside")]
    assert outside[-1] == "Outside: input size torch.Size([10, 5]) output_size torch.Size([10, 2])"
    assert len(outside) == 4


@needs_cuda
def test_matches_torch_data_parallel_on_cuda():
    model = _mlp("cuda:0")
    x = torch.randn(30, 5, dtype=torch.float64, device="cuda:0")
    ours = DataParallel(model, device_ids=[0, 0, 0])(x)
    theirs = nn.DataParallel(model, device_ids=[0])(x)
    torch.testing.assert_close(ours, theirs)


@needs_cuda
def test_cpu_devices_may_gather_onto_cuda():
    model = _mlp()
    x = torch.randn(6, 5, dtype=torch.float64)
    out = DataParallel(model, device_ids=["cpu", "cpu"], output_device=0)(x)
    assert out.device == torch.device("cuda", 0)
    torch.testing.assert_close(out.cpu(), model(x))


@needs_cuda
def test_cuda_parameters_with_cpu_first_device_are_named():
    with pytest.raises(RuntimeError, match=r"found parameter '0.weight' on device cuda:0"):
        DataParallel(_mlp("cuda:0"), device_ids=["cpu", "cuda:0"])(torch.randn(4, 5, dtype=torch.float64))


def test_something_other_than_a_module_is_named_where_torchs_would_fail_on_it():
    # torch's: "'function' object has no attribute 'to'"; without devices both call it as it is
    from ddpkit.errors import NotAModuleError

    with pytest.raises(NotAModuleError, match=r"DataParallel wraps a torch.nn.Module, got function") as info:
        DataParallel(lambda t: t, device_ids=["cpu"])
    assert isinstance(info.value, AttributeError)


@pytest.fixture
def deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


@pytest.mark.parametrize("devices", [["cpu"] * 3, pytest.param(["cuda:0"] * 3, marks=needs_cuda)],
                         ids=["3xcpu", "3xcuda0"])
def test_dropout_on_a_repeated_device_is_reproducible_in_deterministic_mode(devices, deterministic):
    # replicas sharing a device share its generator: in deterministic mode they draw in replica order
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(32, 32), nn.Dropout(0.5))]).to(devices[0])
    x = torch.randn(30, 32, device=devices[0])
    dp = DataParallel(model, device_ids=devices)
    outputs = []
    for _ in range(3):
        torch.manual_seed(123)
        outputs.append(dp(x))
    torch.manual_seed(123)
    expected = torch.cat([model(chunk) for chunk in x.chunk(3)])
    for output in outputs:
        torch.testing.assert_close(output, expected, rtol=0, atol=0)
