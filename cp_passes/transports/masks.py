"""The key side of attention after a transport: masks at the rank's global positions, and metadata.

The mask functions are traced into the graph (ATen); the positions of queries and keys come from the
:class:`~cp_passes.layout.Layout`, so they hold for any layout and add no guards on the local length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from ..graph.analysis import SHAPE_ONLY, meta_val, numel_hint
from ..key_plan import band, outside
from ..layout import Layout
from .collectives import all_gather


@torch.library.custom_op("cp_passes::metadata_gather", mutates_args=())
def metadata_gather_op(x: torch.Tensor, dim: int, world: int, group_name: str) -> torch.Tensor:
    """All-gather sequence metadata (positions, doc ids) along ``dim``: no autograd edge."""
    dim = dim % x.dim()
    rows = x.movedim(dim, 0)
    if rows.dtype == torch.bool:  # gloo and Inductor's CPU code both handle uint8, not bool (torch 2.13)
        return all_gather(rows.to(torch.uint8), world, group_name).to(torch.bool).movedim(0, dim).contiguous()
    return all_gather(rows, world, group_name).movedim(0, dim).contiguous()


@metadata_gather_op.register_fake
def _(x, dim, world, group_name):
    shape = list(x.shape)
    shape[dim % x.dim()] *= world
    return x.new_empty(shape)


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


def key_positions(local, rank: int, world: int, kind: str, halo: int | None, device=None,
                  left_padding: int = 0, causal: bool = True, after: int = 0) -> torch.Tensor:
    """The global positions of the keys a transport brings: for each of the rank's ranges ``[left_padding
    rows, halo rows, its rows, after rows]`` after a halo (negative before the sequence start, -1 for a zero
    row in front or after the end), else the gathered rows a causal query can see (every gathered row when not
    ``causal``)."""
    layout = Layout(world, kind)
    if halo is not None:
        return layout.halo_positions(halo, rank, local, device, left_padding, after)
    return torch.arange(layout.visible_prefix(rank, local), device=device) if causal \
        else layout.gathered_positions(local, device)


def own_segment(local, world: int, kind: str, halo: int, device=None, left_padding: int = 0, after: int = 0):
    """``[local, keys]``: whether each key of a halo (:func:`key_positions`) belongs to the query's own range:
    a query sees keys of its own segment only, so a row two segments share (a window longer than the gap
    between a rank's ranges) counts once. None when the rank holds one range."""
    layout = Layout(world, kind)
    if layout.chunks == 1:
        return None
    keys = layout.halo_segments(halo, local, device, left_padding, after)
    return layout.query_segments(local, device)[:, None] == keys[None, :]


def brought_positions(query: torch.Tensor, rank: int, world: int, kind: str, window: int | None, halo: bool,
                      left_padding: int = 0, ahead: int = 0) -> torch.Tensor:
    """The global position of every key the transport brings; -1 for a zero row in front of a halo (and, as
    ever, for a halo row outside the sequence)."""
    return key_positions(query.shape[-2], rank, world, kind, window - 1 if halo else None, query.device,
                         left_padding, after=ahead if halo else 0)


def check_envelope(visible: torch.Tensor, before: int | None, after: int = 0) -> None:
    """Fail at run time unless ``visible`` (``[.., n, n]`` over the whole sequence, True: the query sees the
    key) stays inside the envelope :func:`outside` names. Every rank checks the whole mask, so all reach the
    same verdict and none is left waiting in a collective."""
    kept = band(visible.shape[-1], None if before is None else before + 1, visible.device, after)
    torch._assert_async((visible & ~kept).logical_not().all(), outside(before, after))


def causal_mask(query: torch.Tensor, rank: int, world: int, kind: str, window: int | None, halo: bool,
                left_padding: int = 0, ahead: int = 0) -> torch.Tensor:
    """Boolean ``[local_len, keys]``: key at global position ``k`` is visible to the query at ``p`` iff
    ``-ahead <= p - k`` (``< window`` for a sliding window) and ``k >= 0`` (a halo's left padding and rows
    outside the sequence never are), and, after a halo, the key is in the query's own segment
    (:func:`own_segment`). ``ahead`` > 0: a two-sided window."""
    q_pos = Layout(world, kind).positions(rank, query.shape[-2], query.device)
    k_pos = brought_positions(query, rank, world, kind, window, halo, left_padding, ahead)
    # compared by broadcasting 1-D positions: booleans [local_len, keys], no int64 distance of that size
    visible = (k_pos[None, :] <= (q_pos + ahead)[:, None]) & (k_pos >= 0)[None, :]
    if window is not None:
        visible = visible & (k_pos[None, :] > (q_pos - window)[:, None])
    own = own_segment(query.shape[-2], world, kind, window - 1, query.device, left_padding, ahead) if halo else None
    return visible if own is None else visible & own


def query_positions(query: torch.Tensor, rank: int, world: int, kind: str) -> torch.Tensor:
    """The global position of every local query row."""
    return Layout(world, kind).positions(rank, query.shape[-2], query.device)


def visible_key_positions(query: torch.Tensor, rank: int, world: int, kind: str, causal: bool = True) -> torch.Tensor:
    """The global positions of the keys a causal query on ``rank`` can see, in global order (every key's when not
    ``causal``, in gather order)."""
    return key_positions(query.shape[-2], rank, world, kind, None, query.device, causal=causal)


def in_global_order(gathered: torch.Tensor, dim: int, world: int, kind: str) -> torch.Tensor:
    """A gather (rank order) in the order of global positions: what a mask over the whole sequence reads."""
    return Layout(world, kind).unshard(gathered, dim % gathered.dim())


def kept_keys(block: torch.Tensor, keys: torch.Tensor, query: torch.Tensor, world: int, kind: str,
              window: int | None, halo: bool, left_padding: int = 0, ahead: int = 0) -> torch.Tensor:
    """A mask evaluated at this rank's rows and the keys brought (``keys``: their positions, evaluated at 0
    where negative), with the keys outside the sequence hidden and, after a halo, each query's keys kept to its
    own range (:func:`own_segment`)."""
    block = block & (keys >= 0)
    own = own_segment(query.shape[-2], world, kind, window - 1, query.device, left_padding, ahead) if halo else None
    return block if own is None else block & own


def sequence_positions(query: torch.Tensor, world: int) -> torch.Tensor:
    """Every global position of the sequence (``world`` times ``query``'s local length)."""
    return torch.arange(world * query.shape[-2], device=query.device)


def mask_block(global_mask: torch.Tensor, query: torch.Tensor, rank: int, world: int, kind: str, window: int | None,
               halo: bool, left_padding: int = 0, causal: bool = True, ahead: int = 0) -> torch.Tensor:
    """This rank's rows of a mask evaluated over the whole sequence, cut to the keys its transport brings
    (columns outside the sequence are False). Fails at run time if the model allows a key outside the
    envelope the transport was planned for (causal, a causal window, or a two-sided window of ``window - 1``
    earlier and ``ahead`` later keys; :func:`check_envelope`). Bidirectional with no window (every key brought):
    nothing lies outside."""
    if causal or window is not None:
        check_envelope(global_mask, None if window is None else window - 1, ahead)
    rows = global_mask.index_select(-2, Layout(world, kind).positions(rank, query.shape[-2], query.device))
    k_pos = (brought_positions(query, rank, world, kind, window, halo, left_padding, ahead) if causal or halo
             else key_positions(query.shape[-2], rank, world, kind, None, query.device, causal=False))
    block = rows.index_select(-1, k_pos.clamp(min=0)) & (k_pos >= 0)
    own = own_segment(query.shape[-2], world, kind, window - 1, query.device, left_padding, ahead) if halo else None
    return block if own is None else block & own


def first_keys(mask: torch.Tensor, query: torch.Tensor, world: int, kind: str) -> torch.Tensor:
    """``[chunks]``: for each of this rank's ranges, the first key (a global position: the keys are the
    causal prefix in global order) that any of its queries (``query``'s rows) sees in ``mask`` (``[..,
    queries or 1, prefix]``), or the prefix's length where none does. Causal attention needs only the keys
    from there to the range's end."""
    chunks, local, prefix = Layout(world, kind).chunks, query.shape[-2], mask.shape[-1]
    rows = mask.expand(*mask.shape[:-2], local, prefix)
    seen = rows.reshape(-1, chunks, local // chunks, prefix).any(0).any(1)  # [chunks, prefix]
    return torch.where(seen.any(-1), seen.to(torch.int8).argmax(-1), prefix)
