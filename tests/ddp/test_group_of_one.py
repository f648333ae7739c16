"""A process group of one (torchrun --nproc-per-node 1): ddpkit's DDP runs no reducer there, yet it
raises where torch's does, so that a script fails at one rank as it would at eight."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import ddpkit
from ddpkit.errors import SecondGradientError, UnusedParametersError
from tests.ranks import run_ranks


class _HalfUsed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.spare = nn.Linear(4, 4)
        self.use_spare = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x) + self.spare(x) if self.use_spare else self.used(x)


class _Reentrant(nn.Module):
    """A layer run inside a reentrant checkpoint: its parameters get their gradient from the inner
    backward, then once more in the outer one, since the layer is also used outside it."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.layer, x, use_reentrant=True) + self.layer(x)


class _LastBlockCheckpointed(nn.Module):
    """The block nearest the loss in a reentrant checkpoint: the first gradients come from its inner
    backward, which ends before the outer one reaches ``body``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.head, self.body(x), use_reentrant=True)


def _first_error(ddp: nn.Module, steps: int = 3) -> tuple[int, BaseException] | None:
    """The step and error of the first step that raised (forward and backward), else None."""
    for step in range(steps):
        try:
            ddp(torch.ones(2, 4, requires_grad=True)).sum().backward()
        except RuntimeError as e:
            return step, e
    return None


def _errors_worker() -> dict:
    out = {}
    for model in (_HalfUsed, _Reentrant):
        torch.manual_seed(0)
        step, error = _first_error(nn.parallel.DistributedDataParallel(model()))
        out[f"torch {model.__name__}"] = (step, str(error).split(".")[0])
        torch.manual_seed(0)
        ddp = ddpkit.DDP(model())
        step, error = _first_error(ddp)
        out[f"ddpkit {model.__name__}"] = (step, type(error), str(error))
        out[f"{model.__name__} logged"] = ddp._get_ddp_logging_data().get("has_error")
    # the error ends that iteration only: steps that use every parameter train on
    ddp = ddpkit.DDP(_HalfUsed())
    _first_error(ddp, 1)
    ddp.module.use_spare = True
    out["after"] = _first_error(ddp)
    ddp.module.use_spare = False
    out["copy"] = _first_error(copy.deepcopy(ddp), 1) is not None  # it checks its own parameters
    return out


@pytest.mark.timeout(90)
def test_a_group_of_one_raises_what_torchs_reducer_raises_there():
    [out] = run_ranks(_errors_worker, 1, timeout=75)
    # torch: at the next forward; ddpkit: at the backward that left them without a gradient
    assert out["torch _HalfUsed"] == (1, "Expected to have finished reduction in the prior iteration "
                                         "before starting a new one")
    step, kind, text = out["ddpkit _HalfUsed"]
    assert (step, kind) == (0, UnusedParametersError) and "Expected to have finished reduction in the prior " \
        "iteration before starting a new one" in text and "rank 0: 'spare.weight', 'spare.bias'" in text
    assert out["torch _Reentrant"] == (0, "Expected to mark a variable ready only once")
    step, kind, text = out["ddpkit _Reentrant"]
    assert (step, kind) == (0, SecondGradientError) and "Expected to mark a variable ready only once" in text
    assert "parameter 'layer.weight'" in text or "parameter 'layer.bias'" in text
    assert out["_HalfUsed logged"] == out["_Reentrant logged"] == 1
    assert out["after"] is None and out["copy"]


def _quiet_worker() -> dict:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _quiet_cases()
    out["warnings"] = [str(w.message) for w in caught if "DistributedDataParallel" in str(w.message)]
    return out


def _quiet_cases() -> dict:
    out = {}
    configs = {"find_unused_parameters": dict(find_unused_parameters=True), "static_graph": dict(static_graph=True)}
    for name, options in configs.items():
        for model in (_HalfUsed, _Reentrant):
            out[f"{name} {model.__name__}"] = _first_error(ddpkit.DDP(model(), **options))
    ddp = ddpkit.DDP(_Reentrant())
    ddp._set_static_graph()
    out["_set_static_graph"] = _first_error(ddp)
    out["last block checkpointed"] = _first_error(ddpkit.DDP(_LastBlockCheckpointed()))
    out["torch: last block checkpointed"] = _first_error(nn.parallel.DistributedDataParallel(_LastBlockCheckpointed()))
    # no_sync steps are local: nothing to finish, as in torch
    ddp = ddpkit.DDP(_HalfUsed())
    with ddp.no_sync():
        out["no_sync"] = _first_error(ddp)
    # a backward that reaches no parameter (a penalty on the input) changes nothing
    ddp = ddpkit.DDP(_HalfUsed())
    x = torch.ones(2, 4, requires_grad=True)
    torch.autograd.grad(ddp(x).sum(), x)
    ddp.module.use_spare = True
    out["grad of the input"] = _first_error(ddp)
    # GPipe through a pipeline stage: every microbatch's forward, then every backward
    ddp = ddpkit.DDP(nn.Linear(4, 4))
    outputs = [ddp(torch.ones(2, 4)) for _ in range(3)]
    for output in outputs:
        output.sum().backward()
    out["forwards then backwards"] = _first_error(ddp)
    # with every parameter used, a group of one trains as one process does
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    ddp = ddpkit.DDP(model)
    for m in (ddp, reference):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for step in range(3):
            opt.zero_grad()
            m(torch.full((3, 4), float(step))).pow(2).sum().backward()
            opt.step()
    out["trains"] = all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    return out


@pytest.mark.timeout(90)
def test_a_group_of_one_accepts_what_torch_accepts_there():
    [out] = run_ranks(_quiet_worker, 1, timeout=75)
    assert out.pop("trains") and out.pop("warnings") == []
    assert out == {key: None for key in out}


def _comm_hook_worker() -> tuple:
    ddp = ddpkit.DDP(_HalfUsed())
    ddp.register_comm_hook(None, ddpkit.hooks.allreduce_hook)  # a reducer now: it checks
    step, error = _first_error(ddp)
    return step, type(error).__name__


@pytest.mark.timeout(60)
def test_a_group_of_one_with_a_comm_hook_checks_through_its_reducer():
    assert run_ranks(_comm_hook_worker, 1, timeout=45) == [(0, "UnusedParametersError")]


def test_the_single_process_fallback_stays_a_plain_wrapper():
    """No process group: DDP is the module, unused parameters and all."""
    ddp = ddpkit.DDP(_HalfUsed())
    assert ddp.process_group is None and ddp._solo is None
    assert _first_error(ddp) is None


class _FailsBetweenLayers(nn.Module):
    """With ``fail``, backward raises between its layers: after the second's gradients, before the first's."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 2)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.first(x)
        if self.fail:
            hidden.register_hook(lambda grad: (_ for _ in ()).throw(ValueError("a hook failed")))
        return self.second(hidden)


def _raised_midway_worker() -> list:
    """A backward that raised midway (caught by the script): the next forward says so, once."""
    seen = []
    for DDP in (nn.parallel.DistributedDataParallel, ddpkit.DDP):  # noqa: N806
        model = _FailsBetweenLayers()
        ddp = DDP(model)
        model.fail = True
        try:
            ddp(torch.ones(2, 4)).sum().backward()
        except ValueError:
            pass
        model.fail = False
        steps = []
        for _ in range(2):
            try:
                ddp(torch.ones(2, 4)).sum().backward()
                steps.append("ok")
            except RuntimeError as e:
                steps.append(str(e) if DDP is ddpkit.DDP else str(e).split(".")[0])
        seen.append(steps)
    return seen


@pytest.mark.timeout(60)
def test_a_group_of_one_says_once_that_the_last_backward_did_not_finish():
    [(torch_steps, ddpkit_steps)] = run_ranks(_raised_midway_worker, 1, timeout=45)
    phrase = "Expected to have finished reduction in the prior iteration before starting a new one"
    assert torch_steps[0] == phrase
    assert phrase in ddpkit_steps[0] and ddpkit_steps[1] == "ok"  # torch raises at every later forward


def _fallback_after_init_worker() -> tuple:
    # a plain `python train.py` that calls ddpkit.init(): no launcher variables, a Gloo group of one
    import os

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE"):
        os.environ.pop(name, None)
    env = ddpkit.init()
    ddp = ddpkit.DDP(_HalfUsed())
    return env.launcher, ddp.process_group is not None, ddp._solo is None, _first_error(ddp)


@pytest.mark.timeout(60)
def test_the_single_process_fallback_after_init_stays_a_plain_wrapper():
    assert run_ranks(_fallback_after_init_worker, 1, init=False, timeout=45) == [("single", True, True, None)]
