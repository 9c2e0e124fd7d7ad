"""Halo: the positions just before (and after) each of this rank's ranges, from as many ranks as they span.

Serves causal convolutions (``(k - 1) * dilation`` rows replace the left pad), causal sliding-window
attention (``window - 1`` rows of K/V) and two-sided windows (an encoder's local attention: rows from both
sides, ``[halo, range, after]``). Exactly the needed rows move, in one ``all_to_all`` with exact
split sizes (:meth:`Layout.halo_sources`); rows a rank holds itself (a balanced layout's tail range follows
its head on the middle rank) are copied, and positions outside the sequence are zeros. The counts are
computed at run time from the concrete local length, so one graph serves every length. With two ranges per
rank the halo is ``[halo, head, halo, tail]``: a convolution then drops the outputs that straddle the
two (:func:`drop_seams`) and attention masks every key outside a query's own range.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.fx

from ..graph.analysis import bind_args, meta_val, numel_hint
from ..layout import CONTIGUOUS, KINDS, Layout, chunk_len
from .base import Cost, Transport, gradient_by, register_transport
from .collectives import assemble, exchange, return_rows
from .masks import metadata_gather_op  # noqa: F401  (registers cp_passes::metadata_gather)

aten = torch.ops.aten


@functools.lru_cache(maxsize=256)
def _plans(world: int, kind: str, halo: int, local_len: int, after: int = 0) -> tuple:
    """Every rank's :meth:`Layout.halo_sources`: the same on every rank, computed once per length."""
    layout = Layout(world, kind)
    return tuple(tuple(tuple(pieces) for pieces in layout.halo_sources(halo, r, local_len, after))
                 for r in range(world))


def _placed(pieces: tuple, halo: int, size: int) -> list[tuple[int | None, int, int, int]]:
    """``(owner, row, rows, offset)``: where each source piece of one range lands in its segment ``[halo rows,
    the range's size rows, the rows after]`` (after any left padding)."""
    placed, at = [], 0
    for owner, row, n in pieces:
        placed.append((owner, row, n, at if at < halo else at + size))
        at += n
    return placed


@torch.library.custom_op("cp_passes::halo", mutates_args=())
def halo_op(x: torch.Tensor, dim: int, halo: int, left_padding: int, rank: int, world: int,
            group_name: str, kind: str = CONTIGUOUS, after: int = 0) -> torch.Tensor:
    """For each of this rank's ranges (one, or two in a balanced layout), ``[left_padding zeros, the halo
    positions before it, its rows, the after positions after it]`` along ``dim``; positions outside the
    sequence are zeros."""
    dim = dim % x.dim()
    rows = x.movedim(dim, 0)
    local_len = rows.shape[0]
    plans = _plans(world, kind, halo, local_len, after)
    received = exchange(rows, plans, rank, world, group_name)
    pieces = []
    size = local_len // len(plans[rank])
    for i, sources in enumerate(plans[rank]):
        if left_padding:
            pieces.append(rows.new_zeros((left_padding, *rows.shape[1:])))
        before = [(owner, row, n) for owner, row, n, at in _placed(sources, halo, size) if at < halo]
        pieces += assemble(rows, before, received, plans, rank)
        pieces.append(rows.narrow(0, i * size, size))
        pieces += assemble(rows, sources[len(before):], received, plans, rank)
    return torch.cat(pieces).movedim(0, dim).contiguous()


@halo_op.register_fake
def _(x, dim, halo, left_padding, rank, world, group_name, kind=CONTIGUOUS, after=0):
    shape = list(x.shape)
    shape[dim % x.dim()] += Layout(world, kind).chunks * (left_padding + halo + after)
    return x.new_empty(shape)


@torch.library.custom_op("cp_passes::halo_backward", mutates_args=())
def halo_backward_op(grad: torch.Tensor, dim: int, halo: int, left_padding: int, rank: int, world: int,
                     group_name: str, kind: str = CONTIGUOUS, after: int = 0) -> torch.Tensor:
    """The gradient of :func:`halo_op`: each halo row's gradient returns to the rank that holds the row."""
    dim = dim % grad.dim()
    rows = grad.movedim(dim, 0)
    chunks = Layout(world, kind).chunks
    local_len = rows.shape[0] - chunks * (left_padding + halo + after)
    size = local_len // chunks
    plans = _plans(world, kind, halo, local_len, after)
    segment = left_padding + halo + size + after
    out = torch.cat([rows.narrow(0, i * segment + left_padding + halo, size) for i in range(chunks)])
    back = {q: [] for q in range(world)}
    for i, sources in enumerate(plans[rank]):
        for owner, row, n, at in _placed(sources, halo, size):
            at += i * segment + left_padding
            if owner == rank:
                out.narrow(0, row, n).add_(rows.narrow(0, at, n))
            elif owner is not None:
                back[owner].append((row, rows.narrow(0, at, n)))
    return_rows(back, out, plans, rank, world, group_name)
    return out.movedim(0, dim).contiguous()


@halo_backward_op.register_fake
def _(grad, dim, halo, left_padding, rank, world, group_name, kind=CONTIGUOUS, after=0):
    shape = list(grad.shape)
    shape[dim % grad.dim()] -= Layout(world, kind).chunks * (left_padding + halo + after)
    return grad.new_empty(shape)


gradient_by(halo_op, halo_backward_op)


def drop_seams(out: torch.Tensor, dim: int, halo: int, chunks: int) -> torch.Tensor:
    """A stencil's output over a halo of several ranges (``[halo, range, halo, range]``, each output reading
    ``halo`` rows before it) without the ``halo`` outputs that straddle two ranges."""
    shape = list(out.shape)
    shape[dim] -= (chunks - 1) * halo  # the local length, not chunks * (length // chunks)
    size = chunk_len(shape[dim], chunks)
    return torch.cat([out.narrow(dim, i * (size + halo), size) for i in range(chunks)], dim).reshape(shape)


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
    layouts = KINDS
    runtime = (torch.ops.cp_passes.halo.default, torch.ops.cp_passes.metadata_gather.default)

    def apply(self, edit, request) -> None:
        if isinstance(request, ConvHalo):
            return self._conv(edit, request)
        from .attention import AttentionKV, rewrite_attention

        assert isinstance(request, AttentionKV), request
        rewrite_attention(edit, request, lambda x, name: self.insert(edit, x, request.dim, request.keys.halo,
                                                                     f"{name}_halo", left_padding=request.left_padding,
                                                                     after=request.keys.after))

    def insert(self, edit, x, dim: int, halo: int, name: str, before=None, left_padding: int = 0,
               after: int = 0) -> torch.fx.Node:
        return edit.insert(torch.ops.cp_passes.halo.default,
                           (x, dim, halo, left_padding, edit.rank, edit.world, edit.group_name, edit.layout.kind)
                           + ((after,) if after else ()), name=name, before=before)

    def _conv(self, edit, match: ConvHalo) -> None:
        node = match.conv
        halo = self.insert(edit, edit.current(match.source), match.dim, match.halo, "cp_conv_halo",
                           before=match.pad or node)
        chunks = edit.layout.chunks
        if match.pad is not None:  # its users are the pattern's own (the conv, or slices before an unfold)
            if chunks > 1 and node.target is aten.unfold.default:  # the slices between keep every position
                node.args = (halo, *node.args[1:])
            edit.replace_uses(match.pad, halo, keep_claimed=False)
        else:
            args = bind_args(node)
            args["input"], args["padding"] = halo, [0]
            node.args, node.kwargs = (), args
            edit.replace_uses(match.slice, node)
        if chunks > 1:  # each range read its own halo: the outputs between ranges go
            seamless = edit.insert(drop_seams, (node, match.dim, match.halo, chunks), name="cp_conv_seams",
                                   before=node.next)
            edit.replace_uses(node, seamless)
        edit.changed(node)

    def cost(self, request, layout, rank, local_len) -> Cost:
        if isinstance(request, ConvHalo):
            halo, after, row, what = request.halo, 0, row_bytes(request.source, local_len), f"{request.halo} rows"
            itemsize = meta_val(request.source).dtype.itemsize
        else:
            halo, after = request.keys.halo, request.keys.after
            what = f"{halo} rows" + (f" before and {after} after" if after else "") + f" of {request.kv_label}"
            row, itemsize = request.row_bytes(local_len), request.itemsize
        send, recv, _ = layout.halo_counts(halo, rank, local_len, after)
        cost = Cost(f"all_to_all {what} | bw all_to_all", sum(recv) * row // itemsize, sum(recv) * row,
                    sum(recv) * row, sum(send) * row)
        return cost if isinstance(request, ConvHalo) else cost + request.metadata_cost(layout.world)


HALO = register_transport(Halo())
