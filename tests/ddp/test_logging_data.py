"""``_get_ddp_logging_data()``: torch's logging data, key for key, against torch's own DDP.

Each 2-rank Gloo run trains both DDPs on identical models, side by side, and reads both logs after
every step; the tests compare ddpkit's with torch's (the keys, and every value that is not a time),
check the sampling and the timings' order, and that an error DDP raised is in the log.
"""
from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import ddpkit
from ddpkit.hooks import allreduce_hook

pytestmark = pytest.mark.timeout(90)

_TIMES = re.compile(r"(^avg_|_time$|_time_start$|_time_end$)")


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.unused = nn.Linear(6, 8), nn.Linear(8, 3), nn.Linear(3, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


_CONFIGS = {
    "defaults": {},
    "find-unused": {"find_unused_parameters": True},
    "static-graph": {"static_graph": True},
    "bucket-view": {"gradient_as_bucket_view": True, "broadcast_buffers": False},
    "comm-hook": {},
}


def _both_worker(config: str, steps: int, rate: int) -> dict:
    torch.manual_seed(0)
    model = _Net()
    if config != "find-unused":
        model.unused.requires_grad_(False)
    kwargs = _CONFIGS[config]
    both = {"torch": TorchDDP(copy.deepcopy(model), **kwargs),
            "ddpkit": ddpkit.DistributedDataParallel(copy.deepcopy(model), **kwargs)}
    logs = {who: [ddp._get_ddp_logging_data()] for who, ddp in both.items()}
    for ddp in both.values():
        ddp._set_ddp_runtime_logging_sample_rate(rate)
        if config == "comm-hook":
            ddp.register_comm_hook(None, allreduce_hook)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(steps):
        for who, ddp in both.items():
            ddp(x).sum().backward()
            logs[who].append(ddp._get_ddp_logging_data())
    return logs


def _assert_same_as_torch(logs: dict, where: str, static_graph: bool = False) -> None:
    for step, (mine, theirs) in enumerate(zip(logs["ddpkit"], logs["torch"], strict=True)):
        assert sorted(mine) == sorted(theirs), f"{where}, after step {step}"
        same = {k: v for k, v in theirs.items() if not _TIMES.search(k)}
        if static_graph and theirs["iteration"] == 1:
            # torch counts no bucket in the iteration that counts hooks, though it reduces them all
            assert (mine.pop("num_buckets_reduced"), same.pop("num_buckets_reduced")) == (1, 0)
        assert {k: mine[k] for k in same} == same, f"{where}, after step {step}"


@pytest.mark.parametrize("config", list(_CONFIGS))
def test_the_same_keys_and_values_as_torch_step_by_step(config):
    """Every key torch logs, after construction and after each of 13 steps (sampled: 1-10, 12),
    with the same value unless it is a time (the comm hook: torch logs the hook's name too)."""
    for rank, logs in enumerate(run_ranks(_both_worker, 2, args=(config, 13, 4))):
        _assert_same_as_torch(logs, f"rank {rank}, {config}", static_graph=config == "static-graph")
        assert logs["ddpkit"][-1]["iteration"] == 12


def _irregular_worker() -> dict:
    """Steps as scripts take them: a forward that fails (a batch of the wrong shape), a forward with no
    backward, two forwards before one backward, with a sample rate of 2."""
    torch.manual_seed(0)
    model = _Net()
    model.unused.requires_grad_(False)
    both = {"torch": TorchDDP(copy.deepcopy(model)), "ddpkit": ddpkit.DistributedDataParallel(copy.deepcopy(model))}
    logs = {who: [] for who in both}
    x = torch.randn(4, 6)
    for step in range(16):
        for who, ddp in both.items():
            ddp._set_ddp_runtime_logging_sample_rate(2)
            if step in (3, 12):
                with pytest.raises(RuntimeError):
                    ddp(torch.randn(4, 7))
            elif step in (5, 10):
                ddp(x).sum()
            elif step in (7, 8):
                (ddp(x).sum() + ddp(x).sum()).backward()
            else:
                ddp(x).sum().backward()
            logs[who].append(ddp._get_ddp_logging_data())
    return logs


def test_failed_and_unfinished_forwards_count_as_in_torch():
    for rank, logs in enumerate(run_ranks(_irregular_worker, 2)):
        _assert_same_as_torch(logs, f"rank {rank}")
        assert logs["ddpkit"][-1]["iteration"] == 16  # 18 forwards in all; the 17th reported the 16th


def _sampling_worker(rate: int) -> list[dict]:
    torch.manual_seed(0)
    ddp = ddpkit.DistributedDataParallel(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)))
    ddp._set_ddp_runtime_logging_sample_rate(rate)
    x = torch.randn(4, 6)
    out = []
    for _ in range(16):
        ddp(x).sum().backward()
        out.append(ddp._get_ddp_logging_data())
    return out


def test_samples_the_first_ten_iterations_then_every_rate_th_with_times_in_order():
    """torch's rule (``should_collect_runtime_stats``): the forward of iteration n reports the
    iteration before it when n <= 10 or n % rate == 0; the time stamps run forward, start to end."""
    logs = run_ranks(_sampling_worker, 2, args=(3,))[0]
    assert [log["iteration"] for log in logs] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 10, 12, 12, 12, 15]
    for log in logs[1:]:
        assert log["forward_compute_time"] >= 1 and log["backward_compute_time"] >= 1
        assert log["backward_comm_time"] >= 1
        assert log["forward_compute_time_start"] <= log["backward_compute_time_start"] \
            <= log["backward_comm_time_start"] <= log["backward_comm_time_end"]
        assert log["backward_compute_time_start"] <= log["backward_compute_time_end"]
        assert log["avg_backward_compute_time"] >= 1 and log["avg_forward_compute_time"] >= 1
        assert log["prev_iteration_grad_ready_order_indices"] == "3, 2, 1, 0"
        assert log.get("rebuilt_per_bucket_param_indices") == ("3 2 1 0" if log["iteration"] > 1 else None)


def _errors_worker() -> dict:
    ddp = ddpkit.DistributedDataParallel(nn.Linear(3, 2))
    before = ddp._get_ddp_logging_data()
    out = {"before": ("has_error" in before, "error" in before)}
    with pytest.raises(ValueError, match="sample rate should be equal or greater than 1, got 0"):
        ddp._set_ddp_runtime_logging_sample_rate(0)
    out["rate"] = ddp._get_ddp_logging_data()["error"]
    ddp(torch.randn(2, 3)).sum().backward()
    with pytest.raises(RuntimeError, match="should be called before training loop starts"):
        ddp._set_static_graph()
    out["static"] = ddp._get_ddp_logging_data()["error"]
    with pytest.raises(RuntimeError):
        ddp.register_comm_hook(None, allreduce_hook)
        ddp.register_comm_hook(None, allreduce_hook)  # a second one is refused, as in torch
    out["hook"] = ddp._get_ddp_logging_data()
    missing = ddpkit.DistributedDataParallel(_Net())  # _Net.unused gets no gradient
    with pytest.raises(RuntimeError):
        missing(torch.randn(2, 6)).sum().backward()
    out["backward"] = missing._get_ddp_logging_data()["error"]
    return out


def test_an_error_ddp_raises_is_in_the_log_as_torch_records_it():
    for out in run_ranks(_errors_worker, 2):
        assert out["before"] == (False, False)
        assert out["rate"].startswith("<class 'ValueError'>: ")
        assert "should be called before training loop starts" in out["static"]
        assert out["hook"]["has_error"] == 1 and "register_comm_hook" in out["hook"]["error"]
        assert out["hook"]["comm_hook"] == "allreduce_hook"
        # as torch's reducer notes its own errors: the message alone
        assert out["backward"].startswith("DistributedDataParallel") and "unused.weight" in out["backward"]


def _copy_and_join_worker() -> dict:
    ddp = ddpkit.DistributedDataParallel(nn.Linear(3, 2))
    with ddp.join():
        ddp(torch.randn(2, 3)).sum().backward()
    twin = copy.deepcopy(ddp)
    twin(torch.randn(2, 3)).sum().backward()
    twin(torch.randn(2, 3)).sum().backward()
    return {"join": ddp._get_ddp_logging_data().get("join_uneven_inputs"),
            "twin": twin._get_ddp_logging_data(), "twin_logger_is_own": twin.logger is not ddp.logger}


def test_join_is_logged_and_a_deep_copy_logs_afresh():
    for out in run_ranks(_copy_and_join_worker, 2):
        assert out["join"] == 1
        assert out["twin_logger_is_own"] and out["twin"]["iteration"] == 1
        assert "join_uneven_inputs" not in out["twin"]


def test_a_world_of_one_logs_its_facts_and_its_forward_times():
    """No process group: no reducer and no buckets, but torch's iterations, keys and forward times."""
    ddp = ddpkit.DistributedDataParallel(nn.Linear(3, 2).double())
    first = ddp.logger._get_ddp_logging_data()
    log = ddp._get_ddp_logging_data()
    assert (log["world_size"], log["rank"], log["dtypes"], log["iteration"]) == (1, 0, "double", 0)
    assert log["num_parameter_tensors"] == 2 and log["total_parameter_size_bytes"] == 8 * 8
    for _ in range(4):
        ddp(torch.randn(2, 3, dtype=torch.double)).sum().backward()
    log = ddp._get_ddp_logging_data()
    assert (log["iteration"], log["has_rebuilt_buckets"], log["num_buckets_reduced"]) == (3, 0, 0)
    assert log["forward_compute_time"] >= 1 and log["avg_forward_compute_time"] >= 1
    assert log["backward_comm_time"] == 0  # nothing to average, nothing timed
    assert first.ints_map["iteration"] == 0  # the logger's data is a copy, as torch's


class _Branches(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.left, self.right = nn.Linear(6, 8), nn.Linear(8, 3), nn.Linear(8, 3)

    def forward(self, x, step):
        h = torch.relu(self.fc1(x))
        return self.left(h) if step < 2 else self.right(h)


def _changing_graph_worker() -> dict:
    torch.manual_seed(0)
    model = _Branches()
    both = {"torch": TorchDDP(copy.deepcopy(model), find_unused_parameters=True),
            "ddpkit": ddpkit.DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)}
    out = {who: [] for who in both}
    for step in range(4):
        for who, ddp in both.items():
            ddp(torch.randn(4, 6), step).sum().backward()
            log = ddp._get_ddp_logging_data()
            out[who].append((log.get("can_set_static_graph"), log["iteration"], log.get("unused_parameter_size")))
    return out


def test_can_set_static_graph_turns_0_when_the_unused_parameters_change_as_in_torch():
    for out in run_ranks(_changing_graph_worker, 2):
        assert out["ddpkit"] == out["torch"]
        assert [entry[0] for entry in out["ddpkit"]] == [None, None, 0, 0]


def _group_of_one_worker() -> dict:
    ddp = ddpkit.DistributedDataParallel(nn.Linear(3, 2))
    before = ddp._get_ddp_logging_data()["bucket_sizes"]
    ddp.register_comm_hook(None, allreduce_hook)  # torch runs a hook in a group of one: a reducer now
    for _ in range(3):
        ddp(torch.randn(2, 3)).sum().backward()
    return {"before": before, "after": ddp._get_ddp_logging_data()}


def test_a_group_of_one_with_a_comm_hook_logs_the_buckets_it_gets():
    out = run_ranks(_group_of_one_worker, 1)[0]
    assert out["before"] == ""  # no reducer, no buckets: nothing to average
    log = out["after"]
    assert (log["bucket_sizes"], log["comm_hook"], log["iteration"]) == ("32", "allreduce_hook", 2)
    assert log["backward_comm_time"] >= 1 and log["prev_iteration_grad_ready_order_indices"] == "1, 0"
