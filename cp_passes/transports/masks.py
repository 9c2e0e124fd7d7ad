"""The key side of attention after a transport: masks at the rank's global positions, and metadata.

The mask functions are traced into the graph (ATen); the positions of queries and keys come from the
:class:`~cp_passes.layout.Layout`, so they hold for any layout and add no guards on the local length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from ..graph.analysis import SHAPE_ONLY, meta_val, numel_hint
from ..key_plan import Move, outside, outside_band_counts
from ..layout import Layout


@dataclass
class MetadataMask:
    """An attention mask the model builds from sequence metadata (doc ids, position ids) as well as
    positions: ``nodes`` compute ``mask`` from ``tensor_leaves`` (sharded inputs, or activations of a mask
    computed without gradient: gathered), ``size_leaves`` (lengths, made global) and ``inputs`` (what every
    rank holds whole: parameters, read as they are)."""

    mask: torch.fx.Node
    nodes: list[torch.fx.Node]
    tensor_leaves: list[torch.fx.Node]
    size_leaves: list[torch.fx.Node]
    leaf_dims: list[int]
    inputs: list[torch.fx.Node] = field(default_factory=list)
    learned: bool = False
    """A bias learned from positions: it carries a gradient back to ``inputs`` (parameters), which are read with
    their autograd edges."""

    def shape_only(self, leaf: torch.fx.Node) -> bool:
        """Whether the mask reads only ``leaf``'s shape, dtype and device (``x.new_full(...)``): no rows of it
        need to move, a tensor of its global shape stands in."""
        users = [n for n in self.nodes if leaf in n.all_input_nodes]
        return bool(users) and all(n.target in SHAPE_ONLY for n in users)

    @property
    def gathered(self) -> list[torch.fx.Node]:
        """The tensor leaves whose rows move (every rank's)."""
        return [leaf for leaf in self.tensor_leaves if not self.shape_only(leaf)]

    def gathered_bytes(self, world: int) -> int:
        """What one rank receives to evaluate the mask over the whole sequence."""
        return sum(numel_hint(leaf) * meta_val(leaf).dtype.itemsize for leaf in self.gathered) * (world - 1)


def global_shaped(x: torch.Tensor, dim: int, world: int) -> torch.Tensor:
    """A stand-in for a tensor the mask reads only the shape of: uninitialised, ``dim`` ``world`` times as
    long (the whole sequence)."""
    shape = list(x.shape)
    shape[dim % x.dim()] *= world
    return x.new_empty(shape)


def key_positions(local, rank: int, world: int, kind: str, before: int | None, device=None,
                  left_padding: int = 0, causal: bool = True, after: int = 0) -> torch.Tensor:
    """The global positions of the keys a transport brings: with ``before`` (a halo), for each of the rank's
    ranges ``[left_padding rows, before rows, its rows, after rows]`` (negative before the sequence start, -1 for
    a zero row in front or after the end), else the gathered rows a causal query can see (every gathered row when not
    ``causal``)."""
    layout = Layout(world, kind)
    if before is not None:
        return layout.halo_positions(before, rank, local, device, left_padding, after)
    return torch.arange(layout.visible_prefix(rank, local), device=device) if causal \
        else layout.gathered_positions(local, device)


def own_segment(local, world: int, kind: str, before: int, device=None, left_padding: int = 0, after: int = 0):
    """``[local, keys]``: whether each key of a halo (:func:`key_positions`) belongs to the query's own range:
    a query sees keys of its own segment only, so a row two segments share (a window longer than the gap
    between a rank's ranges) counts once. None when the rank holds one range."""
    layout = Layout(world, kind)
    if layout.chunks == 1:
        return None
    keys = layout.halo_segments(before, local, device, left_padding, after)
    return layout.query_segments(local, device)[:, None] == keys[None, :]


def brought_positions(query: torch.Tensor, rank: int, world: int, kind: str, move: str, before: int | None,
                      after: int | None = 0, left_padding: int = 0) -> torch.Tensor:
    """The global position of every key ``move`` (a :class:`~cp_passes.key_plan.Move`) brings: for a halo of
    ``before`` and ``after`` rows, ``[left_padding, before rows, the range, after rows]`` for each of the rank's
    ranges (-1 for a zero row in front, negative before the sequence start); the causal prefix in global order;
    every key in gather order."""
    if move == Move.HALO:
        return key_positions(query.shape[-2], rank, world, kind, before, query.device, left_padding, after=after)
    return key_positions(query.shape[-2], rank, world, kind, None, query.device, causal=move == Move.PREFIX)


def _own_range(query: torch.Tensor, world: int, kind: str, move: str, before: int | None, after: int | None,
               left_padding: int) -> torch.Tensor | None:
    """After a halo of several ranges, whether each key lies in its query's own range (:func:`own_segment`)."""
    if move != Move.HALO:
        return None
    return own_segment(query.shape[-2], world, kind, before, query.device, left_padding, after)


def reach_mask(query: torch.Tensor, rank: int, world: int, kind: str, move: str, before: int | None,
               after: int | None = 0, left_padding: int = 0) -> torch.Tensor:
    """Boolean ``[local_len, keys]`` at the keys ``move`` brought: the key at global position ``k`` is visible to
    the query at ``p`` iff ``-after <= p - k <= before`` (``before`` None: every earlier key), ``k >= 0`` (a
    halo's left padding and rows outside the sequence never are), and, after a halo, the key is in the query's
    own range (:func:`own_segment`)."""
    q_pos = Layout(world, kind).positions(rank, query.shape[-2], query.device)
    k_pos = brought_positions(query, rank, world, kind, move, before, after, left_padding)
    # compared by broadcasting 1-D positions: booleans [local_len, keys], no int64 distance of that size
    visible = (k_pos[None, :] <= (q_pos + (after or 0))[:, None]) & (k_pos >= 0)[None, :]
    if before is not None:
        visible = visible & (k_pos[None, :] >= (q_pos - before)[:, None])
    own = _own_range(query, world, kind, move, before, after, left_padding)
    return visible if own is None else visible & own


def query_positions(query: torch.Tensor, rank: int, world: int, kind: str) -> torch.Tensor:
    """The global position of every local query row."""
    return Layout(world, kind).positions(rank, query.shape[-2], query.device)


def kept_keys(block: torch.Tensor, keys: torch.Tensor, query: torch.Tensor, world: int, kind: str, move: str,
              before: int | None, after: int | None = 0, left_padding: int = 0) -> torch.Tensor:
    """A mask evaluated at this rank's rows and the keys brought (``keys``: their positions, evaluated at 0
    where negative), with the keys outside the sequence hidden and, after a halo, each query's keys kept to its
    own range (:func:`own_segment`)."""
    block = block & (keys >= 0)
    own = _own_range(query, world, kind, move, before, after, left_padding)
    return block if own is None else block & own


def sequence_positions(query: torch.Tensor, world: int) -> torch.Tensor:
    """Every global position of the sequence (``world`` times ``query``'s local length)."""
    return torch.arange(world * query.shape[-2], device=query.device)


def mask_block(global_mask: torch.Tensor, query: torch.Tensor, rank: int, world: int, kind: str, move: str,
               before: int | None, after: int | None = 0, left_padding: int = 0) -> torch.Tensor:
    """This rank's rows of a mask evaluated over the whole sequence, cut to the keys ``move`` brought (columns
    outside the sequence are False). Fails at run time on every rank alike if the model allows a key outside
    the reach ``-after <= i - j <= before`` the keys were planned for (:func:`outside_band_counts`); every key
    brought: nothing lies outside."""
    if before is not None or after is not None:
        n = global_mask.shape[-1]
        every = torch.arange(n, device=global_mask.device)
        counts = outside_band_counts(global_mask.reshape(-1, n, n).any(0), every, every, before, after or 0)
        torch._assert_async(counts[0] == 0, outside(before, after or 0))
    rows = global_mask.index_select(-2, Layout(world, kind).positions(rank, query.shape[-2], query.device))
    k_pos = brought_positions(query, rank, world, kind, move, before, after, left_padding)
    return kept_keys(rows.index_select(-1, k_pos.clamp(min=0)), k_pos, query, world, kind, move, before, after,
                     left_padding)


def first_keys(mask: torch.Tensor, query: torch.Tensor, world: int, kind: str) -> torch.Tensor:
    """``[chunks]``: for each of this rank's ranges, the first key (a global position: the keys are the
    causal prefix in global order) that any of its queries (``query``'s rows) sees in ``mask`` (``[..,
    queries or 1, prefix]``), or the prefix's length where none does. Causal attention needs only the keys
    from there to the range's end."""
    chunks, local, prefix = Layout(world, kind).chunks, query.shape[-2], mask.shape[-1]
    rows = mask.expand(*mask.shape[:-2], local, prefix)
    seen = rows.reshape(-1, chunks, local // chunks, prefix).any(0).any(1)  # [chunks, prefix]
    return torch.where(seen.any(-1), seen.to(torch.int8).argmax(-1), prefix)
