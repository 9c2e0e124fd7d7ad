"""Reductions: a mean over the sequence becomes this rank's sum over the global count.

``loss(reduction=mean)`` -> ``loss(reduction=sum) / global_count``: a per-rank partial sum whose ranks add
up to the single-device mean, so the summed gradients match too. The count is one all-reduce, no autograd.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from ..graph.analysis import bind_args
from .base import Cost, Transport, register_transport
from .collectives import all_reduce_sum

aten = torch.ops.aten


@torch.library.custom_op("cp_passes::global_count", mutates_args=())
def global_count_op(target: torch.Tensor, ignore_index: int | None, group_name: str) -> torch.Tensor:
    """How many targets all ranks hold (those ``!= ignore_index`` when given): a global mean's denominator."""
    target = target.detach()
    local = (target != ignore_index) if ignore_index is not None else torch.ones_like(target, dtype=torch.bool)
    return all_reduce_sum(local.sum(dtype=torch.int64), group_name)


@global_count_op.register_fake
def _(target, ignore_index, group_name):
    return target.new_empty((), dtype=torch.int64)


@dataclass
class GlobalMean:
    """A loss with ``reduction="mean"`` over sequence-sharded targets (argument ``target_name``)."""

    node: torch.fx.Node
    target_name: str
    ignore_index: int | None


class Reductions(Transport):
    name = "reductions"
    order = 40
    runtime = (torch.ops.cp_passes.global_count.default,)

    def apply(self, edit, request: GlobalMean) -> None:
        node = request.node
        args = bind_args(node)
        args["reduction"] = 2
        node.args, node.kwargs = (), args
        edit.changed(node)
        count = edit.insert(torch.ops.cp_passes.global_count.default,
                            (args[request.target_name], request.ignore_index, edit.group_name),
                            name="cp_global_count", before=node.next)
        mean = edit.insert(aten.div.Tensor, (node, count), name="cp_global_mean", before=count.next)
        edit.replace_uses(node, mean)

    def cost(self, request, layout, rank, local_len) -> Cost:
        moved = 8 * (layout.world - 1)
        return Cost("all_reduce of one count (no autograd)", 1, moved, moved, moved)


REDUCTIONS = register_transport(Reductions())
