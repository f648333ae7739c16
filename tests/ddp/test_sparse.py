"""Sparse gradients (nn.Embedding(sparse=True)): buckets of their own, as torch's DDP makes them.

The training itself is compared with torch's DDP in test_ddp.py (the sparse_embedding
configurations); here: the bucket assignment against torch's own function, the buckets a comm hook
sees against torch's, and a rank without the gradient, which torch's DDP cannot handle.
"""
from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks
from torch import nn

from ddpkit.ddp.arguments import sparse_gradient_names
from ddpkit.ddp.bucket_groups import assign_buckets, initial_groups, rebuilt_groups
from ddpkit.ddp.sparse_bucket import SparseBucket, empty_sparse_like


def _params(seed: int, count: int = 12) -> tuple[list[torch.Tensor], list[bool]]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.empty(int(torch.randint(1, 300, (1,), generator=gen)), 4) for _ in range(count)]
    sparse = [bool(torch.rand(1, generator=gen) < 0.3) for _ in range(count)]
    return params, sparse


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("first_cap, cap", [(1024, 4096), (100, 100), (4096, 4096)])
def test_a_sparse_parameter_gets_a_bucket_of_its_own_as_torch_assigns_it(seed, first_cap, cap):
    """Reference: torch's _compute_bucket_assignment_by_size with expect_sparse_gradient, in
    registration order (sorted) and in a gradient-ready order (torch's rebuild, unsorted)."""
    params, sparse = _params(seed)
    expected, _ = dist._compute_bucket_assignment_by_size(params, [first_cap, cap], sparse)
    assert assign_buckets(params, range(len(params)), cap, first_cap, sparse=sparse) == expected
    assert initial_groups(params, cap, first_cap, hooked=True, rebuilt_later=False, sparse=sparse) == expected[::-1]
    order = torch.randperm(len(params), generator=torch.Generator().manual_seed(seed)).tolist()
    rebuilt, _ = dist._compute_bucket_assignment_by_size([params[i] for i in order], [first_cap, cap], sparse, order)
    assert rebuilt_groups(params, order, cap, first_cap, hooked=True, sparse=sparse) == rebuilt


def test_sparse_gradients_follow_torchs_rule_sparse_embeddings_only():
    model = nn.Sequential(nn.Embedding(5, 2, sparse=True), nn.EmbeddingBag(5, 2, sparse=True),
                          nn.Embedding(5, 2), nn.Linear(2, 2))
    names = [n for n, _ in model.named_parameters()]
    assert sparse_gradient_names(model, names) == ["0.weight", "1.weight", None, None, None]


def test_a_joined_ranks_sparse_bucket_holds_zeros_shaped_as_an_embeddings_gradient():
    emb = nn.Embedding(6, 3, sparse=True)
    emb(torch.tensor([1, 4])).sum().backward()
    zeros = SparseBucket(2, [emb.weight], [7], is_last=True, extra=1).zeros_like()
    grad = emb.weight.grad
    assert (zeros.buffer().sparse_dim(), zeros.buffer().dense_dim()) == (grad.sparse_dim(), grad.dense_dim())
    assert zeros.buffer().shape == grad.shape and zeros.buffer()._nnz() == 0 and zeros.flag.tolist() == [0]
    assert zeros.gradients() == [] and zeros.parameters()[0] is emb.weight and zeros.index() == 2
    assert empty_sparse_like(emb.weight).to_dense().count_nonzero() == 0


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.fc, self.out = nn.Embedding(20, 4, sparse=True), nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, ids, use_emb=True):
        h = self.emb(ids).mean(1) if use_emb else torch.zeros(len(ids), 4)
        return self.out(torch.tanh(self.fc(h)))


def _recording_hook(log, bucket):
    log.append((bucket.index(), [tuple(p.shape) for p in bucket.parameters()], bucket.buffer().is_sparse,
                len(bucket.gradients())))
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])


def _hook_worker(cap: float | None) -> dict:
    import ddpkit

    seen = {}
    for kind, cls in (("ddpkit", ddpkit.DDP), ("torch", nn.parallel.DistributedDataParallel)):
        torch.manual_seed(0)
        ddp, log = cls(_Model(), bucket_cap_mb=cap), []
        ddp.register_comm_hook(log, _recording_hook)
        gen = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(3):
            ddp(torch.randint(0, 20, (5, 3), generator=gen)).sum().backward()
            log.append("end")
        seen[kind] = (log, [p.grad.to_dense() for p in ddp.parameters()])
    return seen


@pytest.mark.parametrize("cap", [None, 0.0002])
def test_a_comm_hook_sees_the_sparse_bucket_where_torchs_does(cap):
    """Before the rebuild the sparse bucket goes last; after it, first (torch's rebuilt order)."""
    for seen in run_ranks(_hook_worker, 2, args=(cap,), timeout=60):
        assert seen["ddpkit"][0] == seen["torch"][0]
        assert any(entry[2] for entry in seen["torch"][0] if entry != "end")  # the hook got it sparse
        for mine, ref in zip(seen["ddpkit"][1], seen["torch"][1]):
            torch.testing.assert_close(mine, ref, rtol=0, atol=1e-6)


def _grad_none_worker() -> dict:
    """The embedding unused on rank 1 with its .grad None: torch's DDP raises "Expected sparse
    gradient to be defined" there (and rank 0 waits); ddpkit counts it as zeros."""
    import ddpkit

    torch.manual_seed(0)
    rank = dist.get_rank()
    ddp = ddpkit.DDP(_Model(), find_unused_parameters=True)
    ids = torch.randint(0, 20, (5, 3), generator=torch.Generator().manual_seed(rank))
    ddp(ids, use_emb=rank == 0).sum().backward()
    got = ddp.module.emb.weight.grad
    local = _Model()  # rank 0's gradient alone, halved: the reference
    local.load_state_dict(ddp.module.state_dict())
    local(ids).sum().backward()
    ddp.module.emb.weight.grad = None
    ddp(ids, use_emb=False).sum().backward()  # unused on every rank: left None, as a dense one
    return {"grad": got.to_dense(), "sparse": got.is_sparse, "rank0_half": local.emb.weight.grad.to_dense() / 2,
            "unused_everywhere": ddp.module.emb.weight.grad}


def test_a_rank_without_the_sparse_gradient_contributes_zeros_and_gets_the_average():
    results = run_ranks(_grad_none_worker, 2, timeout=60)
    reference = results[0]["rank0_half"]
    for out in results:
        assert out["sparse"]
        torch.testing.assert_close(out["grad"], reference, rtol=0, atol=1e-6)
        assert out["unused_everywhere"] is None


def _densify(p: nn.Parameter) -> None:
    p.grad = p.grad.to_dense()


class _TiedModel(nn.Module):
    """A sparse embedding whose weight is also the output layer's: its gradient comes out dense."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 4, sparse=True)
        self.out = nn.Linear(4, 20, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tokens):
        return self.out(self.emb(tokens))


def _dense_grad_worker(tied: bool) -> tuple[str, list[str], str, str]:
    import ddpkit
    from ddpkit.errors import DenseGradientError

    torch.manual_seed(0)
    ddp = ddpkit.DDP(_TiedModel() if tied else _Model())
    if not tied:
        ddp.module.emb.weight.register_post_accumulate_grad_hook(_densify)
    try:
        ddp(torch.randint(0, 20, (5, 3))).sum().backward()
    except DenseGradientError as e:
        return str(e), [c.__name__ for c in (TypeError, RuntimeError) if isinstance(e, c)], e.parameter, \
            pickle.loads(pickle.dumps(e)).parameter
    return "no error", [], "", ""


@pytest.mark.parametrize("tied", [False, True], ids=["densified_by_a_hook", "tied_to_a_linear"])
def test_a_sparse_embeddings_gradient_made_dense_raises_naming_it(tied):
    """Where torch raises RuntimeError "Expected variable to have sparse gradient.": the same type
    and words, and the parameter, its layout and shape, on every rank."""
    results = run_ranks(_dense_grad_worker, 2, (tied,), timeout=60)
    for rank, (message, types, parameter, unpickled) in enumerate(results):
        assert message.startswith(f"DistributedDataParallel on rank {rank}: Expected variable to have sparse "
                                  "gradient: 'emb.weight' belongs to a sparse embedding, but its .grad is a dense "
                                  "tensor (torch.strided, shape [20, 4])."), message
        assert "HINT: leave its gradient sparse" in message
        assert types == ["TypeError", "RuntimeError"] and parameter == unpickled == "emb.weight"


def test_a_hooks_result_must_be_sparse_and_shaped_as_the_gradient():
    from ddpkit.errors import CommHookError

    emb = nn.Embedding(6, 3, sparse=True)
    emb(torch.tensor([1, 4])).sum().backward()
    bucket = SparseBucket(0, [emb.weight], [0], is_last=False)
    bucket.fill(0.5, as_view=False, copied=[False])
    assert bucket.buffer() is emb.weight.grad and bucket.flag is None
    torch.testing.assert_close(emb.weight.grad.to_dense()[1], torch.full((3,), 0.5))
    with pytest.raises(CommHookError, match=r"a torch.strided tensor of shape \[6, 3\], but the bucket holds a sparse"):
        bucket.take_result(torch.zeros(6, 3), "'h'", rank=0)
    bucket.take_result(empty_sparse_like(emb.weight), "'h'", rank=0)
    assert emb.weight.grad._nnz() == 0


def _missing_worker() -> str:
    """The first iteration: the sparse bucket goes last, so the status flag goes beside it."""
    import ddpkit

    torch.manual_seed(0)
    ddp = ddpkit.DDP(_Model())
    assert ddp.reducer.buckets[-1].sparse and ddp.reducer.buckets[-1].flag is not None
    try:
        ddp(torch.randint(0, 20, (5, 3)), use_emb=dist.get_rank() == 0).sum().backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_missing_gradient_raises_on_every_rank_when_the_last_bucket_is_sparse():
    results = run_ranks(_missing_worker, 2, timeout=60)
    for message in results:
        assert "emb.weight" in message and "rank 1" in message, message
