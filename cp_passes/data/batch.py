"""Batch side: pad global [batch, seq] tensors to equal shards and keep this rank's positions of the layout."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..group import resolve_group
from ..layout import BALANCED, Layout, resolve_layout
from ..spec import CPSpec, resolve_spec
from .checks import check_batch
from .marks import Mark, batch_fingerprint, mark
from .packing import pack


@dataclass(frozen=True)
class ShardLayout:
    """How one global batch was split: lengths, padding and every rank's slice of the sequence."""

    seq_len: int
    """Global length before padding."""
    padded_len: int
    """Global length after padding to a multiple of world_size * pad_multiple (times 2 for a balanced layout)."""
    world_size: int
    rank: int
    slices: tuple[tuple[tuple[int, int], ...], ...]
    """Every rank's ``[start, stop)`` ranges in the padded sequence (in local order), in rank order: one per rank
    for a contiguous layout, a head and a tail for a balanced one."""
    valid: torch.Tensor
    """This rank's validity mask ``[batch, local_len]``: False on padding."""
    layout: Layout
    """Which global positions each rank holds (the graph side uses the same)."""
    order: torch.Tensor | None = None
    """With ``balance="documents"``: ``[batch, padded_len]``, the packed row's position that each position of the
    interleaved row holds (:func:`~cp_passes.data.packing.interleaved_order`, one order per batch row); None
    otherwise."""

    @property
    def local_len(self) -> int:
        return self.padded_len // self.world_size

    @property
    def pad(self) -> int:
        return self.padded_len - self.seq_len

    @property
    def start(self) -> int:
        """The global position of this rank's first local row."""
        return self.slices[self.rank][0][0]

    @property
    def positions(self) -> torch.Tensor:
        """The global position of every local row (``[local_len]``): local rows follow the layout, so a
        balanced layout's tail range comes after its head. With interleaved documents, each batch row's own
        (``[batch, local_len]``): the position in the packed row, before interleaving."""
        positions = self.layout.positions(self.rank, self.local_len, self.valid.device)
        return positions if self.order is None else self.order[:, positions]

    def in_global_order(self, gathered: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Every rank's local rows concatenated in rank order along ``dim`` (an all-gather's result), put in
        the order of the global sequence (the packed row's, documents no longer interleaved; ``dim`` 1 then,
        rows along dim 0), padding cut off."""
        rows = self.layout.unshard(gathered, dim % gathered.dim())
        if self.order is not None:
            if dim % gathered.dim() != 1:
                raise ValueError(f"a batch with interleaved documents orders each row its own way: gather along "
                                 f"dim 1 (rows along dim 0), got dim {dim}")
            back = torch.argsort(self.order.to(rows.device), dim=1)
            rows = rows.gather(1, back.view(*back.shape, *[1] * (rows.dim() - 2)).expand(rows.shape))
        return rows.narrow(dim, 0, self.seq_len)


def shard_batch(batch: Mapping, mesh, spec=None, *, pad_multiple: int = 1,
                packed_alignment: int = 1, mask_keys: tuple[str, ...] = (),
                balance: str | None = None) -> tuple[dict, ShardLayout]:
    """Pad every sequence tensor of ``batch`` to a multiple of ``P * pad_multiple`` (``2P * pad_multiple`` for a
    balanced layout) and keep this rank's positions of the spec's layout (:func:`cp_passes.layout.resolve_layout`):
    the ``r``-th ``1/P`` of the sequence (contiguous), or its ``r``-th and ``(2P - 1 - r)``-th ``1/2P``,
    concatenated (balanced). The :class:`ShardLayout` says which, and puts gathered rows back in order.

    ``pad_multiple`` and ``packed_alignment`` combine with the spec's own (their least common multiple), so
    a family whose model groups the sequence into windows needs no argument here.

    ``spec`` is a CPSpec, a spec name or ``.py`` path (as :func:`cp_passes.cp_compile` takes), None, or the
    compiled module itself, whose spec is then used (``compiled.shard_batch(batch)`` says the same with the
    module's group): the form that cannot disagree with ``cp_compile``, which, given no spec, picks the shipped
    one by the model's type (a recurrence keeps shards contiguous) where ``shard_batch`` alone cannot know it.
    Token inputs (``spec.token_keys``) are padded with ``spec.pad_token_id``, labels with
    ``spec.ignore_index`` (so the loss ignores padding), position ids by continuing the count, masks
    (``attention_mask``, ``loss_mask`` and ``mask_keys``) and bool or floating tensors with 0, ``doc_ids``
    with -1. Which entries are sequence tensors follows ``spec`` exactly as :func:`cp_passes.cp_compile`
    does. Non-tensor entries pass through.

    Packed rows (``seq_lens`` / ``seq_lens_padded`` ``[batch, docs]`` with unused slots -1000, or
    ``cu_seqlens`` / ``cu_seqlens_padded`` offsets) first become one global layout (see
    :mod:`cp_passes.data.packing`): documents moved to multiples of ``packed_alignment``, a ``doc_ids`` map
    (-1 on padding), per-document ``position_ids`` (given ones are validated), and ``shift_labels``
    shifted inside each document from unshifted ``labels`` (targets whose ``loss_mask`` is 0 ignored).
    Validity comes from the lengths.

    ``balance="documents"`` (packed rows, balanced layout) balances the attention work of packed documents:
    every document is padded to a multiple of ``2P`` and cut into ``2P`` pieces, and rank ``r`` holds pieces ``r``
    and ``2P - 1 - r`` of each (per-document head-tail). The row is interleaved so that the balanced layout's
    chunks hold those pieces (:func:`~cp_passes.data.packing.interleaved_order`); the compiled module accepts
    such a batch only where it can show the model does not tell: every document kept apart by the attention
    masks, positions from the batch, the row's order read only through comparisons inside those masks.

    Before anything is packed or padded, a malformed batch is refused (see :mod:`cp_passes.batch_checks`):
    sequence tensors whose rows or length differ from ``input_ids`` (or ``inputs_embeds``) ones, except a
    one-row position tensor, which applies to every row; an integer sequence tensor that no spec field
    declares; lengths that do not describe every row.
    """
    cp = resolve_group(mesh)
    return shard_for_rank(batch, cp.rank, cp.size, spec, pad_multiple=pad_multiple,
                          packed_alignment=packed_alignment, mask_keys=mask_keys, balance=balance,
                          _group=tuple(dist.get_process_group_ranks(cp.group)))


BALANCES = (None, "documents")


def shard_for_rank(batch: Mapping, rank: int, world_size: int, spec=None, *,
                   pad_multiple: int = 1, packed_alignment: int = 1, mask_keys: tuple[str, ...] = (),
                   balance: str | None = None, _group: tuple[int, ...] | None = None) -> tuple[dict, ShardLayout]:
    """:func:`shard_batch` for an explicit rank and world size (no process group needed)."""
    if not isinstance(batch, Mapping):
        raise TypeError(f"shard_batch takes a mapping of named tensors, got {type(batch).__name__}")
    for name, value in (("pad_multiple", pad_multiple), ("packed_alignment", packed_alignment)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if balance not in BALANCES:
        raise ValueError(f"balance must be one of {BALANCES}, got {balance!r}")
    compiled_spec = getattr(spec, "spec", None)
    spec = resolve_spec(compiled_spec if isinstance(compiled_spec, CPSpec) else spec)
    pad_multiple, packed_alignment = math.lcm(pad_multiple, spec.pad_multiple), math.lcm(packed_alignment,
                                                                                         spec.packed_alignment)
    checked = check_batch(dict(batch), spec, mask_keys)
    rows, seq_len = checked.rows, checked.seq_len
    batch, packed_valid, order = checked.batch, None, None
    layout, why = resolve_layout(spec, world_size)
    multiple = world_size * layout.chunks * pad_multiple
    if balance == "documents":
        if not checked.padding.packed:
            raise ValueError("balance='documents' balances packed documents: pass their lengths (seq_lens or "
                             "cu_seqlens) with the batch")
        if world_size > 1 and layout.kind != BALANCED:
            raise ValueError(f"balance='documents' deals each document's pieces out head and tail, which needs the "
                             f"balanced layout; spec {spec.name!r} gets the {layout.kind} one ({why})")
    if checked.padding.packed:
        pieces = 2 * world_size if balance == "documents" and world_size > 1 else 1
        batch = pack(checked, math.lcm(packed_alignment, multiple) if pieces > 1 else packed_alignment, pieces)
        packed_valid, order = batch.pop("valid"), batch.pop("order", None)
        seq_len = packed_valid.shape[1]
    padded = -(-seq_len // multiple) * multiple
    local = padded // world_size
    fingerprint = batch_fingerprint([checked.batch[k] for k in sorted(checked.seq_keys)])
    out, cut = {}, Mark(layout.kind, seq_len, padded, order is not None, _group, world_size, rank, fingerprint)
    for key, value in batch.items():
        added = key not in checked.batch  # doc_ids, position_ids, shift_labels from packing: always sharded
        if not (key in checked.seq_keys or added):
            out[key] = value
            continue
        dim = spec.dim_of(key, value)
        if padded > seq_len:
            shape = list(value.shape)
            shape[dim] = padded - seq_len
            fill_value = checked.padding.value(key, value)
            if fill_value is None:
                steps = torch.arange(1, padded - seq_len + 1, device=value.device, dtype=value.dtype)
                steps = steps.view([-1 if d == dim else 1 for d in range(value.dim())])
                fill = value.narrow(dim, seq_len - 1, 1) + steps
            else:
                fill = torch.full(shape, fill_value, dtype=value.dtype, device=value.device)
            value = torch.cat([value, fill], dim=dim)
        out[key] = mark(layout.shard(value, dim, rank).contiguous(), cut)
    device = batch[checked.shape_key].device
    valid = (layout.positions(rank, local, device) < seq_len).expand(rows, local)
    if packed_valid is not None:
        valid = layout.shard(torch.cat([packed_valid, packed_valid.new_zeros(rows, padded - seq_len)], 1), 1, rank)
    shards = ShardLayout(seq_len, padded, world_size, rank, tuple(layout.ranges(r, local) for r in range(world_size)),
                         valid.contiguous(), layout, order)
    return out, shards
