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
from torch.fx.experimental.symbolic_shapes import guard_int


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

    Backward is a reduce-scatter: each rank gets the sum of all remote uses of its shard. The shard is
    laid out sequence-first so the gathered buffer is already in global order (no chunk-and-concat copy).
    """
    dim = dim % x.dim()
    gathered = funcol.all_gather_single_autograd(x.movedim(dim, 0).contiguous(), 0, group_name)
    if isinstance(gathered, funcol.AsyncCollectiveTensor):
        gathered = funcol.wait_tensor(gathered)
    return gathered.movedim(0, dim)


def causal_key_prefix(keys: torch.Tensor, dim: int, rank: int, query: torch.Tensor) -> torch.Tensor:
    """Keep the gathered keys that a causal query on ``rank`` can see: those of ranks 0..rank."""
    return keys.narrow(dim, 0, (rank + 1) * query.shape[-2])


def causal_mask_at_offset(query: torch.Tensor, rank: int, window: int | None = None) -> torch.Tensor:
    """Boolean ``[local_len, (rank + 1) * local_len]``: global key ``j`` is visible to local query ``i``
    iff ``0 <= rank * local_len + i - j`` (``< window`` for a sliding window)."""
    local = query.shape[-2]
    q_pos = torch.arange(local, device=query.device) + rank * local
    k_pos = torch.arange((rank + 1) * local, device=query.device)
    distance = q_pos[:, None] - k_pos[None, :]
    visible = distance >= 0
    return visible if window is None else visible & (distance < window)


def halo_counts(halo: int, local_len, rank: int, world: int) -> tuple[list, list, object]:
    """Rows this rank sends to and receives from every rank for a halo of ``halo`` positions.

    Rank ``r`` needs global positions ``[r * L - halo, r * L)``: the last ``min(L, halo - k * L)`` rows
    of rank ``r - 1 - k`` for ``k = 0, 1, ...``, and zeros where the sequence has no predecessor.
    Returns ``(send, recv, zeros)``.

    With a symbolic ``local_len`` every comparison here is a guard, and every rank must add the same
    guards (a rank whose cached graph still holds while another's fails would run its collectives
    alone). So the first and only decision is the same on every rank, ``local_len >= halo``: then the
    halo is the last ``halo`` rows of rank ``r - 1`` (``halo`` zeros on rank 0) and one graph serves
    every such length. A shorter shard pins the length (one graph per length, on every rank) before
    the per-hop arithmetic.
    """
    if halo <= 0:
        return [0] * world, [0] * world, 0
    if local_len >= halo:
        send = [halo if r == rank + 1 else 0 for r in range(world)]
        recv = [halo if q == rank - 1 else 0 for q in range(world)]
        return send, recv, halo if rank == 0 else 0
    local_len = guard_int(local_len)

    def rows(k):
        return max(0, min(local_len, halo - k * local_len))

    send = [rows(r - rank - 1) if r > rank else 0 for r in range(world)]
    recv = [rows(rank - q - 1) if q < rank else 0 for q in range(world)]
    return send, recv, leading_zeros(halo, local_len, rank)


def leading_zeros(halo: int, local_len, rank: int):
    """How many of the ``halo`` positions before rank ``rank``'s shard precede the sequence start:
    ``max(0, halo - rank * local_len)``, with the same guards as :func:`halo_counts` on every rank."""
    if halo <= 0:
        return 0
    if local_len >= halo:
        return halo if rank == 0 else 0
    return max(0, halo - rank * guard_int(local_len))


def halo_exchange(x: torch.Tensor, dim: int, halo: int, rank: int, world: int, group_name: str,
                  left_padding: int = 0) -> torch.Tensor:
    """Prepend the ``halo`` positions that precede this rank's shard along ``dim``.

    Exactly the needed rows move (from as many preceding ranks as ``halo`` spans); positions before
    the sequence start are zeros; ``left_padding`` more zero positions go in front and are never sent.
    The result has ``left_padding + halo + local_len`` positions. Backward returns each halo row's
    gradient to the rank that owns it.
    """
    dim = dim % x.dim()
    local_len = x.shape[dim]
    send, recv, zeros = halo_counts(halo, local_len, rank, world)
    pieces = []
    if left_padding + zeros:
        shape = list(x.shape)
        shape[dim] = left_padding + zeros
        pieces.append(x.new_zeros(shape))
    if world > 1 and halo > 0:  # every rank takes part: each sends or receives something
        rows = x.movedim(dim, 0)  # all_to_all splits along dim 0
        buffer = torch.cat([rows.narrow(0, local_len - c, c) for c in send], dim=0).contiguous()
        received = funcol.all_to_all_single_autograd(buffer, recv, send, group_name)
        if isinstance(received, funcol.AsyncCollectiveTensor):
            received = funcol.wait_tensor(received)
        pieces.append(received.movedim(0, dim))
    pieces.append(x)
    return torch.cat(pieces, dim=dim)


def global_count(target: torch.Tensor, ignore_index, group_name: str) -> torch.Tensor:
    """How many targets all ranks hold (those ``!= ignore_index`` when given): the denominator of a global
    mean. Metadata only: no autograd."""
    target = target.detach()
    local = (target != ignore_index).sum() if ignore_index is not None else torch.ones_like(target).sum()
    total = funcol.all_reduce(local, "sum", group_name)
    return funcol.wait_tensor(total) if isinstance(total, funcol.AsyncCollectiveTensor) else total


def gather_halo(x: torch.Tensor, mesh, halo: int, dim: int = 1, left_padding: int = 0) -> torch.Tensor:
    """Eager halo exchange (differentiable): ``[left_padding zeros, halo preceding positions, x]`` along ``dim``."""
    cp = resolve_group(mesh)
    return halo_exchange(x, dim, halo, cp.rank, cp.size, cp.name, left_padding)


def gather_sequence(local: torch.Tensor, mesh, dim: int = 1, layout=None) -> torch.Tensor:
    """Reassemble a sequence-sharded tensor on every rank (differentiable).

    With the ``ShardLayout`` from :func:`cp_passes.shard_batch`, the padding is cut off again.
    """
    cp = resolve_group(mesh)
    full = local if cp.size == 1 else sequence_all_gather(local, dim, cp.name)
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


def window_mask_with_halo(query: torch.Tensor, window: int, rank: int) -> torch.Tensor:
    """Boolean ``[local_len, window - 1 + local_len]`` for keys ``[halo, local]``: key at global position
    ``k`` is visible to the query at ``p`` iff ``0 <= p - k < window`` and ``k >= 0`` (zero halo rows
    before the sequence start are never visible)."""
    local = query.shape[-2]
    halo = window - 1
    q_pos = torch.arange(local, device=query.device) + rank * local
    k_pos = torch.arange(halo + local, device=query.device) + (rank * local - halo)
    distance = q_pos[:, None] - k_pos[None, :]
    return (k_pos[None, :] >= 0) & (distance >= 0) & (distance < window)


def metadata_all_gather(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    """All-gather sequence metadata (positions, doc ids) along ``dim``: no autograd edge."""
    dim = dim % x.dim()
    if x.dtype == torch.bool:  # Inductor's CPU code generation asserts on a gathered bool buffer (torch 2.13)
        return metadata_all_gather(x.to(torch.uint8), dim, group_name).to(torch.bool)
    gathered = funcol.all_gather_single(x.detach().movedim(dim, 0).contiguous(), 0, group_name)
    if isinstance(gathered, funcol.AsyncCollectiveTensor):
        gathered = funcol.wait_tensor(gathered)
    return gathered.movedim(0, dim)


def mask_block_for_keys(global_mask: torch.Tensor, query: torch.Tensor, rank: int, window: int | None,
                        halo: bool) -> torch.Tensor:
    """This rank's rows of a mask evaluated over the whole sequence, cut to the keys its transport brings:
    the prefix ``[0, (rank + 1) * L)`` after a gather, ``[rank * L - (window - 1), (rank + 1) * L)`` after a
    halo (columns before the sequence start are False). Fails at run time if the model allows a key outside
    the causal (window) envelope that the transport was planned for: every rank checks every row of the
    global mask, so all ranks reach the same verdict and none is left waiting in a collective."""
    local = query.shape[-2]
    envelope = torch.ones(global_mask.shape[-2:], dtype=torch.bool, device=query.device).tril()
    if window is not None:
        envelope = envelope.triu(1 - window)
    torch._assert_async((global_mask & ~envelope).logical_not().all(),
                        "cp_passes: the model's attention mask allows a key outside the causal window that the "
                        "spec declares (or outside causal attention); declare the right AttentionRule")
    rows = global_mask.narrow(-2, rank * local, local)
    if not halo:
        return rows.narrow(-1, 0, (rank + 1) * local)
    h = window - 1
    missing = leading_zeros(h, local, rank)
    block = rows.narrow(-1, rank * local - h + missing, h + local - missing)
    if missing:
        block = torch.cat([block.new_zeros((*block.shape[:-1], missing)), block], dim=-1)
    return block


COLLECTIVES = (sequence_all_gather, halo_exchange, metadata_all_gather, global_count)
"""The transports that issue a collective: every rank must call them in the same order."""
