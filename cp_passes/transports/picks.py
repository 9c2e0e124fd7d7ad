"""Picks: rows of the sequence read by their global position, and the position of a sequence's max or min.

``hidden[:, -1]`` (last-token pooling), ``hidden[:, 0]`` (a CLS token), ``logits[rows, last]`` with ``last`` a
whole index tensor (transformers' sequence-classification pick of the last non-padding token) and ``gather`` or
``index_select`` along the sequence by a whole index read rows by their global position. The rank that holds a
row gives it and the others zeros, and one all-reduce gives every rank the whole pick (backward: the gradient
all-reduced, which the owner's row takes). An ``argmax`` or ``argmin`` of integer or boolean values along the
sequence is the single device's: the ranks' best values all-reduced, then the smallest global position that
holds the best (two all-reduces of one integer a row, no autograd).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from ..graph.analysis import meta_val, numel_hint
from ..layout import KINDS, Layout
from .base import Cost, Transport, register_transport
from .reductions import global_extreme_op, global_sum_op

aten = torch.ops.aten


def held_rows(position: torch.Tensor, local_len, rank: int, world: int, kind: str):
    """For global positions (negative ones count from the end, as an index does): ``(local row, held)``, the
    row of rank ``rank`` that holds each (0 where it holds none) and whether it holds it."""
    layout = Layout(world, kind)
    size = layout.chunk_len(local_len)
    position = torch.where(position < 0, position + layout.global_len(local_len), position)
    chunk = torch.div(position, size, rounding_mode="floor")
    local, held = torch.zeros_like(position), torch.zeros_like(position, dtype=torch.bool)
    for offset, c in enumerate(layout.chunk_indices(rank)):
        here = chunk == c
        local = torch.where(here, position - c * size + offset * size, local)
        held = held | here
    return local, held


def _whole(local: torch.Tensor, held: torch.Tensor, group_name: str) -> torch.Tensor:
    """The held rows' values on every rank: the others' zeros added to the owner's row."""
    return global_sum_op(torch.where(held, local, torch.zeros((), dtype=local.dtype, device=local.device)),
                         group_name)


def pick_index(x: torch.Tensor, indices: list, dim: int, rank: int, world: int, kind: str,
               group_name: str) -> torch.Tensor:
    """``x[indices]`` where ``indices[dim]`` holds global positions along ``x``'s sequence dim ``dim``."""
    local, held = held_rows(indices[dim].to(torch.int64), x.shape[dim], rank, world, kind)
    indices = list(indices)
    indices[dim] = torch.where(held, local, 0)
    out = aten.index.Tensor(x, indices)
    picked = [d for d, i in enumerate(indices) if i is not None]
    shape = torch.broadcast_shapes(*(i.shape for i in indices if i is not None))
    lead = picked[0] if picked == list(range(picked[0], picked[-1] + 1)) else 0  # where advanced indexing puts them
    held = held.expand(shape).reshape((1,) * lead + tuple(shape) + (1,) * (out.dim() - lead - len(shape)))
    return _whole(out, held, group_name)


def pick_select(x: torch.Tensor, dim: int, index: int, rank: int, world: int, kind: str,
                group_name: str) -> torch.Tensor:
    """``x.select(dim, index)`` along ``x``'s sequence dim ``dim`` (a negative index counts from the global end)."""
    position = torch.full((), index, dtype=torch.int64, device=x.device)
    return pick_index(x, [None] * dim + [position], dim, rank, world, kind, group_name)


def pick_gather(x: torch.Tensor, dim: int, index: torch.Tensor, rank: int, world: int, kind: str,
                group_name: str) -> torch.Tensor:
    """``x.gather(dim, index)`` with global positions in ``index`` along ``x``'s sequence dim ``dim``."""
    local, held = held_rows(index.to(torch.int64), x.shape[dim], rank, world, kind)
    return _whole(x.gather(dim, torch.where(held, local, 0)), held, group_name)


def pick_index_select(x: torch.Tensor, dim: int, index: torch.Tensor, rank: int, world: int, kind: str,
                      group_name: str) -> torch.Tensor:
    """``x.index_select(dim, index)`` with global positions in ``index`` along ``x``'s sequence dim ``dim``."""
    return pick_index(x, [None] * dim + [index], dim, rank, world, kind, group_name)


def global_arg_extreme(x: torch.Tensor, dim: int, keepdim: bool, op: str, rank: int, world: int, kind: str,
                       group_name: str) -> torch.Tensor:
    """``x.argmax(dim)`` (``op="max"``) or ``argmin`` along the sequence dim ``dim`` as one device computes it:
    the first global position that holds the best value."""
    values, rows = (torch.max if op == "max" else torch.min)(x.to(torch.int64), dim, keepdim=True)
    layout = Layout(world, kind)
    found = layout.positions(rank, x.shape[dim], x.device)[rows]
    best = global_extreme_op(values, op, group_name)
    found = global_extreme_op(torch.where(values == best, found, layout.global_len(x.shape[dim])), "min", group_name)
    return found if keepdim else found.squeeze(dim)


@dataclass
class Pick:
    """``node`` reads rows of ``x`` along its sequence dim ``dim`` by global position: ``kind`` "index" (the index
    tensor at ``indices[dim]``), "select" (the constant ``index``), "gather" or "index_select"."""

    node: torch.fx.Node
    x: torch.fx.Node
    dim: int
    kind: str
    index: int = 0

    @property
    def from_end(self) -> bool:
        """Whether the pick may count from the end of the sequence (then it reads the padding shard_batch adds):
        a negative constant, or an index tensor (whose negative entries count from the end)."""
        return self.kind != "select" or self.index < 0


@dataclass
class GlobalArgExtreme:
    """``node`` is an argmax (``op="max"``) or argmin of integer or boolean values along the sequence dim ``dim``."""

    node: torch.fx.Node
    dim: int
    keepdim: bool
    op: str


class Picks(Transport):
    name = "picks"
    order = 42
    layouts = KINDS
    runtime = (torch.ops.cp_passes.global_sum.default, torch.ops.cp_passes.global_extreme.default)

    def apply(self, edit, request: Pick | GlobalArgExtreme) -> None:
        node = request.node
        layout = (edit.rank, edit.world, edit.layout.kind, edit.group_name)
        if isinstance(request, GlobalArgExtreme):
            args = (edit.current(node.args[0]), request.dim, request.keepdim, request.op, *layout)
            new = edit.insert(global_arg_extreme, args, name=f"cp_global_arg{request.op}", before=node)
        else:
            x = edit.current(request.x)
            if request.kind == "select":
                args = (x, request.dim, request.index, *layout)
                new = edit.insert(pick_select, args, name="cp_pick_select", before=node)
            elif request.kind == "index":
                indices = [edit.current(i) if isinstance(i, torch.fx.Node) else i for i in node.args[1]]
                new = edit.insert(pick_index, (x, indices, request.dim, *layout), name="cp_pick_index", before=node)
            else:
                fn = pick_gather if request.kind == "gather" else pick_index_select
                index = edit.current(node.args[2])
                new = edit.insert(fn, (x, request.dim, index, *layout), name=f"cp_pick_{request.kind}", before=node)
        edit.replace_uses(node, new)

    def cost(self, request, layout, rank, local_len) -> Cost:
        rows = numel_hint(request.node)
        if isinstance(request, GlobalArgExtreme):
            moved = 2 * 8 * rows * (layout.world - 1)
            return Cost("2 all_reduce (max or min) of one position a row (no autograd)", 2 * rows, moved, moved,
                        moved, moved)
        moved = rows * meta_val(request.node).dtype.itemsize * (layout.world - 1)
        return Cost("all_reduce of the picked rows, zeros where another rank holds them (backward: all_reduce)",
                    rows, moved, moved // (layout.world - 1) if layout.world > 1 else 0, moved, 0)


PICKS = register_transport(Picks())
