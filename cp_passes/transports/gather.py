"""Sequence gather: every rank's shard of K/V, concatenated in the layout's gather order.

Serves causal (and full) attention. Backward is a reduce-scatter: each rank gets the sum of every use
of its shard. A causal query then keeps only the gathered rows it can see (:meth:`Layout.visible_prefix`).
"""

from __future__ import annotations

import torch
import torch.fx

from ..layout import KINDS
from .base import Cost, Transport, gradient_by, register_transport
from .collectives import all_gather, reduce_scatter
from .masks import metadata_gather_op  # noqa: F401  (registers cp_passes::metadata_gather)
from .reductions import global_sum_op  # noqa: F401  (registers cp_passes::global_sum: a mask's causal check)


@torch.library.custom_op("cp_passes::sequence_gather", mutates_args=())
def sequence_gather_op(x: torch.Tensor, dim: int, world: int, group_name: str) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order. The shard is laid out sequence-first so
    the gathered buffer is already in order."""
    dim = dim % x.dim()
    return all_gather(x.movedim(dim, 0), world, group_name).movedim(0, dim).contiguous()


@sequence_gather_op.register_fake
def _(x, dim, world, group_name):
    shape = list(x.shape)
    shape[dim % x.dim()] *= world
    return x.new_empty(shape)


@torch.library.custom_op("cp_passes::sequence_reduce_scatter", mutates_args=())
def sequence_reduce_scatter_op(grad: torch.Tensor, dim: int, world: int, group_name: str) -> torch.Tensor:
    """The gradient of :func:`sequence_gather_op`: this rank's rows, summed over every rank's gradient."""
    dim = dim % grad.dim()
    return reduce_scatter(grad.movedim(dim, 0), world, group_name).movedim(0, dim).contiguous()


@sequence_reduce_scatter_op.register_fake
def _(grad, dim, world, group_name):
    shape = list(grad.shape)
    shape[dim % grad.dim()] //= world
    return grad.new_empty(shape)


gradient_by(sequence_gather_op, sequence_reduce_scatter_op)


class SequenceGather(Transport):
    name = "sequence_gather"
    order = 30
    layouts = KINDS
    runtime = (torch.ops.cp_passes.sequence_gather.default, torch.ops.cp_passes.metadata_gather.default,
               torch.ops.cp_passes.global_sum.default)
    gathers_keys = True

    def insert(self, edit, x: torch.fx.Node, dim: int, name: str) -> torch.fx.Node:
        return edit.insert(torch.ops.cp_passes.sequence_gather.default, (x, dim, edit.world, edit.group_name),
                           name=name)

    def apply(self, edit, request) -> None:
        from .attention import rewrite_attention

        rewrite_attention(edit, request, lambda x, name: self.insert(edit, x, request.dim, f"{name}_gathered"))

    def cost(self, request, layout, rank, local_len) -> Cost:
        total = request.elements
        row = request.row_bytes(local_len)
        if request.window:
            needed = sum(layout.halo_counts(request.window - 1, rank, local_len, request.ahead)[1]) * row
        elif request.causal:
            needed = layout.seen_before(rank, local_len) * row
        else:
            needed = (layout.global_len(local_len) - local_len) * row
        moved = (layout.world - 1) * total * request.itemsize
        return (Cost(f"all_gather {request.kv_label} | bw reduce_scatter", (layout.world - 1) * total, moved, needed,
                     moved) + request.metadata_cost(layout.world))


SEQUENCE_GATHER = register_transport(SequenceGather())
