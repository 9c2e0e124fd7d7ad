"""Per call: does this rank's batch follow the module's layout? Read locally, agreed on with the inputs' digest.

A batch is in the layout when :func:`cp_passes.shard_batch` cut it for that layout (:mod:`cp_passes.data.marks`
knows its tensors and copies of them), or when it carries positions (``spec.position_keys``) that this rank
can hold: no position exceeds the global position of its row (positions count from 0 and restart in a packed
row, so they never run ahead of the row). A contiguous slice passed where the layout is balanced fails that
on every rank after the first; any rank's refusal rides on the inputs' all-reduce
(:func:`~.agreement.check_inputs`), so every rank raises it. A batch with neither is refused unless the layout
is contiguous, the one a hand-cut batch follows. Nothing is gathered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..data.marks import Mark, mark_of, marked
from ..group import CPGroup
from ..layout import CONTIGUOUS, resolve_layout
from ..spec import CPSpec

_FIX = ("cut the batch with cp_passes.shard_batch(batch, mesh, spec) (the spec cp_compile has), or, to keep "
        "each rank's contiguous slice, compile with CPSpec(layout=\"contiguous\")")


@dataclass(frozen=True)
class BatchLayout:
    refusal: str | None = None
    """Why this rank's batch is refused, or None."""
    cut: Mark | None = None
    """How shard_batch cut the batch (the same on every rank), or None when it did not."""

    @property
    def padded(self) -> Mark | None:
        """The cut when shard_batch padded the sequence."""
        return self.cut if self.cut is not None and self.cut.padded_len > self.cut.seq_len else None

    def lines(self) -> list[str]:
        """What every rank must agree on (the refusal's text aside)."""
        cut = self.padded
        return [f"batch refused: {self.refusal is not None}",
                f"padding shard_batch added: {cut.padded_len - cut.seq_len if cut else 0}",
                f"documents interleaved: {self.interleaved}"]

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
                f"{resolve_layout(spec, cp.size)[1]}); pass the spec cp_compile has to shard_batch", cut)
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
