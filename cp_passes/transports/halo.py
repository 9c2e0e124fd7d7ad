"""Halo: the positions just before (and after) each of this rank's ranges, from as many ranks as they span.

Serves causal convolutions (``(k - 1) * dilation`` rows replace the left pad), causal sliding-window
attention (``window - 1`` rows of K/V, moved by the key mover :mod:`.key_move` through :mod:`.attention`) and
two-sided windows (an encoder's local attention: rows from both sides, ``[halo, range, after]``). The rows move
in one ``all_to_all`` (:func:`~.halo_exchange.halo_op`). With two ranges per rank the halo is ``[halo, head,
halo, tail]``: a convolution then drops the outputs that straddle the two (:func:`drop_seams`) and attention
masks every key outside a query's own range.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from ..graph.analysis import bind_args, meta_val, numel_hint
from ..layout import KINDS, chunk_len
from .attention import AttentionKV, attention_cost, rewrite_attention
from .base import Cost, Transport, register_transport
from .halo_exchange import halo_op  # noqa: F401  (registers cp_passes::halo)
from .key_move import runtime as key_movers_runtime

aten = torch.ops.aten


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

    @property
    def runtime(self) -> tuple:
        return key_movers_runtime()

    def apply(self, edit, request: ConvHalo | AttentionKV) -> None:
        if isinstance(request, AttentionKV):
            return rewrite_attention(edit, request)
        return self._conv(edit, request)

    def _conv(self, edit, match: ConvHalo) -> None:
        node = match.conv
        halo = edit.insert(torch.ops.cp_passes.halo.default,
                           (edit.current(match.source), match.dim, match.halo, 0, edit.rank, edit.world,
                            edit.group_name, edit.layout.kind), name="cp_conv_halo", before=match.pad or node)
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

    def cost(self, request: ConvHalo | AttentionKV, layout, rank, local_len) -> Cost:
        if isinstance(request, AttentionKV):
            return attention_cost(request, layout, rank, local_len)
        row, itemsize = row_bytes(request.source, local_len), meta_val(request.source).dtype.itemsize
        send, recv, _ = layout.halo_counts(request.halo, rank, local_len)
        moved = sum(recv) * row
        return Cost(f"all_to_all {request.halo} rows | bw all_to_all", moved // itemsize, moved, moved, sum(send) * row)


HALO = register_transport(Halo())
