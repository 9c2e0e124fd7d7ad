"""Scan: a running op along the sequence is a local scan plus a carry from the preceding ranks.

``cumsum``, ``cumprod``, ``logcumsumexp``, ``cummax`` and ``cummin`` are associative: on a shard they give
this rank's running value, and combining it with the running value at the end of every preceding rank (the
carry) gives the global one. Each rank's last running value is all-gathered (one row per rank and batch
row, with autograd: the backward is a reduce-scatter) and the carry is reduced from the preceding ranks'
rows (:meth:`Layout.preceding_ranks`), masked rather than sliced so every rank reads the gathered rows.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx

from ..graph.analysis import meta_val, numel_hint
from ..layout import Layout
from .base import Cost, Transport, register_transport
from .gather import sequence_gather_op  # noqa: F401  (registers cp_passes::sequence_gather)
from .masks import metadata_gather_op  # noqa: F401  (registers cp_passes::metadata_gather)

aten = torch.ops.aten

SCANS = {aten.cumsum: "cumsum", aten.cumprod: "cumprod", aten.logcumsumexp: "logcumsumexp",
         aten.cummax: "cummax", aten.cummin: "cummin"}


@dataclass
class Scan:
    """``node = op(source, dim)`` along the sequence (``op`` one of :data:`SCANS`' names)."""

    node: torch.fx.Node
    source: torch.fx.Node
    dim: int
    op: str = "cumsum"


def _along(gathered: torch.Tensor, dim: int, world: int) -> list[int]:
    """The shape of a per-rank vector broadcast against ``gathered`` (ranks along ``dim``)."""
    shape = [1] * gathered.dim()
    shape[dim] = world
    return shape


def _preceding(gathered: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """Boolean, broadcastable against ``gathered``: which gathered rows come from the preceding ranks."""
    mask = torch.zeros(world, dtype=torch.bool, device=gathered.device)
    mask[Layout(world).preceding_ranks(rank)] = True
    return mask.view(_along(gathered, dim, world))


def carry_reduce(gathered: torch.Tensor, dim: int, rank: int, world: int, op: str) -> torch.Tensor:
    """The preceding ranks' running values reduced into one carry (the op's identity on the first rank)."""
    before = _preceding(gathered, dim, rank, world)
    if op == "cumsum":
        return torch.where(before, gathered, 0).sum(dim, keepdim=True, dtype=gathered.dtype)
    if op == "cumprod":
        return torch.where(before, gathered, 1).prod(dim, keepdim=True, dtype=gathered.dtype)
    return torch.where(before, gathered, float("-inf")).logsumexp(dim, keepdim=True)


def combine(local: torch.Tensor, carry: torch.Tensor, op: str) -> torch.Tensor:
    if op == "cumsum":
        return local + carry
    if op == "cumprod":
        return local * carry
    return torch.logaddexp(local, carry)


def global_index(indices: torch.Tensor, values: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """The global position of the last local running max (min)."""
    return indices.narrow(dim, -1, 1) + Layout(world).start(rank, values.shape[dim])


def _ordered(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.uint8) if values.dtype == torch.bool else values


def _at_least(a: torch.Tensor, b: torch.Tensor, largest: bool) -> torch.Tensor:
    """Whether ``a`` replaces ``b`` as a running max (min) when it comes later: ``a >= b`` (``<=``), and NaN
    is the most extreme value, as in ``torch.cummax``."""
    a, b = _ordered(a), _ordered(b)
    return (a >= b if largest else a <= b) | (a != a)


def _last(condition: torch.Tensor, dim: int, world: int) -> torch.Tensor:
    """The last rank along ``dim`` where ``condition`` holds (-1 if none)."""
    ranks = torch.arange(world, device=condition.device).view(_along(condition, dim, world))
    return torch.where(condition, ranks, -1).amax(dim, keepdim=True)


def extreme_carry(values: torch.Tensor, indices: torch.Tensor, dim: int, rank: int, world: int, largest: bool):
    """The running max (min) at the end of the preceding ranks and its global index: a NaN if any (the last
    one), else the best value with, among equal values, the later index, as ``torch.cummax`` picks; index
    -1 on the first rank."""
    before = _preceding(values, dim, rank, world)
    ordered = _ordered(values.detach())
    if ordered.dtype.is_floating_point:
        fill = float("-inf") if largest else float("inf")
    else:
        fill = torch.iinfo(ordered.dtype).min if largest else torch.iinfo(ordered.dtype).max
    nan = before & (ordered != ordered)
    masked = torch.where(before & ~nan, ordered, fill)
    best = masked.amax(dim, keepdim=True) if largest else masked.amin(dim, keepdim=True)
    chosen = torch.where(nan.any(dim, keepdim=True), _last(nan, dim, world),
                         _last(before & ~nan & (ordered == best), dim, world))
    value = values.gather(dim, chosen.clamp(min=0))
    index = torch.where(chosen >= 0, indices.gather(dim, chosen.clamp(min=0)), -1)
    return value, index


def extreme_combine(values: torch.Tensor, indices: torch.Tensor, carry_value: torch.Tensor,
                    carry_index: torch.Tensor, dim: int, rank: int, world: int, largest: bool):
    """The global running max (min): this rank's where it replaces the carry (see :func:`_at_least`)."""
    start = Layout(world).start(rank, values.shape[dim])
    local = _at_least(values, carry_value, largest) | (carry_index < 0)
    return torch.where(local, values, carry_value), torch.where(local, indices + start, carry_index)


class ScanTransport(Transport):
    name = "scan"
    order = 25
    runtime = (torch.ops.cp_passes.sequence_gather.default, torch.ops.cp_passes.metadata_gather.default)

    def _gather(self, edit, x: torch.fx.Node, dim: int, name: str, before, grad: bool) -> torch.fx.Node:
        """All ranks' ``x`` along ``dim``; with autograd (backward: reduce-scatter) when ``grad``."""
        op = torch.ops.cp_passes.sequence_gather if grad else torch.ops.cp_passes.metadata_gather
        return edit.insert(op.default, (x, dim, edit.world, edit.group_name), name=name, before=before)

    def apply(self, edit, request: Scan) -> None:
        node, dim, after = request.node, request.dim, request.node.next
        if request.op in ("cummax", "cummin"):
            return self._extreme(edit, request)
        last = edit.insert(aten.narrow.default, (node, dim, -1, 1), name="cp_scan_last", before=after)
        gathered = self._gather(edit, last, dim, "cp_scan_totals", after, meta_val(node).is_floating_point())
        carry = edit.insert(carry_reduce, (gathered, dim, edit.rank, edit.world, request.op), name="cp_scan_carry",
                            before=after)
        scanned = edit.insert(combine, (node, carry, request.op), name="cp_scanned", before=after)
        edit.replace_uses(node, scanned)

    def _extreme(self, edit, request: Scan) -> None:
        node, dim = request.node, request.dim
        parts = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        after = max(parts.values(), key=lambda n: list(node.graph.nodes).index(n)).next if parts else node.next
        values = parts.get(0) or edit.insert(operator.getitem, (node, 0), name="cp_scan_values", before=after)
        indices = parts.get(1) or edit.insert(operator.getitem, (node, 1), name="cp_scan_indices", before=after)
        largest = request.op == "cummax"
        last_v = edit.insert(aten.narrow.default, (values, dim, -1, 1), name="cp_scan_last", before=after)
        last_i = edit.insert(global_index, (indices, values, dim, edit.rank, edit.world), name="cp_scan_last_index",
                             before=after)
        grad = meta_val(request.source).is_floating_point()
        gathered_v = self._gather(edit, last_v, dim, "cp_scan_totals", after, grad)
        gathered_i = self._gather(edit, last_i, dim, "cp_scan_total_indices", after, False)
        carry = edit.insert(extreme_carry, (gathered_v, gathered_i, dim, edit.rank, edit.world, largest),
                            name="cp_scan_carry", before=after)
        carry_v = edit.insert(operator.getitem, (carry, 0), name="cp_scan_carry_value", before=after)
        carry_i = edit.insert(operator.getitem, (carry, 1), name="cp_scan_carry_index", before=after)
        out = edit.insert(extreme_combine, (values, indices, carry_v, carry_i, dim, edit.rank, edit.world, largest),
                          name="cp_scanned", before=after)
        for k, part in ((0, values), (1, indices)):
            new = edit.insert(operator.getitem, (out, k), name=f"cp_scanned_{k}", before=after)
            edit.replace_uses(part, new)

    def cost(self, request: Scan, layout, rank, local_len) -> Cost:
        total = numel_hint(request.node if request.op not in ("cummax", "cummin") else request.source)
        total = total // local_len * meta_val(request.source).dtype.itemsize
        if request.op in ("cummax", "cummin"):
            total += total // meta_val(request.source).dtype.itemsize * 8  # and each running value's index
        moved = (layout.world - 1) * total
        metadata = 0 if meta_val(request.source).is_floating_point() else moved  # gathered without autograd
        return Cost("all_gather each rank's last running value | bw reduce_scatter",
                    moved // meta_val(request.source).dtype.itemsize, moved, len(layout.preceding_ranks(rank)) * total,
                    moved, metadata)


SCAN = register_transport(ScanTransport())
