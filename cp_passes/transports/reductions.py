"""Reductions: a mean over the sequence becomes this rank's sum over the global count, and a count that a
non-linear op reads becomes the global count.

``loss(reduction=mean)`` -> ``loss(reduction=sum) / global_count``: a per-rank partial sum whose ranks add
up to the single-device mean, so the summed gradients match too. The count is one all-reduce, no autograd.
An integer partial sum (how many image tokens a mask holds) that an op reads other than linearly (a count
check's comparison) is all-reduced first (no autograd: integers carry no gradient), so that op sees the
single-device value; so is the length of ``x[mask]`` when only that length is read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from ..graph.analysis import bind_args, meta_val, numel_hint
from ..layout import KINDS
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


@torch.library.custom_op("cp_passes::global_sum", mutates_args=())
def global_sum_op(partial: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum over ranks of an integer per-rank partial sum."""
    return all_reduce_sum(partial.clone(), group_name)


@global_sum_op.register_fake
def _(partial, group_name):
    return torch.empty_like(partial)


@dataclass
class GlobalSum:
    """``node`` reads the integer partial sums ``partial`` non-linearly: it reads their global values instead."""

    node: torch.fx.Node
    partial: list[torch.fx.Node]


@dataclass
class MaskedCount:
    """``node = x[mask]``, only measured: it is replaced by an empty tensor of the global count's length
    (times the trailing sizes ``rest``)."""

    node: torch.fx.Node
    x: torch.fx.Node
    mask: torch.fx.Node
    rest: tuple[int, ...]


class Reductions(Transport):
    name = "reductions"
    order = 40
    layouts = KINDS  # sums over ranks: the order of positions does not matter
    runtime = (torch.ops.cp_passes.global_count.default, torch.ops.cp_passes.global_sum.default)

    def apply(self, edit, request: GlobalMean | GlobalSum | MaskedCount) -> None:
        node = request.node
        if isinstance(request, MaskedCount):
            local = edit.insert(aten.sum.dim_IntList, (edit.current(request.mask), None), {"dtype": torch.int64},
                                name="cp_masked_count")
            total = edit.insert(torch.ops.cp_passes.global_sum.default, (local, edit.group_name),
                                name="cp_global_masked_count")
            count = edit.insert(aten._local_scalar_dense.default, (total,), name="cp_global_masked_count_value")
            sized = edit.insert(aten.new_empty.default, (request.x, [count, *request.rest]), name="cp_masked_sized")
            edit.replace_uses(node, sized)
            return
        if isinstance(request, GlobalSum):
            for i, partial in enumerate(map(edit.current, request.partial)):
                total = edit.insert(torch.ops.cp_passes.global_sum.default, (partial, edit.group_name),
                                    name=f"cp_global_sum_{i}")
                node.replace_input_with(partial, total)
            edit.changed(node)
            return
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
        if isinstance(request, MaskedCount):
            moved = 8 * (layout.world - 1)
            return Cost("all_reduce of one count (no autograd)", 1, moved, moved, moved, moved)
        if isinstance(request, GlobalSum):
            elements = sum(numel_hint(p) for p in request.partial)
            moved = sum(numel_hint(p) * meta_val(p).dtype.itemsize for p in request.partial) * (layout.world - 1)
            return Cost("all_reduce of integer partial sums (no autograd)", elements, moved, moved, moved, moved)
        moved = 8 * (layout.world - 1)
        return Cost("all_reduce of one count (no autograd)", 1, moved, moved, moved, moved)


REDUCTIONS = register_transport(Reductions())
