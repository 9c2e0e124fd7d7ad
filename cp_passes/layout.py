"""The layout: which global sequence positions each rank holds, for the batch and the graph alike.

Every question of the form "where is position p" is answered here and nowhere else: the batch side
(:func:`cp_passes.shard_batch`) slices with it, the graph side (positions, masks, halos, gathers and
their byte counts) computes with it. The local length may be a ``SymInt``: the arithmetic adds no guards,
so one compiled graph serves every length.

A rank holds ``chunks`` equal ranges of the sequence, concatenated in local order; a gather concatenates
every rank's rows in rank order. Two kinds:

- ``CONTIGUOUS``: rank ``r`` holds ``[r * L, (r + 1) * L)``. A causal query on the last rank sees every
  key, on the first only its own: the last rank does ``P`` times the first's attention work.
- ``BALANCED``: the sequence is cut into ``2P`` chunks of ``L / 2`` and rank ``r`` holds chunks ``r`` and
  ``2P - 1 - r`` (head and tail, "zigzag"): every rank's causal queries see ``2P + 1`` chunks of keys.

Which kind a model gets is :func:`resolve_layout`'s decision, from the spec, so that
:func:`~cp_passes.shard_batch` and :func:`~cp_passes.cp_compile` agree before any graph exists.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CONTIGUOUS = "contiguous"
BALANCED = "balanced"
KINDS = (CONTIGUOUS, BALANCED)
AUTO = "auto"


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

    def describe(self) -> str:
        if self.kind == BALANCED:
            return (f"balanced: the sequence in {2 * self.world} chunks, rank r holds chunks r and "
                    f"{2 * self.world - 1} - r")
        return f"contiguous: rank r holds the r-th of {self.world} slices"

    # -- rank <-> global position -----------------------------------------------------------
    @property
    def chunks(self) -> int:
        """How many ranges each rank holds (the local length is a multiple of it)."""
        return 2 if self.kind == BALANCED else 1

    def global_len(self, local_len):
        return self.world * local_len

    def chunk_len(self, local_len):
        """The length of each of a rank's ranges (see :func:`chunk_len`)."""
        return chunk_len(local_len, self.chunks)

    def chunk_indices(self, rank: int) -> tuple[int, ...]:
        """The global chunk index (chunks of ``local_len / chunks`` positions) of each range of ``rank``."""
        if self.kind == BALANCED:
            return rank, 2 * self.world - 1 - rank
        return (rank,)

    def gather_chunks(self) -> list[int]:
        """The global chunk index of every range of a gather (every rank's ranges in rank order)."""
        return [c for rank in range(self.world) for c in self.chunk_indices(rank)]

    def ranges(self, rank: int, local_len) -> tuple[tuple[object, object], ...]:
        """The global ``[start, stop)`` ranges rank ``rank`` holds, in local order."""
        size = self.chunk_len(local_len)
        return tuple((c * size, (c + 1) * size) for c in self.chunk_indices(rank))

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

    def sources(self, start: int, stop: int, local_len: int) -> list[tuple[int | None, int, int]]:
        """Where the global positions ``[start, stop)`` are held: ``(owner rank, owner's first local row,
        rows)`` pieces in order, owner ``None`` for positions outside the sequence. ``local_len`` is
        concrete."""
        total, pieces, cur = self.global_len(local_len), [], start
        while cur < stop:
            if cur < 0 or cur >= total:
                rows = min(stop, 0) - cur if cur < 0 else stop - cur
                pieces.append((None, 0, rows))
            else:
                owner, row, left = self._locate(cur, local_len)
                rows = min(stop - cur, left)
                pieces.append((owner, row, rows))
            cur += rows
        return pieces

    def shifted_sources(self, offset: int, rank: int, local_len: int) -> list[tuple[int | None, int, int]]:
        """Where rank ``rank``'s rows come from when every local row reads global position ``p + offset``:
        :meth:`sources` pieces in local order. ``local_len`` is concrete."""
        return [piece for start, stop in self.ranges(rank, local_len)
                for piece in self.sources(start + offset, stop + offset, local_len)]

    def positions(self, rank: int, local_len, device=None) -> torch.Tensor:
        """The global position of every local row of rank ``rank`` (``[local_len]`` int64)."""
        rows = torch.arange(local_len, device=device)
        if self.kind != BALANCED:
            return rows + rank * local_len
        size = self.chunk_len(local_len)  # the tail's rows move from local row `size` to chunk 2P - 1 - r
        return torch.where(rows < size, rows + rank * size, rows + (2 * self.world - 2 - rank) * size)

    def gathered_positions(self, local_len, device=None) -> torch.Tensor:
        """The global position of every row of a gather (every rank's rows in rank order)."""
        return torch.cat([self.positions(rank, local_len, device) for rank in range(self.world)])

    def shard(self, tensor: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
        """Rank ``rank``'s rows of a global tensor along ``dim``."""
        local = tensor.shape[dim] // self.world
        pieces = [tensor.narrow(dim, start, stop - start) for start, stop in self.ranges(rank, local)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)

    def unshard(self, gathered: torch.Tensor, dim: int) -> torch.Tensor:
        """A gather (every rank's rows in rank order along ``dim``) in global order."""
        if self.kind == CONTIGUOUS:
            return gathered
        local = gathered.shape[dim] // self.world
        order = torch.argsort(self.gathered_positions(local, gathered.device))
        return gathered.index_select(dim, order)

    # -- what a transport moves -------------------------------------------------------------
    def prefix_chunks(self, rank: int) -> int:
        """How many chunks (``1 / chunks`` of a local length each) from the sequence start to the end of rank
        ``rank``'s last range."""
        return max(self.chunk_indices(rank)) + 1

    def visible_prefix(self, rank: int, local_len):
        """How many positions a causal query on ``rank`` can see: every position before the end of its last
        range (what :func:`~cp_passes.transports.gather.prefix_gather_op` brings, in global order)."""
        return self.prefix_chunks(rank) * self.chunk_len(local_len)

    def seen_before(self, rank: int, local_len):
        """How many rows of other ranks causal queries on ``rank`` see: those of every range before its last
        one that it does not hold (the lower bound of what a causal gather brings it)."""
        mine = self.chunk_indices(rank)
        return (max(mine) + 1 - len(mine)) * self.chunk_len(local_len)

    def preceding_chunks(self, rank: int) -> list[list[bool]]:
        """For each of rank ``rank``'s ranges, which ranges of a gather (:meth:`gather_chunks` order) precede
        it in the sequence."""
        order = self.gather_chunks()
        return [[c < mine for c in order] for mine in self.chunk_indices(rank)]

    def first_is_local(self, rank: int) -> bool:
        """Whether causal attention over the keys a gather lets rank ``rank`` see is plain causal attention
        over its own rows (it holds the sequence's first positions and sees nothing else)."""
        return rank == 0 and self.chunks == 1

    def halo_sources(self, before: int, rank: int, local_len: int,
                     after: int = 0) -> list[list[tuple[int | None, int, int]]]:
        """For each of rank ``rank``'s ranges, where the ``before`` positions in front of it (then the ``after``
        positions after it: a two-sided halo) are held (:meth:`sources` pieces: owner ``None`` outside the
        sequence, owner ``rank`` for rows it holds itself). ``local_len`` is concrete."""
        return [(self.sources(start - before, start, local_len) if before > 0 else [])
                + (self.sources(stop, stop + after, local_len) if after > 0 else [])
                for start, stop in self.ranges(rank, local_len)]

    def halo_counts(self, before: int, rank: int, local_len: int, after: int = 0) -> tuple[list[int], list[int], int]:
        """Rows rank ``rank`` sends to and receives from every other rank for a halo of the ``before``
        positions in front of each of its ranges (and ``after`` after it), and how many of those lie outside the
        sequence (zeros). Exactly the needed rows move, each once (two ranges' halos that overlap share
        their rows: :func:`wanted_rows`); rows it holds itself are copied. ``local_len`` is concrete."""
        plans = [self.halo_sources(before, other, local_len, after) for other in range(self.world)]
        send = [0 if other == rank else sum(n for _, n in wanted_rows(plans[other], rank))
                for other in range(self.world)]
        recv = [0 if owner == rank else sum(n for _, n in wanted_rows(plans[rank], owner))
                for owner in range(self.world)]
        zeros = sum(n for pieces in plans[rank] for owner, _, n in pieces if owner is None)
        return send, recv, zeros

    def leading_zeros(self, before: int, rank: int, local_len: int) -> int:
        """How many of the ``before`` positions in front of rank ``rank``'s ranges precede the sequence start."""
        return sum(rows for pieces in self.halo_sources(before, rank, local_len)
                   for owner, _, rows in pieces if owner is None)

    def halo_positions(self, before: int, rank: int, local_len, device=None, left_padding: int = 0,
                       after: int = 0) -> torch.Tensor:
        """Global positions of the rows of a halo: for each range, ``[left_padding rows (-1), before rows,
        the range's rows, after rows]`` (positions before the sequence start are negative, those after its
        end -1)."""
        pieces = []
        for start, stop in self.ranges(rank, local_len):
            if left_padding:
                pieces.append(torch.full((left_padding,), -1, device=device))
            pieces.append(torch.arange(stop - start + before + after, device=device) + (start - before))
        positions = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        if after:
            positions = torch.where(positions < self.global_len(local_len), positions, -1)
        return positions

    def halo_segments(self, before: int, local_len, device=None, left_padding: int = 0,
                      after: int = 0) -> torch.Tensor:
        """Which range each row of a halo (:meth:`halo_positions`) belongs to (``[rows]`` int64)."""
        size = self.chunk_len(local_len) + before + after + left_padding
        return torch.arange(self.chunks * size, device=device) // size

    def query_segments(self, local_len, device=None) -> torch.Tensor:
        """Which range each local row belongs to (``[local_len]`` int64)."""
        return torch.arange(local_len, device=device) // self.chunk_len(local_len)


def wanted_rows(segments, owner: int) -> list[tuple[int, int]]:
    """The rows of ``owner`` that a rank's ``segments`` (lists of ``(owner, owner's row, rows)`` pieces, as
    :meth:`Layout.sources` gives them) take, each once: ``(first row, rows)`` runs in row order, overlapping
    and adjacent pieces merged. What moves from ``owner`` to that rank, in this order."""
    runs: list[list[int]] = []
    for start, stop in sorted((row, row + n) for pieces in segments for o, row, n in pieces if o == owner and n):
        if runs and start <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], stop)
        else:
            runs.append([start, stop])
    return [(start, stop - start) for start, stop in runs]


def chunk_len(local_len, chunks: int):
    """``local_len // chunks``. A symbolic local length is checked to divide (a guard and a run-time assert),
    which also lets the shape arithmetic see that ``chunks * chunk_len`` is the local length."""
    if chunks > 1:
        torch._check(local_len % chunks == 0, lambda: (
            f"cp_passes: a balanced layout needs a local length divisible by {chunks}, got {local_len}; shard the "
            f"batch with cp_passes.shard_batch and the same spec (it pads to a multiple of 2P)"))
    return local_len // chunks


def resolve_layout(spec, world: int) -> tuple[Layout, str]:
    """The layout a spec asks for at ``world`` ranks, and why. ``auto`` is balanced unless the spec declares
    something whose rows must stay in sequence order on each rank: a :class:`~cp_passes.spec.Recurrence`
    (its state flows from rank to rank) or an eager module (hand-written CP code for contiguous shards).
    Decided from the spec alone, so the batch and the graph agree before the model runs."""
    asked = getattr(spec, "layout", AUTO)
    if world == 1:
        return Layout(1), "one rank holds the whole sequence"
    if asked == CONTIGUOUS:
        return Layout(world), "the spec asks for it (CPSpec(layout='contiguous'))"
    if asked == BALANCED:
        return Layout(world, BALANCED), "the spec asks for it (CPSpec(layout='balanced'))"
    needs = [f"Recurrence {r.kernel!r} (its state flows from rank to rank)" for r in spec.recurrences]
    needs += [f"eager module {m!r} (hand-written for contiguous shards)" for m in spec.eager_modules]
    if needs:
        return Layout(world), f"auto: {'; '.join(needs)} needs contiguous shards"
    return Layout(world, BALANCED), "auto: every transport this spec can use supports it"
