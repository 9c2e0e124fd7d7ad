"""Positions: ``arange(seq_len)`` becomes this rank's global positions, and a table sliced to the sequence length
(``table[:S]``, ``table[n - S:]``) this rank's rows of it. No communication."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from ..graph.analysis import meta_val
from ..layout import KINDS, Layout
from .base import Cost, Transport, register_transport

aten = torch.ops.aten


def global_positions(end, rank: int, world: int, kind: str, dtype: torch.dtype, device=None) -> torch.Tensor:
    """The global positions of rank ``rank``'s rows when the local sequence has ``end`` positions."""
    return Layout(world, kind).positions(rank, end, device).to(dtype)


@dataclass
class Arange:
    """``arange(end)`` over the local sequence."""

    node: torch.fx.Node
    end: object


def table_rows(table: torch.Tensor, dim: int, local_len, first: int, per_length: int, rank: int, world: int,
               kind: str) -> torch.Tensor:
    """The rows of ``table`` along ``dim`` that the single device's slice ``table[start(S):start(S) + S]`` gives
    this rank's positions, where ``start(S) = first + per_length * S`` at the global length ``S``."""
    layout = Layout(world, kind)
    start = first + per_length * layout.global_len(local_len)
    return table.index_select(dim, layout.positions(rank, local_len, table.device) + start)


@dataclass
class TableRows:
    """``table.slice(dim, start(s), start(s) + s)`` of a tensor that is not sharded, ``s`` the local length."""

    node: torch.fx.Node
    table: torch.fx.Node
    dim: int
    first: int
    per_length: int


class Positions(Transport):
    name = "positions"
    order = 10
    layouts = KINDS

    def apply(self, edit, request) -> None:
        node = request.node
        if isinstance(request, TableRows):
            after = node.next  # the slice's own length is this rank's
            local = edit.insert(aten.sym_size.int, (node, request.dim), name="cp_table_length", before=after)
            rows = edit.insert(table_rows, (edit.current(request.table), request.dim, local, request.first,
                                            request.per_length, edit.rank, edit.world, edit.layout.kind),
                               name="cp_table_rows", before=after)
            edit.replace_uses(node, rows)
            return
        device = node.kwargs.get("device")
        positions = edit.insert(global_positions, (request.end, edit.rank, edit.world, edit.layout.kind,
                                                   meta_val(node).dtype, device),
                                name="cp_positions")
        edit.replace_uses(node, positions)

    def cost(self, request, layout, rank, local_len) -> Cost:
        return Cost()


POSITIONS = register_transport(Positions())
