"""Sequence gather: the keys and values attention reads from other ranks.

Full (bidirectional) attention all-gathers every rank's shard in the layout's gather order; its backward is a
reduce-scatter (each rank gets the sum of every use of its shard). Causal attention brings only what its queries
can see (:func:`prefix_gather_op`: every position before the end of the rank's last range, in global order),
in one ``all_to_all`` of exactly the rows other ranks hold, whose backward returns each row's gradient to its
owner: the causal lower bound on every layout (a balanced rank's tail range sees all but the chunks after it).
Without packed documents' first keys that exchange is started, waited for and finished as separate nodes
(:mod:`.prefix_exchange`), so that compute runs while it travels; with them, :func:`prefix_gather_op` does all
three in one op (what moves depends on the first keys).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.fx

from ..key_plan import PREFIX
from ..layout import CONTIGUOUS, KINDS, Layout
from .base import Cost, Transport, gradient_by, register_transport
from .collectives import all_gather, assemble, exchange, piece_counts, reduce_scatter, return_rows
from .masks import metadata_gather_op  # noqa: F401  (registers cp_passes::metadata_gather)
from .prefix_exchange import insert_exchange, prefix_start
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


@functools.lru_cache(maxsize=256)
def _prefix_plans(world: int, kind: str, local_len: int, firsts: tuple | None = None) -> tuple:
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
    plans = _prefix_plans(world, kind, rows.shape[0], _all_firsts(firsts, world, group_name))
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
    plans = _prefix_plans(world, kind, local_len, _all_firsts(firsts, world, group_name))
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


class SequenceGather(Transport):
    name = "sequence_gather"
    order = 30
    layouts = KINDS
    runtime = (torch.ops.cp_passes.sequence_gather.default, torch.ops.cp_passes.prefix_gather.default,
               torch.ops.cp_passes.metadata_gather.default, torch.ops.cp_passes.global_sum.default, prefix_start)
    gathers_keys = True

    def insert(self, edit, x: torch.fx.Node, dim: int, name: str, causal: bool = False,
               firsts: torch.fx.Node | None = None) -> torch.fx.Node:
        """Every rank's ``x`` (an all-gather), or with ``causal`` the positions a causal query on this rank can
        see: started, waited for and put in order as three nodes (:mod:`.prefix_exchange`), so that compute can
        run in between; with ``firsts`` (from each range's first key a mask shows: the rows that move depend on
        the data) in one blocking op, :func:`prefix_gather_op`."""
        if causal and firsts is None:
            return insert_exchange(edit, x, dim, name)
        if causal:
            return edit.insert(torch.ops.cp_passes.prefix_gather.default,
                               (x, dim, edit.rank, edit.world, edit.group_name, edit.layout.kind, firsts), name=name)
        return edit.insert(torch.ops.cp_passes.sequence_gather.default, (x, dim, edit.world, edit.group_name),
                           name=name)

    def apply(self, edit, request) -> None:
        from .attention import rewrite_attention

        rewrite_attention(edit, request, lambda x, name, firsts=None: self.insert(
            edit, x, request.dim, f"{name}_gathered", request.keys.move == PREFIX, firsts))

    def cost(self, request, layout, rank, local_len) -> Cost:
        row, reach = request.row_bytes(local_len), request.keys.reach
        if request.keys.move == PREFIX:
            scope = ("from each range's first key its mask shows, at most the causal prefix"
                     if request.keys.first_keys else "causal prefix")
            cost = prefix_cost(layout, rank, local_len, row, request.itemsize, request.kv_label, scope=scope)
            if reach.before is not None:  # a window by gather, as the spec asks: its halo is the bound
                window = sum(layout.halo_counts(reach.before, rank, local_len)[1]) * row
                cost = dataclasses.replace(cost, lower_bound_bytes=window)
            return cost + request.metadata_cost(layout.world)
        total = request.elements
        needed = (layout.global_len(local_len) - local_len) * row
        moved = (layout.world - 1) * total * request.itemsize
        return (Cost(f"all_gather {request.kv_label} | bw reduce_scatter", (layout.world - 1) * total, moved, needed,
                     moved) + request.metadata_cost(layout.world))


def prefix_cost(layout: Layout, rank: int, local_len: int, row: int, itemsize: int, what: str,
                backward: str = " | bw all_to_all", firsts: tuple | None = None, scope: str = "causal prefix") -> Cost:
    """What :func:`prefix_gather_op` moves for rank ``rank`` (``row`` bytes a position): the rows of every
    position before the end of its last range that another rank holds, the causal lower bound; with
    ``firsts`` (every rank's :func:`~.masks.first_keys`, as the op all-gathers them), those from each range's
    first key."""
    send, recv, _ = piece_counts(_prefix_plans(layout.world, layout.kind, local_len, firsts), rank, layout.world)
    moved = sum(recv) * row
    return Cost(f"all_to_all {what} ({scope}){backward}", moved // itemsize, moved, moved, sum(send) * row)


SEQUENCE_GATHER = register_transport(SequenceGather())


@prefix_gather_backward_op.register_fake
def _(grad, dim, rank, world, group_name, kind=CONTIGUOUS, firsts=None):
    shape = list(grad.shape)
    shape[dim % grad.dim()] = _local_len(Layout(world, kind), rank, shape[dim % grad.dim()])
    return grad.new_empty(shape)


gradient_by(prefix_gather_op, prefix_gather_backward_op)


def _local_len(layout: Layout, rank: int, prefix_len):
    """The local length at which rank ``rank``'s visible prefix is ``prefix_len`` rows."""
    return prefix_len // layout.prefix_chunks(rank) * layout.chunks
