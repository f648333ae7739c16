"""torch.profiler traces name ddpkit DDP's work: its forward as torch's DDP names it, and per bucket
the fill (with its bytes), the all-reduce or comm hook, the write-back, and the end-of-backward wait."""
from __future__ import annotations

import json

import pytest
import torch
from ranks import run_ranks
from torch import nn
from torch.profiler import ProfilerActivity, profile

import ddpkit
from ddpkit.ddp import profiling

CAP_MB = 1100 / 2**20  # a Linear(16, 16)'s weight and bias (1088 B) fill a bucket: several buckets


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def _step(model: nn.Module) -> None:
    model(torch.randn(8, 16)).sum().backward()


def _profiled_step(model: nn.Module, trace: str | None = None) -> list[str]:
    _step(model)  # the buckets are rebuilt after the first step: profile the second
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _step(model)
    if trace is not None:
        prof.export_chrome_trace(trace)
    return [e.name for e in prof.events()]


def _worker(trace_dir: str) -> dict:
    trace = f"{trace_dir}/rank{ddpkit.get_rank()}.json"
    ddp = ddpkit.DDP(_model(), bucket_cap_mb=CAP_MB)
    names = _profiled_step(ddp, trace)
    with open(trace) as f:
        traced = [e.get("name") for e in json.load(f)["traceEvents"]]
    # the bucket sizes by hand: the parameters' bytes
    buckets = [(b.index(), sum(p.numel() * p.element_size() for p in b.params)) for b in ddp.reducer.buckets]
    hooked = ddpkit.DDP(_model(), bucket_cap_mb=CAP_MB)
    hooked.register_comm_hook(None, ddpkit.hooks.allreduce_hook)
    return {"names": names, "traced": traced, "buckets": buckets, "hooked": _profiled_step(hooked),
            "torch": _profiled_step(nn.parallel.DistributedDataParallel(_model())),
            "total": sum(p.numel() * p.element_size() for p in _model().parameters())}


@pytest.mark.timeout(120)
def test_a_profiled_training_step_names_ddpkit_ddp_work_per_bucket(tmp_path):
    for rank in run_ranks(_worker, world_size=2, args=(str(tmp_path),), timeout=90):
        buckets = rank["buckets"]
        assert len(buckets) >= 2 and sum(size for _, size in buckets) == rank["total"]
        assert "DistributedDataParallel.forward" in rank["torch"]  # the reference's name for it
        expected = ["DistributedDataParallel.forward", "ddpkit.finalize_backward.wait"]
        for index, size in buckets:
            expected += [f"ddpkit.bucket[{index}].fill ({size} B)", f"ddpkit.bucket[{index}].all_reduce",
                         f"ddpkit.bucket[{index}].write_back"]
        for name in expected:
            assert rank["names"].count(name) == 1, name  # once per step: per bucket, not per parameter
            assert name in rank["traced"], name
        assert not any(".comm_hook" in n for n in rank["names"])
        hooked = [n for n in rank["hooked"] if n.startswith("ddpkit.bucket[")]
        assert any(n.endswith(".comm_hook") for n in hooked) and not any(n.endswith(".all_reduce") for n in hooked)


def test_ranges_cost_nothing_but_a_flag_read_when_no_profiler_runs(monkeypatch):
    def refuse(name):
        raise AssertionError(f"record_function({name!r}) entered with no profiler running")

    bucket = ddpkit.ddp.bucket.Bucket(3, [nn.Parameter(torch.zeros(5))], [0], is_last=True)
    monkeypatch.setattr(torch.autograd.profiler, "record_function", refuse)
    assert not profiling.profiling()
    with profiling.profiled("x"), profiling.bucket_range(bucket, "fill"):
        pass
    monkeypatch.undo()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        assert profiling.profiling()
        with profiling.bucket_range(bucket, "fill"):
            pass
    assert [e.name for e in prof.events()] == ["ddpkit.bucket[3].fill (20 B)"]


def _execution_trace_worker(path: str) -> list[str]:
    from torch.profiler import ExecutionTraceObserver

    model = ddpkit.DDP(_model())
    _step(model)
    observer = ExecutionTraceObserver().register_callback(f"{path}.{torch.distributed.get_rank()}.json")
    observer.start()  # no profiler: torch's Python flag stays off
    _step(model)
    observer.stop()
    observer.unregister_callback()
    with open(f"{path}.{torch.distributed.get_rank()}.json") as f:
        return [node["name"] for node in json.load(f)["nodes"]]


def test_an_execution_trace_without_a_profiler_records_the_forward_as_torchs_ddp_names_it(tmp_path):
    for names in run_ranks(_execution_trace_worker, 2, args=(str(tmp_path / "et"),)):
        assert "DistributedDataParallel.forward" in names
