"""torch.distributed.checkpoint sees ddpkit's DDP as torch's: the same keys, checkpoints that cross.

The reference is torch's DDP: ``get_model_state_dict`` / ``get_state_dict`` give it the bare module's
keys (no ``module.``), and ``dcp.save`` / ``dcp.load`` of their result move between torch's DDP, ddpkit's
DDP and the bare module. ddpkit's DDP must do the same; see ddpkit/ddp/ddp_class_checks.py.
"""
from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from ranks import run_ranks
from torch import nn

from ddpkit.ddp import ddp_class_checks

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("torch", "ddpkit", "bare")


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Sequential(nn.Linear(8, 3)))


def _wrap(kind: str, module: nn.Module) -> nn.Module:
    import ddpkit

    if kind == "torch":
        return nn.parallel.DistributedDataParallel(module)
    return ddpkit.DDP(module) if kind == "ddpkit" else module


def _trained(kind: str, seed: int, steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A wrapped (or bare) model and its Adam after ``steps`` steps on the same batch on every rank,
    so that the bare module's ranks agree too."""
    model = _wrap(kind, _model(seed))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        x, y = torch.randn(6, 5, generator=gen), torch.randn(6, 3, generator=gen)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return model, optimizer


def _bare(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """Parameters, buffers and Adam's state, by the bare module's names: what a restore must match."""
    module = _bare(model)
    state = {name: {k: v.clone() for k, v in optimizer.state[p].items()} for name, p in module.named_parameters()}
    return {"tensors": {k: v.detach().clone() for k, v in module.state_dict().items()}, "optim": state}


def _assert_same(got: dict, expected: dict, what: str) -> None:
    assert got["tensors"].keys() == expected["tensors"].keys(), what
    for k, v in expected["tensors"].items():
        assert torch.equal(got["tensors"][k], v), f"{what}: {k}"
    assert got["optim"].keys() == expected["optim"].keys(), what
    for name, state in expected["optim"].items():
        assert state.keys() == got["optim"][name].keys(), f"{what}: {name}"
        for k, v in state.items():
            assert torch.equal(got["optim"][name][k], v), f"{what}: {name}.{k}"


# ------------------------------------------------------------------------------------------------
# workers (module level: spawn pickles them by name)


def _keys_worker() -> dict[str, list]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    out = {}
    for kind in KINDS:
        model, optimizer = _trained(kind, seed=0, steps=1)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        out[kind] = {"model": list(get_model_state_dict(model)), "state_dict": list(model_sd),
                     "optim_state": sorted(optim_sd["state"]),
                     "optim_params": [list(g["params"]) for g in optim_sd["param_groups"]],
                     "plain": list(model.state_dict())}
    return out


def _cross_worker(root: str) -> list[str]:
    """dcp.save from each kind, dcp.load into each kind; return the directions that restored exactly."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    saved = {}
    for kind in KINDS:
        model, optimizer = _trained(kind, seed=1, steps=2)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{root}/{kind}")
        saved[kind] = _snapshot(model, optimizer)
    restored = []
    for src in KINDS:
        for dst in KINDS:
            model, optimizer = _trained(dst, seed=7, steps=1)  # other weights, other Adam state
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=f"{root}/{src}")
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
            _assert_same(_snapshot(model, optimizer), saved[src], f"{src} -> {dst}")
            restored.append(f"{src} -> {dst}")
    return restored


# ------------------------------------------------------------------------------------------------
# tests


@pytest.mark.timeout(120)
def test_get_state_dict_gives_ddpkit_ddp_the_keys_torch_ddp_gets():
    for keys in run_ranks(_keys_worker, world_size=2, timeout=90):
        assert keys["ddpkit"]["model"] == keys["torch"]["model"] == keys["bare"]["model"]
        assert not any(k.startswith("module.") for k in keys["ddpkit"]["model"])
        for part in ("state_dict", "optim_state", "optim_params"):
            assert keys["ddpkit"][part] == keys["torch"][part] == keys["bare"][part], part
        assert "0.weight" in keys["ddpkit"]["optim_state"]
        # the wrapper's own state_dict() keeps its prefix, as torch's does
        assert keys["ddpkit"]["plain"] == keys["torch"]["plain"] == ["module." + k for k in keys["bare"]["plain"]]


@pytest.mark.timeout(180)
def test_dcp_checkpoints_cross_between_torch_ddp_ddpkit_ddp_and_the_bare_module(tmp_path):
    pytest.importorskip("numpy", reason="dcp.save gathers its plan through torch's gather_object, which uses numpy")
    results = run_ranks(_cross_worker, world_size=2, args=(str(tmp_path),), timeout=150)
    directions = [f"{src} -> {dst}" for src in KINDS for dst in KINDS]
    assert results == [directions, directions]


def test_adapt_widens_only_the_ddp_name_and_is_idempotent():
    torch_ddp = nn.parallel.DistributedDataParallel
    fake = types.ModuleType(ddp_class_checks.TARGET)
    fake.DDP, fake.FSDP = torch_ddp, object
    assert ddp_class_checks.adapt(fake) and ddp_class_checks.adapt(fake)
    assert fake.DDP is ddp_class_checks.TorchOrDdpkitDDP and fake.FSDP is object
    import ddpkit

    assert issubclass(torch_ddp, fake.DDP) and issubclass(ddpkit.DDP, fake.DDP)
    assert not isinstance(nn.Linear(2, 2), fake.DDP) and not issubclass(nn.Module, fake.DDP)


def test_adapt_leaves_a_torch_without_the_ddp_name_alone_and_says_so():
    fake = types.ModuleType(ddp_class_checks.TARGET)
    with pytest.warns(RuntimeWarning, match="HINT: pass model.module"):
        assert not ddp_class_checks.adapt(fake)
    assert not hasattr(fake, "DDP")


def test_install_adapts_a_module_imported_before_ddpkit(monkeypatch):
    fake = types.ModuleType(ddp_class_checks.TARGET)
    fake.DDP = nn.parallel.DistributedDataParallel
    monkeypatch.setitem(sys.modules, ddp_class_checks.TARGET, fake)
    ddp_class_checks.install()
    assert fake.DDP is ddp_class_checks.TorchOrDdpkitDDP


@pytest.mark.timeout(60)
def test_torch_module_imported_after_ddpkit_and_reimported_is_adapted():
    script = (
        "import sys, ddpkit\n"
        "from ddpkit.ddp.ddp_class_checks import TARGET, TorchOrDdpkitDDP\n"
        "assert TARGET not in sys.modules\n"
        "import torch.distributed.checkpoint.state_dict as sd\n"
        "assert sd.DDP is TorchOrDdpkitDDP\n"
        "import importlib; importlib.reload(sd)\n"
        "assert sd.DDP is TorchOrDdpkitDDP\n"
        "import inspect; assert 'def _get_fqns' in inspect.getsource(sd)\n"  # the loader still answers
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=ROOT, timeout=50)
