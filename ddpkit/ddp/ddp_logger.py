"""torch's DDP logger: the facts, sampled timings and last error that ``_get_ddp_logging_data()`` reads.

torch keeps a C++ ``dist.Logger`` beside its reducer; debugging guides, monitoring code and torch's
own tests read it through ``ddp._get_ddp_logging_data()`` or ``ddp.logger``. This is its counterpart,
with torch's keys, units (nanoseconds; time stamps since the epoch) and sampling: the construction
facts and the environment once; then, at the forward of each sampled iteration (the first ten, then
every ``sample_rate``-th), what the iteration before it measured (forward, backward compute and
communication times, their overlap, running averages over the samples), the rebuilt buckets, the
order its gradients became ready in, its unused parameters' bytes and the buckets it reduced; and
the last error DDP raised. Off the sampled iterations it costs a comparison per forward and bucket.

The times are the host's, taken where the reducer acts; on CUDA they say when work was issued,
where torch times the GPU with CUDA events.
"""
from __future__ import annotations

import functools
import logging
import os
import time
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

__all__ = ["DDPLogger", "LoggingData", "SAMPLE_RATE", "logs_errors"]

SAMPLE_RATE = 100
"""torch's ``kDDPRuntimeLoggingSampleRate``: after the first ten, every 100th iteration is sampled."""

_log = logging.getLogger("ddpkit.ddp")

_ENVIRONMENT = {
    None: ("MASTER_PORT", "MASTER_ADDR", "TORCH_DISTRIBUTED_DEBUG", "CUDA_VISIBLE_DEVICES"),
    "nccl": ("NCCL_SOCKET_IFNAME", "NCCL_BLOCKING_WAIT", "NCCL_ASYNC_ERROR_HANDLING", "NCCL_DEBUG",
             "NCCL_NTHREADS", "NCCL_IB_TIMEOUT"),
    "gloo": ("GLOO_SOCKET_IFNAME", "GLOO_DEVICE_TRANSPORT"),
}
_DURATIONS = (  # torch's calculate_avg_time calls: key, from event, to event
    ("forward_compute_time", "forward", "backward_compute"),
    ("backward_compute_time", "backward_compute", "backward_compute_end"),
    ("backward_comm_time", "backward_comm", "backward_comm_end"),
    ("backward_compute_comm_overlap_time", "backward_comm", "backward_compute_end"),
)
_STAMPS = (("forward_compute_time_start", "forward"), ("backward_compute_time_start", "backward_compute"),
           ("backward_comm_time_start", "backward_comm"), ("backward_compute_time_end", "backward_compute_end"),
           ("backward_comm_time_end", "backward_comm_end"))
_DTYPE_NAMES = {  # the C++ type names torch's logger joins into "dtypes"
    torch.float32: "float", torch.float64: "double", torch.float16: "c10::Half", torch.bfloat16: "c10::BFloat16",
    torch.int64: "long int", torch.int32: "int", torch.int16: "short int", torch.int8: "signed char",
    torch.uint8: "unsigned char", torch.bool: "bool", torch.complex64: "c10::complex<float>",
    torch.complex128: "c10::complex<double>",
}


def logs_errors(method: Callable) -> Callable:
    """A DDP method whose errors are noted in the logging data first, as torch's DDP notes its own."""
    @functools.wraps(method)
    def logging_errors(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as e:
            self.logger.logged(e, typed=True)
            raise
    return logging_errors


class LoggingData:
    """torch's ``DDPLoggingData`` as Python sees it: string facts and integer facts."""

    def __init__(self) -> None:
        self.strs_map: dict[str, str] = {}
        self.ints_map: dict[str, int] = {}


class DDPLogger:
    """``dist.Logger``'s members, for one DistributedDataParallel (held weakly, as torch's reducer
    holds its logger). ``None``: a reducer's own, before a DDP gives it one; it records errors only.

    The DDP calls ``start_forward`` as each synced forward begins (which reports the iteration before
    it if that was sampled); on a sampled iteration (``timing``) the reducer calls ``start_backward``,
    ``mark`` and ``end_backward``.
    """

    def __init__(self, ddp: Any = None):
        self._ddp = weakref.ref(ddp) if ddp is not None else lambda: None
        self.data = LoggingData()
        self.sample_rate = SAMPLE_RATE
        self.timing = False  # this iteration is sampled: the reducer marks its events
        self.grad_order: list[int] | None = None  # a sampled iteration's gradient-ready order
        self._times: dict[str, int] = {}
        self._backward: tuple[int, int] = (0, 0)  # unused parameter bytes, buckets reduced
        self._samples = 0  # torch's num_iterations_stats_recorded_
        self.forwards = 0  # synced forwards begun: torch's num_iterations_
        self._unused: set[int] | None = None  # find_unused_parameters: the last forward's unused ones

    # ---- torch's dist.Logger members -----------------------------------------------------------
    def _get_ddp_logging_data(self) -> LoggingData:
        """A copy, as torch's returns one: it does not change with later iterations."""
        data = LoggingData()
        data.strs_map, data.ints_map = dict(self.data.strs_map), dict(self.data.ints_map)
        return data

    def _set_comm_hook_name(self, name: str) -> None:
        self.data.strs_map["comm_hook"] = name

    def _set_uneven_input_join(self) -> None:
        self.data.ints_map["join_uneven_inputs"] = 1

    def _set_static_graph(self) -> None:
        self.data.ints_map["static_graph"] = 1

    def set_error_and_log(self, error: str) -> None:
        self.data.ints_map["has_error"] = 1
        self.data.strs_map["error"] = error

    def logged(self, error: BaseException, typed: bool = False) -> BaseException:
        """``error``, noted first as torch's DDP notes an error it raises (``raise logger.logged(e)``):
        its message, as torch's reducer checks note theirs, or ``typed``, with its class first, as
        torch's Python side does (``_log_and_throw``)."""
        self.set_error_and_log(f"{type(error)}: {error}" if typed else str(error))
        return error

    def set_construction_data_and_log(self, module_name: str, device_ids: list[int], output_device: int,
                                      broadcast_buffers: bool, has_sync_bn: bool, static_graph: bool) -> None:
        """The facts of a DDP just built (torch's arguments; the rest is read from the DDP)."""
        ddp = self._ddp()
        strs, ints = self.data.strs_map, self.data.ints_map
        if static_graph:
            self._set_static_graph()
        strs["module_name"] = module_name
        ints.update(world_size=ddp.world_size, rank=ddp.rank, iteration=0,
                    is_multi_device_module=int(ddp.is_multi_device_module))
        params = ddp.reducer.params if ddp.reducer is not None else [p for _, p in ddp._states(buffers=False)]
        ints["num_parameter_tensors"] = len(params)
        ints["total_parameter_size_bytes"] = sum(p.numel() * p.element_size() for p in params)
        strs["dtypes"] = ", ".join(sorted({_DTYPE_NAMES.get(p.dtype, str(p.dtype)) for p in params}))
        self.note_buckets(ddp.reducer.buckets if ddp.reducer is not None else [])
        backend = dist.get_backend(ddp.process_group) if ddp.process_group is not None else ""
        for name in _ENVIRONMENT[None] + _ENVIRONMENT.get(backend, ()):
            strs[name.lower()] = os.environ.get(name, "N/A")
        if backend == "gloo":
            ints["gloo_num_threads"] = _gloo_threads(ddp)
        strs["device_ids"] = ", ".join(map(str, device_ids))
        ints.update(output_device=output_device, broadcast_buffers=int(broadcast_buffers), has_sync_bn=int(has_sync_bn),
                    bucket_cap_bytes=ddp.bucket_bytes_cap, find_unused_parameters=int(ddp.find_unused_parameters),
                    gradient_as_bucket_view=int(ddp.gradient_as_bucket_view))
        strs["backend_name"] = backend
        if dist.get_debug_level() != dist.DebugLevel.OFF:
            facts = {**ints, **strs}
            _log.info("[Rank %d]: DDP Initialized with: \n%s", ddp.rank,
                      "".join(f"{key}: {value}\n" for key, value in sorted(facts.items())))

    def set_runtime_stats_and_log(self) -> None:
        """Before a synced forward: if the iteration before it was sampled, take what it measured."""
        if not self.sampled(self.forwards):
            return
        ddp = self._ddp()
        reducer = ddp.reducer if ddp is not None else None
        self._samples += 1
        strs, ints = self.data.strs_map, self.data.ints_map
        ints["iteration"] = self.forwards
        ints["unused_parameter_size"], ints["num_buckets_reduced"] = self._backward
        rebuilt = int(ddp is not None and ddp._has_rebuilt_buckets)
        if ints.get("has_rebuilt_buckets", 0) != rebuilt:  # the buckets settle once: say so once
            strs["rebuilt_bucket_sizes"] = _bucket_sizes(reducer.buckets)
            strs["rebuilt_per_bucket_param_indices"] = ", ".join(
                " ".join(map(str, _given_indices(b))) for b in reducer.buckets)
        ints["has_rebuilt_buckets"] = rebuilt
        if self.grad_order:  # the order of the iteration before: this forward's backward has not run
            strs["prev_iteration_grad_ready_order_indices"] = ", ".join(map(str, self.grad_order))
        times, self._times = self._times, {}
        for key, start, end in _DURATIONS:  # torch's map has all eight keys from the first sample on
            ints[key] = 0
            average = ints.setdefault("avg_" + key, 0)
            if start in times and end in times and times[end] >= times[start]:
                ints[key] = took = times[end] - times[start]
                ints["avg_" + key] = (took + average * (self._samples - 1)) // self._samples
        for key, event in _STAMPS:
            ints[key] = times.get(event, 0)
        if dist.get_debug_level() == dist.DebugLevel.DETAIL:
            _log.info("[Rank %d / %d] [before iteration %d] Training %s unused_parameter_size=%d \n Avg forward "
                      "compute time: %d \n Avg backward compute time: %d \nAvg backward comm. time: %d \n Avg "
                      "backward comm/comp overlap time: %d", ints.get("rank", 0), ints.get("world_size", 1),
                      self.forwards, strs.get("module_name"), ints["unused_parameter_size"],
                      ints["avg_forward_compute_time"], ints["avg_backward_compute_time"],
                      ints["avg_backward_comm_time"], ints["avg_backward_compute_comm_overlap_time"])

    # ---- what the DDP and its reducer tell it --------------------------------------------------
    def sampled(self, iteration: int) -> bool:
        """torch's ``should_collect_runtime_stats`` for synced forward number ``iteration``."""
        return iteration > 0 and (iteration <= 10 or iteration % self.sample_rate == 0)

    def start_forward(self) -> None:
        """A synced forward begins (torch's iteration: counted even if the forward then fails): report
        the iteration before if it was sampled, and time this one if it is."""
        self.set_runtime_stats_and_log()
        self.forwards += 1
        self.timing = self.sampled(self.forwards)
        if self.timing:
            self._times = {"forward": time.time_ns()}

    def end_forward(self) -> None:
        """A forward without a reducer (a world of one) ended: no backward of DDP's to time."""
        if self.timing:
            self.mark("backward_compute")
            self.timing = False

    def note_unused(self, unused: Sequence[int]) -> None:
        """find_unused_parameters' search found ``unused`` in this forward. As torch,
        ``can_set_static_graph`` is logged 0, with the iteration, the first time the set changes."""
        if "can_set_static_graph" in self.data.ints_map:  # said once; no search results kept after
            return
        now = set(unused)
        if self._unused is not None and now != self._unused:
            self.data.ints_map.update(can_set_static_graph=0, iteration=self.forwards)
        self._unused = now

    def start_backward(self, record: list[int] | None, unused: Sequence[torch.Tensor]) -> list[int]:
        """A sampled iteration's forward ended, leaving ``unused`` out (torch resets its counts here:
        what it reports if no backward follows); returns the list its gradient-ready order goes into
        (``record``: the one a bucket rebuild fills already)."""
        self.mark("backward_compute")
        self._backward = (sum(p.numel() * p.element_size() for p in unused), 0)
        self.grad_order = [] if record is None else record
        return self.grad_order

    def mark(self, event: str) -> None:
        """A sampled iteration reached ``event`` (the last time counts, as torch's timer)."""
        self._times[event] = time.time_ns()

    def end_backward(self, params: Sequence[torch.Tensor], used: Sequence[bool], buckets: Sequence[Any],
                     skip_unused: bool) -> None:
        """A sampled iteration's averages are written back; ``used``: which parameters had a gradient,
        ``skip_unused``: a bucket of unused ones was not all-reduced."""
        self._times["backward_comm_end"] = time.time_ns()
        unused = sum(p.numel() * p.element_size() for p, u in zip(params, used) if not u)
        skipped = sum(skip_unused and not any(used[i] for i in b.param_indices) for b in buckets)
        self._backward = (unused, len(buckets) - skipped)
        self.timing = False

    def note_buckets(self, buckets: Sequence[Any]) -> None:
        """The buckets a reducer was built with: torch's ``bucket_sizes``."""
        self.data.strs_map["bucket_sizes"] = _bucket_sizes(buckets)


def _bucket_sizes(buckets: Sequence[Any]) -> str:
    return ", ".join(str(sum(p.numel() * p.element_size() for p in b.params)) for b in buckets)


def _given_indices(bucket: Any) -> list[int]:
    """A bucket's parameter indices in the order torch's bucket lists them (not the memory layout's)."""
    order = getattr(bucket, "_given_order", range(len(bucket.param_indices)))
    return [bucket.param_indices[pos] for pos in order]


def _gloo_threads(ddp: Any) -> int:
    """The worker threads of the DDP's Gloo backend (torch's default: 2)."""
    try:
        return int(ddp.process_group._get_backend(torch.device("cpu")).options._threads)
    except (AttributeError, RuntimeError):
        return 2
