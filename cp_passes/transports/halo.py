"""Halo: the positions just before this rank's shard, from as many preceding ranks as they span.

Serves causal convolutions (``(k - 1) * dilation`` rows replace the left pad) and sliding-window
attention (``window - 1`` rows of K/V). Exactly the needed rows move, in one ``all_to_all`` with exact
split sizes (:meth:`Layout.halo_counts`); positions before the sequence start are zeros. The counts are
computed at run time from the concrete local length, so one graph serves every length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from ..graph.analysis import bind_args, meta_val, numel_hint
from ..layout import Layout
from .base import Cost, Transport, gradient_by, register_transport
from .collectives import all_to_all
from .masks import metadata_gather_op  # noqa: F401  (registers cp_passes::metadata_gather)


def _halo_rows(x: torch.Tensor, dim: int, halo: int, rank: int, world: int, group_name: str) -> list[torch.Tensor]:
    local_len = x.shape[dim]
    send, recv, zeros = Layout(world).halo_counts(halo, rank, local_len)
    pieces = []
    if zeros:
        shape = list(x.shape)
        shape[dim] = zeros
        pieces.append(x.new_zeros(shape))
    if world > 1 and halo > 0:  # every rank takes part: each sends or receives something
        rows = x.movedim(dim, 0)
        buffer = torch.cat([rows.narrow(0, local_len - c, c) for c in send], dim=0)
        pieces.append(all_to_all(buffer, recv, send, group_name).movedim(0, dim))
    return pieces


@torch.library.custom_op("cp_passes::halo", mutates_args=())
def halo_op(x: torch.Tensor, dim: int, halo: int, left_padding: int, rank: int, world: int,
            group_name: str) -> torch.Tensor:
    """``[left_padding zeros, the halo positions before this shard, x]`` along ``dim``."""
    dim = dim % x.dim()
    pieces = _halo_rows(x, dim, halo, rank, world, group_name)
    if left_padding:
        shape = list(x.shape)
        shape[dim] = left_padding
        pieces.insert(0, x.new_zeros(shape))
    return torch.cat(pieces + [x], dim=dim)


@halo_op.register_fake
def _(x, dim, halo, left_padding, rank, world, group_name):
    shape = list(x.shape)
    shape[dim % x.dim()] += left_padding + halo
    return x.new_empty(shape)


@torch.library.custom_op("cp_passes::halo_backward", mutates_args=())
def halo_backward_op(grad: torch.Tensor, dim: int, halo: int, left_padding: int, rank: int, world: int,
                     group_name: str) -> torch.Tensor:
    """The gradient of :func:`halo_op`: each halo row's gradient returns to the rank that sent the row."""
    dim = dim % grad.dim()
    local_len = grad.shape[dim] - left_padding - halo
    out = grad.narrow(dim, left_padding + halo, local_len).clone()
    if world > 1 and halo > 0:
        send, recv, zeros = Layout(world).halo_counts(halo, rank, local_len)
        rows = grad.movedim(dim, 0)
        back = rows.narrow(0, left_padding + zeros, sum(recv))  # the rows this rank received, in rank order
        returned = all_to_all(back, send, recv, group_name)  # the gradient of the rows this rank sent
        target, offset = out.movedim(dim, 0), 0
        for count in send:
            target.narrow(0, local_len - count, count).add_(returned.narrow(0, offset, count))
            offset += count
    return out


@halo_backward_op.register_fake
def _(grad, dim, halo, left_padding, rank, world, group_name):
    shape = list(grad.shape)
    shape[dim % grad.dim()] -= left_padding + halo
    return grad.new_empty(shape)


gradient_by(halo_op, halo_backward_op)


@dataclass
class ConvHalo:
    """A causal convolution: ``conv(pad(x, (halo, 0)))`` (``pad`` set) or ``conv(x, padding=halo)[..., :s]``
    (``slice`` set); or a causal window ``pad(x, (halo, 0)).unfold(dim, halo + 1, 1)`` (``conv`` is the
    unfold). The halo replaces the left pad."""

    conv: torch.fx.Node
    source: torch.fx.Node
    halo: int
    pad: torch.fx.Node | None = None
    slice: torch.fx.Node | None = None
    dim: int = 2
    """The sequence dim of ``source``."""


def row_bytes(node: torch.fx.Node, local_len: int) -> int:
    return numel_hint(node) // local_len * meta_val(node).dtype.itemsize


class Halo(Transport):
    name = "halo"
    order = 20
    runtime = (torch.ops.cp_passes.halo.default, torch.ops.cp_passes.metadata_gather.default)

    def apply(self, edit, request) -> None:
        if isinstance(request, ConvHalo):
            return self._conv(edit, request)
        from .attention import AttentionKV, rewrite_attention

        assert isinstance(request, AttentionKV), request
        rewrite_attention(edit, request, lambda x, name: self.insert(edit, x, request.dim, request.window - 1,
                                                                     f"{name}_halo", left_padding=request.left_padding))

    def insert(self, edit, x, dim: int, halo: int, name: str, before=None, left_padding: int = 0) -> torch.fx.Node:
        return edit.insert(torch.ops.cp_passes.halo.default,
                           (x, dim, halo, left_padding, edit.rank, edit.world, edit.group_name), name=name,
                           before=before)

    def _conv(self, edit, match: ConvHalo) -> None:
        node = match.conv
        halo = self.insert(edit, edit.current(match.source), match.dim, match.halo, "cp_conv_halo",
                           before=match.pad or node)
        if match.pad is not None:  # its users are the pattern's own (the conv, or slices before an unfold)
            edit.replace_uses(match.pad, halo, keep_claimed=False)
        else:
            args = bind_args(node)
            args["input"], args["padding"] = halo, [0]
            node.args, node.kwargs = (), args
            edit.replace_uses(match.slice, node)
        edit.changed(node)

    def cost(self, request, layout, rank, local_len) -> Cost:
        if isinstance(request, ConvHalo):
            halo, row, what = request.halo, row_bytes(request.source, local_len), f"{request.halo} rows"
            itemsize = meta_val(request.source).dtype.itemsize
        else:
            halo, what = request.window - 1, f"{request.window - 1} rows of {request.kv_label}"
            row, itemsize = request.row_bytes(local_len), request.itemsize
        send, recv, _ = layout.halo_counts(halo, rank, local_len)
        cost = Cost(f"all_to_all {what} | bw all_to_all", sum(recv) * row // itemsize, sum(recv) * row,
                    (halo - layout.leading_zeros(halo, rank, local_len)) * row, sum(send) * row)
        return cost if isinstance(request, ConvHalo) else cost + request.metadata_cost(layout.world)


HALO = register_transport(Halo())
