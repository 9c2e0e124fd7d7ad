"""Splice: features every rank holds whole, scattered into the sequence where a sharded mask says.

``masked_scatter(x, mask, source)`` fills the masked positions of ``x`` with ``source``'s elements in
order: a vision-language model splices its image features into the token embeddings this way. On a shard,
the model's call would start from ``source``'s first element on every rank. The element at a masked
local position is the one whose index counts the masked elements before it in the whole batch's row-major
order: those of the earlier rows (all ranks), of the same row on the preceding ranks, and of this rank's
row before it. Each rank's per-row counts are all-gathered (one ``[batch]`` integer vector a rank, no
autograd: an exclusive scan over ranks), the features are read at those indices, and the gradient flows
back to them through the read, so each rank's feature gradients cover its own positions and add up over
ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from ..graph.analysis import meta_val
from ..layout import CONTIGUOUS, KINDS, Layout
from .base import Cost, Transport, register_transport
from .gathers import metadata_gather_op  # noqa: F401  (registers cp_passes::metadata_gather)

aten = torch.ops.aten


@dataclass
class Splice:
    """``node = masked_scatter(x, mask, source)`` with ``x`` and ``mask`` sharded along dim 1 (after
    broadcasting, ``[batch, seq, ...]``) and ``source`` whole on every rank."""

    node: torch.fx.Node
    x: torch.fx.Node
    mask: torch.fx.Node
    source: torch.fx.Node


def row_counts(x: torch.Tensor, mask: torch.Tensor, chunks: int = 1) -> torch.Tensor:
    """``[chunks, batch]``: how many elements of each local row the (broadcast) mask selects in each of the
    rank's ranges."""
    return mask.expand(x.shape).reshape(x.shape[0], chunks, -1).sum(2, dtype=torch.int64).t()


def spliced(x: torch.Tensor, mask: torch.Tensor, source: torch.Tensor, counts: torch.Tensor, rank: int,
            world: int, kind: str = CONTIGUOUS) -> torch.Tensor:
    """``masked_scatter`` on this rank's rows as on the whole sequence, given every range's ``counts``
    (``[ranges of the gather, batch]``, from :func:`row_counts`)."""
    rows, layout = x.shape[0], Layout(world, kind)
    selected = mask.expand(x.shape).reshape(rows, layout.chunks, -1)  # a range's elements are contiguous
    totals = counts.sum(0)
    preceding = torch.tensor(layout.preceding_chunks(rank), dtype=torch.bool, device=counts.device)
    before = torch.where(preceding[:, :, None], counts[None], 0).sum(1)  # [chunks, batch]
    first = (totals.cumsum(0) - totals)[None, :] + before
    index = (first.t().unsqueeze(2) + selected.cumsum(2, dtype=torch.int64) - 1).reshape(rows, -1)
    selected = selected.reshape(rows, -1)
    flat = source.reshape(-1)
    torch._assert_async(totals.sum() <= flat.numel(),
                        "masked_scatter: number of elements of source < number of ones in mask")
    # Unmasked elements read any element and drop it: one more element keeps an empty source readable.
    padded = torch.cat([flat, flat.new_zeros(1)])
    read = padded[index.clamp(0, flat.numel())]
    return torch.where(selected, read, x.reshape(rows, -1)).view(x.shape)


class SpliceTransport(Transport):
    name = "splice"
    order = 26
    layouts = KINDS
    runtime = (torch.ops.cp_passes.metadata_gather.default,)

    def apply(self, edit, request: Splice) -> None:
        node, x, mask, source = request.node, edit.current(request.x), edit.current(request.mask), request.source
        local = edit.insert(row_counts, (x, mask, edit.layout.chunks), name="cp_splice_counts")
        counts = edit.insert(torch.ops.cp_passes.metadata_gather.default, (local, 0, edit.world, edit.group_name),
                             name="cp_splice_all_counts")
        out = edit.insert(spliced, (x, mask, source, counts, edit.rank, edit.world, edit.layout.kind),
                          name="cp_spliced")
        edit.replace_uses(node, out)

    def cost(self, request: Splice, layout, rank, local_len) -> Cost:
        """The bound: per row, the count over the preceding ranks (none on the first) and, after the first row,
        the count over the earlier rows."""
        rows = meta_val(request.x).shape[0]
        moved = 8 * rows * layout.chunks * (layout.world - 1)
        before = any(any(column) for column in layout.preceding_chunks(rank))
        needed = 8 * (rows - 1) * (layout.world > 1) + 8 * rows * before
        return Cost("all_gather of per-range, per-row counts (no autograd)", rows * layout.chunks * (layout.world - 1),
                    moved, needed, moved, moved)


SPLICE = register_transport(SpliceTransport())
