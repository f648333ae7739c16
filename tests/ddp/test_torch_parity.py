"""ddpkit's DDP against torch's, member by member: the public names, their values, the private
members libraries call, and torch's words in ddpkit's errors.

Each 2-rank Gloo run builds both DDPs on identical models and returns what each says, so a test
compares ddpkit's answer with torch's rather than with a value written down here.
"""
from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import ddpkit

_MODULE_NAMES = set(dir(nn.Module))
_DDPKIT_ONLY = {"rank", "world_size"}  # ddpkit's own public facts (docs/torch-compat.md)
_SKIP_VALUE = {"module", "reducer", "logger", "process_group", "join_process_group", "modules_buffers",
               "named_module_buffers"}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def _public(ddp: nn.Module) -> set[str]:
    names = {n for n in vars(ddp) if not n.startswith("_")} - {"training"}
    return names | ({n for n in dir(type(ddp)) if not n.startswith("_")} - _MODULE_NAMES)


def _plain(value):
    """A comparable form of an attribute's value (a device as text, a set sorted)."""
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, torch.device):
        return str(value)
    return value


def _attributes_worker(kwargs: dict) -> dict:
    both = {"torch": TorchDDP(_model(), **kwargs), "ddpkit": ddpkit.DistributedDataParallel(_model(), **kwargs)}
    out = {}
    for who, ddp in both.items():
        names = _public(ddp)
        values = {n: _plain(getattr(ddp, n)) for n in names
                  if n not in _SKIP_VALUE and not callable(getattr(ddp, n))}
        values["process_group is the default group"] = ddp.process_group is dist.group.WORLD
        values["named_module_buffers"] = {n: b.clone() for n, b in ddp.named_module_buffers.items()}
        values["modules_buffers"] = [b.clone() for b in ddp.modules_buffers]
        sync, rebuilt, logging_data = [], [], []
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
        for _ in range(3):
            sync.append((ddp.will_sync_module_buffers(), ddp._check_sync_bufs_pre_fwd()))
            rebuilt.append(ddp._has_rebuilt_buckets)
            logging_data.append(ddp._get_ddp_logging_data())
            ddp(x).sum().backward()
        with torch.no_grad():
            ddp(x)  # an unsynced forward: the next one does not broadcast buffers
        sync.append((ddp.will_sync_module_buffers(), ddp._check_sync_bufs_pre_fwd()))
        moved = ddp.to_kwargs((x, [x]), {"y": x}, 0)
        out[who] = {"names": names, "values": values, "sync": sync, "rebuilt": rebuilt,
                    "logging": logging_data, "to_kwargs": moved, "to_kwargs_no_kwargs": ddp.to_kwargs((x,), {}, 0)}
    return out


@pytest.mark.parametrize("kwargs", [{}, {"bucket_cap_mb": 1, "broadcast_buffers": False},
                                    {"find_unused_parameters": True}, {"static_graph": True}],
                         ids=["defaults", "cap-no-buffers", "find-unused", "static-graph"])
def test_public_names_and_values_match_torch(kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # broadcast_buffers is deprecated in both
        results = run_ranks(_attributes_worker, world_size=2, args=(kwargs,))
    for rank, out in enumerate(results):
        t, d = out["torch"], out["ddpkit"]
        assert d["names"] - _DDPKIT_ONLY == t["names"], f"rank {rank}"
        for name, value in t["values"].items():
            if name in ("named_module_buffers", "modules_buffers"):
                continue
            assert d["values"][name] == value, f"rank {rank}: {name}"
        assert list(d["values"]["named_module_buffers"]) == list(t["values"]["named_module_buffers"])
        for a, b in zip(d["values"]["modules_buffers"], t["values"]["modules_buffers"], strict=True):
            assert torch.equal(a, b)
        assert d["sync"] == t["sync"]
        assert d["rebuilt"] == t["rebuilt"]
        for moved in ("to_kwargs", "to_kwargs_no_kwargs"):
            _assert_same_structure(d[moved], t[moved])
        # torch's logging data, every key that is not a time (tests/ddp/test_logging_data.py has more)
        for step, (dl, tl) in enumerate(zip(d["logging"], t["logging"], strict=True)):
            same = {k: v for k, v in tl.items() if not k.endswith(("_time", "_start", "_end"))
                    and not k.startswith("avg_") and k != "num_buckets_reduced"}
            assert sorted(dl) == sorted(tl) and {k: dl[k] for k in same} == same, f"rank {rank} step {step}"


def _assert_same_structure(a, b) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b) and a.device == b.device
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same_structure(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_same_structure(a[k], b[k])
    else:
        assert a == b


def _scatter_gather_worker() -> dict:
    ddp = ddpkit.DistributedDataParallel(_model())
    x = torch.arange(12.0).view(6, 2)
    inputs, kwargs = ddp.scatter((x,), {"y": x}, ["cpu", "cpu"])
    return {"inputs": inputs, "kwargs": kwargs, "gathered": ddp.gather([t[0] for t in inputs], "cpu"), "x": x}


def test_scatter_and_gather_split_and_join_along_dim():
    """torch's own scatter and gather need CUDA; on CPU the reference is chunk and cat along dim."""
    out = run_ranks(_scatter_gather_worker, world_size=2)[0]
    halves = out["x"].chunk(2)
    assert [t[0] for t in out["inputs"]] == list(out["inputs"][i][0] for i in range(2))
    for i in range(2):
        assert torch.equal(out["inputs"][i][0], halves[i]) and torch.equal(out["kwargs"][i]["y"], halves[i])
    assert torch.equal(out["gathered"], out["x"])


def _private_worker() -> dict:
    ddp = ddpkit.DistributedDataParallel(_model())
    out = {"deepcopy_names": _public(copy.deepcopy(ddp)) == _public(ddp)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        TorchDDP(_model(), static_graph=True)._set_static_graph()
        ddpkit.DistributedDataParallel(_model(), static_graph=True)._set_static_graph()
    out["static_warnings"] = [str(w.message) for w in caught]
    ignored = {}
    for who, DDP in (("torch", TorchDDP), ("ddpkit", ddpkit.DistributedDataParallel)):  # noqa: N806
        model = _model()
        DDP._set_params_and_buffers_to_ignore_for_model(model, ["0.bias", "1.running_mean"])
        ignored[who] = sorted(n for n, t in (*model.named_parameters(), *model.named_buffers())
                              if getattr(t, "_ddp_ignored", False))
        ddp = DDP(model)
        with torch.no_grad():  # different buffers per rank; torch's call with no argument syncs rank 0's
            for b in ddp.module.buffers():
                b.fill_(dist.get_rank() + 1)
        ddp._sync_buffers()
        out[f"synced {who}"] = {n: b.clone() for n, b in ddp.module.named_buffers()}
    out["ignored"] = ignored
    return out


def test_private_members_answer_or_refuse_clearly():
    for rank, out in enumerate(run_ranks(_private_worker, world_size=2)):
        assert out["deepcopy_names"]
        torch_warning, ddpkit_warning = out["static_warnings"]
        assert torch_warning in ddpkit_warning
        assert out["ignored"]["ddpkit"] == out["ignored"]["torch"] == ["0.bias", "1.running_mean"]
        after_torch, after_ddpkit = out["synced torch"], out["synced ddpkit"]
        assert list(after_torch) == list(after_ddpkit)
        for name, value in after_torch.items():  # the ignored buffer keeps this rank's value in both
            assert torch.equal(after_ddpkit[name], value), (rank, name)
        assert after_ddpkit["1.running_var"].eq(1).all() and after_ddpkit["1.running_mean"].eq(rank + 1).all()


# ---- torch's words in ddpkit's errors -----------------------------------------------------------
class _HalfUsed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x):
        return self.a(x)


class _SometimesB(nn.Module):
    """``b`` is used only where ``use_b`` says: a graph that changes, for static_graph's errors."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x, use_b: bool):
        return self.b(self.a(x)) if use_b else self.a(x)


class _CheckpointedTwice(nn.Module):
    """One layer under two reentrant checkpoints: its gradients arrive in two reentrant backwards."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(2, 2)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.a, checkpoint(self.a, x, use_reentrant=True), use_reentrant=True)


def _returns_tensor(state, bucket):
    return bucket.buffer()


def _bucket_annotated_int(state, bucket: int) -> torch.futures.Future[torch.Tensor]:
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future()


def _annotated_tensor(state, bucket) -> torch.Tensor:
    return bucket.buffer()


def _failing_future(state, bucket):  # unannotated: torch reads this file's annotations as strings
    future: torch.futures.Future = torch.futures.Future()
    future.set_exception(ValueError("compression failed"))
    return future


def _failing_callback(state, bucket):  # the usual shape of a hook: a collective, then a callback
    def decompress(future):
        raise ValueError("decompression failed")
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(decompress)


def _misuse(kind: str, DDP: type) -> None:  # noqa: N803 - a class, torch's or ddpkit's
    rank, x = dist.get_rank(), torch.ones(1, 2, requires_grad=True)
    if kind == "unused":
        ddp = DDP(_HalfUsed())
        for _ in range(2):
            ddp(x).sum().backward()
    elif kind in ("static_graph_grew", "static_graph_shrank"):  # b unused, then used; or the reverse
        ddp = DDP(_SometimesB(), static_graph=True)
        for step in range(4):
            ddp(x, use_b=(step >= 2) == (kind == "static_graph_grew")).sum().backward()
    elif kind == "marked_twice":
        ddp = DDP(_CheckpointedTwice(), find_unused_parameters=True)  # kept: torch's holds itself weakly
        ddp(x).sum().backward()
    elif kind == "hook_twice":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        ddp = DDP(nn.Linear(2, 2))
        ddp.register_comm_hook(None, allreduce_hook)
        ddp.register_comm_hook(None, allreduce_hook)
    elif kind == "hook_returns_tensor":
        ddp = DDP(nn.Linear(2, 2))
        ddp.register_comm_hook(None, _returns_tensor)
        ddp(x).sum().backward()
    elif kind == "hook_bucket_annotation":  # annotations are strings here (from __future__): torch reads them
        DDP(nn.Linear(2, 2)).register_comm_hook(None, _bucket_annotated_int)
    elif kind == "hook_return_annotation":
        DDP(nn.Linear(2, 2)).register_comm_hook(None, _annotated_tensor)
    elif kind == "torch_sync_batchnorm_on_cpu":
        DDP(nn.Sequential(nn.Linear(2, 2), nn.SyncBatchNorm(2)))
    elif kind == "hook_not_callable":
        DDP(nn.Linear(2, 2)).register_comm_hook(None, 3)
    elif kind == "device_ids_on_cpu":
        DDP(nn.Linear(2, 2), device_ids=[0])
    elif kind == "two_device_ids":
        DDP(nn.Linear(2, 2), device_ids=[0, 1])
    elif kind == "nothing_to_train":
        DDP(nn.Linear(2, 2).requires_grad_(False))
    elif kind == "models_differ":
        DDP(nn.Sequential(*[nn.Linear(2, 2) for _ in range(1 + rank)]))
    elif kind == "lazy":
        DDP(nn.LazyLinear(2))
    elif kind == "two_device_types":  # meta stands in for a second device type
        DDP(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta")))
    elif kind == "expanded_buffer":  # its elements share memory: the broadcast cannot write it
        model = nn.Linear(2, 2)
        model.register_buffer("spread", torch.zeros(2).expand(3, 2))
        DDP(model)
    elif kind == "static_graph_late":
        ddp = DDP(nn.Linear(2, 2))
        ddp(x).sum().backward()
        ddp._set_static_graph()
    elif kind == "join_exhausted":
        ddp = DDP(nn.Linear(2, 2))
        with ddp.join(throw_on_early_termination=True):
            for _ in range(1 + 2 * rank):
                ddp(x).sum().backward()
    elif kind == "pickle_subgroup":
        copy.deepcopy(DDP(nn.Linear(2, 2), process_group=dist.new_group([0, 1])))
    elif kind == "meta":  # deferred initialization: materialized after wrapping, nothing would be averaged
        DDP(nn.Linear(2, 2, device="meta"))
    elif kind == "not_a_module":
        DDP(lambda x: x)
    elif kind == "group_as_a_string":
        DDP(nn.Linear(2, 2), process_group="gloo")
    elif kind == "sparse_made_dense":  # a sparse embedding tied to the output layer: a dense gradient
        model = nn.Sequential(nn.Embedding(6, 2, sparse=True), nn.Linear(2, 6, bias=False))
        model[1].weight = model[0].weight
        ddp = DDP(model)  # kept: torch's holds itself weakly
        ddp(torch.tensor([1, 4])).sum().backward()
    elif kind in ("hook_future_fails", "hook_callback_fails"):
        ddp = DDP(nn.Linear(2, 2))
        ddp.register_comm_hook(None, _failing_future if kind == "hook_future_fails" else _failing_callback)
        ddp(x).sum().backward()


def _misuse_worker(kind: str) -> dict:
    out = {}
    for who, DDP in (("torch", TorchDDP), ("ddpkit", ddpkit.DistributedDataParallel)):  # noqa: N806
        try:
            _misuse(kind, DDP)
            out[who] = None
        except Exception as e:  # noqa: BLE001 - what each raises is the result
            facts = {k: v for k, v in vars(e).items() if isinstance(v, (int, str, dict, bool))}
            out[who] = ([c.__name__ for c in type(e).__mro__], str(e), facts)
    return out


# kind: (torch's key phrase, or phrases, and whether ddpkit's message names the rank)
_MISUSES = {
    "unused": (("Expected to have finished reduction in the prior iteration before starting a new one",
                "your module has parameters that were not used in producing loss"), True),
    "static_graph_grew": (("Your training graph has changed in this iteration",
                           "not compatible with static_graph set to True"), True),
    "static_graph_shrank": (("Expected to have finished reduction in the prior iteration before starting a new one",
                             "your training graph has changed in this iteration"), True),
    "marked_twice": ("Expected to mark a variable ready only once", True),
    "hook_twice": ("register_comm_hook or register_builtin_comm_hook can only be called once", True),
    "hook_returns_tensor": ("must return a torch.futures.Future object", True),
    "hook_bucket_annotation": ("Communication hook: bucket annotation should be dist.GradBucket", True),
    "hook_return_annotation": ("Communication hook: return annotation should be torch.futures.Future[torch.Tensor]",
                               True),
    "torch_sync_batchnorm_on_cpu": ("SyncBatchNorm layers only work with GPU modules", False),
    "hook_not_callable": ("Communication hook must be callable", True),
    "device_ids_on_cpu": ("DistributedDataParallel device_ids and output_device arguments only work with "
                          "single-device/multiple-device GPU modules or CPU modules", False),
    "two_device_ids": ("device_ids can only be None or contain a single element", False),
    "nothing_to_train": ("DistributedDataParallel is not needed when a module doesn't have any parameter that "
                         "requires a gradient", True),
    "models_differ": ("DDP expects same model across all ranks", True),
    "lazy": ("Modules with uninitialized parameters can't be used with `DistributedDataParallel`", False),
    "two_device_types": ("DistributedDataParallel's input module must be on the same type of devices", False),
    "expanded_buffer": ("unsupported operation: more than one element of the written-to tensor refers to a "
                        "single memory location", True),
    "static_graph_late": ("set_static_graph() should be called before training loop starts and after "
                          "DistributedDataParallel is constructed", True),
    "join_exhausted": ("exhausted", False),  # torch's Join speaks for both: the same words
    "pickle_subgroup": ("DDP Pickling/Unpickling are only supported when using DDP with the default process "
                        "group", False),
    "meta": ("Tensor.item() cannot be called on meta tensors", False),
    "sparse_made_dense": ("Expected variable to have sparse gradient", True),
    # torch's words here are an accident of its code ("'function' object has no attribute
    # 'named_parameters'", a pybind signature, "Unable to cast compression failed to Tensor"): its type
    # is kept, and ddpkit says what is wrong
    "not_a_module": ("", False),
    "group_as_a_string": ("", False),
    "hook_future_fails": ("", True),
    "hook_callback_fails": ("decompression failed", True),
}


@pytest.mark.parametrize("kind", list(_MISUSES))
def test_misuse_raises_torchs_type_with_torchs_words(kind):
    phrase, names_rank = _MISUSES[kind]
    for rank, out in enumerate(run_ranks(_misuse_worker, world_size=2, args=(kind,))):
        assert out["torch"] is not None and out["ddpkit"] is not None, (rank, out)
        (torch_mro, torch_message, _), (ddpkit_mro, message, facts) = out["torch"], out["ddpkit"]
        assert torch_mro[0] in ddpkit_mro, (rank, torch_mro[0], ddpkit_mro)  # the same type, or a subclass
        for words in phrase if isinstance(phrase, tuple) else (phrase,):
            assert words in torch_message, (rank, torch_message)  # the phrase is torch's
            assert words in message, (rank, message)
        if names_rank:
            assert f"rank {rank}" in message or f"Rank {rank}" in message, message
        if "rank" in facts:
            assert facts["rank"] == rank
        if kind == "unused":
            assert facts["by_rank"] == {0: ["b.weight", "b.bias"], 1: ["b.weight", "b.bias"]}
            assert "'b.weight', 'b.bias'" in message
        if kind == "marked_twice":  # torch names the parameter too (with TORCH_DISTRIBUTED_DEBUG unset)
            assert f"with name {facts['parameter']} has been marked as ready twice" in torch_message
            assert f"parameter '{facts['parameter']}'" in message
        if kind in ("hook_future_fails", "hook_callback_fails"):  # named, and caused by the hook's error
            assert ddpkit_mro[0] == "CommHookError" and "_failing_" in facts["hook"], (ddpkit_mro, facts)
        if kind == "join_exhausted":
            assert message == torch_message
        if kind == "sparse_made_dense":
            assert facts["parameter"] == "0.weight" and "'0.weight'" in message
        if kind == "models_differ":
            assert facts["differing_rank"] == 1 and "'1.weight'" in message


_ALL_USED = "find_unused_parameters=True was specified in DDP constructor, but did not find any unused parameters"


def _all_used_warning_worker() -> dict:
    x = torch.ones(1, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        half = ddpkit.DistributedDataParallel(_HalfUsed(), find_unused_parameters=True)
        for _ in range(2):
            half(x).sum().backward()
        unused_warnings = len(caught)
        for _ in range(2):  # two models, every parameter used: said once in the process, as torch's
            full = ddpkit.DistributedDataParallel(nn.Linear(2, 2), find_unused_parameters=True)
            for _ in range(2):
                full(x).sum().backward()
    said = [(str(w.message), w.category.__name__, os.path.basename(w.filename)) for w in caught
            if _ALL_USED in str(w.message)]
    return {"unused_warnings": unused_warnings, "said": said}


def test_find_unused_parameters_with_none_unused_warns_once_as_torch():
    """torch's reducer says it once per process (TORCH_WARN_ONCE, on stderr through its C++ log);
    ddpkit says it with torch's words as a UserWarning at the user's line, which filters can silence."""
    for rank, out in enumerate(run_ranks(_all_used_warning_worker, world_size=2)):
        assert out["unused_warnings"] == 0, out  # something unused: nothing to say
        [(message, category, filename)] = out["said"]
        assert category == "UserWarning" and f"on rank {rank}" in message and "HINT: " in message, message
        assert filename == os.path.basename(__file__), filename  # the user's line, not ddpkit's


def _allreduce_spelled_as_strings(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])


def _hooks_across_worker() -> dict:
    """ddpkit's hooks on torch's DDP, and a hook annotated in strings on ddpkit's: as torch's hooks."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    grads = {}
    for who, DDP, hook in (("torch", TorchDDP, default_hooks.fp16_compress_hook),  # noqa: N806
                           ("ddpkit hook on torch", TorchDDP, ddpkit.hooks.fp16_compress_hook),
                           ("ddpkit allreduce on torch", TorchDDP, ddpkit.hooks.allreduce_hook),
                           ("strings on ddpkit", ddpkit.DDP, _allreduce_spelled_as_strings)):
        ddp = DDP(_model())
        ddp.register_comm_hook(None, hook)
        ddp(x).sum().backward()
        grads[who] = [p.grad.clone() for p in ddp.parameters()]
    return grads


def test_ddpkits_hooks_serve_torchs_ddp_and_string_annotations_serve_ddpkits():
    for out in run_ranks(_hooks_across_worker, world_size=2):
        for name in ("ddpkit hook on torch", "ddpkit allreduce on torch", "strings on ddpkit"):
            for a, b in zip(out[name], out["torch"], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)  # fp16 rounding in torch's


def _builtin_hook_worker(name: str) -> dict:
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    grads = {}
    for who, DDP in (("torch", TorchDDP), ("ddpkit", ddpkit.DistributedDataParallel)):  # noqa: N806
        ddp = DDP(_model())
        ddp._register_builtin_comm_hook(getattr(dist.BuiltinCommHookType, name))
        ddp(x).sum().backward()
        grads[who] = [p.grad.clone() for p in ddp.parameters()]
    return grads


@pytest.mark.parametrize("name", ["ALLREDUCE", "FP16_COMPRESS"])
def test_builtin_comm_hooks_by_name_average_as_torchs(name):
    # torch's docstring example registers them this way
    for out in run_ranks(_builtin_hook_worker, world_size=2, args=(name,)):
        for a, b in zip(out["ddpkit"], out["torch"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _late_hook_worker() -> dict:
    """torch accepts a comm hook after training started (no error, no warning): so must ddpkit."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    grads = {}
    for who, DDP in (("torch", TorchDDP), ("ddpkit", ddpkit.DistributedDataParallel)):  # noqa: N806
        ddp = DDP(_model())
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for step in range(3):
                if step == 1:
                    ddp.register_comm_hook(None, allreduce_hook)
                ddp.zero_grad()
                ddp(x).sum().backward()
        grads[who] = [p.grad.clone() for p in ddp.parameters()]
    return grads


def test_comm_hook_registered_after_training_started_averages_as_torch():
    for out in run_ranks(_late_hook_worker, world_size=2):
        for a, b in zip(out["ddpkit"], out["torch"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _fused_optim_worker() -> dict:
    """torch's optimizer in backward: the parameters move during backward, no optimizer.step()."""
    out = {}
    for who, DDP in (("torch", TorchDDP), ("ddpkit", ddpkit.DistributedDataParallel)):  # noqa: N806
        for optim, args, kwargs, subset in ((torch.optim.SGD, (0.1,), {"momentum": 0.9}, False),
                                            (torch.optim.Adam, (0.01,), {"betas": (0.8, 0.9)}, True)):
            torch.manual_seed(0)
            ddp = DDP(_model())
            params = [next(ddp.module.parameters())] if subset else None
            ddp._register_fused_optim(optim, *args, optim_params=params, **kwargs)
            for step in range(3):
                x = torch.randn(4, 4, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
                ddp(x).pow(2).sum().backward()
            out[f"{who} {optim.__name__}"] = [p.detach().clone() for p in ddp.parameters()]
        try:
            ddp.register_comm_hook(None, lambda state, bucket: None)
        except RuntimeError as e:
            out[f"{who} second hook"] = str(e)
    return out


def test_register_fused_optim_steps_the_parameters_in_backward_as_torchs():
    for out in run_ranks(_fused_optim_worker, world_size=2):
        for name in ("SGD", "Adam"):
            moved = [not torch.equal(a, b) for a, b in zip(out[f"torch {name}"], _model().parameters())]
            assert any(moved)
            for a, b in zip(out[f"ddpkit {name}"], out[f"torch {name}"]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        torch_phrase = "register_comm_hook or register_builtin_comm_hook can only be called once"
        assert torch_phrase in out["torch second hook"] and torch_phrase in out["ddpkit second hook"]


def test_register_fused_optim_without_a_process_group_says_it_needs_one():
    ddp = ddpkit.DistributedDataParallel(_model())
    with pytest.raises(RuntimeError, match=r"_register_fused_optim\(SGD\) needs a process group.*HINT"):
        ddp._register_fused_optim(torch.optim.SGD, 0.1)
