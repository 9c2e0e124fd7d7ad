"""Scan: a cumulative sum along the sequence is a local scan plus the preceding ranks' totals.

``cumsum(x)`` on a shard is this rank's running sum; adding the sum of every preceding rank's total (one
all-gather of one total per rank and row, :meth:`Layout.preceding_ranks`) gives the global running sum.
The gradient of a rank's total is the sum of the offset gradients of the ranks after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from ..graph.analysis import meta_val, numel_hint
from ..layout import Layout
from .base import Cost, Transport, gradient_by, register_transport
from .collectives import all_gather

aten = torch.ops.aten


@torch.library.custom_op("cp_passes::scan_offset", mutates_args=())
def scan_offset_op(total: torch.Tensor, rank: int, world: int, group_name: str) -> torch.Tensor:
    """The sum of ``total`` over the ranks preceding this one."""
    gathered = all_gather(total[None], world, group_name)
    offset = torch.zeros_like(total)
    for q in Layout(world).preceding_ranks(rank):
        offset += gathered[q]
    return offset


@scan_offset_op.register_fake
def _(total, rank, world, group_name):
    return torch.empty_like(total)


@torch.library.custom_op("cp_passes::scan_offset_backward", mutates_args=())
def scan_offset_backward_op(grad: torch.Tensor, rank: int, world: int, group_name: str) -> torch.Tensor:
    """The gradient of this rank's total: the offset gradients of every rank it precedes."""
    gathered = all_gather(grad[None], world, group_name)
    layout, out = Layout(world), torch.zeros_like(grad)
    for r in range(world):
        if rank in layout.preceding_ranks(r):
            out += gathered[r]
    return out


@scan_offset_backward_op.register_fake
def _(grad, rank, world, group_name):
    return torch.empty_like(grad)


gradient_by(scan_offset_op, scan_offset_backward_op)


@dataclass
class Scan:
    """``node = cumsum(source, dim)`` along the sequence."""

    node: torch.fx.Node
    source: torch.fx.Node
    dim: int


class ScanTransport(Transport):
    name = "scan"
    order = 25
    runtime = (torch.ops.cp_passes.scan_offset.default,)

    def apply(self, edit, request: Scan) -> None:
        node, dtype = request.node, meta_val(request.node).dtype
        total = edit.insert(aten.sum.dim_IntList, (request.source, [request.dim], True), {"dtype": dtype},
                            name="cp_scan_total", before=node.next)
        offset = edit.insert(torch.ops.cp_passes.scan_offset.default, (total, edit.rank, edit.world, edit.group_name),
                             name="cp_scan_offset", before=total.next)
        scanned = edit.insert(aten.add.Tensor, (node, offset), name="cp_scanned", before=offset.next)
        edit.replace_uses(node, scanned)
        edit.changed(node)

    def cost(self, request: Scan, layout, rank, local_len) -> Cost:
        total = numel_hint(request.node) // local_len * meta_val(request.node).dtype.itemsize
        moved = (layout.world - 1) * total
        return Cost("all_gather one total per row | bw all_gather", moved // meta_val(request.node).dtype.itemsize,
                    moved, len(layout.preceding_ranks(rank)) * total, moved)


SCAN = register_transport(ScanTransport())
