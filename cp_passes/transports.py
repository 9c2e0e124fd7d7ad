"""Transports: the functions the rewrite passes call from the graph, and their eager twins.

Every collective is a functional collective addressed by group *name* (a ProcessGroup object
placed in a graph breaks code generation), so Inductor sees and schedules it. Functions here
are traced into ATen by AOTAutograd; in the rewritten FX graph they appear under these names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


@dataclass(frozen=True)
class CPGroup:
    """The context-parallel process group as the passes see it."""

    group: dist.ProcessGroup
    name: str
    rank: int
    size: int


def resolve_group(mesh) -> CPGroup:
    """Accept a 1-D ``DeviceMesh`` or a ``ProcessGroup`` for the CP dimension."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mesh, DeviceMesh):
        if mesh.ndim != 1:
            raise ValueError(
                f"cp_passes needs the 1-D CP dimension of a mesh, got a {mesh.ndim}-D mesh "
                f"{mesh.mesh_dim_names}; pass mesh['cp'] (or your CP dim's name)"
            )
        group = mesh.get_group()
    elif isinstance(mesh, dist.ProcessGroup):
        group = mesh
    else:
        raise TypeError(f"mesh must be a 1-D DeviceMesh or a ProcessGroup, got {type(mesh).__name__}")
    return CPGroup(group, group.group_name, dist.get_rank(group), dist.get_world_size(group))


def sequence_all_gather(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    """Concatenate every rank's contiguous shard along ``dim`` in rank order.

    Backward is a reduce-scatter: each rank gets the sum of all remote uses of its shard.
    """
    return funcol.all_gather_tensor_autograd(x, gather_dim=dim, group=group_name)


def causal_key_prefix(keys: torch.Tensor, dim: int, rank: int, query: torch.Tensor) -> torch.Tensor:
    """Keep the gathered keys that a causal query on ``rank`` can see: those of ranks 0..rank."""
    return keys.narrow(dim, 0, (rank + 1) * query.shape[-2])


def causal_mask_at_offset(query: torch.Tensor, rank: int) -> torch.Tensor:
    """Boolean ``[local_len, (rank + 1) * local_len]``: global key ``j`` is visible to local query ``i``
    iff ``j <= rank * local_len + i``."""
    local = query.shape[-2]
    q_pos = torch.arange(local, device=query.device) + rank * local
    k_pos = torch.arange((rank + 1) * local, device=query.device)
    return k_pos[None, :] <= q_pos[:, None]


def gather_sequence(local: torch.Tensor, mesh, dim: int = 1, layout=None) -> torch.Tensor:
    """Reassemble a sequence-sharded tensor on every rank (differentiable).

    With the ``ShardLayout`` from :func:`cp_passes.shard_batch`, the padding is cut off again.
    """
    cp = resolve_group(mesh)
    if cp.size == 1:
        full = local
    else:
        full = funcol.all_gather_tensor_autograd(local.contiguous(), gather_dim=dim, group=cp.name)
        full = funcol.wait_tensor(full) if isinstance(full, funcol.AsyncCollectiveTensor) else full
    if layout is not None:
        full = full.narrow(dim, 0, layout.seq_len)
    return full


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
