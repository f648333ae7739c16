"""The configurations test_ddp.py trains with ddpkit's DDP and torch's side by side.

Each is a named ``Config``; its name is its test id, e.g.
``pytest tests/ddp/test_ddp.py -k bucket_halves`` trains only those. The defaults train an MLP for
four synchronised steps with torch's default DDP arguments.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Config", "CONFIGS", "THREE_RANKS"]


@dataclass(frozen=True)
class Config:
    """One way to build and train a DDP; ``_train`` in test_ddp.py reads every field."""

    name: str
    model: str = "mlp"  # a name test_ddp._model knows
    steps: int = 4  # optimizer steps; with ``uneven``, 2 more per rank
    kwargs: dict[str, Any] = field(default_factory=dict, hash=False)  # both DDPs' constructor arguments
    torch_kwargs: dict[str, Any] | None = field(default=None, hash=False)  # torch's, where they differ
    split_bytes: int | None = None  # ddpkit's Gloo split size (see Note [Gloo halves] in docs/design.md)
    # from this size on ddpkit reduces a gradient where it lies (see Note [Big gradients in place])
    in_place_bytes: int | None = None
    # the device types whose buckets share one block (CUDA's by default; see Note [One block per device])
    one_block: tuple[str, ...] | None = None
    set_static_graph: bool = False  # call the private _set_static_graph() after construction
    hook: str | None = None  # a comm hook, by name (test_ddp._hook)
    user_hook: str | None = None  # a post-accumulate-grad hook: "double", "replace" or "drop"
    different_init: bool = False  # ranks start from different weights: DDP must broadcast rank 0's
    accumulate: str | None = None  # "no_sync" or "attribute": two local steps, then a synchronised one
    set_to_none: bool = True  # zero_grad's argument
    zero_grad_after_forward: bool = False
    uneven: bool | str = False  # ranks take different step counts under join(); or "last_rank_first"
    join: dict[str, Any] = field(default_factory=dict, hash=False)  # join()'s arguments
    some_only_in_local_steps: bool = False  # the 'unused' model's branch runs in no_sync steps only
    discarded_forward: bool = False  # a forward whose output no backward reaches
    # a second forward before the one backward, with these kwargs on rank 0 ({}: none); None: one forward
    two_forwards: dict[str, Any] | None = field(default=None, hash=False)
    gradient_penalty: bool = False  # autograd.grad through the outputs before backward
    second_backward: bool = False  # a second backward through the same forward
    tolerance: float = 1e-5  # largest difference allowed in any parameter or buffer


CONFIGS: tuple[Config, ...] = (
    Config("defaults"),
    Config("tiny_buckets", kwargs={"bucket_cap_mb": 0.0002}),
    Config("wide_default_buckets", model="wide", steps=3),
    Config("wide_several_buckets", model="wide", steps=3, kwargs={"bucket_cap_mb": 0.5}),
    Config("wide_no_sync", model="wide", accumulate="no_sync", steps=6),
    Config("wide_allreduce_hook", model="wide", steps=3, hook="allreduce_hook"),
    Config("wide_grad_as_bucket_view", model="wide", steps=3, kwargs={"gradient_as_bucket_view": True}),
    Config("user_hook_in_place", model="wide", steps=3, user_hook="double"),
    Config("user_hook_replaces_grad", model="wide", steps=3, user_hook="replace"),
    Config("user_hook_drops_grad", model="wide", steps=3, user_hook="drop"),
    Config("user_hook_tiny_buckets", user_hook="double", kwargs={"bucket_cap_mb": 0.0003}),
    Config("wide_join_divide_by_active_ranks", model="wide", steps=3, uneven=True,
           join={"divide_by_initial_world_size": False}),
    Config("different_init", different_init=True),
    Config("rebuilt_into_fewer_buckets", model="reordered", kwargs={"bucket_cap_mb": 800 / 2**20}),
    Config("grad_as_bucket_view", kwargs={"gradient_as_bucket_view": True, "bucket_cap_mb": 0.0005}),
    Config("grad_as_bucket_view_zeroed", kwargs={"gradient_as_bucket_view": True}, set_to_none=False),
    Config("no_sync", accumulate="no_sync", steps=6),
    Config("require_backward_grad_sync", accumulate="attribute", steps=6, set_to_none=False),
    Config("static_graph", kwargs={"static_graph": True, "bucket_cap_mb": 0.0003}),
    Config("static_graph_checkpointed_twice", model="checkpointed_twice", kwargs={"static_graph": True}),
    Config("static_graph_checkpointed_twice_tiny_buckets", model="checkpointed_twice",
           kwargs={"static_graph": True, "bucket_cap_mb": 0.0003}),
    Config("static_graph_checkpointed_inside_and_out", model="checkpointed_inside_and_out", steps=5,
           kwargs={"static_graph": True}),
    Config("static_graph_checkpointed_whole", model="checkpointed_whole", kwargs={"static_graph": True}),
    Config("gradient_penalty", gradient_penalty=True),
    # torch's static_graph averages at the end of the autograd.grad call in its first iteration,
    # before any gradient exists (off by 1.5e-2 from single-process training, where ddpkit is
    # exact): the reference is torch without static_graph
    Config("static_graph_gradient_penalty", gradient_penalty=True, kwargs={"static_graph": True},
           torch_kwargs={}),
    Config("static_graph_checkpointed_find_unused", model="checkpointed_twice",
           kwargs={"static_graph": True, "find_unused_parameters": True}),
    # torch's static_graph fails an INTERNAL ASSERT when the first backward is a no_sync one; the
    # reference is torch without static_graph, which computes the same thing
    Config("static_graph_no_sync", accumulate="no_sync", steps=6, kwargs={"static_graph": True},
           torch_kwargs={}),
    Config("second_backward_through_one_forward", second_backward=True),
    Config("plain_output_checkpointed_last", model="plain_output_checkpointed_last"),
    Config("params_and_buffers_to_ignore", model="local_head"),
    Config("params_and_buffers_to_ignore_bucket_view", model="local_head",
           kwargs={"gradient_as_bucket_view": True}),
    Config("set_static_graph_after_construction", model="checkpointed_twice", set_static_graph=True),
    Config("set_static_graph_find_unused", model="unused", set_static_graph=True,
           kwargs={"find_unused_parameters": True}),
    Config("complex_parameters", model="complex"),
    Config("complex_parameters_join", model="complex", uneven=True),
    # a hook sees complex gradients as real numbers, twice as many, as torch shows them
    Config("complex_parameters_allreduce_hook", model="complex", hook="allreduce_hook"),
    Config("complex_parameters_fp16_hook", model="complex", hook="fp16_compress_hook", tolerance=2e-3),
    Config("complex_parameters_fp16_wrapper", model="complex", hook="fp16_wrapped_allreduce"),
    Config("channels_last", model="channels_last"),
    Config("channels_last_grad_as_bucket_view", model="channels_last", set_to_none=False,
           kwargs={"gradient_as_bucket_view": True}),
    Config("one_bucket_per_parameter", kwargs={"bucket_cap_mb": 0}),
    Config("find_unused", model="unused", kwargs={"find_unused_parameters": True}),
    Config("find_unused_tiny_buckets", model="unused",
           kwargs={"find_unused_parameters": True, "bucket_cap_mb": 0.0002}),
    Config("static_graph_unused", model="unused", kwargs={"static_graph": True}),
    Config("batchnorm_broadcast", model="bn"),
    Config("batchnorm_no_broadcast", model="bn", kwargs={"broadcast_buffers": False}),
    Config("batchnorm_no_sync", model="bn", accumulate="no_sync", steps=6),
    Config("allreduce_hook", hook="allreduce_hook", kwargs={"bucket_cap_mb": 0.0003}),
    Config("fp16_hook", hook="fp16_compress_hook", tolerance=2e-3),
    Config("bf16_hook", hook="bf16_compress_hook", tolerance=2e-2),
    Config("fp16_wrapper_of_allreduce_hook", hook="fp16_wrapped_allreduce", model="wide", steps=3),
    # gradients() are views of the buffer a hook set, as torch's: writes through them are reduced
    Config("gradients_of_a_set_buffer_hook", hook="gradients_of_set_buffer", model="wide", steps=3),
    # a hook acting on whole buckets: torch's layout before and after the rebuild, small first bucket
    Config("bucket_norm_hook", hook="bucket_norm", model="wide", steps=3),
    Config("bucket_norm_hook_tiny_buckets", hook="bucket_norm", kwargs={"bucket_cap_mb": 0.0003}),
    # torch gives the 1 MiB first bucket to the default cap only, not to a 25 the caller passed
    Config("bucket_norm_hook_cap_25_passed", hook="bucket_norm", model="wide", steps=3,
           kwargs={"bucket_cap_mb": 25}),
    Config("bucket_norm_hook_static_graph_unused", hook="bucket_norm", model="unused",
           kwargs={"static_graph": True, "bucket_cap_mb": 0.0003}),
    Config("bucket_norm_hook_set_static_graph_find_unused", hook="bucket_norm", model="unused",
           set_static_graph=True, kwargs={"find_unused_parameters": True, "bucket_cap_mb": 0.0003}),
    Config("bucket_norm_hook_find_unused", hook="bucket_norm", model="unused",
           kwargs={"find_unused_parameters": True, "bucket_cap_mb": 0.0003}),
    Config("bucket_norm_hook_static_graph", hook="bucket_norm", steps=5,
           kwargs={"static_graph": True, "bucket_cap_mb": 0.0003}),
    Config("find_unused_zero_grad_after_forward", model="unused", zero_grad_after_forward=True,
           kwargs={"find_unused_parameters": True}),
    Config("find_unused_zeroed_after_forward", model="unused", zero_grad_after_forward=True,
           set_to_none=False, kwargs={"find_unused_parameters": True}),
    Config("static_graph_zero_grad_after_forward", model="unused", zero_grad_after_forward=True,
           kwargs={"static_graph": True}),
    Config("two_forwards_one_backward", two_forwards={}),
    Config("two_forwards_find_unused", model="unused", two_forwards={"use_some": False},
           kwargs={"find_unused_parameters": True}),
    Config("discarded_forward", discarded_forward=True, model="bn"),
    Config("two_forwards_batchnorm", two_forwards={}, model="bn"),
    Config("find_unused_branch_used_only_in_no_sync", model="unused", accumulate="no_sync", steps=6,
           some_only_in_local_steps=True, kwargs={"find_unused_parameters": True}),
    Config("buffer_replaced_out_of_place", model="moving_average"),
    Config("discarded_forward_find_unused", discarded_forward=True, model="unused",
           kwargs={"find_unused_parameters": True}),
    # a large bucket's all-reduce goes as two halves on Gloo; a joined rank must shadow both
    Config("bucket_halves", split_bytes=256, kwargs={"bucket_cap_mb": 0.0005}),
    Config("bucket_halves_join", split_bytes=256, uneven=True, model="wide"),
    Config("bucket_halves_find_unused_join", split_bytes=256, uneven=True, model="unused",
           kwargs={"find_unused_parameters": True}),
    Config("join_uneven", uneven=True),
    Config("join_divide_by_active_ranks", uneven=True, join={"divide_by_initial_world_size": False}),
    Config("join_uneven_bn", uneven=True, model="bn", kwargs={"bucket_cap_mb": 0.0003}),
    Config("join_uneven_unused", uneven=True, model="unused", kwargs={"find_unused_parameters": True}),
    # torch's joined rank sends its last used map again: 'some' gets zeros, not None, afterwards
    Config("join_unused_user_joins_first", uneven="last_rank_first", model="unused",
           kwargs={"find_unused_parameters": True}),
    # torch 2.13's newer constructor arguments (tests/ddp/test_constructor.py checks what this cannot)
    # init_sync=False: no broadcast at construction, so each rank trains on from its own weights
    Config("init_sync_off_different_init", different_init=True, kwargs={"init_sync": False}),
    Config("init_sync_off_bn", model="bn", different_init=True, kwargs={"init_sync": False}),
    Config("check_reduction_deprecated", kwargs={"check_reduction": True}),
    Config("forward_sync_buffers_off", model="bn", kwargs={"forward_sync_buffers": False}),
    Config("forward_sync_buffers_wins_over_broadcast_buffers", model="bn",
           kwargs={"broadcast_buffers": False, "forward_sync_buffers": True}),
    Config("forward_sync_buffers_join", model="bn", uneven=True, kwargs={"forward_sync_buffers": True}),
    # bucket_norm scales each bucket by its own norm: the averages differ unless the buckets are torch's
    Config("bucket_cap_mb_list", model="wide", steps=3, kwargs={"bucket_cap_mb_list": [0.01, 1, 0.5]}),
    Config("bucket_norm_hook_cap_list", hook="bucket_norm", model="wide", steps=3,
           kwargs={"bucket_cap_mb_list": [0.01, 1, 0.5]}),
    Config("bucket_norm_hook_cap_list_tiny", hook="bucket_norm", kwargs={"bucket_cap_mb_list": [0.0002, 0.0005]}),
    Config("bucket_norm_hook_cap_list_find_unused", hook="bucket_norm", model="unused",
           kwargs={"find_unused_parameters": True, "bucket_cap_mb_list": [0.0002, 0.0005]}),
    Config("skip_all_reduce_unused_params", model="unused_everywhere",
           kwargs={"find_unused_parameters": True, "skip_all_reduce_unused_params": True, "bucket_cap_mb": 0.0002}),
    Config("skip_all_reduce_unused_params_hook", model="unused_everywhere", hook="bucket_norm",
           kwargs={"find_unused_parameters": True, "skip_all_reduce_unused_params": True, "bucket_cap_mb": 0.0002}),
    # nn.Embedding(sparse=True): a sparse gradient, all-reduced as it is in a bucket of its own
    Config("sparse_embedding", model="sparse"),
    Config("sparse_embedding_tiny_buckets", model="sparse", kwargs={"bucket_cap_mb": 0.0002}),
    Config("sparse_embedding_find_unused", model="sparse_unused", set_to_none=False,
           kwargs={"find_unused_parameters": True}),
    Config("sparse_embedding_unused_everywhere", model="sparse_unused_everywhere", set_to_none=False,
           kwargs={"find_unused_parameters": True}),
    Config("sparse_embedding_no_sync", model="sparse", accumulate="no_sync", steps=6),
    Config("sparse_embedding_grad_as_bucket_view", model="sparse", kwargs={"gradient_as_bucket_view": True}),
    Config("sparse_embedding_static_graph", model="sparse", kwargs={"static_graph": True}),
    Config("sparse_embedding_join", model="sparse", uneven=True),
    Config("sparse_embedding_join_divide_by_active_ranks", model="sparse", uneven=True,
           join={"divide_by_initial_world_size": False}),
    Config("sparse_embedding_allreduce_hook", model="sparse", hook="allreduce_hook"),
    Config("sparse_embedding_join_allreduce_hook", model="sparse", uneven=True, hook="allreduce_hook"),
    # the hook sees the sparse bucket, and torch's buckets around it, before and after the rebuild
    Config("sparse_embedding_bucket_norm_hook", model="sparse", hook="bucket_norm",
           kwargs={"bucket_cap_mb": 0.0002}),
    Config("batched_grad_copy", kwargs={"batched_grad_copy": True}),
    Config("batched_grad_copy_wide_bucket_view", model="wide", steps=3,
           kwargs={"batched_grad_copy": True, "gradient_as_bucket_view": True}),
    # the buckets in one block, as on CUDA (here on the CPU, where each has its own by default)
    Config("one_block", one_block=("cpu",), kwargs={"bucket_cap_mb": 0.0005}),
    Config("one_block_wide", model="wide", steps=3, one_block=("cpu",), kwargs={"bucket_cap_mb": 0.5}),
    Config("one_block_grad_as_bucket_view", one_block=("cpu",),
           kwargs={"gradient_as_bucket_view": True, "bucket_cap_mb": 0.0005}),
    Config("one_block_join", model="wide", uneven=True, one_block=("cpu",), kwargs={"bucket_cap_mb": 0.5}),
    # big gradients reduced where they lie (real models: from 2 MiB; here from a few hundred bytes)
    Config("in_place", in_place_bytes=256),
    Config("in_place_wide", model="wide", steps=3, in_place_bytes=4096),
    Config("in_place_tiny_buckets", in_place_bytes=256, kwargs={"bucket_cap_mb": 0.0002}),
    Config("in_place_one_bucket_per_parameter", in_place_bytes=256, kwargs={"bucket_cap_mb": 0}),
    Config("in_place_halves", in_place_bytes=256, split_bytes=256),
    Config("in_place_zeroed", in_place_bytes=256, set_to_none=False),
    Config("in_place_no_sync", in_place_bytes=256, accumulate="no_sync", steps=6),
    Config("in_place_attribute_accumulation", in_place_bytes=256, accumulate="attribute", steps=6,
           set_to_none=False),
    Config("in_place_user_hook_in_place", model="wide", steps=3, user_hook="double", in_place_bytes=4096),
    Config("in_place_user_hook_replaces_grad", model="wide", steps=3, user_hook="replace", in_place_bytes=4096),
    Config("in_place_user_hook_drops_grad", model="wide", steps=3, user_hook="drop", in_place_bytes=4096),
    Config("in_place_join", in_place_bytes=256, uneven=True),
    Config("in_place_join_halves", model="wide", in_place_bytes=4096, split_bytes=4096, uneven=True),
    Config("in_place_join_divide_by_active_ranks", in_place_bytes=256, uneven=True,
           join={"divide_by_initial_world_size": False}),
    Config("in_place_channels_last", model="channels_last", in_place_bytes=64),
    Config("in_place_complex", model="complex", in_place_bytes=64),
    Config("in_place_batchnorm", model="bn", in_place_bytes=64),
    Config("in_place_ignored_parameters", model="local_head", in_place_bytes=64),
    Config("in_place_two_forwards", two_forwards={}, in_place_bytes=256),
    Config("in_place_second_backward", second_backward=True, in_place_bytes=256),
    Config("in_place_gradient_penalty", gradient_penalty=True, in_place_bytes=256),
    Config("in_place_rebuilt_into_fewer_buckets", model="reordered", in_place_bytes=256,
           kwargs={"bucket_cap_mb": 800 / 2**20}),
    # where in place is never used: the same results as ever
    Config("in_place_off_static_graph", in_place_bytes=256, kwargs={"static_graph": True}),
    Config("in_place_off_set_static_graph", model="checkpointed_twice", in_place_bytes=256, set_static_graph=True),
    Config("in_place_off_find_unused", model="unused", in_place_bytes=256, kwargs={"find_unused_parameters": True}),
    Config("in_place_off_bucket_norm_hook", hook="bucket_norm", in_place_bytes=256),
    Config("in_place_off_grad_as_bucket_view", in_place_bytes=256, kwargs={"gradient_as_bucket_view": True}),
    # the wide model's 600 x 700 weight keeps its average in its bucket slot (Note [Averages in their
    # slots]); backward then accumulates into the slot where zero_grad does not set it to None
    Config("wide_zeroed", model="wide", steps=3, set_to_none=False),
    Config("wide_zeroed_after_forward", model="wide", steps=3, set_to_none=False, zero_grad_after_forward=True),
    Config("wide_zero_grad_after_forward", model="wide", steps=3, zero_grad_after_forward=True),
    Config("wide_no_sync_zeroed", model="wide", accumulate="no_sync", steps=6, set_to_none=False),
    Config("wide_join_zeroed", model="wide", steps=3, uneven=True, set_to_none=False),
    Config("wide_user_hook_replaces_zeroed", model="wide", steps=3, user_hook="replace", set_to_none=False),
    Config("wide_grad_as_bucket_view_zeroed", model="wide", steps=3, set_to_none=False,
           kwargs={"gradient_as_bucket_view": True}),
    Config("wide_grad_as_bucket_view_join_divide_by_active_ranks", model="wide", steps=3, uneven=True,
           join={"divide_by_initial_world_size": False}, kwargs={"gradient_as_bucket_view": True}),
)

_BY_NAME = {config.name: config for config in CONFIGS}
assert len(_BY_NAME) == len(CONFIGS), "two configurations share a name (a test id)"

# also run on 3 ranks, where a rank is neither first nor last
THREE_RANKS: tuple[Config, ...] = tuple(_BY_NAME[name] for name in (
    "defaults", "static_graph_checkpointed_twice", "tiny_buckets", "different_init", "find_unused",
    "batchnorm_broadcast", "no_sync", "join_uneven", "join_divide_by_active_ranks", "fp16_hook",
    "grad_as_bucket_view", "wide_join_divide_by_active_ranks", "join_unused_user_joins_first",
    "bucket_halves_join", "sparse_embedding", "sparse_embedding_find_unused", "sparse_embedding_no_sync",
    "sparse_embedding_join", "in_place", "in_place_join", "in_place_join_halves", "wide_zeroed"))
