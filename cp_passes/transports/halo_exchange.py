"""The halo's runtime: the rows just before (and after) each of this rank's ranges, from the ranks that hold them.

:func:`halo_op` brings exactly the needed rows in one ``all_to_all`` with exact split sizes
(:meth:`Layout.halo_sources`); rows a rank holds itself (a balanced layout's tail range follows its head on the
middle rank) are copied, and positions outside the sequence are zeros. The counts are computed at run time from
the concrete local length, so one graph serves every length. Its backward returns each halo row's gradient to
the rank that holds the row. The halo transport (:mod:`.halo`) and the key mover (:mod:`.key_move`) insert it.
"""

from __future__ import annotations

import functools

import torch

from ..layout import CONTIGUOUS, Layout
from .base import gradient_by
from .collectives import assemble, exchange, return_rows


@functools.lru_cache(maxsize=256)
def halo_plans(world: int, kind: str, before: int, local_len: int, after: int = 0) -> tuple:
    """Every rank's :meth:`Layout.halo_sources`: the same on every rank, computed once per length."""
    layout = Layout(world, kind)
    return tuple(tuple(tuple(pieces) for pieces in layout.halo_sources(before, r, local_len, after))
                 for r in range(world))


def placed_rows(pieces: tuple, before: int, size: int) -> list[tuple[int | None, int, int, int]]:
    """``(owner, row, rows, offset)``: where each source piece of one range lands in its segment ``[before rows,
    the range's size rows, the rows after]`` (after any left padding)."""
    placed, at = [], 0
    for owner, row, n in pieces:
        placed.append((owner, row, n, at if at < before else at + size))
        at += n
    return placed


@torch.library.custom_op("cp_passes::halo", mutates_args=())
def halo_op(x: torch.Tensor, dim: int, before: int, left_padding: int, rank: int, world: int,
            group_name: str, kind: str = CONTIGUOUS, after: int = 0) -> torch.Tensor:
    """For each of this rank's ranges (one, or two in a balanced layout): ``left_padding`` zeros, the ``before``
    positions in front of it, its rows, the ``after`` positions after it, along ``dim``; positions outside the
    sequence are zeros."""
    dim = dim % x.dim()
    rows = x.movedim(dim, 0)
    local_len = rows.shape[0]
    plans = halo_plans(world, kind, before, local_len, after)
    received = exchange(rows, plans, rank, world, group_name)
    pieces = []
    size = local_len // len(plans[rank])
    for i, sources in enumerate(plans[rank]):
        if left_padding:
            pieces.append(rows.new_zeros((left_padding, *rows.shape[1:])))
        front = [(owner, row, n) for owner, row, n, at in placed_rows(sources, before, size) if at < before]
        pieces += assemble(rows, front, received, plans, rank)
        pieces.append(rows.narrow(0, i * size, size))
        pieces += assemble(rows, sources[len(front):], received, plans, rank)
    return torch.cat(pieces).movedim(0, dim).contiguous()


@halo_op.register_fake
def _(x, dim, before, left_padding, rank, world, group_name, kind=CONTIGUOUS, after=0):
    shape = list(x.shape)
    shape[dim % x.dim()] += Layout(world, kind).chunks * (left_padding + before + after)
    return x.new_empty(shape)


@torch.library.custom_op("cp_passes::halo_backward", mutates_args=())
def halo_backward_op(grad: torch.Tensor, dim: int, before: int, left_padding: int, rank: int, world: int,
                     group_name: str, kind: str = CONTIGUOUS, after: int = 0) -> torch.Tensor:
    """The gradient of :func:`halo_op`: each halo row's gradient returns to the rank that holds the row."""
    dim = dim % grad.dim()
    rows = grad.movedim(dim, 0)
    chunks = Layout(world, kind).chunks
    local_len = rows.shape[0] - chunks * (left_padding + before + after)
    size = local_len // chunks
    plans = halo_plans(world, kind, before, local_len, after)
    segment = left_padding + before + size + after
    out = torch.cat([rows.narrow(0, i * segment + left_padding + before, size) for i in range(chunks)])
    back = {q: [] for q in range(world)}
    for i, sources in enumerate(plans[rank]):
        for owner, row, n, at in placed_rows(sources, before, size):
            at += i * segment + left_padding
            if owner == rank:
                out.narrow(0, row, n).add_(rows.narrow(0, at, n))
            elif owner is not None:
                back[owner].append((row, rows.narrow(0, at, n)))
    return_rows(back, out, plans, rank, world, group_name)
    return out.movedim(0, dim).contiguous()


@halo_backward_op.register_fake
def _(grad, dim, before, left_padding, rank, world, group_name, kind=CONTIGUOUS, after=0):
    shape = list(grad.shape)
    shape[dim % grad.dim()] -= Layout(world, kind).chunks * (left_padding + before + after)
    return grad.new_empty(shape)


gradient_by(halo_op, halo_backward_op)
