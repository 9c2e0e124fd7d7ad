"""Shift: every local row reads the row ``offset`` positions away (a constant-offset stencil).

``pad(x, (a, b), value)[..., start:start + s]`` along the sequence reads ``x[t + start - a]``, and ``value``
outside the sequence: Hugging Face's in-model label shift (``offset`` 1: each rank needs the next rank's
first row), a token shift, one tap of a stencil. The rows come from the ranks that own them (as many as
``|offset|`` spans) in one ``all_to_all``; exactly the rows that are not local move. The gradient is the
shift by ``-offset`` with zeros outside.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.fx

from ..graph.analysis import hint, meta_val, numel_hint
from ..layout import CONTIGUOUS, KINDS, Layout
from .base import Cost, Transport, gradient_by, register_transport
from .collectives import assemble, exchange


@functools.lru_cache(maxsize=256)
def _plans(world: int, kind: str, offset: int, local_len: int) -> tuple:
    """Every rank's :meth:`Layout.shifted_sources`: the same on every rank, computed once per length."""
    layout = Layout(world, kind)
    return tuple((tuple(layout.shifted_sources(offset, r, local_len)),) for r in range(world))


def _shift(x: torch.Tensor, dim: int, offset: int, fill: float, rank: int, world: int, group_name: str,
           kind: str) -> torch.Tensor:
    rows = x.movedim(dim, 0)
    plans = _plans(world, kind, offset, x.shape[dim])
    received = exchange(rows, plans, rank, world, group_name)
    pieces = assemble(rows, plans[rank][0], received, plans, rank, fill)
    return torch.cat(pieces).movedim(0, dim).contiguous()


@torch.library.custom_op("cp_passes::shift", mutates_args=())
def shift_op(x: torch.Tensor, dim: int, offset: int, fill: float, rank: int, world: int, group_name: str,
             kind: str = CONTIGUOUS) -> torch.Tensor:
    """``out[t] = x[t + offset]`` along ``dim`` over the global sequence, ``fill`` outside it."""
    return _shift(x, dim % x.dim(), offset, fill, rank, world, group_name, kind)


@shift_op.register_fake
def _(x, dim, offset, fill, rank, world, group_name, kind=CONTIGUOUS):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


gradient_by(shift_op, shift_op, lambda dim, offset, fill, rank, world, group_name, kind=CONTIGUOUS:
            (dim, -offset, 0.0, rank, world, group_name, kind))


@dataclass
class Shift:
    """``node`` (a slice of a padded tensor) reads ``source`` shifted by ``offset`` along ``dim``."""

    node: torch.fx.Node
    source: torch.fx.Node
    dim: int
    offset: int
    fill: float
    pad: torch.fx.Node | None = None
    """The pad the slice reads: the shift reads ``source`` where the pad did (before later mutations)."""


@dataclass
class Diff(Shift):
    """``node = diff(source, dim=dim, prepend=prepend)``: ``source`` minus ``source`` shifted by one, the
    prepended row at the sequence's first position."""

    prepend: torch.fx.Node | None = None


def previous_rows(shifted: torch.Tensor, prepend: torch.Tensor, dim: int, rank: int, world: int,
                  kind: str) -> torch.Tensor:
    """Each position's previous row, ``prepend`` at the sequence's first position."""
    positions = Layout(world, kind).positions(rank, shifted.shape[dim], shifted.device)
    shape = [1] * shifted.dim()
    shape[dim] = -1
    return torch.where((positions == 0).view(shape), prepend.to(shifted.dtype), shifted)


def difference(x: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """``torch.diff``'s step: ``x != previous`` for booleans, ``x - previous`` otherwise."""
    return x != previous if x.dtype == torch.bool else x - previous


class ShiftTransport(Transport):
    name = "shift"
    order = 15
    layouts = KINDS
    runtime = (torch.ops.cp_passes.shift.default,)

    def apply(self, edit, request: Shift) -> None:
        shifted = edit.insert(torch.ops.cp_passes.shift.default,
                              (edit.current(request.source), request.dim, request.offset, float(request.fill),
                               edit.rank, edit.world, edit.group_name, edit.layout.kind), name="cp_shifted",
                              before=request.pad)
        if isinstance(request, Diff):
            previous = edit.insert(previous_rows, (shifted, request.prepend, request.dim, edit.rank, edit.world,
                                                    edit.layout.kind),
                                   name="cp_previous")
            shifted = edit.insert(difference, (edit.current(request.source), previous), name="cp_diff")
        edit.replace_uses(request.node, shifted)

    def cost(self, request: Shift, layout, rank, local_len) -> Cost:
        rows = hint(meta_val(request.source).shape[request.dim])  # positions, or windows of them
        row = numel_hint(request.source) // rows * meta_val(request.source).dtype.itemsize
        recv = sum(n for owner, _, n in layout.shifted_sources(request.offset, rank, rows)
                   if owner not in (None, rank))
        sent = sum(n for r in range(layout.world) if r != rank
                   for owner, _, n in layout.shifted_sources(request.offset, r, rows) if owner == rank)
        return Cost(f"all_to_all {abs(request.offset)} rows {'after' if request.offset > 0 else 'before'} | "
                    f"bw all_to_all", recv * row // meta_val(request.source).dtype.itemsize, recv * row, recv * row,
                    sent * row)


SHIFT = register_transport(ShiftTransport())
