"""ddpkit's DistributedDataParallel trains to the same parameters as torch's, in every configuration.

Each configuration trains the same model from the same start with both classes on 2 or 3 Gloo ranks,
different data per rank, SGD with momentum; parameters, buffers and which grads are None must agree.
Every configuration (configs.py) is its own test, named after it; all those of one world size share
one spawned run, which a configuration that raises does not stop.
"""
from __future__ import annotations

import contextlib
import os
import traceback
import warnings
from datetime import timedelta

import pytest
import torch
from configs import CONFIGS, THREE_RANKS, Config
from ranks import run_ranks
from torch import nn

IN = 6


class SGD:
    """SGD with momentum, as torch.optim.SGD computes it; torch.optim's first use costs seconds."""

    def __init__(self, params, lr: float, momentum: float):
        self.params, self.lr, self.momentum = list(params), lr, momentum
        self.buffers: list[torch.Tensor | None] = [None] * len(self.params)

    @torch.no_grad()
    def step(self) -> None:
        for i, p in enumerate(self.params):
            if p.grad is not None:
                buf = self.buffers[i]
                self.buffers[i] = buf = p.grad.clone() if buf is None else buf.mul_(self.momentum).add_(p.grad)
                p.add_(buf, alpha=-self.lr)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()


class Unused(nn.Module):
    """``never`` is unused on every rank; ``some`` only on ranks that pass use_some=False."""

    def __init__(self):
        super().__init__()
        self.a, self.some, self.never, self.out = (nn.Linear(IN, 8), nn.Linear(8, 8), nn.Linear(8, 8),
                                                   nn.Linear(8, 3))

    def forward(self, x, use_some=True):
        h = torch.relu(self.a(x))
        return self.out(self.some(h) if use_some else h)


class Reordered(nn.Module):
    """Registered in the reverse of the order it is used: the rebuilt buckets differ in number."""

    def __init__(self):
        super().__init__()
        self.out, self.mid, self.inp = nn.Linear(16, 3), nn.Linear(40, 16), nn.Linear(IN, 40)

    def forward(self, x):
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


class MovingAverage(nn.Module):
    """Replaces its buffer out of place in forward (``self.avg = ...``), as many EMA codes do."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(IN, 3)
        self.register_buffer("avg", torch.zeros(3))

    def forward(self, x):
        y = self.linear(x)
        self.avg = 0.9 * self.avg + 0.1 * y.detach().mean(0)
        return y - self.avg


class Checkpointed(nn.Module):
    """``shared`` runs in two reentrant checkpoints (or one, and once outside): its gradient
    accumulator fires once per reentrant backward, which torch supports with static_graph only."""

    def __init__(self, inside_and_out: bool = False):
        super().__init__()
        self.inside_and_out = inside_and_out
        # 128 x 128: a big tensor, scaled into its bucket by its own hook
        self.inp, self.shared, self.out = nn.Linear(IN, 128), nn.Linear(128, 128), nn.Linear(128, 3)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.shared, torch.tanh(self.inp(x)), use_reentrant=True)
        h = torch.tanh(h)
        h = self.shared(h) if self.inside_and_out else checkpoint(self.shared, h, use_reentrant=True)
        return self.out(torch.tanh(h))


class CheckpointedWhole(nn.Module):
    """Every parameter is reached only by reentrant backwards, twice: none fires in the outer one."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(IN, IN), nn.Tanh())

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.body, x.detach().requires_grad_(), use_reentrant=True)
        return checkpoint(self.body, h, use_reentrant=True)


class ComplexValued(nn.Module):
    """Complex weights (spectral and state-space models have them); a real loss."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(IN, 8, dtype=torch.cfloat) / 3)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        return self.out((x.to(torch.cfloat) @ self.w).abs())


class ChannelsLast(nn.Module):
    """A convolution whose weight is channels_last: its gradient keeps that layout."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, kernel_size=(1, 2)).to(memory_format=torch.channels_last)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.conv(x.view(-1, 2, 1, 3))).flatten(1))


class PlainOutput:
    """Neither a tensor, a container nor a dataclass: DDP's search for output tensors skips it."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits


class PlainOutputCheckpointedLast(nn.Module):
    """The last layer in a reentrant checkpoint: its parameters' hooks fire in an inner backward."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(IN, 8), nn.Linear(8, 3)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return PlainOutput(checkpoint(self.out, torch.tanh(self.inp(x)), use_reentrant=True))


class LocalHead(nn.Module):
    """A shared trunk and a per-rank head and buffer that DDP is told to ignore (torch's private
    ``_set_params_and_buffers_to_ignore_for_model``, common in multi-task code)."""

    IGNORED = ["head.weight", "head.bias", "seen"]

    def __init__(self):
        super().__init__()
        self.trunk, self.head = nn.Linear(IN, 8), nn.Linear(8, 3)
        self.register_buffer("seen", torch.zeros(1))

    def forward(self, x):
        self.seen += len(x)
        return self.head(torch.tanh(self.trunk(x))) + self.seen


class SparseEmbedding(nn.Module):
    """An nn.Embedding(sparse=True) feeding dense layers: its gradient is a sparse tensor, in a
    bucket of its own; ``use_emb=False`` leaves it out of the graph (find_unused_parameters)."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc, self.out = nn.Embedding(20, 4, sparse=True), nn.Linear(IN + 4, 8), nn.Linear(8, 3)

    def forward(self, x, use_emb=True):
        ids = (x.detach().abs() * 4).long().clamp(max=19)  # a few rows, different on each rank
        h = self.emb(ids).mean(1) if use_emb else x.new_zeros(len(x), 4)
        return self.out(torch.tanh(self.fc(torch.cat([x, h], 1))))


def _model(name: str) -> nn.Module:
    if name == "mlp":
        return nn.Sequential(nn.Linear(IN, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    if name == "bn":
        return nn.Sequential(nn.Linear(IN, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    if name in ("unused", "unused_everywhere"):  # unused_everywhere: use_some on every rank
        return Unused()
    if name == "reordered":
        return Reordered()
    if name == "moving_average":
        return MovingAverage()
    if name == "wide":  # big tensors (copied in by their own hooks) mixed with small ones
        return nn.Sequential(nn.Linear(IN, 600), nn.ReLU(), nn.Linear(600, 700), nn.ReLU(), nn.Linear(700, 3))
    if name == "plain_output_checkpointed_last":
        return PlainOutputCheckpointedLast()
    if name == "local_head":
        return LocalHead()
    # sparse_unused: not used on rank 1 after the first step; sparse_unused_everywhere: on no rank
    if name in ("sparse", "sparse_unused", "sparse_unused_everywhere"):
        return SparseEmbedding()
    if name == "complex":
        return ComplexValued()
    if name == "channels_last":
        return ChannelsLast()
    if name == "checkpointed_whole":
        return CheckpointedWhole()
    if name == "checkpointed_twice":
        return Checkpointed()
    if name == "checkpointed_inside_and_out":
        return Checkpointed(inside_and_out=True)
    raise ValueError(name)


def _bucket_norm_hook(state, bucket):
    """Scales each bucket by its own norm: equal results need torch's buckets exactly."""
    import torch.distributed as dist

    buffer = bucket.buffer()
    buffer.div_(1 + buffer.norm())
    world = dist.get_world_size()
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0] / world)


def _gradients_of_set_buffer_hook(state, bucket):
    """Swaps in a copy of the buffer, then doubles the gradients through ``gradients()``."""
    import torch.distributed as dist

    bucket.set_buffer(bucket.buffer().clone())
    for gradient in bucket.gradients():
        gradient.mul_(2)
    buffer = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])


def _hook(kind: str, name: str):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if name == "bucket_norm":
        return _bucket_norm_hook
    if name == "gradients_of_set_buffer":
        return _gradients_of_set_buffer_hook

    if name == "fp16_wrapped_allreduce":  # torch's wrapper swaps in a half buffer (set_buffer)
        return default_hooks.fp16_compress_wrapper(_hook(kind, "allreduce_hook"))
    if kind == "ddpkit":
        import ddpkit.ddp.hooks

        return getattr(ddpkit.hooks, name)

    def reference(state, bucket):  # torch refuses its bf16 hook by name off NCCL; it runs on Gloo
        return getattr(default_hooks, name)(state, bucket)

    return reference


def _double_in_place(p: nn.Parameter) -> None:
    p.grad.mul_(2)


def _double_out_of_place(p: nn.Parameter) -> None:
    p.grad = p.grad * 2


def _drop(p: nn.Parameter) -> None:  # e.g. an optimizer step in backward that frees the gradient
    p.grad = None


_USER_HOOKS = {"double": _double_in_place, "replace": _double_out_of_place, "drop": _drop}


def _train(kind: str, cfg: Config, rank: int) -> dict:
    """Train one model with ddpkit's ('ddpkit') or torch's ('torch') DDP; return its final state."""
    import ddpkit

    torch.manual_seed(1000 + (rank if cfg.different_init else 0))
    cls = ddpkit.DistributedDataParallel if kind == "ddpkit" else nn.parallel.DistributedDataParallel
    kwargs = cfg.kwargs if kind == "ddpkit" or cfg.torch_kwargs is None else cfg.torch_kwargs
    model = _model(cfg.model)
    if cfg.model == "local_head":
        with torch.no_grad():
            model.head.weight.add_(rank)
            model.seen.fill_(10 * rank)
        cls._set_params_and_buffers_to_ignore_for_model(model, LocalHead.IGNORED)
    options = {name: value for name, value in (("split_bytes", cfg.split_bytes), ("in_place_bytes", cfg.in_place_bytes),
                                               ("one_block", cfg.one_block)) if value is not None}
    if cfg.one_block:  # as on CUDA, where no gradient adopts its slot (adoption keeps the blocks apart)
        options["adopt"] = False
    # halves and in-place gradients at smaller sizes than real models need; one block on the CPU too
    if options and kind == "ddpkit":
        class SmallSizesDDP(ddpkit.DistributedDataParallel):
            _reducer_options = options

        cls = SmallSizesDDP
    ddp = cls(model, **kwargs)
    if cfg.set_static_graph:  # torch's own error messages recommend this private call
        ddp._set_static_graph()
    if cfg.hook is not None:
        ddp.register_comm_hook(None, _hook(kind, cfg.hook))
    if cfg.user_hook is not None:  # registered after wrapping: what it leaves in .grad is what is averaged
        for p in ddp.module.parameters():
            p.register_post_accumulate_grad_hook(_USER_HOOKS[cfg.user_hook])
    opt = SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(7 + rank)
    if cfg.uneven == "last_rank_first":  # the rank that uses the 'some' branch joins first
        import torch.distributed as dist

        rank_order = dist.get_world_size() - 1 - rank
    else:
        rank_order = rank
    steps = cfg.steps + (2 * rank_order if cfg.uneven else 0)
    forward_kwargs = {"use_some": rank == 1} if cfg.model == "unused" else {}
    with ddp.join(**cfg.join) if cfg.uneven else contextlib.nullcontext():
        for step in range(steps):
            x = x_in = (torch.randn(5, IN, generator=data) + rank).requires_grad_(cfg.gradient_penalty)
            local = cfg.accumulate is not None and step % 3 != 2
            if cfg.model.startswith("sparse_unused"):  # torch needs a .grad there: used by every rank at first
                forward_kwargs = {"use_emb": step == 0 or (rank == 0 and cfg.model == "sparse_unused")}
            if cfg.some_only_in_local_steps:
                forward_kwargs = {"use_some": local}
            if local and cfg.accumulate == "attribute":
                ddp.require_backward_grad_sync = False
            with ddp.no_sync() if local and cfg.accumulate == "no_sync" else contextlib.nullcontext():
                if cfg.discarded_forward:  # e.g. evaluation without torch.no_grad()
                    ddp(x + 1, **forward_kwargs)
                out = ddp(x, **forward_kwargs)
                out = out.logits if isinstance(out, PlainOutput) else out
                if cfg.two_forwards is not None:  # a siamese loss: two forwards, one backward
                    out = out - ddp(x.flip(0) * 2, **(cfg.two_forwards if rank == 0 else {}))
                loss = out.square().mean()
                if cfg.gradient_penalty:  # WGAN-GP: autograd.grad through the outputs first
                    slope, = torch.autograd.grad(out.sum(), x_in, create_graph=True)
                    loss = loss + slope.square().mean()
                if cfg.zero_grad_after_forward:  # pytorch/examples' ImageNet order
                    opt.zero_grad(set_to_none=cfg.set_to_none)
                loss.backward(retain_graph=cfg.second_backward)
                if cfg.second_backward:  # its gradients stay local, in both DDPs
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        out.sum().backward()
            ddp.require_backward_grad_sync = True
            if not local:
                views = _grads_are_bucket_views(ddp) if kind == "ddpkit" else None
                strides = [None if p.grad is None or p.grad.is_sparse else p.grad.stride() for p in ddp.parameters()]
                opt.step()
                if not cfg.zero_grad_after_forward:
                    opt.zero_grad(set_to_none=cfg.set_to_none)
    state = {k: v.detach().clone() for k, v in ddp.state_dict().items()}
    grads_none = [None if p.grad is None else p.grad.is_sparse for p in ddp.parameters()]
    if not cfg.kwargs.get("gradient_as_bucket_view"):
        views = None
    return {"state": state, "grads_none": grads_none, "views": views, "strides": strides}


def _grads_are_bucket_views(ddp) -> bool:
    storages = {b.buffer().untyped_storage().data_ptr() for b in ddp.reducer.buckets if not b.sparse}
    return all(p.grad is not None and (p.grad.is_sparse or p.grad.untyped_storage().data_ptr() in storages)
               for n, p in ddp.module.named_parameters() if n not in ddp.parameters_to_ignore)


# A rank left waiting in a collective by a configuration that raised on another rank gives up after
# this long, so that one configuration's failure costs seconds, not the whole run's deadline.
COLLECTIVE_TIMEOUT = 30.0
RUN_TIMEOUT = 100.0


def _compare_worker(configs: list[Config]) -> list[dict]:
    """Train every configuration with both DDPs; one that raises yields its traceback instead.

    After each configuration the ranks tell each other through the store, which no collective can
    block, whether they finished it. If one did not, the others may have stopped in different
    collectives, so the process group is made afresh before the next configuration.
    """
    import torch.distributed as dist

    import ddpkit

    ddpkit.init(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        store = dist.PrefixStore("test_ddp/", dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
            timeout=timedelta(seconds=RUN_TIMEOUT), wait_for_workers=False))
        results = []
        for index, cfg in enumerate(configs):
            try:
                results.append({"ddpkit": _train("ddpkit", cfg, rank), "torch": _train("torch", cfg, rank)})
            except Exception:  # noqa: BLE001 - reported by this configuration's own test
                results.append({"error": traceback.format_exc()})
            store.set(f"{index}/{rank}", "error" if "error" in results[-1] else "ok")
            if any(store.get(f"{index}/{r}") != b"ok" for r in range(world_size)):
                dist.destroy_process_group()
                dist.init_process_group("gloo", store=dist.PrefixStore(f"{index}/group/", store), rank=rank,
                                        world_size=world_size, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT))
        return results
    finally:
        ddpkit.shutdown()


def _run(request: pytest.FixtureRequest, world_size: int, fixture: str) -> dict[str, list[dict]] | Exception:
    """Run, in one spawn, the configurations of the selected tests that use ``fixture``.

    Returns each configuration's per-rank results by name, or why the whole run failed.
    """
    selected = {item.callspec.params["cfg"].name for item in request.session.items
                if fixture in getattr(item, "fixturenames", ()) and hasattr(item, "callspec")}
    configs = [cfg for cfg in CONFIGS if cfg.name in selected]
    try:
        per_rank = run_ranks(_compare_worker, world_size, args=(configs,), init=False, timeout=RUN_TIMEOUT)
    except Exception as e:  # noqa: BLE001 - every test of this run reports it
        return e
    return {cfg.name: [results[i] for results in per_rank] for i, cfg in enumerate(configs)}


@pytest.fixture(scope="module")
def two_ranks(request: pytest.FixtureRequest) -> dict[str, list[dict]] | Exception:
    return _run(request, 2, "two_ranks")


@pytest.fixture(scope="module")
def three_ranks(request: pytest.FixtureRequest) -> dict[str, list[dict]] | Exception:
    return _run(request, 3, "three_ranks")


def _check(cfg: Config, run: dict[str, list[dict]] | Exception) -> None:
    if isinstance(run, Exception):
        pytest.fail(f"the run of every configuration failed: {type(run).__name__}: {run}", pytrace=False)
    results = run[cfg.name]
    errors = [f"--- rank {rank} ---\n{got['error']}" for rank, got in enumerate(results) if "error" in got]
    if errors:
        pytest.fail(f"{cfg.name} raised on {len(errors)} of {len(results)} ranks:\n" + "\n".join(errors),
                    pytrace=False)
    for rank, got in enumerate(results):
        mine, ref = got["ddpkit"], got["torch"]
        assert mine["grads_none"] == ref["grads_none"], (cfg.name, rank)
        assert mine["strides"] == ref["strides"], (cfg.name, rank, "gradient layout")
        assert mine["state"].keys() == ref["state"].keys(), (cfg.name, rank)
        for key, value in ref["state"].items():
            wide = torch.complex128 if value.is_complex() else torch.float64  # both parts
            diff = (mine["state"][key].to(wide) - value.to(wide)).abs().max().item()
            assert diff <= cfg.tolerance, f"{cfg.name}: rank {rank} {key} differs by {diff}"
        if mine["views"] is not None:
            assert mine["views"], f"{cfg.name}: a .grad is not a view into a bucket"


@pytest.mark.timeout(RUN_TIMEOUT + 20)  # the first test of the module waits for the whole run
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda cfg: cfg.name)
def test_trains_like_torch_ddp_on_two_ranks(cfg: Config, two_ranks) -> None:
    _check(cfg, two_ranks)


@pytest.mark.timeout(RUN_TIMEOUT + 20)
@pytest.mark.parametrize("cfg", THREE_RANKS, ids=lambda cfg: cfg.name)
def test_trains_like_torch_ddp_on_three_ranks(cfg: Config, three_ranks) -> None:
    _check(cfg, three_ranks)
