"""DDP's ``mixed_precision`` against a hand-written reference of torch's meaning, on Gloo ranks.

The reference trains in one process on the global batch: for each rank's slice it casts a copy of
the fp32 parameters to ``param_dtype``, runs forward and backward there (gradients in
``param_dtype``), casts each rank's gradient to ``reduce_dtype``, sums them in rank order and
divides by the world size in ``reduce_dtype``, upcasts, and takes an SGD step on the fp32
parameters. BatchNorm's running statistics follow rank 0's slice (DDP broadcasts rank 0's buffers
before each forward). torch's own mixed_precision cannot serve as the reference: it fails on CPU.
"""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from ranks import RankFailure, run_ranks
from torch import nn
from torch.nn.parallel.distributed import _MixedPrecision

import ddpkit
from ddpkit.errors import CommHookError

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
LR, STEPS, BATCH = 0.5, 3, 8


def _model(bn: bool) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(6, 8)] + ([nn.BatchNorm1d(8)] if bn else []) + [nn.ReLU(), nn.Linear(8, 3)]
    return nn.Sequential(*layers)


def _data(world: int, steps: int, micro: int = 1) -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [torch.randn(world * BATCH, 6) for _ in range(steps * micro)]


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def _train(world: int, setting: tuple, bn: bool, micro: int) -> dict:
    """One rank: DDP with mixed_precision, SGD on its slice; ``micro`` backwards per step (no_sync)."""
    rank = dist.get_rank()
    model = _model(bn)
    ddp = ddpkit.DDP(model, mixed_precision=_MixedPrecision(*setting))
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    grad_dtypes, batches = set(), _data(world, STEPS, micro)
    for step in range(STEPS):
        opt.zero_grad()
        for m in range(micro):
            x = batches[step * micro + m][rank * BATCH:(rank + 1) * BATCH]
            if m < micro - 1:
                with ddp.no_sync():
                    _loss(ddp(x)).backward()
            else:
                _loss(ddp(x)).backward()
        grad_dtypes |= {p.grad.dtype for p in model.parameters()}
        opt.step()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "buffers": {n: b.clone() for n, b in model.named_buffers()},
            "grad_dtypes": grad_dtypes, "parameters": all(isinstance(p, nn.Parameter) for p in model.parameters())}


def _reference(world: int, setting: tuple, bn: bool, micro: int) -> nn.Module:
    param_dtype, reduce_dtype, buffer_dtype = setting
    reduce_dtype = reduce_dtype or param_dtype
    master = _model(bn)
    if buffer_dtype is not None:
        for b in master.buffers():
            if b.is_floating_point():
                b.data = b.to(buffer_dtype)
    batches = _data(world, STEPS, micro)
    for step in range(STEPS):
        local = []
        for rank in range(world):
            work = copy.deepcopy(master)
            for p in work.parameters():
                p.data = p.data.to(param_dtype)
            grads = [torch.zeros_like(p, dtype=FP32) for p in master.parameters()]
            for m in range(micro):
                if rank != 0:  # DDP broadcasts rank 0's buffers before each forward
                    for wb, mb in zip(work.buffers(), master.buffers()):
                        wb.copy_(mb)
                _loss(work(batches[step * micro + m][rank * BATCH:(rank + 1) * BATCH].to(param_dtype))).backward()
                grads = [g + p.grad.float() for g, p in zip(grads, work.parameters())]  # fp32 accumulation
                work.zero_grad()
                if rank == 0:
                    for wb, mb in zip(work.buffers(), master.buffers()):
                        mb.copy_(wb)
            local.append(grads if micro > 1 else [g.to(param_dtype) for g in grads])
        with torch.no_grad():
            for i, p in enumerate(master.parameters()):
                total = local[0][i].to(reduce_dtype)
                for grads in local[1:]:
                    total = total + grads[i].to(reduce_dtype)
                p -= LR * (total / world).float()
    return master


CASES = {  # (param_dtype, reduce_dtype, buffer_dtype), batch norm, world, micro-batches per step
    "bf16-reduce-fp32": ((BF16, FP32, None), False, 2, 1),
    "bf16-reduce-bf16": ((BF16, BF16, None), False, 2, 1),
    "bf16-reduce-default": ((BF16, None, None), False, 2, 1),
    "fp16-reduce-fp32": ((FP16, FP32, None), False, 2, 1),
    "bf16-batchnorm-buffers-bf16": ((BF16, FP32, BF16), True, 2, 1),
    "bf16-no_sync-reduce-bf16": ((BF16, BF16, None), False, 2, 2),
    "bf16-three-ranks-reduce-bf16": ((BF16, BF16, None), False, 3, 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_training_equals_the_reference(case):
    setting, bn, world, micro = CASES[case]
    results = run_ranks(_train, world_size=world, args=(world, setting, bn, micro))
    master = _reference(world, setting, bn, micro)
    # Tolerance: each rank's forward and backward are the reference's own operations on the same
    # slices, so the local gradients agree bit for bit; what may differ is the order Gloo sums the
    # ranks' gradients in, which in reduce_dtype changes each averaged gradient by at most one
    # rounding of it, 2**-8 relative in bfloat16. Over STEPS steps of LR that moves a parameter by
    # at most LR * STEPS * 2**-8 * max|grad| (|grad| < 4 here): 0.03. With two ranks the order cannot
    # matter in any dtype (a + b = b + a, one rounding, and halving is exact), so there the bound is 0:
    # reducing in fp32 where bf16 was asked, or the reverse, would fail these cases.
    atol = 0.0 if world == 2 else LR * STEPS * 2**-8 * 4
    for r in results:
        assert r["grad_dtypes"] == {FP32} and r["parameters"]
        for n, p in master.named_parameters():
            assert r["params"][n].dtype == FP32
            torch.testing.assert_close(r["params"][n], p.detach(), rtol=0, atol=atol, msg=f"{case}: {n}")
    for n, b in master.named_buffers():
        assert results[0]["buffers"][n].dtype == b.dtype
        torch.testing.assert_close(results[0]["buffers"][n], b, rtol=0, atol=atol, msg=f"{case}: {n}")
    # and mixed precision did something: fp32 training ends elsewhere
    fp32 = _reference(world, (FP32, FP32, None), bn, micro)
    assert any(not torch.equal(p, q) for p, q in zip(master.parameters(), fp32.parameters()))


def test_buffers_are_cast_at_construction_and_integer_counters_kept():
    ddp = ddpkit.DDP(_model(bn=True), mixed_precision=SimpleNamespace(param_dtype=None, reduce_dtype=None,
                                                                       buffer_dtype=BF16))
    bn = ddp.module[1]
    assert bn.running_mean.dtype == BF16 and bn.running_var.dtype == BF16
    assert bn.num_batches_tracked.dtype == torch.int64 and bn.weight.dtype == FP32


def test_a_wrapped_data_parallel_runs_in_the_param_dtype_as_its_module_does():
    # torch.func.functional_call refuses every nn.DataParallel, ddpkit's included
    setting = _MixedPrecision(param_dtype=BF16)
    x = torch.randn(8, 6)
    plain = ddpkit.DDP(_model(bn=False), mixed_precision=setting)
    wrapped = ddpkit.DDP(ddpkit.DataParallel(_model(bn=False), device_ids=["cpu"] * 2), mixed_precision=setting)
    out, expected = wrapped(x), plain(x)
    assert out.dtype == BF16 and torch.equal(out, expected)
    _loss(out).backward()
    _loss(expected).backward()
    for p, q in zip(wrapped.module.module.parameters(), plain.module.parameters()):
        # two replicas' bf16 gradients summed in fp32 against one bf16 gradient: bf16's rounding apart
        assert p.dtype == FP32
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=1e-3)


def test_a_config_without_the_three_fields_is_refused_by_name():
    with pytest.raises(ddpkit.MixedPrecisionError, match=r"mixed_precision=.* lacks reduce_dtype, buffer_dtype.*HINT:"):
        ddpkit.DDP(nn.Linear(2, 2), mixed_precision=SimpleNamespace(param_dtype=FP16))
    # torch's DDP reads the fields and raises an AttributeError in these words; so does ddpkit's
    with pytest.raises(AttributeError, match="'str' object has no attribute 'param_dtype'") as caught:
        ddpkit.DDP(nn.Linear(2, 2), mixed_precision="bf16")
    assert caught.value.missing == ["param_dtype", "reduce_dtype", "buffer_dtype"]
    with pytest.raises(TypeError, match=r"mixed_precision.param_dtype=torch.int32 is not a floating-point"):
        ddpkit.DDP(nn.Linear(2, 2), mixed_precision=_MixedPrecision(param_dtype=torch.int32))


def test_a_compiled_module_is_refused():
    with pytest.raises(NotImplementedError, match="mixed_precision cannot be combined with a torch.compile'd"):
        ddpkit.DDP(torch.compile(nn.Linear(2, 2)), mixed_precision=_MixedPrecision(param_dtype=BF16))


def _combinations() -> list[str]:
    caught = []
    ddp = ddpkit.DDP(nn.Linear(2, 2), mixed_precision=_MixedPrecision(param_dtype=BF16))
    try:
        ddp.register_comm_hook(None, ddpkit.hooks.bf16_compress_hook)
    except CommHookError as e:
        caught.append(str(e))
    try:
        ddp.join()
    except NotImplementedError as e:
        caught.append(str(e))
    return caught


def test_comm_hooks_and_join_are_refused_with_a_typed_error():
    for caught in run_ranks(_combinations, world_size=2):
        assert len(caught) == 2
        assert "register_comm_hook(bf16_compress_hook) cannot be combined with mixed_precision" in caught[0]
        assert "join() is not implemented with mixed_precision" in caught[1]


def test_a_rank_with_a_bad_config_fails_every_rank():
    # rank 1's TypeError reaches rank 0 through the construction's cross-rank check: neither waits
    with pytest.raises(RankFailure, match="is not a floating-point"):
        run_ranks(_bad_on_rank_1, world_size=2, timeout=30)


def _bad_on_rank_1() -> None:
    dtype = torch.int32 if dist.get_rank() == 1 else BF16
    ddpkit.DDP(nn.Linear(2, 2), mixed_precision=_MixedPrecision(param_dtype=dtype))


def _compiled_around(backend: str) -> bool:
    torch.manual_seed(0)
    model = _model(bn=False)
    ddp = ddpkit.DDP(model, mixed_precision=_MixedPrecision(param_dtype=BF16, reduce_dtype=BF16))
    x = torch.randn(BATCH, 6)
    _loss(torch.compile(ddp, backend=backend)(x)).backward()
    compiled = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    _loss(ddp(x)).backward()
    return all(a.dtype == FP32 and torch.equal(a, p.grad) for a, p in zip(compiled, model.parameters()))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_around_ddp_averages_the_same_gradients_as_eager(backend):
    assert run_ranks(_compiled_around, world_size=2, args=(backend,), timeout=180) == [True, True]
