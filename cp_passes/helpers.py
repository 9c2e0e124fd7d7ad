"""Helpers for code outside the compiled module: the transports' runtime ops, called directly."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .group import resolve_group
from .layout import CONTIGUOUS
from .transports.gathers import sequence_gather_op
from .transports.halo_exchange import halo_op


def gather_halo(x: torch.Tensor, mesh, halo: int, dim: int = 1, left_padding: int = 0, layout=None,
                after: int = 0) -> torch.Tensor:
    """Eager halo exchange (differentiable): ``[left_padding zeros, halo preceding positions, x, after following
    positions]`` along ``dim`` (positions outside the sequence are zeros), for each of the rank's ranges of
    ``layout`` (the ``ShardLayout`` from :func:`cp_passes.shard_batch`; contiguous shards without it)."""
    cp = resolve_group(mesh)
    kind = layout.layout.kind if layout is not None else CONTIGUOUS
    return halo_op(x, dim, halo, left_padding, cp.rank, cp.size, cp.name, kind, after)


def gather_sequence(local: torch.Tensor, mesh, dim: int = 1, layout=None) -> torch.Tensor:
    """Reassemble a sequence-sharded tensor on every rank (differentiable), in global order.

    ``layout`` is the ``ShardLayout`` from :func:`cp_passes.shard_batch`: it says which positions each rank
    holds (a balanced layout's rows are reordered), and the padding is cut off again.
    """
    cp = resolve_group(mesh)
    if layout is None:
        if cp.size > 1:
            raise ValueError("gather_sequence needs layout=, the ShardLayout shard_batch returned: it says which "
                             "positions each rank holds (a balanced layout's are not in rank order)")
        return local
    full = local if cp.size == 1 else sequence_gather_op(local, dim, cp.size, cp.name)
    return layout.in_global_order(full, dim)


def all_reduce_gradients(module: torch.nn.Module, mesh) -> None:
    """Sum every parameter gradient over the CP group.

    Each CP rank's backward yields the gradient of its own tokens' loss; the step needs their sum.
    Under FSDP or DDP on a mesh that includes the CP dimension this happens already; without one,
    call this between ``backward()`` and ``optimizer.step()``.
    """
    cp = resolve_group(mesh)
    if cp.size == 1:
        return
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if grads:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=cp.group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
