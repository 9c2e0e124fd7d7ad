"""The collectives the transports' runtime ops issue, addressed by group name and waited on at once.

They run inside the ``cp_passes::*`` custom ops, eagerly, whatever compiled the graph around them.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed._functional_collectives as funcol

from ..layout import wanted_rows


def _waited(result) -> torch.Tensor:
    return funcol.wait_tensor(result) if isinstance(result, funcol.AsyncCollectiveTensor) else result


def all_to_all(rows: torch.Tensor, recv: list[int], send: list[int], group_name: str) -> torch.Tensor:
    """Send ``send[r]`` leading-dim rows of ``rows`` (in rank order) to rank ``r``; receive ``recv[q]`` from ``q``."""
    return _waited(funcol.all_to_all_single(rows.contiguous(), recv, send, group_name))


def all_gather(rows: torch.Tensor, world: int, group_name: str) -> torch.Tensor:
    """Every rank's ``rows`` concatenated along dim 0 in rank order."""
    return _waited(funcol.all_gather_single(rows.contiguous(), 0, group_name))


def reduce_scatter(rows: torch.Tensor, world: int, group_name: str) -> torch.Tensor:
    """The sum over ranks of this rank's ``1 / world`` of ``rows`` along dim 0."""
    return _waited(funcol.reduce_scatter_single(rows.contiguous(), "sum", 0, group_name))


def all_reduce(value: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
    """``value`` reduced over the ranks with ``op`` ("sum", "max", "min")."""
    return _waited(funcol.all_reduce(value, op, group_name))


def all_reduce_sum(value: torch.Tensor, group_name: str) -> torch.Tensor:
    return all_reduce(value, "sum", group_name)


def piece_counts(plans: tuple, rank: int, world: int) -> tuple[list[int], list[int], bool]:
    """For plans of pieces (``plans[r]``: rank ``r``'s segments, each a list of ``(owner, owner's row, rows)``,
    owner None for zeros): the rows this rank sends to and receives from every other rank, each row once however
    many pieces take it (:func:`~cp_passes.layout.wanted_rows`), and whether any rank receives any (the same on
    every rank: all take part in the exchange, or none)."""
    send = [sum(n for _, n in _wanted(plans, d, rank)) if d != rank else 0 for d in range(world)]
    recv = [sum(n for _, n in _wanted(plans, rank, q)) if q != rank else 0 for q in range(world)]
    moves = any(owner not in (None, r) for r, plan in enumerate(plans) for pieces in plan for owner, _, _ in pieces)
    return send, recv, moves


@functools.lru_cache(maxsize=1024)
def _wanted(plans: tuple, receiver: int, owner: int) -> tuple[tuple[int, int], ...]:
    return tuple(wanted_rows(plans[receiver], owner))


def _offset(runs, row: int) -> int:
    """Where ``row`` of the owner lies in what a rank received from it (its :func:`_wanted` runs, in order)."""
    at = 0
    for start, n in runs:
        if start <= row < start + n:
            return at + row - start
        at += n
    raise AssertionError(f"cp_passes internal error: row {row} was not received")


def split_rows(rows: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    """``rows`` cut along dim 0 into consecutive pieces of ``counts`` rows."""
    out, start = [], 0
    for n in counts:
        out.append(rows.narrow(0, start, n))
        start += n
    return out


def exchange(rows: torch.Tensor, plans: tuple, rank: int, world: int, group_name: str) -> dict[int, torch.Tensor]:
    """One ``all_to_all`` that moves the pieces of ``plans`` (see :func:`piece_counts`): what this rank received
    from each owner, its pieces in plan order."""
    send, recv, moves = piece_counts(plans, rank, world)
    if not moves:
        return {}
    outgoing = [rows.narrow(0, row, n) for d in range(world) if d != rank for row, n in _wanted(plans, d, rank)]
    buffer = torch.cat(outgoing) if outgoing else rows.narrow(0, 0, 0)
    return dict(enumerate(split_rows(all_to_all(buffer, recv, send, group_name), recv)))


def return_rows(back: dict[int, list[tuple[int, torch.Tensor]]], out: torch.Tensor, plans: tuple, rank: int,
                world: int, group_name: str) -> None:
    """The reverse of :func:`exchange` for gradients: ``back[owner]`` holds ``(owner's row, gradient)`` for the
    pieces this rank took from ``owner``; the gradients of a row two pieces took add up, each row's returns once to
    its owner and is added at its row of ``out``."""
    send, recv, moves = piece_counts(plans, rank, world)
    if not moves:
        return
    returning = [_rows_back(back.get(q, []), _wanted(plans, rank, q), recv[q], out) for q in range(world) if q != rank]
    buffer = torch.cat(returning) if returning else out.narrow(0, 0, 0)
    returned = split_rows(all_to_all(buffer, send, recv, group_name), send)  # the rows this rank sent
    for d in range(world):
        offset = 0
        for row, n in (_wanted(plans, d, rank) if d != rank else ()):
            out.narrow(0, row, n).add_(returned[d].narrow(0, offset, n))
            offset += n


def _rows_back(pieces: list[tuple[int, torch.Tensor]], runs, total: int, like: torch.Tensor) -> torch.Tensor:
    """The gradients of the rows received from one owner, in the order they came (``runs``): the pieces in row
    order where none overlap, else summed into place."""
    pieces = sorted(pieces, key=lambda piece: piece[0])
    if sum(g.shape[0] for _, g in pieces) == total:
        return torch.cat([g for _, g in pieces]) if pieces else like.narrow(0, 0, 0)
    summed = like.new_zeros((total, *like.shape[1:]))
    for row, g in pieces:
        if g.shape[0]:
            summed.narrow(0, _offset(runs, row), g.shape[0]).add_(g)
    return summed


def assemble(rows: torch.Tensor, pieces, received: dict[int, torch.Tensor], plans: tuple, rank: int,
             fill: float = 0.0) -> list[torch.Tensor]:
    """The tensors of ``pieces`` (``(owner, owner's row, rows)``) in order: this rank's own rows, the rows
    :func:`exchange` received from each other owner (found in ``plans``' runs for this rank), ``fill`` outside the
    sequence."""
    out = []
    for owner, row, n in pieces:
        if n == 0:
            continue
        if owner is None:
            out.append(torch.full((n, *rows.shape[1:]), fill, dtype=rows.dtype, device=rows.device))
        elif owner == rank:
            out.append(rows.narrow(0, row, n))
        else:
            out.append(received[owner].narrow(0, _offset(_wanted(plans, rank, owner), row), n))
    return out
