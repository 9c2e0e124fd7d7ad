"""Positions: ``arange(seq_len)`` becomes this rank's global positions. No communication."""

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


class Positions(Transport):
    name = "positions"
    order = 10
    layouts = KINDS

    def apply(self, edit, request: Arange) -> None:
        node = request.node
        device = node.kwargs.get("device")
        positions = edit.insert(global_positions, (request.end, edit.rank, edit.world, edit.layout.kind,
                                                   meta_val(node).dtype, device),
                                name="cp_positions")
        edit.replace_uses(node, positions)

    def cost(self, request, layout, rank, local_len) -> Cost:
        return Cost()


POSITIONS = register_transport(Positions())
