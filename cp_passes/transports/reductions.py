"""Reductions: a mean over the sequence becomes this rank's sum over the global count, and a sum that a
non-linear op reads becomes the global sum.

``loss(reduction=mean)`` -> ``loss(reduction=sum) / global_count``: a per-rank partial sum whose ranks add
up to the single-device mean, so the summed gradients match too. The count is one all-reduce, no autograd.
A partial sum that an op reads other than linearly (a count check's comparison, a router's load-balancing
loss: per-expert token fractions times mean router probabilities) is all-reduced first, so that op sees the
single-device value on every rank; a row count written as the length (``sum / x.shape[0]``) is made the
global count the same way; and the length of ``x[mask]`` when only that length is read. A max, min, any or all
of integer or boolean metadata over the sequence (longrope's ``torch.max(position_ids) + 1``) is this rank's
value reduced over the ranks, no autograd: every rank sees the single-device value.

Gradients follow the objective cp_passes trains: the ranks' shares added, and each value every rank holds
whole counted once. The backward of an all-reduce is the all-reduce of the ranks' gradients; a value every rank
holds whole (a global sum, anything free of the sequence) added to a per-rank share enters as its ``1 / P``
share (:class:`Share`), so that the ranks' losses still add up to the single-device loss; and a whole value the
compiled module returns passes back ``1 / P`` of its gradient on every rank (:class:`WholeOutput`): every rank
runs the backward from it, and the ranks' gradients add up to one device's.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx

from ..graph.analysis import bind_args, meta_val, numel_hint
from ..layout import KINDS
from .base import Cost, Transport, gradient_by, register_transport
from .collectives import all_reduce, all_reduce_sum

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


gradient_by(global_sum_op, global_sum_op)


@torch.library.custom_op("cp_passes::global_length", mutates_args=())
def global_length_op(like: torch.Tensor, local: float, group_name: str) -> torch.Tensor:
    """The sum over ranks of ``local``, a row count each rank computed from its own length (as ``like``'s
    dtype, a 0-dim tensor)."""
    return all_reduce_sum(torch.tensor(local, dtype=like.dtype), group_name)


@global_length_op.register_fake
def _(like, local, group_name):
    return like.new_empty(())


global_length_op.register_autograd(lambda ctx, grad: (None, None, None), setup_context=lambda ctx, inputs, output: None)


@dataclass
class GlobalSum:
    """``node`` reads the partial sums ``partial`` non-linearly: it reads their global values instead, and its
    arguments named in ``lengths`` (row counts from the local length) their global counts."""

    node: torch.fx.Node
    partial: list[torch.fx.Node]
    origin: torch.fx.Node | None = None
    """The op that made the sum (a loss that ignores the padded labels does not read the padding)."""
    lengths: tuple[str, ...] = ()


@dataclass
class Share:
    """``node`` adds whole values (``whole``: argument names) to a per-rank share: each enters as ``1 / P``."""

    node: torch.fx.Node
    whole: tuple[str, ...]


@dataclass
class WholeOutput:
    """``node``, a value every rank holds whole, is returned by the compiled module: every rank runs the backward
    from it, so the gradient it passes back is ``1 / P`` of what it is given and it counts once in the objective."""

    node: torch.fx.Node


@torch.library.custom_op("cp_passes::whole_output", mutates_args=())
def whole_output_op(value: torch.Tensor, world: int) -> torch.Tensor:
    """``value`` as it is; its gradient is ``1 / world`` of the one it is given."""
    return value.clone()


@whole_output_op.register_fake
def _(value, world):
    return torch.empty_like(value)


gradient_by(whole_output_op, lambda grad, world: grad / world)


@torch.library.custom_op("cp_passes::global_extreme", mutates_args=())
def global_extreme_op(local: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
    """The max (``op="max"``) or min over the ranks of an integer or boolean per-rank max, min, any or all."""
    return all_reduce(local.to(torch.int64), op, group_name).to(local.dtype)


@global_extreme_op.register_fake
def _(local, op, group_name):
    return torch.empty_like(local)


@dataclass
class GlobalExtreme:
    """``node`` takes the max or min (``op``; any is a max, all a min) of integer metadata over the sequence: the
    ranks' values are reduced with ``op``."""

    node: torch.fx.Node
    op: str


@dataclass
class MaskedCount:
    """``node = x[mask]``, only measured: it is replaced by an empty tensor of the global count's length
    (times the trailing sizes ``rest``)."""

    node: torch.fx.Node
    x: torch.fx.Node
    mask: torch.fx.Node
    rest: tuple[int, ...]


def _set_argument(node: torch.fx.Node, name: str, value) -> None:
    """Replace ``node``'s argument ``name`` (positional or keyword) with ``value``."""
    schema = node.target._schema
    position = next(i for i, a in enumerate(schema.arguments) if a.name == name)
    if position < len(node.args):
        node.args = node.args[:position] + (value,) + node.args[position + 1:]
    else:
        node.kwargs = {**node.kwargs, name: value}


class Reductions(Transport):
    name = "reductions"
    order = 40
    layouts = KINDS  # sums over ranks: the order of positions does not matter
    runtime = (torch.ops.cp_passes.global_count.default, torch.ops.cp_passes.global_sum.default,
               torch.ops.cp_passes.global_length.default, torch.ops.cp_passes.global_extreme.default)

    def apply(self, edit, request: GlobalMean | GlobalSum | MaskedCount | GlobalExtreme | WholeOutput) -> None:
        node = request.node
        if isinstance(request, WholeOutput):
            (output,) = edit.graph.find_nodes(op="output")
            value = edit.current(node)
            share = edit.insert(torch.ops.cp_passes.whole_output.default, (value, edit.world),
                                name="cp_whole_output", before=output)
            output.replace_input_with(value, share)
            return
        if isinstance(request, GlobalExtreme):
            total = edit.insert(torch.ops.cp_passes.global_extreme.default, (node, request.op, edit.group_name),
                                name=f"cp_global_{request.op}", before=node.next)
            edit.replace_uses(node, total)
            return
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
            like = next((a for a in node.all_input_nodes if isinstance(meta_val(a), torch.Tensor)), None)
            for i, partial in enumerate(map(edit.current, request.partial)):
                total = edit.insert(torch.ops.cp_passes.global_sum.default, (partial, edit.group_name),
                                    name=f"cp_global_sum_{i}")
                node.replace_input_with(partial, total)
            args = bind_args(node)
            for name in request.lengths:
                total = edit.insert(torch.ops.cp_passes.global_length.default, (like, args[name], edit.group_name),
                                    name="cp_global_length")
                _set_argument(node, name, total)
            edit.changed(node)
            return
        if isinstance(request, Share):
            args = bind_args(node)
            for name in request.whole:
                share = edit.insert(aten.div.Tensor if isinstance(args[name], torch.fx.Node) else operator.truediv,
                                    (args[name], edit.world), name="cp_share")
                _set_argument(node, name, share)
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
        if isinstance(request, GlobalExtreme):
            moved = 8 * numel_hint(request.node) * (layout.world - 1)
            return Cost(f"all_reduce {request.op} (no autograd)", numel_hint(request.node), moved, moved, moved,
                        moved)
        if isinstance(request, MaskedCount):
            moved = 8 * (layout.world - 1)
            return Cost("all_reduce of one count (no autograd)", 1, moved, moved, moved, moved)
        if isinstance(request, GlobalSum):
            elements = sum(numel_hint(p) for p in request.partial) + len(request.lengths)
            moved = (sum(numel_hint(p) * meta_val(p).dtype.itemsize for p in request.partial)
                     + 8 * len(request.lengths)) * (layout.world - 1)
            return Cost("all_reduce of partial sums (backward: all_reduce)", elements, moved, moved, moved, moved)
        if isinstance(request, Share):
            return Cost("none: 1 / P of a value every rank holds")
        if isinstance(request, WholeOutput):
            return Cost("none: backward passes 1 / P of the gradient")
        moved = 8 * (layout.world - 1)
        return Cost("all_reduce of one count (no autograd)", 1, moved, moved, moved, moved)


REDUCTIONS = register_transport(Reductions())
