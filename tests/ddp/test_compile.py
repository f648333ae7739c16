"""torch.compile with ddpkit's DDP, against torch's DDP, in both orders users write:

    torch.compile(DDP(model))     DDP(torch.compile(model))

* graph breaks and warnings (backend="eager"): none that torch's DDP does not have;
* the graph is split at the buckets (Dynamo's DDPOptimizer, backend="aot_eager"), so each bucket's
  all-reduce launches while the rest of the compiled backward runs, in the same order as torch's;
* training with inductor ends at eager training's parameters, to the tolerance torch's DDP shows.

Two Gloo ranks each; the models are small, the steps few.
"""
from __future__ import annotations

import shutil
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks
from torch import nn

import ddpkit
from ddpkit.ddp import compile_support

pytestmark = pytest.mark.skipif(
    sys.platform == "win32" or not torch._dynamo.is_dynamo_supported(), reason="torch.compile is unsupported here")

ORDERS = ("outer", "inner")  # torch.compile(DDP(model)), DDP(torch.compile(model))
KINDS = ("torch", "ddpkit")
STEPS = 3
MB = 1  # DDPOptimizer's first bucket is 1 MB and must not exceed bucket_cap_mb


class Net(nn.Module):
    """Three buckets of 1 MB (two 512x512 layers and the rest), and a buffer DDP broadcasts."""

    def __init__(self, width: int = 512):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, width), nn.Linear(width, width), nn.Linear(width, width),
                                     nn.Linear(width, 4)])
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = torch.relu(layer(x))
        return self.layers[-1](x) * self.scale


def _wrap(kind: str, module: nn.Module, **kwargs) -> nn.Module:
    if kind == "torch":
        return torch.nn.parallel.DistributedDataParallel(module, **kwargs)
    return ddpkit.DistributedDataParallel(module, **kwargs)


def _compiled(kind: str, order: str, backend, width: int = 512, **kwargs) -> nn.Module:
    torch.manual_seed(0)
    model = Net(width)
    if order == "outer":
        return torch.compile(_wrap(kind, model, **kwargs), backend=backend)
    return _wrap(kind, torch.compile(model, backend=backend), **kwargs)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def _train(model: nn.Module, steps: int = STEPS) -> nn.Module:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model


def _each_setup():
    """Every (DDP, order) pair, each compiled afresh."""
    for kind in KINDS:
        for order in ORDERS:
            torch._dynamo.reset()
            yield kind, order


# ---- graph breaks and warnings --------------------------------------------------------------------
def _breaks_worker() -> dict:
    from torch._dynamo.utils import counters

    out = {}
    for kind, order in _each_setup():
        counters.clear()
        graphs = []

        def count(gm, example_inputs, graphs=graphs):
            graphs.append(gm)
            return gm.forward
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _train(_compiled(kind, order, count, bucket_cap_mb=MB))
        out[kind, order] = dict(breaks=sum(counters["graph_break"].values()),
                                reasons=[r.splitlines()[0] for r in counters["graph_break"]],
                                graphs=len(graphs), warnings={str(w.message) for w in caught})
    return out


@pytest.mark.timeout(300)
def test_no_graph_break_or_warning_that_torchs_ddp_does_not_have():
    for out in run_ranks(_breaks_worker, 2, timeout=240):
        for order in ORDERS:
            ours, torchs = out["ddpkit", order], out["torch", order]
            assert ours["breaks"] <= torchs["breaks"], (order, ours["reasons"], torchs["reasons"])
            assert ours["warnings"] <= torchs["warnings"], (order, ours["warnings"] - torchs["warnings"])
            assert ours["graphs"] == torchs["graphs"] == 3, (order, ours, torchs)  # one per bucket
        assert out["ddpkit", "inner"]["breaks"] == 0


# ---- the compiled backward overlaps the all-reduces ---------------------------------------------------
def _recording_hook(events, bucket):  # unannotated: torch checks a return annotation
    events.append(("launch", len(bucket.parameters())))
    return ddpkit.hooks.allreduce_hook(None, bucket)


def _compiled_segments(output: torch.Tensor) -> list:
    """The autograd nodes of the compiled subgraphs' backwards, reachable from ``output``."""
    found, stack, seen = [], [output.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "CompiledFunctionBackward":
            found.append(node)
        stack.extend(fn for fn, _ in node.next_functions)
    return found


def _overlap_worker() -> dict:
    out = {}
    for kind, order in _each_setup():
        model = _compiled(kind, order, "aot_eager", bucket_cap_mb=MB)
        events: list = []
        (model._orig_mod if order == "outer" else model).register_comm_hook(events, _recording_hook)
        _train(model, steps=2)  # the buckets are rebuilt after the first backward
        events.clear()
        x, y = _batch(STEPS)
        loss = nn.functional.mse_loss(model(x), y)
        for node in _compiled_segments(loss):
            node.register_hook(lambda *_, events=events: events.append(("segment done",)))
        loss.backward()
        out[kind, order] = events
    return out


@pytest.mark.timeout(300)
def test_each_bucket_is_all_reduced_while_the_compiled_backward_goes_on_as_with_torchs_ddp():
    for out in run_ranks(_overlap_worker, 2, timeout=240):
        for order in ORDERS:
            ours = out["ddpkit", order]
            assert ours == out["torch", order], order
            # three compiled backward pieces, a bucket launched after each: not all after the last
            assert [event[0] for event in ours] == ["segment done", "launch"] * 3, ours


# ---- numbers with inductor --------------------------------------------------------------------------
def _inductor_worker() -> dict:
    def params(model: nn.Module) -> list[torch.Tensor]:
        return [p.detach().clone() for p in model.parameters()]
    out = {}
    for kind in KINDS:
        torch.manual_seed(0)
        eager = params(_train(_wrap(kind, Net(16))))
        for order in ORDERS if kind == "ddpkit" else ("inner",):
            torch._dynamo.reset()
            compiled = params(_train(_compiled(kind, order, "inductor", width=16)))
            out[kind, order] = max((a - b).abs().max().item() for a, b in zip(compiled, eager))
    return out


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("cc") is None,
                    reason="inductor on CPU needs a C++ compiler")
@pytest.mark.timeout(600)
def test_inductor_training_ends_at_eager_trainings_parameters():
    for out in run_ranks(_inductor_worker, 2, timeout=540):
        tolerance = max(4 * out["torch", "inner"], 1e-6)  # what compiling changes for torch's DDP
        for order in ORDERS:
            assert out["ddpkit", order] <= tolerance, (order, out)


def test_torch_reads_the_active_ddp_module_where_ddpkit_sets_it():
    """The adaptation holds on this torch: Dynamo's question answers ddpkit's DDP during its forward."""
    assert compile_support.ADAPTED
    torch_ddp = torch.nn.parallel.DistributedDataParallel
    seen = []

    class Probe(nn.Linear):
        def forward(self, x):
            seen.append(torch_ddp._get_active_ddp_module())
            return super().forward(x)

    ddp = ddpkit.DistributedDataParallel(Probe(1, 1))
    ddp(torch.ones(1))
    assert seen == [ddp] and torch_ddp._get_active_ddp_module() is None


def test_ignored_parameters_are_marked_for_ddpoptimizer_as_torch_marks_them():
    """DDPOptimizer leaves ``_ddp_ignored`` tensors out of its buckets; ddpkit's call marks torch's set."""
    marked = {}
    for kind, cls in (("torch", torch.nn.parallel.DistributedDataParallel), ("ddpkit", ddpkit.DDP)):
        model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
        cls._set_params_and_buffers_to_ignore_for_model(model, ["0.bias", "1.running_mean"])
        marked[kind] = sorted(n for n, t in [*model.named_parameters(), *model.named_buffers()]
                              if getattr(t, "_ddp_ignored", False))
    assert marked["ddpkit"] == marked["torch"] == ["0.bias", "1.running_mean"]


def _compiled_autograd_worker(mode: str) -> dict:
    """torch.compile(DDP(model)) with its backward under compiled autograd, as torch documents it;
    with the python reducer as one graph (fullgraph=True), which torch's DDP allows there."""
    from torch._dynamo import compiled_autograd

    out = {}
    for kind, cls in (("torch", nn.parallel.DistributedDataParallel), ("ddpkit", ddpkit.DDP)):
        torch._dynamo.reset()
        torch._dynamo.config.optimize_ddp = mode  # read when the DDP is built, by either
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
        ddp = cls(model)
        compiled = torch.compile(ddp, backend="aot_eager", fullgraph=mode == "python_reducer")
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(dist.get_rank())
        try:
            for _ in range(2):
                opt.zero_grad()
                loss = compiled(torch.randn(5, 8, generator=gen)).pow(2).sum()
                with compiled_autograd._enable(torch.compile(backend="aot_eager")):
                    loss.backward()
                opt.step()
            out[kind] = [p.detach().clone() for p in model.parameters()]
        except RuntimeError as e:
            out[kind] = str(e)
    return out


@pytest.mark.timeout(300)
def test_compiled_autograd_with_the_python_reducer_trains_as_torchs_ddp():
    for out in run_ranks(_compiled_autograd_worker, 2, args=("python_reducer",), timeout=280):
        assert not isinstance(out["ddpkit"], str), out["ddpkit"]
        for mine, theirs in zip(out["ddpkit"], out["torch"], strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(300)
def test_compiled_autograd_with_a_reducer_is_refused_in_torchs_words():
    for out in run_ranks(_compiled_autograd_worker, 2, args=(True,), timeout=280):
        phrase = "Compiled autograd is not compatible with"
        assert phrase in out["torch"] and "DDP Reducer" in out["torch"], out["torch"]
        assert phrase in out["ddpkit"] and "optimize_ddp" in out["ddpkit"], out["ddpkit"]


def _python_reducer_copy_worker() -> list[torch.Tensor]:
    """A deep copy of a DDP built in the python reducer's mode averages with hooks of its own."""
    import copy

    torch._dynamo.config.optimize_ddp = "python_reducer"
    ddp = copy.deepcopy(ddpkit.DDP(nn.Linear(3, 2), bucket_cap_mb=10))
    assert ddp.reducer is None and ddp._python_reducer is not None
    # torch's DDP has inductor fuse the per-parameter all-reduces into buckets of its cap
    assert (torch._inductor.config._fuse_ddp_communication, torch._inductor.config._fuse_ddp_bucket_size) == (True, 10)
    ddp(torch.full((1, 3), float(dist.get_rank()))).sum().backward()
    return [p.grad for p in ddp.parameters()]


@pytest.mark.timeout(120)
def test_a_copy_in_the_python_reducers_mode_averages_too():
    first, second = run_ranks(_python_reducer_copy_worker, 2, timeout=100)
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(first[0], torch.full((2, 3), 0.5))  # inputs 0 and 1, averaged


def _python_reducer_hook_worker(hook_name: str) -> list[torch.Tensor]:
    """In eager mode the python reducer calls a comm hook per gradient; its all-reduce must be done
    when backward returns (and done before the process exits: a Gloo callback then aborts it)."""
    torch._dynamo.config.optimize_ddp = "python_reducer"
    hook = getattr(ddpkit.hooks, hook_name)
    ddp = ddpkit.DDP(nn.Linear(3, 2, bias=False))
    ddp.register_comm_hook(None, hook)
    ddp(torch.full((1, 3), float(dist.get_rank()))).sum().backward()
    return [p.grad.clone() for p in ddp.parameters()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hook_name", ["allreduce_hook", "fp16_compress_hook"])
def test_the_python_reducer_waits_for_a_comm_hooks_average_in_eager_mode(hook_name):
    for grads in run_ranks(_python_reducer_hook_worker, 2, args=(hook_name,), timeout=100):
        torch.testing.assert_close(grads[0], torch.full((2, 3), 0.5))  # inputs 0 and 1, averaged


def _bookkeeping_calls(model: nn.Module, ddp_class: type = ddpkit.DDP) -> list[str]:
    """Which way a forward in eager mode, then under torch.compile, runs DDP's pre-forward bookkeeping."""
    calls: list[str] = []
    plain = ddpkit.DDP._pre_forward.plain

    def counted(self, *inputs, **kwargs):
        calls.append("plain")
        return plain(self, *inputs, **kwargs)

    ddpkit.DDP._pre_forward.plain = counted
    try:
        ddp = ddp_class(model)
        ddp(torch.randn(1, 2))
        calls.append("|")
        torch._dynamo.reset()
        torch.compile(ddp, backend="eager")(torch.randn(1, 2))
    finally:
        ddpkit.DDP._pre_forward.plain = plain
    return calls


def test_without_torch_compile_the_bookkeeping_runs_without_dynamos_wrapper():
    """In eager mode the bookkeeping is called as it is (the wrapper costs 15 us a call); under
    torch.compile it goes through the wrapper, which keeps Dynamo out of it."""
    expected = ["plain", "|"] if compile_support.DYNAMO_CALLBACK is not None else ["|"]
    assert _bookkeeping_calls(nn.Linear(2, 2)) == expected


def test_a_subclass_that_overrides_the_bookkeeping_is_called_as_it_is():
    class Counting(ddpkit.DDP):
        seen = 0

        def _pre_forward(self, *inputs, **kwargs):  # torch's signature
            type(self).seen += 1
            return super()._pre_forward(*inputs, **kwargs)

    calls = _bookkeeping_calls(nn.Linear(2, 2), Counting)
    assert Counting.seen == 2 and calls == ["|"]  # its super() call goes through the wrapper


def _compiled_step_worker(kind: str, options: dict) -> list[torch.Tensor]:
    torch.manual_seed(0)
    ddp = _wrap(kind, nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), bucket_cap_mb=MB,
                **options)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)

    @torch.compile(backend="eager")
    def step(x: torch.Tensor) -> torch.Tensor:  # the whole step compiled: backward() is a graph break
        loss = ddp(x).pow(2).mean()
        loss.backward()
        return loss

    for i in range(STEPS):
        step(torch.full((4, 8), float(dist.get_rank() + i)))
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in ddp.parameters()]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("options", [{}, {"find_unused_parameters": True}], ids=["default", "find_unused"])
def test_a_compiled_function_that_calls_backward_trains_as_with_torchs_ddp(options):
    """The reducer's Python hooks run while Dynamo's frame callback is installed; compiled, a
    collective in them failed ("Attempted to access unregistered member on an OpaqueObject")."""
    want = run_ranks(_compiled_step_worker, 2, args=("torch", options))
    got = run_ranks(_compiled_step_worker, 2, args=("ddpkit", options))
    for mine, theirs in zip(got, want):
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
