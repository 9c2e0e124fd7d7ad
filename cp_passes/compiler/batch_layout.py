"""Per call: does this rank's batch follow the module's layout? Read locally, agreed on with the inputs' digest.

A batch is in the layout when :func:`cp_passes.shard_batch` cut it for that layout and for this rank of this
group (:mod:`cp_passes.data.marks` knows its tensors and copies of them; the fingerprint of the global batch
it cut joins the inputs' digest, so ranks that cut different batches are refused together), or when its
positions (``spec.position_keys``) show it:

- locally, no position exceeds the global position of its row (positions count from 0 and restart in a
  packed row, so they never run ahead of the row). A contiguous slice of one document passed where the layout
  is balanced fails that on every rank after the first.
- then together (:func:`confirm_order`, one all-gather of the first and last position of each half of every
  rank's rows): where the module's layout and the other cut put different halves next to each other, the
  positions must run on (``p``, then ``p + 1``) across more joins of the module's layout than of the other's
  (:func:`order_refusal`). Positions that restart, start low or pad (packed rows, left padding) pass the local
  check under either cut; only their order tells. A batch whose positions show neither order is refused
  under the balanced layout and accepted under the contiguous one, the cut a hand-cut batch follows.

Any rank's refusal rides on the inputs' all-reduce (:func:`~.agreement.check_inputs`) or is read from the
same gathered positions, so every rank raises it. A batch with neither marks nor positions is refused unless
the layout is contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..data.marks import Mark, mark_of, marked
from ..group import CPGroup
from ..layout import BALANCED, CONTIGUOUS, Layout, resolve_layout
from ..spec import CPSpec
from .agreement import collective_device

_FIX = ("cut the batch with cp_passes.shard_batch(batch, mesh, spec) (the spec cp_compile has), or, to keep "
        "each rank's contiguous slice, compile with CPSpec(layout=\"contiguous\")")


@dataclass(frozen=True)
class BatchLayout:
    refusal: str | None = None
    """Why this rank's batch is refused, or None."""
    cut: Mark | None = None
    """How shard_batch cut the batch (the same on every rank), or None when it did not."""
    seams: torch.Tensor | None = None
    """Hand-cut positions whose order the ranks check together (:func:`confirm_order`): the first and last
    position of each half of this rank's rows, ``[rows, 2, 2]`` int64 (the rows of every position input)."""
    seam_names: tuple[str, ...] = ()
    """The position inputs ``seams`` reads."""

    @property
    def padded(self) -> Mark | None:
        """The cut when shard_batch padded the sequence."""
        return self.cut if self.cut is not None and self.cut.padded_len > self.cut.seq_len else None

    def lines(self) -> list[str]:
        """What every rank must agree on (the refusal's text aside)."""
        cut = self.padded
        lines = [f"batch refused: {self.refusal is not None}",
                 f"padding shard_batch added: {cut.padded_len - cut.seq_len if cut else 0}",
                 f"documents interleaved: {self.interleaved}",
                 f"order read from positions: {self.seams is not None}"]
        if self.cut is not None:
            lines.append(f"the global batch shard_batch cut (its fingerprint): {self.cut.batch:016x}")
        return lines

    @property
    def interleaved(self) -> bool:
        """shard_batch interleaved the batch's documents (``balance="documents"``)."""
        return self.cut is not None and self.cut.interleaved


def read_batch(spec: CPSpec, cp: CPGroup, leaves: list[tuple[str | None, torch.Tensor]],
               read_data: bool = True) -> BatchLayout:
    """This rank's verdict on its batch. Inputs that cannot be told apart are left to the checks that follow.
    Without ``read_data`` (one rank, or a fake process group, whose structure tests pass made-up shards) only
    shard_batch's marks are read, not the positions."""
    found = spec.length_input(leaves)
    if found is None:
        return BatchLayout()
    seq_len, leading = spec.length_of(*found), spec.batch_dims(*found)
    try:
        sharded = [(name, t) for name, t in leaves if spec.is_sharded(name, t, seq_len, leading)]
    except ValueError:
        return BatchLayout()
    if not sharded:
        return BatchLayout()
    cut = next((c for c in map(marked, (t for _, t in sharded)) if c is not None), None)
    if cut is None:
        # Copies are known by content only, and content can coincide (a doc-id map of zeros looks the same
        # under any layout): they establish a cut when every sequence input is a copy of one cut that way.
        copies = [mark_of(t) for _, t in sharded]
        if all(c is not None and c.kind == copies[0].kind for c in copies):
            cut = copies[0]
    if cut is not None:
        if cut.kind != cp.kind:
            name = next(name for name, t in sharded)
            return BatchLayout(
                f"input {name or '<positional>'!r} was sharded by shard_batch for the {cut.kind} layout, but "
                f"this module was compiled for the {cp.kind} layout (spec {spec.name!r}: "
                f"{resolve_layout(spec, cp.size)[1]}); shard through the compiled module, "
                f"compiled.shard_batch(batch), or pass it its spec, shard_batch(batch, mesh, compiled.spec)", cut)
        members = None if cut.group is None else tuple(dist.get_process_group_ranks(cp.group))
        if read_data and (cut.world_size != cp.size or cut.rank != cp.rank or cut.group not in (None, members)):
            here = f"rank {cp.rank} of {cp.size}" + (f" (the group of global ranks {list(members)})" if members else "")
            return BatchLayout(
                f"input {sharded[0][0] or '<positional>'!r} was cut by shard_batch for {cut.holder()}, but this "
                f"module runs on {here}, its CP group: pass shard_batch the mesh's CP dimension (or group) that "
                f"cp_compile has, not the data-parallel one", cut)
        return BatchLayout(None, cut)
    if not read_data or cp.size == 1:
        return BatchLayout()
    layout = cp.layout
    where = f"rank {cp.rank} of {cp.size} holds under the layout ({layout.describe()})"
    positions = [(name, t) for name, t in sharded if name in spec.position_keys]
    if positions and seq_len % layout.chunks:
        return BatchLayout(f"input {positions[0][0]!r} has the local length {seq_len}, which the layout "
                           f"({layout.describe()}) cannot hold (it needs a multiple of {layout.chunks}); {_FIX}")
    for name, t in positions:
        rows = layout.positions(cp.rank, seq_len, t.device)
        ahead = (t.movedim(spec.dim_of(name, t), -1) > rows).reshape(-1, seq_len).any(0)
        if bool(ahead.any()):
            row = int(ahead.nonzero()[0])
            return BatchLayout(
                f"input {name!r} disagrees with the module's layout: local row {row} holds a position past "
                f"global position {int(rows[row])}, the one {where} (the batch was cut another way: each rank its "
                f"contiguous slice, say); {_FIX}")
    if positions and seq_len % 2 == 0:
        rows = torch.cat([t.movedim(spec.dim_of(name, t), -1).reshape(-1, seq_len).to(torch.int64)
                          for name, t in positions])
        half = seq_len // 2
        seams = torch.stack([rows[:, [0, half - 1]], rows[:, [half, seq_len - 1]]], 1)
        return BatchLayout(seams=seams, seam_names=tuple(name for name, _ in positions))
    if positions or cp.kind == CONTIGUOUS:
        return BatchLayout()
    names = ", ".join(repr(name or "<positional>") for name, _ in sharded)
    return BatchLayout(
        f"cp_passes cannot tell which positions this batch holds: its sequence inputs ({names}) were not cut by "
        f"cp_passes.shard_batch (nor copied from what it returned) and carry no positions "
        f"({', '.join(spec.position_keys)}), and a hand-cut batch (each rank its contiguous slice) would be "
        f"silently wrong under the layout this module runs on ({layout.describe()}; "
        f"{resolve_layout(spec, cp.size)[1]}); {_FIX}, or "
        f"pass {spec.position_keys[0]} (each local row's global position) so that cp_passes can check them")


def confirm_order(cp: CPGroup, batch: BatchLayout) -> None:
    """Raise ValueError on every rank unless hand-cut positions (``batch.seams``, when there are) show the
    module's layout: one all-gather, reached by every rank when the inputs' digest agreed (it says whether
    there are seams), and every rank decides from the same gathered rows."""
    if batch.seams is None:
        return
    local = batch.seams.to(collective_device(cp))
    everyone = [torch.empty_like(local) for _ in range(cp.size)]
    dist.all_gather(everyone, local, group=cp.group)
    refusal = order_refusal(cp.layout, [t.cpu() for t in everyone], batch.seam_names)
    if refusal is not None:
        raise ValueError(refusal)


def _half(piece: tuple[int, int]) -> str:
    return f"the {'first' if piece[1] == 0 else 'second'} half of rank {piece[0]}'s rows"


def order_refusal(layout: Layout, seams: list[torch.Tensor], names: tuple[str, ...]) -> str | None:
    """Why the first and last positions of each half of every rank's rows (``seams[rank]``, ``[rows, 2, 2]``)
    do not show ``layout``, or None. A join is where one half follows another in an order of the halves: the
    contiguous cut's (rank by rank) or the balanced layout's (first halves in rank order, then second halves
    in reverse); each order has ``2P - 2`` joins the other lacks. Positions run on across a join inside a
    document in the true order, and across a join of the other order only where they happen to: the order
    with more such (row, join) pairs is the batch's, and neither shows when they tie."""
    world = layout.world
    contiguous = [(r, h) for r in range(world) for h in (0, 1)]
    balanced = [(r, 0) for r in range(world)] + [(r, 1) for r in reversed(range(world))]
    mine, other = (balanced, contiguous) if layout.kind == BALANCED else (contiguous, balanced)
    other_kind = CONTIGUOUS if layout.kind == BALANCED else BALANCED

    def running_on(order, not_in):
        joins = sorted(set(zip(order, order[1:])) - set(zip(not_in, not_in[1:])))
        counts = [(int((seams[b[0]][:, b[1], 0] == seams[a[0]][:, a[1], 1] + 1).sum()), a, b) for a, b in joins]
        return sum(n for n, _, _ in counts), max(counts)

    (for_mine, _), (for_other, (_, a, b)) = running_on(mine, other), running_on(other, mine)
    name = " and ".join(repr(n) for n in names)
    if for_other > for_mine:
        return (f"input {name} follows the {other_kind} cut, not the module's layout ({layout.describe()}): the "
                f"positions run on (p, then p + 1) across {for_other} joins of halves of rank rows that the "
                f"{other_kind} cut makes and the module's layout does not (from the end of {_half(a)} to the start "
                f"of {_half(b)}, say), and across {for_mine} of the layout's own; {_FIX}")
    if layout.kind == BALANCED and for_mine == for_other:
        return (f"input {name} cannot show that this hand-cut batch follows the module's layout "
                f"({layout.describe()}): the positions run on across as many joins of its chunks that a contiguous "
                f"cut would not make as across joins that only a contiguous cut makes ({for_mine}): they restart "
                f"where chunks end (documents that end there, padding), so they do not tell the chunks' order; "
                f"{_FIX}")
    return None
