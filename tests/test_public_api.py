"""The public surface of API.md: every name is there, and is the function, not a same-named module."""
from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import pytest
import torch

import ddpkit

API_NAMES = ["init", "shutdown", "get_rank", "get_world_size", "is_main_process", "all_reduce",
             "broadcast", "broadcast_object", "all_gather", "reduce_scatter", "barrier", "replicate",
             "scatter", "scatter_kwargs", "parallel_apply", "gather", "DataParallel", "data_parallel",
             "DistributedDataParallel", "DDP", "parallelize", "save", "load", "print"]


def test_every_api_name_is_exported_and_callable():
    for name in API_NAMES:
        assert callable(getattr(ddpkit, name)), name
        assert name in ddpkit.__all__, name
    assert ddpkit.DDP is ddpkit.DistributedDataParallel
    for hook in ("allreduce_hook", "fp16_compress_hook", "bf16_compress_hook"):
        assert callable(getattr(ddpkit.hooks, hook))


def test_importing_a_submodule_never_shadows_the_function_of_the_same_name():
    for module in ("dp.replicate", "dp.parallel_apply", "dp.data_parallel", "parallelize", "logging"):
        importlib.import_module(f"ddpkit.{module}")
    for package in (ddpkit, ddpkit.dp):
        assert inspect.isfunction(package.data_parallel) and inspect.isfunction(package.replicate)
        assert inspect.isfunction(package.parallel_apply)
    assert inspect.isfunction(ddpkit.parallelize)
    out = ddpkit.data_parallel(torch.nn.Linear(3, 2), torch.ones(4, 3), device_ids=["cpu", "cpu"])
    assert out.shape == (4, 2)


# API.md's signatures: torch's arguments and defaults (newer torch spells some defaults None)
API_SIGNATURES = {
    "DistributedDataParallel": dict(device_ids=None, output_device=None, dim=0, broadcast_buffers=None,
                                    init_sync=True, process_group=None, bucket_cap_mb=None,
                                    find_unused_parameters=False, check_reduction=False,
                                    gradient_as_bucket_view=False, static_graph=False,
                                    delay_all_reduce_named_params=None, param_to_hook_all_reduce=None,
                                    mixed_precision=None, device_mesh=None, skip_all_reduce_unused_params=False,
                                    bucket_cap_mb_list=None, batched_grad_copy=False, forward_sync_buffers=None),
    "DataParallel": dict(device_ids=None, output_device=None, dim=0),
    "replicate": dict(detach=False),
    "scatter": dict(dim=0),
    "scatter_kwargs": dict(dim=0),
    "parallel_apply": dict(kwargs_tup=None, devices=None),
    "gather": dict(dim=0),
    "data_parallel": dict(device_ids=None, output_device=None, dim=0, module_kwargs=None),
}


def test_signatures_and_defaults_are_the_contracts():
    for name, defaults in API_SIGNATURES.items():
        params = inspect.signature(getattr(ddpkit, name)).parameters
        for arg, default in defaults.items():
            assert arg in params, f"ddpkit.{name} lacks argument {arg!r}"
            assert params[arg].default == default, f"ddpkit.{name}({arg}=...) default"
        theirs = (getattr(torch.nn, name, None) or getattr(torch.nn.parallel, name, None)
                  or getattr(torch.nn.parallel.scatter_gather, name))
        their_params = inspect.signature(theirs).parameters
        assert set(defaults) <= set(their_params), f"torch's {name} names its arguments differently"


def test_ddp_signature_is_torchs_names_order_defaults_and_kinds():
    """API.md: torch's constructor exactly, so that positional calls mean the same (the 6th is init_sync)."""
    def described(cls) -> list[tuple]:
        return [(p.name, p.default, p.kind) for p in inspect.signature(cls).parameters.values()]

    assert described(ddpkit.DistributedDataParallel) == described(torch.nn.parallel.DistributedDataParallel)
    assert list(inspect.signature(ddpkit.DDP).parameters)[5] == "init_sync"


@pytest.mark.parametrize("method", ["_pre_forward", "_post_forward", "_find_common_rank", "no_sync", "join",
                                    "join_hook", "register_comm_hook", "_set_static_graph",
                                    "_get_ddp_logging_data", "will_sync_module_buffers"])
def test_ddp_methods_that_subclasses_and_torch_call_take_torchs_arguments(method):
    def described(fn) -> list[tuple]:
        return [(p.name, p.default, p.kind) for p in inspect.signature(fn).parameters.values()]

    assert described(getattr(ddpkit.DDP, method)) == \
        described(getattr(torch.nn.parallel.DistributedDataParallel, method))


def test_parallelize_passes_on_every_argument_of_torchs_ddp():
    """parallelize reads DDP's signature: each of torch 2.13's arguments is an option (device_ids it picks)."""
    from ddpkit.parallelize import _DDP_OPTIONS

    theirs = set(inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters) - {"module", "device_ids"}
    assert set(_DDP_OPTIONS) == theirs
    model = torch.nn.Linear(2, 2)  # a single process without GPUs: DDP's options are accepted, unused
    assert ddpkit.parallelize(model, init_sync=False, forward_sync_buffers=False, bucket_cap_mb_list=[1]) is model \
        or torch.cuda.device_count() > 0


def test_torchs_keyword_names_work_too():
    """Code written for torch calls scatter(..., target_gpus=...) and replicate(network=...)."""
    x = torch.arange(6.0).view(3, 2)
    ours = ddpkit.scatter(x, target_devices=["cpu", "cpu"])
    theirs = ddpkit.scatter(inputs=x, target_gpus=["cpu", "cpu"], dim=0)
    assert [t.tolist() for t in theirs] == [t.tolist() for t in ours] == [[[0.0, 1.0], [2.0, 3.0]], [[4.0, 5.0]]]
    inputs, kwargs = ddpkit.scatter_kwargs((x,), {"y": x}, target_gpus=["cpu", "cpu"])
    assert len(inputs) == len(kwargs) == 2 and torch.equal(kwargs[1]["y"], x[2:])
    replicas = ddpkit.replicate(network=torch.nn.Linear(2, 2), devices=["cpu", "cpu"])
    assert len(replicas) == 2 and torch.equal(replicas[0](x), replicas[1](x))
    with pytest.raises(TypeError, match=r"scatter\(\) got both target_devices= and torch's name for it, "
                                        r"target_gpus=; pass one"):
        ddpkit.scatter(x, target_devices=["cpu"], target_gpus=["cpu"])
    for name in ("scatter", "scatter_kwargs", "replicate", "gather", "parallel_apply"):
        theirs = inspect.signature(getattr(torch.nn.parallel, name, None)
                                   or getattr(torch.nn.parallel.scatter_gather, name)).parameters
        ours = inspect.signature(getattr(ddpkit, name)).parameters
        aliases = {"target_gpus": "target_devices", "network": "module"}
        assert [aliases.get(p, p) for p in theirs] == list(ours), name


def test_python_dash_m_ddpkit_answers():
    result = subprocess.run([sys.executable, "-m", "ddpkit", "--help"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and "run" in result.stdout and "bench" in result.stdout


def _fresh(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)


def test_import_ddpkit_loads_no_torch_and_each_name_loads_its_part_on_first_use():
    result = _fresh(
        "import sys, inspect, ddpkit\n"
        "assert 'torch' not in sys.modules, 'import ddpkit loaded torch'\n"
        "import ddpkit.parallelize\n"  # the module first: the package's name stays the function
        "assert inspect.isfunction(ddpkit.parallelize), ddpkit.parallelize\n"
        "assert set(ddpkit.__all__) <= set(dir(ddpkit))\n"
        "from ddpkit import DDP, init, HANG_EXIT_CODE, print\n"
        "assert DDP is ddpkit.DistributedDataParallel and HANG_EXIT_CODE == 86\n"
        "from ddpkit.runtime import DistEnv, all_reduce, get_rank\n"
        "assert ddpkit.env.DistEnv is DistEnv and get_rank() == 0\n"
        "try:\n"
        "    ddpkit.no_such_name\n"
        "except AttributeError as e:\n"
        "    assert 'no_such_name' in str(e)\n"
        "else:\n"
        "    raise AssertionError('no AttributeError')\n")
    assert result.returncode == 0, result.stderr


def test_ddpkit_runs_modules_load_no_torch_before_its_workers_start():
    # the launcher of one node imports torch only once its workers started (Note [Launcher start])
    result = _fresh(
        "import sys\n"
        "import ddpkit.cli, ddpkit.launch.cli, ddpkit.launch.supervisor, ddpkit.launch.rendezvous\n"
        "from ddpkit.launch.config import parse_args\n"
        "from ddpkit.launch.rendezvous import for_config\n"
        "for_config(parse_args(['--nproc-per-node', '2', 'train.py']))\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not loaded, loaded\n")
    assert result.returncode == 0, result.stderr


def test_torchs_numpy_warning_is_filtered_for_a_torch_imported_after_ddpkit():
    # numpy made unimportable: torch then warns "Failed to initialize NumPy" as it loads
    script = "import sys\nsys.modules['numpy'] = None\n{}\nimport torch\n"
    plain = _fresh(script.format(""))
    ours = _fresh(script.format("import ddpkit"))
    assert plain.returncode == 0 and ours.returncode == 0, (plain.stderr, ours.stderr)
    assert "Failed to initialize NumPy" in plain.stderr
    assert "Failed to initialize NumPy" not in ours.stderr, ours.stderr
