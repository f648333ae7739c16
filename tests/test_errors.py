"""ddpkit's typed errors: what each subclasses, the facts it carries, and each message word for word.

The exact-text tests hold one full message per error class, so that a rewording shows as a change
here; the other tests match the parts they are about.
"""
from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist
from ranks import rank_env, run_ranks
from torch import nn

import ddpkit
from ddpkit.checkpoint import load_state_dict
from ddpkit.ddp.errors import second_gradient_error, static_graph_changed_error, unused_gradient_error
from ddpkit.errors import (
    BatchDimError,
    CheckpointSaveError,
    CollectiveMismatchError,
    CommHookError,
    DenseGradientError,
    EmptyListError,
    LateGradientError,
    LauncherVariableError,
    MixedPrecisionError,
    NotAModuleError,
    NotInitializedError,
    OutputKeysError,
    RanksDisagreeError,
    RendezvousError,
    ReplicaCountError,
    SecondGradientError,
    StateDictMismatchError,
    StaticGraphChangedError,
    UnusedParametersError,
    explain,
)

# what each class was raised as before it existed: user code catching that must still catch it
BASES = {
    UnusedParametersError: (RuntimeError,), SecondGradientError: (RuntimeError,), LateGradientError: (RuntimeError,),
    StaticGraphChangedError: (RuntimeError,), RanksDisagreeError: (RuntimeError,),
    CommHookError: (TypeError, RuntimeError), DenseGradientError: (TypeError, RuntimeError),
    NotInitializedError: (RuntimeError, ValueError),
    NotAModuleError: (TypeError, AttributeError), MixedPrecisionError: (TypeError, AttributeError),
    LauncherVariableError: (ValueError,), RendezvousError: (RuntimeError,),
    CheckpointSaveError: (RuntimeError,), StateDictMismatchError: (RuntimeError,),
    CollectiveMismatchError: (RuntimeError,),
    ReplicaCountError: (ValueError, AssertionError),  # ValueError first; AssertionError is torch's
    BatchDimError: (ValueError, IndexError, RuntimeError),  # torch's IndexError, or RuntimeError (0-dim)
    EmptyListError: (ValueError, IndexError, RuntimeError),  # torch reads [0], or finds no device type
    OutputKeysError: (ValueError, KeyError),  # torch's gather looks each key up
}


def test_each_class_is_what_was_raised_before_and_is_exported():
    assert set(BASES) == {getattr(ddpkit.errors, name) for name in ddpkit.errors.__all__ if name != "explain"}
    for cls, bases in BASES.items():
        assert all(issubclass(cls, base) for base in bases), cls
        assert getattr(ddpkit, cls.__name__) is cls and cls.__name__ in ddpkit.__all__
    assert "errors" in ddpkit.__all__ and ddpkit.errors.explain is explain


def test_explain_writes_the_prefix_and_the_hint():
    assert explain("it broke.") == "it broke."
    assert explain("it broke.", "fix it.") == "it broke. HINT: fix it."
    assert explain("it broke.", who="ddpkit.save") == "ddpkit.save: it broke."
    assert explain("it broke.", "fix it.", who="DistributedDataParallel", rank=3) == \
        "DistributedDataParallel on rank 3: it broke. HINT: fix it."


def test_the_facts_survive_pickling():
    error = LauncherVariableError("RANK='x' is bad.", variable="RANK", value="x")
    error.add_note("while starting")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is LauncherVariableError and str(copy) == "RANK='x' is bad."
    assert (copy.variable, copy.value, copy.__notes__) == ("RANK", "x", ["while starting"])


# ---- DistributedDataParallel ---------------------------------------------------------------------------
class _Net(nn.Module):
    def __init__(self, width: int = 4):
        super().__init__()
        self.body, self.fc = nn.Linear(4, width), nn.Linear(width, 2, bias=False)

    def forward(self, x: torch.Tensor, use_fc: bool = True) -> torch.Tensor:
        h = self.body(x)
        return self.fc(h) if use_fc else h


class _Unpicklable:
    def __reduce__(self):
        raise ValueError("this object stays in memory")


def _caught(fn) -> BaseException | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the error itself travels back, pickled
        return e
    return None


def _failures_worker(directory: str) -> dict[str, BaseException | None]:
    rank = dist.get_rank()
    ddp = ddpkit.DDP(_Net())
    return {
        "unused": _caught(lambda: ddp(torch.ones(2, 4), use_fc=rank != 0).sum().backward()),
        "disagree": _caught(lambda: ddpkit.DDP(_Net(width=3 + rank))),
        "refused": _caught(lambda: ddpkit.DDP(_Net() if rank == 0 else "model")),
        "save": _caught(lambda: ddpkit.save(_Unpicklable() if rank == 0 else None, f"{directory}/c.pt")),
    }


@pytest.mark.timeout(60)
def test_real_failures_on_two_ranks_carry_their_facts(tmp_path):
    ranks = run_ranks(_failures_worker, 2, args=(str(tmp_path),), timeout=45)
    for rank, out in enumerate(ranks):
        unused = out["unused"]
        assert type(unused) is UnusedParametersError, unused
        assert (unused.by_rank, unused.rank, unused.static_graph) == ({0: ["fc.weight"]}, rank, False)
        disagree = out["disagree"]
        assert type(disagree) is RanksDisagreeError, disagree
        assert (disagree.rank, disagree.differing_rank) == (rank, 1)
        assert disagree.difference == ("tensor #0 differs: rank 0 has 'body.weight' with shape [3, 4] "
                                       "(float32), rank 1 has 'body.weight' with shape [4, 4] (float32), so "
                                       "tensor #0 with sizes [4, 4] appears not to match sizes of the same "
                                       "param in process 0")
    refused = ranks[0]["refused"]
    assert type(refused) is RanksDisagreeError and (refused.rank, refused.differing_rank) == (0, 1)
    assert refused.difference == ("NotAModuleError: DistributedDataParallel wraps a torch.nn.Module, got str "
                                  "'model'. HINT: wrap the model, an nn.Module instance: DDP(model).")
    own = ranks[1]["refused"]  # the rank whose arguments were refused: its own error
    assert type(own) is ddpkit.NotAModuleError and isinstance(own, (TypeError, AttributeError)) and own.got == "str"
    assert type(ranks[0]["save"]) is ValueError  # rank 0 raises what failed it
    saved = ranks[1]["save"]
    assert type(saved) is CheckpointSaveError, saved
    assert (saved.path, saved.error) == (f"{tmp_path}/c.pt", "ValueError: this object stays in memory")
    # the exact texts
    assert str(ranks[1]["unused"]) == (
        "DistributedDataParallel: Expected to have finished reduction in the prior iteration before "
        "starting a new one (torch's DDP says so at the next forward; ddpkit at this backward, where it "
        "happens). This error indicates that your module has parameters that were not used in producing "
        "loss: they received no gradient in this backward pass, so their buckets could not be averaged "
        "(find_unused_parameters=False): rank 0: 'fc.weight' (this is rank 1). HINT: "
        "pass find_unused_parameters=True to DistributedDataParallel, or make sure the output (the loss) "
        "depends on every parameter; freeze parameters you do not train with requires_grad_(False) before "
        "wrapping the model.")
    assert str(ranks[0]["disagree"]) == (
        "DDP expects same model across all ranks: DistributedDataParallel needs the same parameters and "
        "buffers on every rank, but tensor #0 differs: "
        "rank 0 has 'body.weight' with shape [3, 4] (float32), rank 1 has 'body.weight' with shape [4, 4] "
        "(float32), so tensor #0 with sizes [4, 4] appears not to match sizes of the same param in process 0 "
        "(this is rank 0). HINT: build the model identically on every rank (same arguments, same "
        "code path) before wrapping it.")
    assert str(refused) == ("DistributedDataParallel could not be built on rank 1: NotAModuleError: "
                            "DistributedDataParallel wraps a torch.nn.Module, got str 'model'. HINT: wrap the "
                            "model, an nn.Module instance: DDP(model). (this is rank 0).")
    assert str(saved) == (f"rank 0 failed to save the checkpoint '{tmp_path}/c.pt': ValueError: this "
                          "object stays in memory")


def test_gradient_errors_name_the_parameter():
    twice = second_gradient_error(0, "fc.weight", used=True)
    assert type(twice) is SecondGradientError
    assert (twice.rank, twice.parameter, twice.reduced_as_unused) == (0, "fc.weight", False)
    assert str(twice) == (
        "DistributedDataParallel on rank 0: Expected to mark a variable ready only once, but parameter "
        "'fc.weight' received its gradient twice in one backward "
        "pass (reentrant checkpointing, or a parameter shared with a module outside this DDP). HINT: use "
        "non-reentrant checkpointing (use_reentrant=False), or static_graph=True if every iteration uses the "
        "parameters alike.")
    assert second_gradient_error(0, "fc.weight", used=False).reduced_as_unused is True
    changed = static_graph_changed_error(1, "fc.bias", 1)
    assert type(changed) is StaticGraphChangedError
    assert (changed.rank, changed.parameter, changed.first_count) == (1, "fc.bias", 1)
    assert str(changed) == (
        "DistributedDataParallel on rank 1: Your training graph has changed in this iteration: parameter "
        "'fc.bias' received more gradients in this backward pass than in the first iteration (one gradient). "
        "This is not compatible with static_graph set to True, which says every iteration uses the "
        "parameters alike. HINT: drop static_graph=True (pass find_unused_parameters=True if some parameters "
        "go unused in some iterations).")


def test_unused_parameters_are_listed_by_rank_only_for_ranks_that_lack_some():
    error = unused_gradient_error(2, [(0, ["a.weight", "a.bias"]), (1, []), (2, ["b.weight"])], static_graph=True)
    assert error.by_rank == {0: ["a.weight", "a.bias"], 2: ["b.weight"]}
    assert (error.rank, error.static_graph) == (2, True)
    assert "your training graph has changed in this iteration" in str(error)  # torch's words for it
    # not find_unused_parameters beside static_graph: torch's DDP refuses that pair once the graph changes
    assert str(error).endswith("HINT: drop static_graph=True, which says every iteration uses the parameters "
                               "alike, and pass find_unused_parameters=True if some parameters go unused in "
                               "some iterations.")
    assert "HINT: pass find_unused_parameters=True" in str(unused_gradient_error(0, [(0, ["a.weight"])], False))


def test_a_hook_that_is_not_callable_is_a_comm_hook_error():
    with pytest.raises(CommHookError) as caught:
        ddpkit.DDP(_Net()).register_comm_hook(None, 3)
    assert (caught.value.rank, caught.value.hook) == (0, "int")
    assert str(caught.value) == "Communication hook must be callable as hook(state, bucket), but rank 0 got int."



def test_a_hook_result_of_the_wrong_size_is_a_comm_hook_error():
    from ddpkit.ddp.bucket import Bucket

    bucket = Bucket(2, [torch.nn.Parameter(torch.zeros(4, 4))], [0], is_last=True)
    with pytest.raises(CommHookError) as caught:
        bucket.take_result(torch.zeros(3), "'halve'", rank=1)
    assert (caught.value.rank, caught.value.hook) == (1, "'halve'")
    assert str(caught.value) == (
        "the future of comm hook 'halve' for bucket 2 holds a tensor of 3 elements, but the bucket has 16 "
        "elements. HINT: complete the future with the reduced bucket.buffer() (a tensor of the same size), "
        "as ddpkit.hooks.allreduce_hook does.")

# ---- the job ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("environ, variable, value", [
    ({"RANK": "1"}, "WORLD_SIZE", None),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK", "x"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK", "2"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NODELIST": "n[2-1]"}, "SLURM_JOB_NODELIST", "n[2-1]"),
    ({"PMI_RANK": "0"}, "PMI_SIZE", None),
])
def test_a_launcher_variable_error_names_the_variable_to_fix(environ, variable, value):
    with pytest.raises(LauncherVariableError) as caught:
        ddpkit.detect(environ)
    assert (caught.value.variable, caught.value.value) == (variable, value)


def test_launcher_variable_error_text():
    with pytest.raises(LauncherVariableError) as caught:
        ddpkit.detect({"RANK": "1"})
    assert str(caught.value) == ("RANK='1' is set but WORLD_SIZE is not. HINT: set both (torchrun and "
                                 "'ddpkit run' do), or neither for a single process.")


def test_a_launched_rank_without_init_gets_not_initialized(launched_as_rank_1_of_2):
    with pytest.raises(NotInitializedError) as caught:
        ddpkit.DDP(_Net())
    error = caught.value
    assert (error.needed_by, error.rank, error.world_size, error.launcher) == \
        ("DistributedDataParallel", 1, 2, "torchrun")
    assert str(error) == (
        "DistributedDataParallel: this process is rank 1 of WORLD_SIZE=2 (launcher: torchrun), but no process "
        "group exists (Default process group has not been initialized), so each rank would train on its own, "
        "its gradients never averaged. HINT: call ddpkit.init() first (or torch.distributed.init_process_group()).")


@pytest.mark.timeout(30)
def test_a_rendezvous_that_times_out_says_where_and_how_long(monkeypatch):
    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    for name, value in rank_env(0, 3, store.port).items():  # rank 0 of 3; the "launcher" (us) hosts
        monkeypatch.setenv(name, value)
    try:
        with pytest.raises(RendezvousError) as caught:
            ddpkit.init(backend="gloo", timeout=1)
    finally:
        ddpkit.shutdown()
    error = caught.value
    assert (error.address, error.timeout) == (f"127.0.0.1:{store.port}", 1.0)
    assert str(error) == (
        f"rendezvous at 127.0.0.1:{store.port} timed out after 1 s: only 1 of WORLD_SIZE=3 ranks joined, "
        "missing: ranks 1, 2 (this is rank 0). HINT: a rank failed to start or was launched with a different "
        "MASTER_ADDR/MASTER_PORT or WORLD_SIZE.")


# ---- checkpoints ------------------------------------------------------------------------------------
def test_a_state_dict_that_fits_no_way_lists_the_keys():
    wrapped = {"module.weight": torch.ones(2, 2), "module.scale": torch.ones(1)}
    with pytest.raises(StateDictMismatchError) as caught:
        load_state_dict(nn.Linear(2, 2), wrapped)
    assert (caught.value.missing, caught.value.unexpected) == (["bias"], ["scale"])
    assert str(caught.value) == (
        "the state dict does not fit Linear (tried it as is, with 'module.' removed). Closest, with 'module.' "
        "removed: 1 of the model's keys are missing, e.g. ['bias']; 1 keys are unexpected, e.g. ['scale']. "
        "HINT: was the checkpoint saved from another model? Pass strict=False to load the keys that match (1 of 2).")
