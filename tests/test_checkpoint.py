"""ddpkit.save / load: atomic on the main process, survive a killed writer; prefixes; RNG state."""
from __future__ import annotations

import os
import pickle
import random
import signal
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

try:
    import numpy
except ImportError:  # numpy is optional: the RNG test then covers torch and random only
    numpy = None
import pytest
import torch
from ranks import kill_tree, run_ranks
from torch import nn

import ddpkit
from ddpkit.checkpoint import (
    capture_rng_state,
    latest_checkpoint,
    load_state_dict,
    restore_rng_state,
    unwrap_model,
    unwrap_state_dict,
    wrap_state_dict,
)

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "scripts"


class Wrapper(nn.Module):
    """Stands in for DDP / DataParallel: the wrapped model under the attribute ``module``."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))


def _save_then_load(path: str) -> int:
    ddpkit.save({"rank": ddpkit.get_rank()}, path)
    return ddpkit.load(path)["rank"]  # must already be complete on every rank


# ------------------------------------------------------------------------------------------------
# save / load


@pytest.mark.timeout(10)
def test_save_then_load_round_trips_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "sub" / "ckpt.pt"
    ddpkit.save({"w": torch.arange(3.0), "step": 7}, path)
    loaded = ddpkit.load(path)
    assert loaded["step"] == 7 and torch.equal(loaded["w"], torch.arange(3.0))
    assert sorted(p.name for p in path.parent.iterdir()) == ["ckpt.pt"]


@pytest.mark.timeout(10)
def test_a_checkpoint_gets_the_permissions_torch_save_would_give(tmp_path):
    ddpkit.save({"step": 1}, tmp_path / "mine.pt")
    torch.save({"step": 1}, tmp_path / "torchs.pt")
    mode = (tmp_path / "mine.pt").stat().st_mode & 0o777
    assert mode == (tmp_path / "torchs.pt").stat().st_mode & 0o777, oct(mode)


@pytest.mark.timeout(10)
def test_load_of_a_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope" / "step_10.pt"
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at .*step_10\.pt.*does not exist") as raised:
        ddpkit.load(missing)
    assert str(raised.value).endswith("or None.") and raised.value.errno == 2  # the path is not glued on


@pytest.mark.timeout(10)
def test_save_that_fails_keeps_the_previous_checkpoint_and_no_temporary(tmp_path):
    path = tmp_path / "ckpt.pt"
    ddpkit.save({"version": 1}, path)
    with pytest.raises((pickle.PicklingError, AttributeError)):  # what pickling a lambda raises
        ddpkit.save({"version": 2, "bad": lambda: None}, path)  # lambdas do not pickle
    assert ddpkit.load(path) == {"version": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


@pytest.mark.timeout(10)
def test_save_in_a_launched_job_without_init_says_to_call_it(tmp_path, launched_as_rank_1_of_2):
    """Rank 1 would return before rank 0 had written the file, and its load would fail."""
    with pytest.raises(ddpkit.NotInitializedError, match=r"^ddpkit\.save: this process is rank 1 of WORLD_SIZE=2 .*"
                                           r"call ddpkit.init\(\) first"):
        ddpkit.save({"w": 1}, tmp_path / "ckpt.pt")
    assert not (tmp_path / "ckpt.pt").exists()


@pytest.mark.timeout(10)
def test_save_rejects_a_file_object():
    with pytest.raises(TypeError, match="needs a path"):
        ddpkit.save({}, object())


@pytest.mark.timeout(60)
def test_writer_killed_mid_save_leaves_the_previous_checkpoint_intact(tmp_path):
    path = tmp_path / "ckpt.pt"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # import ddpkit from this checkout
    child = subprocess.Popen([sys.executable, str(SCRIPTS / "ckpt_killed_writer.py"), str(path)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout.readline() == "writing\n"  # half of version 2 is on disk now
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=10) == -signal.SIGKILL
    finally:
        kill_tree(child.pid)
        child.wait(timeout=10)
        child.stdin.close()
        child.stdout.close()
    torn = [p for p in tmp_path.iterdir() if p.name != "ckpt.pt"]
    assert len(torn) == 1 and torn[0].stat().st_size > 0  # the half-written temporary file
    assert ddpkit.load(path)["version"] == 1
    assert latest_checkpoint(tmp_path) == path


@pytest.mark.timeout(60)
def test_only_rank_0_writes_and_every_rank_reads_the_complete_file(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    assert run_ranks(_save_then_load, world_size=2, args=(path,)) == [0, 0]
    assert ddpkit.load(path) == {"rank": 0}


def _load_missing(path: str) -> str:
    try:
        ddpkit.load(path)
    except FileNotFoundError as e:
        return str(e)
    return ""


@pytest.mark.timeout(60)
def test_a_missing_file_in_a_job_of_several_ranks_says_save_is_collective(tmp_path):
    """A load on rank 1 right after a save called on rank 0 alone runs before the file exists."""
    for said in run_ranks(_load_missing, world_size=2, args=(str(tmp_path / "ckpt.pt"),)):
        assert "ddpkit.save is collective, call it on every rank" in said, said


@pytest.mark.timeout(10)
@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes came in Python 3.11")
def test_a_save_that_fails_names_the_path_asked_for_not_only_the_temporary_file(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError) as caught:
        ddpkit.save({}, tmp_path / "file" / "x.pt")  # a file where a directory should be
    assert f"ddpkit.save could not write {str(tmp_path / 'file' / 'x.pt')!r}" in caught.value.__notes__[0]
    assert isinstance(caught.value, NotADirectoryError)  # mkdir said only "File exists: '<the file>'"
    assert f"{str(tmp_path / 'file')!r} is a file, not a directory" in str(caught.value)


# ------------------------------------------------------------------------------------------------
# latest_checkpoint


@pytest.mark.timeout(10)
def test_latest_checkpoint_takes_the_highest_step_that_is_complete(tmp_path):
    for step in (5, 10, 9):
        ddpkit.save({"step": step}, tmp_path / f"step_{step}.pt")
    whole = (tmp_path / "step_10.pt").read_bytes()
    (tmp_path / "step_20.pt").write_bytes(whole[: len(whole) // 2])  # torn by a non-atomic writer
    (tmp_path / ".step_30.pt.tmp-abc").write_bytes(whole)  # a temporary of ddpkit.save
    assert latest_checkpoint(tmp_path) == tmp_path / "step_10.pt"


@pytest.mark.timeout(10)
def test_latest_checkpoint_compares_the_numbers_of_a_name_in_order_and_takes_torchs_legacy_format(tmp_path):
    ddpkit.save({}, tmp_path / "step_00000010.pt")
    ddpkit.save({}, tmp_path / "step_00000100_rank0.pt")  # a number after the step: still step 100
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000100_rank0.pt"
    torch.save({}, tmp_path / "step_00000300.pt", _use_new_zipfile_serialization=False)
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000300.pt"
    epochs = tmp_path / "epochs"
    for name in ("epoch3_step100.pt", "epoch4_step50.pt", "epoch4_step20.pt"):
        ddpkit.save({}, epochs / name)
    assert latest_checkpoint(epochs) == epochs / "epoch4_step50.pt"


@pytest.mark.timeout(10)
def test_latest_checkpoint_is_none_for_an_empty_or_missing_directory(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "missing") is None


# ------------------------------------------------------------------------------------------------
# the "module." prefix


@pytest.mark.timeout(10)
def test_unwrap_and_wrap_round_trip_keys_values_and_metadata():
    wrapped = Wrapper(_model()).state_dict()
    plain = unwrap_state_dict(wrapped)
    assert list(plain) == list(_model().state_dict())
    assert plain._metadata["1"] == wrapped._metadata["module.1"]  # BatchNorm's version survives
    again = wrap_state_dict(plain)
    assert list(again) == list(wrapped)
    assert all(torch.equal(again[k], wrapped[k]) for k in wrapped)


@pytest.mark.timeout(10)
def test_unwrap_and_wrap_refuse_dicts_that_are_not_what_they_expect():
    with pytest.raises(ValueError, match=r"1 of 2 keys do not start with 'module.'"):
        unwrap_state_dict(OrderedDict([("module.a", 1), ("b", 2)]))
    with pytest.raises(ValueError, match="already start with 'module.'"):
        wrap_state_dict(OrderedDict([("module.a", 1), ("b", 2)]))


@pytest.mark.timeout(10)
def test_load_state_dict_moves_weights_between_wrapped_and_plain_models():
    source = _model()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(1.0)
    plain, wrapped = _model(), Wrapper(_model())
    load_state_dict(plain, Wrapper(source).state_dict())     # wrapped -> plain: prefix removed
    load_state_dict(wrapped, source.state_dict())             # plain -> wrapped: prefix added
    load_state_dict(Wrapper(_model()), wrapped.state_dict())  # same shape: as is
    for model in (plain, wrapped.module):
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                     source.state_dict().values()))


@pytest.mark.timeout(10)
def test_load_state_dict_wraps_a_model_whose_own_submodule_is_called_module():
    class Ema(nn.Module):  # as timm's ModelEmaV2: its keys start with "module." unwrapped
        def __init__(self):
            super().__init__()
            self.module = nn.Linear(3, 2)

    source = Ema()
    wrapped, plain = Wrapper(Ema()), Ema()
    load_state_dict(wrapped, source.state_dict())            # bare -> wrapped: "module.module.weight"
    load_state_dict(plain, Wrapper(source).state_dict())     # wrapped -> bare
    for model in (wrapped.module, plain):
        assert torch.equal(model.module.weight, source.module.weight)


@pytest.mark.timeout(10)
def test_load_state_dict_raises_on_a_mismatch_instead_of_guessing():
    other = nn.Sequential(nn.Linear(3, 4))
    with pytest.raises(ddpkit.StateDictMismatchError,
                       match=r"does not fit Sequential .*Closest, with 'module.' removed: "
                             r"7 of the model's keys are missing, e.g. \['1.weight'") as caught:
        load_state_dict(_model(), Wrapper(other).state_dict())
    assert len(caught.value.missing) == 7 and caught.value.missing[0] == "1.weight"
    result = load_state_dict(_model(), Wrapper(other).state_dict(), strict=False)
    assert "1.weight" in result.missing_keys and not result.unexpected_keys


_FORMS = {  # a model as a script may hold it; nn.DataParallel without CUDA is a wrapper that calls it
    "bare": lambda m: m,
    "compiled": lambda m: torch.compile(m, backend="eager"),
    "wrapped": lambda m: nn.DataParallel(m),
    "compiled_wrapped": lambda m: torch.compile(nn.DataParallel(m), backend="eager"),
    "wrapped_compiled": lambda m: nn.DataParallel(torch.compile(m, backend="eager")),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("source", sorted(_FORMS))
def test_load_state_dict_and_unwrap_model_see_through_torch_compile_in_either_order(source):
    """torch.compile puts "_orig_mod." before the keys, outside or inside "module."."""
    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    saved = _FORMS[source](model).state_dict()
    for name, form in _FORMS.items():
        inner = _model()
        target = form(inner)
        assert unwrap_model(target) is inner, name
        load_state_dict(target, saved)
        assert all(torch.equal(a, b) for a, b in zip(inner.state_dict().values(), model.state_dict().values())), name


@pytest.mark.timeout(10)
def test_a_mismatch_where_no_key_matches_says_strict_false_would_load_nothing():
    with pytest.raises(ddpkit.StateDictMismatchError, match=r"No key matches in any of these forms, so "
                                                            r"strict=False would load nothing"):
        load_state_dict(_model(), {"encoder.weight": torch.zeros(2)})
    with pytest.raises(ddpkit.StateDictMismatchError, match=r"strict=False to load the keys that match \(9 of 9\)"):
        load_state_dict(_model(), {**_model().state_dict(), "extra.weight": torch.zeros(2)})


@pytest.mark.timeout(10)
def test_unwrap_model_reaches_the_module_inside_torch_data_parallel():
    inner = _model()
    assert unwrap_model(nn.DataParallel(inner)) is inner
    assert unwrap_model(inner) is inner


# ------------------------------------------------------------------------------------------------
# RNG state


def _draw() -> tuple:
    drawn = (torch.rand(3), random.random())
    return drawn + ((float(numpy.random.rand()),) if numpy is not None else ())


@pytest.mark.timeout(10)
def test_rng_state_survives_a_checkpoint_and_replays_the_same_draws(tmp_path):
    state = capture_rng_state()
    expected = _draw()
    ddpkit.save({"rng": state}, tmp_path / "rng.pt")
    _draw()
    restore_rng_state(ddpkit.load(tmp_path / "rng.pt")["rng"])  # torch's weights_only=True suffices
    again = _draw()
    assert torch.equal(again[0], expected[0]) and again[1:] == expected[1:]
