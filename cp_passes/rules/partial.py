"""A per-rank partial sum (:attr:`~.registry.Value.PARTIAL`): which ops it flows through as it is.

As DTensor's ``Partial`` placement: a sum over the sequence computed on a shard is this rank's share, and the
ranks' shares add up to the single-device value. It stays a share through ops that are linear in it (negation,
casts that keep sums, views, sums, products with values every rank holds); any other op reads the global value,
which these rules ask of the ``reductions`` transport. The planner calls :func:`partial_rule` instead of an
op's own rule wherever an input is a partial sum, and :func:`row_counts` to tell a division by a row count
computed from the local length.
"""

from __future__ import annotations

import sympy
import torch
import torch.fx

from ..errors import op_name, source_line
from ..graph.analysis import has_symbol, meta_val
from ..transports.reductions import GlobalSum, Share
from .registry import Rewrite, RuleContext, Value, out_of_place
from .views import VIEW_OPS

aten = torch.ops.aten



_PARTIAL_LINEAR = {aten.neg, aten.clone, aten._to_copy, aten.to, aten.sum, aten.nansum, *VIEW_OPS}
_CASTS = {aten._to_copy, aten.to, aten.type_as}
_PARTIAL_METADATA = {aten._assert_tensor_metadata, aten.sym_size, aten.sym_numel, aten.sym_stride}
"""Ops that read a partial sum's shape or dtype only."""


def _linear_cast(ctx: RuleContext) -> bool:
    """A cast that keeps sums: to a floating type, or from an integer to an integer at least as wide."""
    source, out = meta_val(ctx.node.args[0]).dtype, meta_val(ctx.node).dtype
    if out.is_floating_point or out.is_complex:
        return True
    return (not source.is_floating_point and not source.is_complex and source is not torch.bool
            and out is not torch.bool and out.itemsize >= source.itemsize)


def _argument_nodes(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Every node ``node`` reads, once per argument that holds it (``all_input_nodes`` lists each once)."""
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), lambda a: found.append(a) or a)
    return found


def partial_rule(ctx: RuleContext, origin: torch.fx.Node, lengths: tuple[str, ...] = ()) -> Value | Rewrite | None:
    """A per-rank partial sum flows as it is through ops that are linear in it (as their first operand). Added to
    values every rank holds whole, it stays a share and they enter as theirs (``1 / P``); an integer one is made
    global instead. Any other op reads the global sum (a ``reductions`` rewrite), and the row counts in ``lengths``
    (arguments computed from the local length, ``sum / x.shape[0]``) the global count."""
    packet = (out_of_place(ctx.node.target) or ctx.node.target).overloadpacket  # add_ adds as add does
    if packet in _PARTIAL_METADATA:
        return None
    tensors = ctx.tensor_inputs()
    partial = [t for t in tensors if ctx.is_partial(t)]
    others = [t for t in tensors if not ctx.is_partial(t)]
    scalars = [a for a in ctx.node.args[1:] if isinstance(a, (int, float)) and not isinstance(a, bool)]
    first = ctx.node.args[0] if ctx.node.args else None
    reads = [a for a in _argument_nodes(ctx.node) if ctx.is_partial(a)]  # by argument: mul(p, p) reads p twice
    ok = False
    if packet in _PARTIAL_LINEAR:
        ok = (reads == [first] and not any(ctx.is_seq(t) for t in others)
              and (packet not in _CASTS or _linear_cast(ctx)))
    elif packet is aten.mul:
        ok = len(reads) == 1 and not any(ctx.is_seq(t) for t in others)
    elif packet is aten.div:  # over a row count from the length (``lengths``) it needs the global count
        ok = (not lengths and reads == [first] and not any(ctx.is_seq(t) for t in others)
              and ctx.args.get("rounding_mode") is None)
        count = _count_divisor(ctx, first, reads, lengths)
        if count is not None:
            return count
    elif packet in (aten.add, aten.sub):
        ok = not others and not scalars
    if ok:
        return Value.PARTIAL
    if any(ctx.is_seq(t) for t in others):
        ctx.refuse(
            f"its input is a per-rank partial sum over the sequence (from {op_name(origin)} at {source_line(origin)}); "
            f"{op_name(ctx.node)} is not linear in it, so applying it before the ranks' sums are added is wrong",
            "return the partial sum from the compiled module and add it up across ranks (dist.all_reduce) before "
            "this op",
        )
    floating = any(meta_val(t).is_floating_point() or meta_val(t).is_complex() for t in partial)
    if packet in (aten.add, aten.sub) and floating and not lengths:
        whole = tuple(name for name in ("self", "other") if name in ctx.args and not ctx.is_partial(ctx.args[name]))
        return Rewrite("share", "reductions", Share(ctx.node, whole), output=Value.PARTIAL,
                       note=f"a value every rank holds added to a per-rank share ({', '.join(whole)}): its 1/P "
                            f"enters, so the ranks' values still add up to the total")
    what = "a sum over the sequence" + (" over a row count from the length" if lengths else "")
    return Rewrite("global_sum", "reductions", GlobalSum(ctx.node, partial, origin, lengths),
                   note=f"{what} read by a non-linear op: its global value (all-reduced; backward all-reduced)")


def _count_divisor(ctx: RuleContext, first, reads, lengths) -> Rewrite | None:
    """A share divided by a count, a row count from the local length (``sum / x.shape[0]``, a mean over the
    sequence) or an integer partial sum (``where(mask, x, 0).sum() / mask.sum()``), is a share of the mean: this
    rank's sum over the global count (the count all-reduced; it has no gradient). The ranks' values add up to
    the single-device mean, as a loss's ``reduction="mean"`` does."""
    divisor = ctx.args.get("other")
    if ctx.args.get("rounding_mode") is not None or not reads or reads[0] is not first:
        return None
    counted = [d for d in reads[1:] if d is divisor]
    if reads[1:] != counted or (not lengths and not counted):
        return None
    if counted and (meta_val(divisor).is_floating_point() or meta_val(divisor).is_complex()
                    or meta_val(divisor).dtype == torch.bool):
        return None
    what = "a row count from the sequence length" if lengths else "an integer sum over the sequence (a count)"
    return Rewrite("global_count", "reductions", GlobalSum(ctx.node, counted, first, lengths), output=Value.PARTIAL,
                   note=f"a sum over the sequence divided by {what}: this rank's sum over the global count "
                        f"(all-reduced); the ranks' values add up to the mean")


def row_counts(ctx: RuleContext) -> tuple[str, ...]:
    """The divisor of ``partial / n`` when ``n`` is a row count from the local length (a multiple of it, as
    ``x.shape[0]`` of rows merged from the batch and the sequence): each rank's ``n`` is its share of the global
    count, so the division is made global. Empty for anything else."""
    if ctx.node.target.overloadpacket is not aten.div or not ctx.is_partial(ctx.args.get("self")):
        return ()
    divisor = ctx.args.get("other")
    if not isinstance(divisor, torch.fx.Node) or isinstance(meta_val(divisor), torch.Tensor) \
            or not has_symbol(divisor, ctx.sym) or ctx.args.get("rounding_mode") is not None:
        return ()
    expr = getattr(meta_val(divisor), "node", None)
    if expr is None:
        return ()
    count = expr.expr.replace(lambda e: type(e).__name__ == "ToFloat", lambda e: e.args[0])  # float(n) is n
    ratio = sympy.simplify(count / ctx.sym)
    return ("other",) if ratio.is_number and ratio > 0 else ()
