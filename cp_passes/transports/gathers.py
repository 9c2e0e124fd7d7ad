"""Gathers along the sequence: every rank's rows of activations or of metadata.

:func:`sequence_gather_op` all-gathers activations (its backward a reduce-scatter: each rank gets the sum of
every use of its shard); :func:`metadata_gather_op` all-gathers sequence metadata (positions, doc ids, a mask's
inputs) without an autograd edge. Both return rank order; :func:`in_global_order` puts a gather in the order of
global positions, as a mask over the whole sequence reads it.
"""

from __future__ import annotations

import torch

from ..layout import Layout
from .base import gradient_by
from .collectives import all_gather, reduce_scatter


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


@torch.library.custom_op("cp_passes::metadata_gather", mutates_args=())
def metadata_gather_op(x: torch.Tensor, dim: int, world: int, group_name: str) -> torch.Tensor:
    """All-gather sequence metadata (positions, doc ids) along ``dim``: no autograd edge."""
    dim = dim % x.dim()
    rows = x.movedim(dim, 0)
    if rows.dtype == torch.bool:  # gloo and Inductor's CPU code both handle uint8, not bool (torch 2.13)
        return all_gather(rows.to(torch.uint8), world, group_name).to(torch.bool).movedim(0, dim).contiguous()
    return all_gather(rows, world, group_name).movedim(0, dim).contiguous()


@metadata_gather_op.register_fake
def _(x, dim, world, group_name):
    shape = list(x.shape)
    shape[dim % x.dim()] *= world
    return x.new_empty(shape)


def in_global_order(gathered: torch.Tensor, dim: int, world: int, kind: str) -> torch.Tensor:
    """A gather (rank order) in the order of global positions: what a mask over the whole sequence reads."""
    return Layout(world, kind).unshard(gathered, dim % gathered.dim())
