"""The causal prefix: the keys a causal query on this rank can see, gathered from the ranks that hold them.

:func:`prefix_gather_op` brings every position before the end of the rank's last range, in global order, in one
``all_to_all`` of exactly the rows other ranks hold (its backward returns each row's gradient to its owner): the
causal lower bound on every layout (a balanced rank's tail range sees all but the chunks after it). With packed
documents' first keys (what a mask shows) only the positions from each range's first key move, and the op does
the whole exchange at once (what moves depends on the data).

Without first keys the gather is split in two, so that compute can run while the keys travel.

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

from ..layout import CONTIGUOUS, Layout, chunk_len
from .base import Cost, gradient_by
from .collectives import _wanted, all_gather, assemble, exchange, piece_counts, return_rows

WAIT = torch.ops._c10d_functional.wait_tensor.default


@functools.lru_cache(maxsize=256)
def unit_plans(world: int, kind: str) -> tuple:
    """Every rank's visible-prefix pieces, ``(owner, owner's row, rows)``, for chunks of one row. Checked
    linear: the plans for chunks of two rows are these doubled."""
    layout = Layout(world, kind)
    one, two = prefix_plans(world, kind, layout.chunks), prefix_plans(world, kind, 2 * layout.chunks)
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


@functools.lru_cache(maxsize=256)
def prefix_plans(world: int, kind: str, local_len: int, firsts: tuple | None = None) -> tuple:
    """Every rank's one segment: where the positions before the end of its last range are held. With
    ``firsts`` (per rank, the first key each of its ranges' queries see: :func:`~.masks.first_keys`), only the
    positions from each range's first key to its end are held by anyone; the others are zeros."""
    layout = Layout(world, kind)
    return tuple((tuple(_needed_sources(layout, r, local_len, None if firsts is None else firsts[r])),)
                 for r in range(world))


def _needed_sources(layout: Layout, rank: int, local_len: int, firsts: tuple | None) -> list:
    """:meth:`Layout.sources` of rank ``rank``'s visible prefix, with ``(None, 0, rows)`` (zeros) for the
    positions before no range's first key."""
    prefix = layout.visible_prefix(rank, local_len)
    if firsts is None:
        return layout.sources(0, prefix, local_len)
    pieces, at = [], 0
    for first, stop in sorted(zip(firsts, (stop for _, stop in layout.ranges(rank, local_len)))):
        first = max(first, at)
        if first >= stop:
            continue
        if first > at:
            pieces.append((None, 0, first - at))
        pieces += layout.sources(first, stop, local_len)
        at = stop
    if at < prefix:
        pieces.append((None, 0, prefix - at))
    return pieces


def _all_firsts(firsts: torch.Tensor | None, world: int, group_name: str) -> tuple | None:
    """Every rank's :func:`~.masks.first_keys` (one small all-gather): what each rank sends depends on them."""
    if firsts is None:
        return None
    table = all_gather(firsts.reshape(1, -1).to(torch.int64), world, group_name).tolist()
    return tuple(tuple(row) for row in table)


@torch.library.custom_op("cp_passes::prefix_gather", mutates_args=())
def prefix_gather_op(x: torch.Tensor, dim: int, rank: int, world: int, group_name: str,
                     kind: str = CONTIGUOUS, firsts: torch.Tensor | None = None) -> torch.Tensor:
    """The keys a causal query on this rank can see: every global position before the end of its last range, in
    global order along ``dim`` (:meth:`Layout.visible_prefix` rows). Only the rows another rank holds move, in
    one ``all_to_all``: the causal lower bound, on every layout. With ``firsts`` (:func:`~.masks.first_keys`: what a
    mask shows, packed documents) only the positions from each range's first key move; the rows before are
    zeros, which the mask hides."""
    dim = dim % x.dim()
    rows = x.movedim(dim, 0)
    plans = prefix_plans(world, kind, rows.shape[0], _all_firsts(firsts, world, group_name))
    received = exchange(rows, plans, rank, world, group_name)
    pieces = assemble(rows, plans[rank][0], received, plans, rank)
    return torch.cat(pieces).movedim(0, dim).contiguous()


@prefix_gather_op.register_fake
def _(x, dim, rank, world, group_name, kind=CONTIGUOUS, firsts=None):
    shape = list(x.shape)
    shape[dim % x.dim()] = Layout(world, kind).visible_prefix(rank, shape[dim % x.dim()])
    return x.new_empty(shape)


@torch.library.custom_op("cp_passes::prefix_gather_backward", mutates_args=())
def prefix_gather_backward_op(grad: torch.Tensor, dim: int, rank: int, world: int, group_name: str,
                              kind: str = CONTIGUOUS, firsts: torch.Tensor | None = None) -> torch.Tensor:
    """The gradient of :func:`prefix_gather_op`: each row's gradient returns to the rank that holds the row."""
    dim = dim % grad.dim()
    rows = grad.movedim(dim, 0)
    local_len = _local_len(Layout(world, kind), rank, rows.shape[0])
    plans = prefix_plans(world, kind, local_len, _all_firsts(firsts, world, group_name))
    out = rows.new_zeros((local_len, *rows.shape[1:]))
    back, at = {q: [] for q in range(world)}, 0
    for owner, row, n in plans[rank][0]:
        if owner == rank:
            out.narrow(0, row, n).add_(rows.narrow(0, at, n))
        elif owner is not None:
            back[owner].append((row, rows.narrow(0, at, n)))
        at += n
    return_rows(back, out, plans, rank, world, group_name)
    return out.movedim(0, dim).contiguous()


@prefix_gather_backward_op.register_fake
def _(grad, dim, rank, world, group_name, kind=CONTIGUOUS, firsts=None):
    shape = list(grad.shape)
    shape[dim % grad.dim()] = _local_len(Layout(world, kind), rank, shape[dim % grad.dim()])
    return grad.new_empty(shape)


gradient_by(prefix_gather_op, prefix_gather_backward_op)


def _local_len(layout: Layout, rank: int, prefix_len):
    """The local length at which rank ``rank``'s visible prefix is ``prefix_len`` rows."""
    return prefix_len // layout.prefix_chunks(rank) * layout.chunks


def prefix_cost(layout: Layout, rank: int, local_len: int, row: int, itemsize: int, what: str,
                backward: str = " | bw all_to_all", firsts: tuple | None = None, scope: str = "causal prefix") -> Cost:
    """What :func:`prefix_gather_op` moves for rank ``rank`` (``row`` bytes a position): the rows of every
    position before the end of its last range that another rank holds, the causal lower bound; with
    ``firsts`` (every rank's :func:`~.masks.first_keys`, as the op all-gathers them), those from each range's
    first key."""
    send, recv, _ = piece_counts(prefix_plans(layout.world, layout.kind, local_len, firsts), rank, layout.world)
    moved = sum(recv) * row
    return Cost(f"all_to_all {what} ({scope}){backward}", moved // itemsize, moved, moved, sum(send) * row)
