"""``arange`` over the sequence: positions, made global by the positions transport."""

from __future__ import annotations

import torch

from ..graph.analysis import meta_val, window
from ..transports.positions import Arange
from .registry import Rewrite, RuleContext, register_rule

aten = torch.ops.aten

LENGTH_FIX = (
    "the local sequence length differs from the global one under CP; compute with shapes only, or pass the "
    "global value in as an input"
)


@register_rule(aten.arange)
def arange_rule(ctx: RuleContext):
    node = ctx.node
    if not ctx.is_seq(node):
        for value in ctx.args.values():
            val = meta_val(value) if isinstance(value, torch.fx.Node) else None
            if isinstance(val, (torch.SymInt, torch.SymFloat)) and ctx.sym in val.node.expr.free_symbols:
                ctx.refuse("it uses the local sequence length as a value", LENGTH_FIX)
        return None
    start, step = ctx.args.get("start", 0), ctx.args.get("step", 1)
    rows = window(meta_val(node).shape[0], ctx.sym, ctx.spec.pad_multiple)
    if start != 0 or step != 1 or rows is None:
        ctx.refuse(
            f"it is an arange over the sequence with start={start}, step={step}, length {meta_val(node).shape[0]}; "
            f"only arange(seq_len) (positions 0..seq_len-1) and arange(seq_len // m) (windows of m positions) "
            f"have a rule",
            "build positions as torch.arange(seq_len) (cp_passes offsets it) or pass position_ids",
        )
    what = "positions" if rows == 1 else f"windows of {rows} positions"
    return Rewrite("arange_positions", "positions", Arange(node, ctx.args["end"]),
                   note=f"this rank's global {what} ({ctx.layout.kind} layout, local length {ctx.local_len()})")
