"""``masked_scatter`` of features every rank holds whole into the sharded sequence (the splice transport)."""

from __future__ import annotations

import torch

from ..graph.analysis import meta_val, seq_multiple
from ..transports.splice import Splice
from .registry import Rewrite, RuleContext, register_rule

aten = torch.ops.aten

_FIX = ("splice into [batch, seq, ...] embeddings with a mask of the same layout (or one that broadcasts over "
        "the trailing dims) and a source every rank holds whole, such as image features computed from the whole "
        "pixel_values")


@register_rule(aten.masked_scatter)
def _masked_scatter(ctx: RuleContext):
    x, mask, source = ctx.arg("self"), ctx.arg("mask"), ctx.arg("source")
    if ctx.is_seq(source):
        ctx.refuse("its source is sharded along the sequence, so the elements a rank's mask selects may sit "
                   "on other ranks", _FIX)
    shape = meta_val(x).shape
    if tuple(meta_val(ctx.node).shape) != tuple(shape) or meta_val(mask).dim() != len(shape):
        ctx.refuse(f"its mask {tuple(meta_val(mask).shape)} broadcasts the {tuple(shape)} tensor it scatters into, "
                   f"or has fewer dims; the splice has a rule only for a mask of the tensor's rank that broadcasts "
                   f"to its shape", _FIX)
    if ctx.seq_dims(x) != (1,) or ctx.seq_dims(mask) != (1,) or seq_multiple(shape[1], ctx.sym) != 1:
        ctx.refuse(f"it scatters into a {tuple(shape)} tensor sharded on dims {ctx.seq_dims(x)} with a mask "
                   f"sharded on dims {ctx.seq_dims(mask)}; the splice has a rule only for both sharded on dim 1 "
                   f"alone, with the local length there", _FIX)
    return Rewrite("masked_scatter_splice", "splice", Splice(ctx.node, x, mask, source),
                   note="each rank reads the source from the count of masked elements before its rows "
                        "(all-gathered per-row counts)")
