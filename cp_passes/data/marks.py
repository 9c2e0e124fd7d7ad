"""What :func:`cp_passes.shard_batch` cut, for which layout, group and rank, with how much padding and from
which global batch: the compiled module reads it to know a batch's layout without asking the other ranks, and
puts the global batch's fingerprint in the inputs' digest the ranks agree on.

A tensor shard_batch returned is known by identity; a copy of it (``.clone()``, ``.to(device)`` onto another
device, ``{k: v.clone() ...}``) by a fingerprint of its contents, kept for the last :data:`REMEMBERED` tensors
shard_batch cut. The fingerprint is computed on the tensor's own device and compared only when the identity
misses, so a batch straight from shard_batch costs nothing.
"""

from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass

import torch

REMEMBERED = 1024


@dataclass(frozen=True)
class Mark:
    """How shard_batch cut one global batch (the same on every rank)."""

    kind: str
    """The layout kind."""
    seq_len: int
    """The global length before padding."""
    padded_len: int
    """The global length after padding."""
    interleaved: bool = False
    """Packed documents interleaved to balance their work (``shard_batch(..., balance="documents")``)."""
    group: tuple[int, ...] | None = None
    """The global ranks of the process group shard_batch cut for, in its order; None for
    :func:`~cp_passes.data.batch.shard_for_rank` (an explicit rank and world size)."""
    world_size: int = 1
    rank: int = 0
    """The rank the shard is for, in that group."""
    batch: int = 0
    """A fingerprint of the global batch (every sequence tensor, before padding): equal on every rank that cut
    the same batch."""

    def holder(self) -> str:
        group = f" (the group of global ranks {list(self.group)})" if self.group is not None else ""
        return f"rank {self.rank} of {self.world_size}{group}"


_BY_ID: dict[int, tuple[weakref.ref, Mark]] = {}
_BY_CONTENT: collections.OrderedDict = collections.OrderedDict()
"""``(shape, dtype)`` -> ``[(fingerprint, mark), ...]``, the oldest entries dropped past REMEMBERED."""
_count = 0


def mark(tensor: torch.Tensor, found: Mark) -> torch.Tensor:
    global _count
    key = id(tensor)
    _BY_ID[key] = (weakref.ref(tensor, lambda _: _BY_ID.pop(key, None)), found)
    _BY_CONTENT.setdefault((tuple(tensor.shape), tensor.dtype), collections.deque()).append(
        (_fingerprint(tensor), found))
    _count += 1
    while _count > REMEMBERED:
        shape, entries = next(iter(_BY_CONTENT.items()))
        entries.popleft()
        _count -= 1
        if not entries:
            del _BY_CONTENT[shape]
    return tensor


def marked(tensor: torch.Tensor) -> Mark | None:
    """The Mark of the tensor shard_batch returned, by identity only."""
    entry = _BY_ID.get(id(tensor))
    return entry[1] if entry is not None and entry[0]() is tensor else None


def mark_of(tensor: torch.Tensor) -> Mark | None:
    """The Mark of ``tensor`` if shard_batch cut it or a copy of the same contents, else None."""
    found = marked(tensor)
    if found is not None:
        return found
    entries = _BY_CONTENT.get((tuple(tensor.shape), tensor.dtype))
    if not entries:
        return None
    mine = _fingerprint(tensor)
    known = torch.stack([f.to(mine.device) for f, _ in entries])
    hits = (known == mine).nonzero()
    return entries[int(hits[-1])][1] if len(hits) else None


SAMPLED = 1 << 16
"""A tensor of more elements is fingerprinted on that many, evenly strided (an embedding shard is large)."""


def batch_fingerprint(tensors: list[torch.Tensor]) -> int:
    """A hash of every element of ``tensors``, in order (one host read)."""
    parts = [_fingerprint(t, sampled=False).cpu() for t in tensors]
    return int(_fingerprint(torch.stack(parts))) if parts else 0


def _fingerprint(tensor: torch.Tensor, sampled: bool = True) -> torch.Tensor:
    """A 0-d int64 hash of the bits of ``tensor`` (the same on any device; no host sync), of at most
    :data:`SAMPLED` of its elements unless not ``sampled``."""
    flat = tensor.detach().reshape(-1)
    if sampled:
        flat = flat[::max(1, -(-flat.numel() // SAMPLED))]
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    elif flat.is_floating_point() or flat.is_complex():
        flat = flat.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64,
                                       16: torch.int64}[flat.element_size()])
    bits = flat.to(torch.int64)
    weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device) * 0x1E3779B97F4A7C15
    return (bits * (weights ^ (weights >> 29))).sum()
