"""The layout: which global sequence positions each rank holds, for the batch and the graph alike.

Every question of the form "where is position p" is answered here and nowhere else: the batch side
(:func:`cp_passes.shard_batch`) slices with it, the graph side (positions, masks, halos, gathers and
their byte counts) computes with it. The local length may be a ``SymInt``: the contiguous layout's
arithmetic adds no guards, so one compiled graph serves every length.

A rank holds one or more global ranges ``[start, stop)``, concatenated in local order; a gather
concatenates every rank's rows in rank order. ``CONTIGUOUS`` (rank ``r`` holds ``[r * L, (r + 1) * L)``)
is the only kind today; a balanced layout (a head and a tail range per rank) adds a kind here, and the
transports that need contiguous shards say so (see :mod:`cp_passes.transports`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CONTIGUOUS = "contiguous"
KINDS = (CONTIGUOUS,)


@dataclass(frozen=True)
class Layout:
    """How a sequence of ``world * local_len`` positions is split over ``world`` ranks."""

    world: int
    kind: str = CONTIGUOUS

    def __post_init__(self) -> None:
        if not isinstance(self.world, int) or self.world < 1:
            raise ValueError(f"Layout.world must be a positive int, got {self.world!r}")
        if self.kind not in KINDS:
            raise ValueError(f"Layout.kind must be one of {KINDS}, got {self.kind!r}")

    # -- rank <-> global position -----------------------------------------------------------
    def global_len(self, local_len):
        return self.world * local_len

    def ranges(self, rank: int, local_len) -> tuple[tuple[object, object], ...]:
        """The global ``[start, stop)`` ranges rank ``rank`` holds, in local order."""
        return ((rank * local_len, (rank + 1) * local_len),)

    def start(self, rank: int, local_len):
        """The global position of rank ``rank``'s first local row."""
        return self.ranges(rank, local_len)[0][0]

    def owner(self, position: int, local_len: int) -> tuple[int, int]:
        """``(rank, local row)`` holding global ``position``."""
        rank, row, _ = self._locate(position, local_len)
        return rank, row

    def _locate(self, position: int, local_len: int) -> tuple[int, int, int]:
        """``(rank, local row, rows left in that rank's range from there)`` for global ``position``."""
        if not 0 <= position < self.global_len(local_len):
            raise IndexError(f"position {position} is outside the sequence of {self.global_len(local_len)}")
        for rank in range(self.world):
            offset = 0
            for start, stop in self.ranges(rank, local_len):
                if start <= position < stop:
                    return rank, offset + position - start, stop - position
                offset += stop - start
        raise AssertionError("unreachable: the ranges cover the sequence")

    def shifted_sources(self, offset: int, rank: int, local_len: int) -> list[tuple[int | None, int, int]]:
        """Where rank ``rank``'s rows come from when every local row reads global position ``p + offset``:
        ``(owner rank, owner's first local row, rows)`` pieces in local order, owner ``None`` for positions
        outside the sequence. ``local_len`` is concrete."""
        total, pieces = self.global_len(local_len), []
        for start, stop in self.ranges(rank, local_len):
            cur, end = start + offset, stop + offset
            while cur < end:
                if cur < 0 or cur >= total:
                    rows = min(end, 0) - cur if cur < 0 else end - cur
                    pieces.append((None, 0, rows))
                else:
                    owner, row, left = self._locate(cur, local_len)
                    rows = min(end - cur, left)
                    pieces.append((owner, row, rows))
                cur += rows
        return pieces

    def positions(self, rank: int, local_len, device=None) -> torch.Tensor:
        """The global position of every local row of rank ``rank`` (``[local_len]`` int64)."""
        pieces = [torch.arange(start, stop, device=device) for start, stop in self.ranges(rank, local_len)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def gathered_positions(self, local_len, device=None) -> torch.Tensor:
        """The global position of every row of a gather (every rank's rows in rank order)."""
        return torch.cat([self.positions(rank, local_len, device) for rank in range(self.world)])

    def shard(self, tensor: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
        """Rank ``rank``'s rows of a global tensor along ``dim``."""
        local = tensor.shape[dim] // self.world
        return torch.cat([tensor.narrow(dim, start, stop - start) for start, stop in self.ranges(rank, local)], dim)

    # -- what a transport moves -------------------------------------------------------------
    def visible_prefix(self, rank: int, local_len):
        """How many leading rows of a gather a causal query on ``rank`` can see: the rows of every rank
        whose positions all precede (or are) this rank's last position."""
        return (rank + 1) * local_len

    def preceding_ranks(self, rank: int) -> list[int]:
        """The ranks all of whose positions precede all of rank ``rank``'s (a scan's carry comes from them)."""
        return list(range(rank))

    def first_is_local(self, rank: int) -> bool:
        """Whether causal attention over the keys a gather lets rank ``rank`` see is plain causal attention
        over its own rows (it holds the sequence's first positions and sees nothing else)."""
        return rank == 0

    def halo_counts(self, halo: int, rank: int, local_len: int) -> tuple[list[int], list[int], int]:
        """Rows rank ``rank`` sends to and receives from every rank for a halo of the ``halo`` positions
        before its shard, and how many of those precede the sequence start (zeros). Exactly the rows
        needed move, from as many preceding ranks as the halo spans. ``local_len`` is concrete."""
        if halo <= 0:
            return [0] * self.world, [0] * self.world, 0

        def rows(k):  # rows rank r needs from rank r - 1 - k
            return max(0, min(local_len, halo - k * local_len))

        send = [rows(r - rank - 1) if r > rank else 0 for r in range(self.world)]
        recv = [rows(rank - q - 1) if q < rank else 0 for q in range(self.world)]
        return send, recv, self.leading_zeros(halo, rank, local_len)

    def leading_zeros(self, halo: int, rank: int, local_len: int) -> int:
        """How many of the ``halo`` positions before rank ``rank``'s shard precede the sequence start."""
        return max(0, halo - rank * local_len) if halo > 0 else 0

    def halo_positions(self, halo: int, rank: int, local_len, device=None) -> torch.Tensor:
        """Global positions of the rows of ``[halo rows, local rows]`` (negative before the sequence)."""
        return torch.arange(halo + local_len, device=device) + (self.start(rank, local_len) - halo)
