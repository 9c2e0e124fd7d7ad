"""The causal key gather split in two, so that compute can run while the keys travel.

``prefix_pack`` takes this rank's rows that other ranks' causal queries can see (rows along dim 0, by receiver
in rank order); a functional ``all_to_all`` sends them and returns before they arrive; ``wait_tensor`` waits;
``prefix_finish`` puts the received rows and this rank's own in global order: the rows
:func:`~.gather.prefix_gather_op` returns, moved the same way. AOTAutograd differentiates the all_to_all (the
backward returns each row's gradient to its owner in one ``all_to_all`` of its own) and the two custom ops by
their gradients below. The start, the wait and the compute between them are separate nodes of the graph, which
:mod:`cp_passes.compiler.schedule` orders: the start as early as its input allows, the wait after the compute
that does not need it.

Row counts are linear in the chunk length (``local_len / chunks``): the plans are made for chunks of one row
and scaled, so one graph serves every sequence length. The slicing happens inside the ops: traced, a slice of a
symbolic length guards on its size not being 1 (a recompile for one length).
"""

from __future__ import annotations

import functools

import torch

from ..layout import Layout, chunk_len
from .collectives import _wanted, piece_counts

WAIT = torch.ops._c10d_functional.wait_tensor.default


@functools.lru_cache(maxsize=256)
def unit_plans(world: int, kind: str) -> tuple:
    """Every rank's visible-prefix pieces, ``(owner, owner's row, rows)``, for chunks of one row. Checked
    linear: the plans for chunks of two rows are these doubled."""
    from .gather import _prefix_plans

    layout = Layout(world, kind)
    one, two = _prefix_plans(world, kind, layout.chunks), _prefix_plans(world, kind, 2 * layout.chunks)
    doubled = tuple(tuple(tuple((o, 2 * row, 2 * n) for o, row, n in seg) for seg in plan) for plan in one)
    assert doubled == two, "cp_passes internal error: prefix plans not linear in the chunk length"
    return one


def _unit(local_len, world: int, kind: str):
    return chunk_len(local_len, Layout(world, kind).chunks)


@functools.lru_cache(maxsize=1024)
def _sent(rank: int, world: int, kind: str) -> tuple[tuple[int, int], ...]:
    """``(row, rows)`` in chunk units of every piece this rank sends, in the all_to_all's order."""
    plans = unit_plans(world, kind)
    return tuple(run for d in range(world) if d != rank for run in _wanted(plans, d, rank))


@functools.lru_cache(maxsize=1024)
def _received(rank: int, world: int, kind: str) -> tuple[tuple[int | None, int, int], ...]:
    """``(where, rows)`` in chunk units of every piece of the visible prefix in global order: ``where`` the row
    in the received buffer, None for this rank's own (then the row in ``x``)."""
    plans = unit_plans(world, kind)
    _, recv, _ = piece_counts(plans, rank, world)
    starts = [sum(recv[:q]) for q in range(world)]
    out = []
    for owner, row, n in plans[rank][0]:
        if owner == rank:
            out.append((None, row, n))
            continue
        at = starts[owner]
        for start, count in _wanted(plans, rank, owner):
            if start <= row < start + count:
                out.append((at + row - start, 0, n))
                break
            at += count
    return tuple(out)


def _shape(x: torch.Tensor, dim: int, rows) -> list:
    """``x``'s shape with ``dim`` moved first and ``rows`` long."""
    return [rows] + [s for i, s in enumerate(x.shape) if i != dim]


@torch.library.custom_op("cp_passes::prefix_pack", mutates_args=())
def prefix_pack_op(x: torch.Tensor, dim: int, rank: int, world: int, kind: str) -> torch.Tensor:
    """The rows of ``x`` (along ``dim``) other ranks' causal queries see, along dim 0 in the all_to_all's order."""
    unit = _unit(x.shape[dim], world, kind)
    pieces = [x.narrow(dim, row * unit, n * unit).movedim(dim, 0) for row, n in _sent(rank, world, kind)]
    return torch.cat(pieces) if pieces else x.new_empty(_shape(x, dim, 0))


@prefix_pack_op.register_fake
def _(x, dim, rank, world, kind):
    unit = _unit(x.shape[dim], world, kind)
    return x.new_empty(_shape(x, dim, sum(n for _, n in _sent(rank, world, kind)) * unit))


@torch.library.custom_op("cp_passes::prefix_unpack", mutates_args=())
def prefix_unpack_op(rows: torch.Tensor, local_len: int, dim: int, rank: int, world: int,
                     kind: str) -> torch.Tensor:
    """The gradient of :func:`prefix_pack_op`: each sent row's gradient added at its row (zeros elsewhere)."""
    unit = _unit(local_len, world, kind)
    out = rows.new_zeros([local_len, *rows.shape[1:]])
    at = 0
    for row, n in _sent(rank, world, kind):
        out.narrow(0, row * unit, n * unit).add_(rows.narrow(0, at, n * unit))
        at += n * unit
    return out.movedim(0, dim).contiguous()


@prefix_unpack_op.register_fake
def _(rows, local_len, dim, rank, world, kind):
    shape = [local_len, *rows.shape[1:]]
    return rows.new_empty(shape).movedim(0, dim).contiguous()


def _pack_setup(ctx, inputs, output):
    x, ctx.dim, ctx.rank, ctx.world, ctx.kind = inputs
    ctx.local_len = x.shape[ctx.dim]


def _pack_backward(ctx, grad):
    return prefix_unpack_op(grad.contiguous(), ctx.local_len, ctx.dim, ctx.rank, ctx.world, ctx.kind), None, None, \
        None, None


prefix_pack_op.register_autograd(_pack_backward, setup_context=_pack_setup)


@torch.library.custom_op("cp_passes::prefix_finish", mutates_args=())
def prefix_finish_op(x: torch.Tensor, received: torch.Tensor, dim: int, rank: int, world: int,
                     kind: str) -> torch.Tensor:
    """The keys a causal query on this rank sees, in global order along ``dim``: ``x``'s own rows and the
    received buffer's (rows along dim 0)."""
    unit = _unit(x.shape[dim], world, kind)
    received = received.movedim(0, dim)
    pieces = [x.narrow(dim, row * unit, n * unit) if where is None else
              received.narrow(dim, where * unit, n * unit) for where, row, n in _received(rank, world, kind)]
    return torch.cat(pieces, dim)


@prefix_finish_op.register_fake
def _(x, received, dim, rank, world, kind):
    shape = list(x.shape)
    shape[dim] = Layout(world, kind).visible_prefix(rank, x.shape[dim])
    return x.new_empty(shape)


@torch.library.custom_op("cp_passes::prefix_finish_backward", mutates_args=())
def prefix_finish_backward_op(grad: torch.Tensor, local_len: int, received_len: int, dim: int, rank: int,
                              world: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient of :func:`prefix_finish_op`: of ``x`` (its own rows') and of the received buffer (rows along
    dim 0), which the all_to_all's gradient returns to their owners."""
    unit = _unit(local_len, world, kind)
    rows = grad.movedim(dim, 0)
    own = rows.new_zeros([local_len, *rows.shape[1:]])
    back = rows.new_zeros([received_len, *rows.shape[1:]])
    at = 0
    for where, row, n in _received(rank, world, kind):
        target = own.narrow(0, row * unit, n * unit) if where is None else back.narrow(0, where * unit, n * unit)
        target.add_(rows.narrow(0, at, n * unit))
        at += n * unit
    return own.movedim(0, dim).contiguous(), back


@prefix_finish_backward_op.register_fake
def _(grad, local_len, received_len, dim, rank, world, kind):
    rows = grad.movedim(dim, 0)
    return (rows.new_empty([local_len, *rows.shape[1:]]).movedim(0, dim).contiguous(),
            rows.new_empty([received_len, *rows.shape[1:]]))


def _finish_setup(ctx, inputs, output):
    x, received, ctx.dim, ctx.rank, ctx.world, ctx.kind = inputs
    ctx.local_len, ctx.received_len = x.shape[ctx.dim], received.shape[0]


def _finish_backward(ctx, grad):
    own, back = prefix_finish_backward_op(grad.contiguous(), ctx.local_len, ctx.received_len, ctx.dim, ctx.rank,
                                          ctx.world, ctx.kind)
    return own, back, None, None, None, None


prefix_finish_op.register_autograd(_finish_backward, setup_context=_finish_setup)


def prefix_start(x: torch.Tensor, dim: int, rank: int, world: int, kind: str, group_name: str) -> torch.Tensor:
    """Send the rows of ``x`` (along ``dim``) other ranks' causal queries see; the received buffer (rows along
    dim 0, by sender in rank order), not yet waited for."""
    dim = dim % x.dim()
    unit = _unit(x.shape[dim], world, kind)
    send, recv, _ = piece_counts(unit_plans(world, kind), rank, world)
    rows = prefix_pack_op(x, dim, rank, world, kind)
    return torch.ops._c10d_functional_autograd.all_to_all_single(rows, [c * unit for c in recv],
                                                                 [c * unit for c in send], group_name)


def prefix_finish(x: torch.Tensor, received: torch.Tensor, dim: int, rank: int, world: int,
                  kind: str) -> torch.Tensor:
    """:func:`prefix_finish_op`. Every rank reads the received buffer, rows or none (the first contiguous rank's
    queries see only its own keys): a rank whose graph dropped the exchange, or recomputed it in the backward
    while others saved it, would leave the other ranks waiting in their all_to_all."""
    return prefix_finish_op(x, received, dim % x.dim(), rank, world, kind)


def insert_exchange(edit, x, dim: int, name: str):
    """Nodes (before ``edit``'s origin) that bring the causal prefix of ``x`` along ``dim``: the start, its wait
    and the rows in global order, the last returned."""
    args = (edit.rank, edit.world, edit.layout.kind)
    started = edit.insert(prefix_start, (x, dim, *args, edit.group_name), name=f"{name}_start")
    waited = edit.insert(WAIT, (started,), name=f"{name}_wait")
    return edit.insert(prefix_finish, (x, waited, dim, *args), name=name)
