"""Scan: a running op along the sequence is a local scan plus a carry from the ranges before.

``cumsum``, ``cumprod``, ``logcumsumexp``, ``cummax`` and ``cummin`` are associative: within one of a rank's
ranges (the whole shard, or a balanced layout's head and tail apart: :func:`range_scan`) they give the
running value, and combining it with the running value at the end of every range before it in the sequence
(the carry) gives the global one. Each range's last running value is all-gathered (one row per range and
batch row, with autograd: the backward is a reduce-scatter) and each carry is reduced from the gathered rows
that precede its range (:meth:`Layout.preceding_chunks`), masked rather than sliced so every rank reads the
gathered rows.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx

from ..graph.analysis import bind_args, meta_val, numel_hint
from ..layout import KINDS, Layout, chunk_len
from .base import Cost, Transport, register_transport
from .gathers import sequence_gather_op  # noqa: F401  (registers cp_passes::sequence_gather)
from .gathers import metadata_gather_op  # noqa: F401  (registers cp_passes::metadata_gather)

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


_OPS = {"cumsum": torch.cumsum, "cumprod": torch.cumprod, "logcumsumexp": torch.logcumsumexp,
        "cummax": torch.cummax, "cummin": torch.cummin}


def range_scan(x: torch.Tensor, dim: int, op: str, chunks: int, dtype=None):
    """``op`` along ``dim`` within each of the rank's ``chunks`` ranges (a balanced layout's head and tail
    are not adjacent in the sequence): the local scan the carries complete. cummax/cummin indices count
    from each range's first row."""
    dim = dim % x.dim()
    parts = x.unflatten(dim, (chunks, chunk_len(x.shape[dim], chunks)))
    out = _OPS[op](parts, dim + 1, dtype=dtype) if dtype is not None else _OPS[op](parts, dim + 1)
    # reshaped to x's own sizes: the rows are the local length, not chunks * (length // chunks)
    if op in ("cummax", "cummin"):
        return out[0].reshape(x.shape), out[1].reshape(x.shape)
    return out.reshape(x.shape)


def range_last(x: torch.Tensor, dim: int, chunks: int) -> torch.Tensor:
    """Each range's last row along ``dim`` (``chunks`` rows)."""
    size = chunk_len(x.shape[dim], chunks)
    rows = torch.arange(1, chunks + 1, device=x.device) * size - 1
    return x.index_select(dim, rows)


def _preceding(gathered: torch.Tensor, dim: int, rank: int, world: int, kind: str) -> torch.Tensor:
    """Boolean ``[.., chunks, ranges of the gather, ..]`` (at ``dim``, ``dim + 1``), broadcastable against
    ``gathered.unsqueeze(dim)``: which gathered ranges precede each of this rank's ranges."""
    before = torch.tensor(Layout(world, kind).preceding_chunks(rank), dtype=torch.bool, device=gathered.device)
    shape = [1] * (gathered.dim() + 1)
    shape[dim], shape[dim + 1] = before.shape
    return before.view(shape)


def _per_row(carry: torch.Tensor, dim: int, local_len, chunks: int, device) -> torch.Tensor:
    """A per-range carry (``chunks`` rows at ``dim``) for every local row."""
    if chunks == 1:
        return carry
    return carry.index_select(dim, torch.arange(local_len, device=device) // chunk_len(local_len, chunks))


def carry_reduce(gathered: torch.Tensor, local: torch.Tensor, dim: int, rank: int, world: int, kind: str,
                 op: str) -> torch.Tensor:
    """The running values at the end of every range before each of this rank's reduced into one carry (the
    op's identity where none precedes), broadcastable against the local rows."""
    dim = dim % gathered.dim()
    before, rows = _preceding(gathered, dim, rank, world, kind), gathered.unsqueeze(dim)
    if op == "cumsum":
        carry = torch.where(before, rows, 0).sum(dim + 1, dtype=gathered.dtype)
    elif op == "cumprod":
        carry = torch.where(before, rows, 1).prod(dim + 1, dtype=gathered.dtype)
    else:
        carry = torch.where(before, rows, float("-inf")).logsumexp(dim + 1)
    return _per_row(carry, dim, local.shape[dim], Layout(world, kind).chunks, gathered.device)


def combine(local: torch.Tensor, carry: torch.Tensor, op: str) -> torch.Tensor:
    if op == "cumsum":
        return local + carry
    if op == "cumprod":
        return local * carry
    return torch.logaddexp(local, carry)


def _range_starts(rank: int, world: int, kind: str, local_len, device) -> torch.Tensor:
    """The global position of the first row of each local row's range."""
    layout = Layout(world, kind)
    return layout.positions(rank, local_len, device) - torch.arange(local_len, device=device) % layout.chunk_len(
        local_len)


def _along(x: torch.Tensor, dim: int) -> list[int]:
    shape = [1] * x.dim()
    shape[dim] = -1
    return shape


def global_index(indices: torch.Tensor, dim: int, rank: int, world: int, kind: str) -> torch.Tensor:
    """The global position of each range's last running max (min)."""
    dim = dim % indices.dim()
    layout = Layout(world, kind)
    starts = _range_starts(rank, world, kind, indices.shape[dim], indices.device)
    return range_last(indices + starts.view(_along(indices, dim)), dim, layout.chunks)


def _ordered(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.uint8) if values.dtype == torch.bool else values


def _at_least(a: torch.Tensor, b: torch.Tensor, largest: bool) -> torch.Tensor:
    """Whether ``a`` replaces ``b`` as a running max (min) when it comes later: ``a >= b`` (``<=``), and NaN
    is the most extreme value, as in ``torch.cummax``."""
    a, b = _ordered(a), _ordered(b)
    return (a >= b if largest else a <= b) | (a != a)


def extreme_carry(values: torch.Tensor, indices: torch.Tensor, local: torch.Tensor, dim: int, rank: int, world: int,
                  kind: str, largest: bool):
    """For each of this rank's ranges, the running max (min) at the end of the ranges before it and its global
    index: a NaN if any (the last one), else the best value with, among equal values, the later index, as
    ``torch.cummax`` picks; index -1 where no range precedes. Broadcastable against the local rows."""
    dim = dim % values.dim()
    before = _preceding(values, dim, rank, world, kind)
    ordered = _ordered(values.detach()).unsqueeze(dim)
    if ordered.dtype.is_floating_point:
        fill = float("-inf") if largest else float("inf")
    else:
        fill = torch.iinfo(ordered.dtype).min if largest else torch.iinfo(ordered.dtype).max
    nan = before & (ordered != ordered)
    masked = torch.where(before & ~nan, ordered, fill)
    best = masked.amax(dim + 1, keepdim=True) if largest else masked.amin(dim + 1, keepdim=True)
    order = torch.tensor(Layout(world, kind).gather_chunks(), device=values.device).view(_along(ordered, dim + 1))

    def last(condition):  # the gathered range latest in the sequence where condition holds (-1 if none)
        key = torch.where(condition, order, -1)
        return torch.where(key.amax(dim + 1, keepdim=True) >= 0, key.argmax(dim + 1, keepdim=True), -1)

    chosen = torch.where(nan.any(dim + 1, keepdim=True), last(nan), last(before & ~nan & (ordered == best)))
    chosen = chosen.squeeze(dim + 1)  # a gathered range for each local range, at dim
    value = values.gather(dim, chosen.clamp(min=0))
    index = torch.where(chosen >= 0, indices.gather(dim, chosen.clamp(min=0)), -1)
    chunks, length = Layout(world, kind).chunks, local.shape[dim]
    return _per_row(value, dim, length, chunks, values.device), _per_row(index, dim, length, chunks, values.device)


def extreme_combine(values: torch.Tensor, indices: torch.Tensor, carry_value: torch.Tensor,
                    carry_index: torch.Tensor, dim: int, rank: int, world: int, kind: str, largest: bool):
    """The global running max (min): this rank's where it replaces the carry (see :func:`_at_least`)."""
    dim = dim % values.dim()
    starts = _range_starts(rank, world, kind, values.shape[dim], values.device).view(_along(values, dim))
    local = _at_least(values, carry_value, largest) | (carry_index < 0)
    return torch.where(local, values, carry_value), torch.where(local, indices + starts, carry_index)


class ScanTransport(Transport):
    name = "scan"
    order = 25
    layouts = KINDS
    runtime = (torch.ops.cp_passes.sequence_gather.default, torch.ops.cp_passes.metadata_gather.default)

    def _gather(self, edit, x: torch.fx.Node, dim: int, name: str, before, grad: bool) -> torch.fx.Node:
        """All ranks' ``x`` along ``dim``; with autograd (backward: reduce-scatter) when ``grad``."""
        op = torch.ops.cp_passes.sequence_gather if grad else torch.ops.cp_passes.metadata_gather
        return edit.insert(op.default, (x, dim, edit.world, edit.group_name), name=name, before=before)

    def _local(self, edit, request: Scan, after) -> torch.fx.Node:
        """The scan within each of the rank's ranges: the node itself when it holds one."""
        chunks = edit.layout.chunks
        if chunks == 1:
            return request.node
        dtype = bind_args(request.node).get("dtype")
        return edit.insert(range_scan, (edit.current(request.source), request.dim, request.op, chunks, dtype),
                           name="cp_range_scan", before=after)

    def apply(self, edit, request: Scan) -> None:
        node, dim, after = request.node, request.dim, request.node.next
        if request.op in ("cummax", "cummin"):
            return self._extreme(edit, request)
        kind, chunks = edit.layout.kind, edit.layout.chunks
        local = self._local(edit, request, after)
        last = edit.insert(range_last, (local, dim, chunks), name="cp_scan_last", before=after)
        gathered = self._gather(edit, last, dim, "cp_scan_totals", after, meta_val(node).is_floating_point())
        carry = edit.insert(carry_reduce, (gathered, local, dim, edit.rank, edit.world, kind, request.op),
                            name="cp_scan_carry", before=after)
        scanned = edit.insert(combine, (local, carry, request.op), name="cp_scanned", before=after)
        edit.replace_uses(node, scanned)

    def _extreme(self, edit, request: Scan) -> None:
        node, dim = request.node, request.dim
        kind, chunks = edit.layout.kind, edit.layout.chunks
        parts = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        after = max(parts.values(), key=lambda n: list(node.graph.nodes).index(n)).next if parts else node.next
        local = self._local(edit, request, after)
        if local is node:
            values = parts.get(0) or edit.insert(operator.getitem, (node, 0), name="cp_scan_values", before=after)
            indices = parts.get(1) or edit.insert(operator.getitem, (node, 1), name="cp_scan_indices", before=after)
        else:
            values = edit.insert(operator.getitem, (local, 0), name="cp_scan_values", before=after)
            indices = edit.insert(operator.getitem, (local, 1), name="cp_scan_indices", before=after)
        largest = request.op == "cummax"
        last_v = edit.insert(range_last, (values, dim, chunks), name="cp_scan_last", before=after)
        last_i = edit.insert(global_index, (indices, dim, edit.rank, edit.world, kind), name="cp_scan_last_index",
                             before=after)
        grad = meta_val(request.source).is_floating_point()
        gathered_v = self._gather(edit, last_v, dim, "cp_scan_totals", after, grad)
        gathered_i = self._gather(edit, last_i, dim, "cp_scan_total_indices", after, False)
        carry = edit.insert(extreme_carry, (gathered_v, gathered_i, values, dim, edit.rank, edit.world, kind, largest),
                            name="cp_scan_carry", before=after)
        carry_v = edit.insert(operator.getitem, (carry, 0), name="cp_scan_carry_value", before=after)
        carry_i = edit.insert(operator.getitem, (carry, 1), name="cp_scan_carry_index", before=after)
        out = edit.insert(extreme_combine, (values, indices, carry_v, carry_i, dim, edit.rank, edit.world, kind,
                                            largest), name="cp_scanned", before=after)
        for k in (0, 1):
            new = edit.insert(operator.getitem, (out, k), name=f"cp_scanned_{k}", before=after)
            if k in parts:
                edit.replace_uses(parts[k], new)

    def cost(self, request: Scan, layout, rank, local_len) -> Cost:
        total = numel_hint(request.node if request.op not in ("cummax", "cummin") else request.source)
        total = total // local_len * meta_val(request.source).dtype.itemsize
        if request.op in ("cummax", "cummin"):
            total += total // meta_val(request.source).dtype.itemsize * 8  # and each running value's index
        mine = set(range(rank * layout.chunks, (rank + 1) * layout.chunks))  # this rank's rows of the gather
        needed = sum(any(column) for g, column in enumerate(zip(*layout.preceding_chunks(rank))) if g not in mine)
        moved = (layout.world - 1) * layout.chunks * total
        metadata = 0 if meta_val(request.source).is_floating_point() else moved  # gathered without autograd
        return Cost("all_gather each range's last running value | bw reduce_scatter",
                    moved // meta_val(request.source).dtype.itemsize, moved, needed * total, moved, metadata)


SCAN = register_transport(ScanTransport())
