"""Reads of sequence rows by global position (the picks transport): ``x.select(seq, i)``, ``x[..., idx]``,
``gather`` and ``index_select`` along the sequence by an index every rank holds whole, and ``argmax`` or
``argmin`` of integer or boolean values along it."""

from __future__ import annotations

import torch
import torch.fx

from ..graph.analysis import meta_val
from ..transports.picks import GlobalArgExtreme, Pick
from .registry import Rewrite, RuleContext, Value

aten = torch.ops.aten

_NOTE = "every rank gets the rows by their global position: the owner's rows all-reduced with the others' zeros"


def _sequence_dim(ctx: RuleContext, x, dim) -> int | None:
    """``dim`` normalised, when it is ``x``'s one sequence dim."""
    if not isinstance(x, torch.fx.Node) or not isinstance(dim, int) or len(ctx.seq_dims(x)) != 1:
        return None
    dim = dim % ctx.ndim(x)
    return dim if ctx.seq_dims(x) == (dim,) else None


def _whole_index(ctx: RuleContext, index) -> bool:
    """An integer index tensor every rank holds whole (its values are the single device's)."""
    return (isinstance(index, torch.fx.Node) and isinstance(meta_val(index), torch.Tensor)
            and not ctx.is_seq(index) and not ctx.is_partial(index)
            and not meta_val(index).is_floating_point() and meta_val(index).dtype != torch.bool)


def _select(ctx: RuleContext, dim: int) -> Rewrite | None:
    """``x.select(dim, i)`` with a constant ``i`` (``-1`` counts from the global end). An index computed from the
    length never arrives: dynamo makes it a constant and guards on the length (:mod:`~cp_passes.compiler.guards`
    checks that guard at the global length)."""
    index = ctx.arg("index")
    if not isinstance(index, int):
        return None
    where = f"position {index}" if index >= 0 else f"the global length - {-index}"
    return Rewrite("pick_row", "picks", Pick(ctx.node, ctx.arg("self"), dim, "select", index),
                   output=Value.REPLICATED, note=f"row at {where}: {_NOTE}")


def _written(node: torch.fx.Node) -> torch.fx.Node | None:
    """An op that writes into ``node`` in place, or into a view of it (``h[:, 0] = 0``), if any."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        for user in n.users:
            schema = getattr(user.target, "_schema", None)
            if user in seen or schema is None:
                continue
            seen.add(user)
            if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
                return user
            if any(r.alias_info is not None for r in schema.returns):
                stack.append(user)
    return None


def pick(ctx: RuleContext) -> Rewrite | None:
    """The picks transport's rewrite when this node reads sequence rows by global position; None otherwise. Rows
    written in place after the pick (``h[:, 0] = 0``) are refused: the pick is a copy on every rank."""
    rewrite = _pick(ctx)
    if rewrite is not None and isinstance(rewrite.request, Pick) and (write := _written(ctx.node)) is not None:
        ctx.refuse(f"{write.target} writes in place into rows of the sequence this op reads; each rank holds only "
                   f"its own rows, and the row written may be another rank's",
                   "write out of place over every position: torch.where(positions == i, value, h), with positions "
                   "an arange over the sequence")
    return rewrite


def _pick(ctx: RuleContext) -> Rewrite | None:
    target = ctx.node.target
    packet = target.overloadpacket
    x = ctx.args.get("self")
    if ctx.is_partial(x) if isinstance(x, torch.fx.Node) else True:
        return None
    if packet is aten.select and target is aten.select.int:
        dim = _sequence_dim(ctx, x, ctx.arg("dim"))
        return _select(ctx, dim) if dim is not None else None
    if target is aten.index.Tensor:
        indices = ctx.arg("indices")
        at = [d for d, i in enumerate(indices) if i is not None and d in ctx.seq_dims(x)]
        if len(at) != 1 or _sequence_dim(ctx, x, at[0]) is None:
            return None
        if not all(_whole_index(ctx, i) for i in indices if i is not None):
            return None
        return Rewrite("pick_rows", "picks", Pick(ctx.node, x, at[0], "index"), output=Value.REPLICATED,
                       note=f"rows by a whole index tensor: {_NOTE}")
    if target in (aten.gather.default, aten.index_select.default):
        dim = _sequence_dim(ctx, x, ctx.arg("dim"))
        if dim is None or not _whole_index(ctx, ctx.arg("index")):
            return None
        kind = "gather" if target is aten.gather.default else "index_select"
        return Rewrite(f"pick_{kind}", "picks", Pick(ctx.node, x, dim, kind), output=Value.REPLICATED,
                       note=f"{kind} by a whole index: {_NOTE}")
    if target in (aten.argmax.default, aten.argmin.default):
        dim = _sequence_dim(ctx, x, ctx.args.get("dim"))
        if dim is None or meta_val(x).is_floating_point() or meta_val(x).is_complex():
            return None
        op = "max" if target is aten.argmax.default else "min"
        return Rewrite(f"global_arg{op}", "picks", GlobalArgExtreme(ctx.node, dim, bool(ctx.args.get("keepdim")), op),
                       output=Value.REPLICATED,
                       note=f"the first global position of the {op} along the sequence: the ranks' {op} and its "
                            f"position all-reduced (no autograd)")
    return None
