"""Convolutions along the sequence: causal ones (found by :mod:`cp_passes.match.causal_conv`) and causal
windows (``pad(x, (k - 1, 0)).unfold(seq, k, 1)``, found by :mod:`cp_passes.match.stencils`) take a halo."""

from __future__ import annotations

import torch

from ..errors import module_path
from ..match import FailedMatch
from ..transports.halo import ConvHalo
from .registry import Rewrite, RuleContext, register_rule

aten = torch.ops.aten


@register_rule(aten.conv1d, aten.convolution, aten.conv2d, aten.conv3d, aten._convolution,
               aten.conv_transpose1d, aten.conv_transpose2d)
def conv_rule(ctx: RuleContext):
    if not ctx.is_seq(ctx.arg("input")):
        return None
    match = ctx.matches.convs.get(ctx.node,
                                  FailedMatch(f"{ctx.node.target} is not a 1-D convolution cp_passes reads"))
    declared = ctx.spec.conv_declared(module_path(ctx.node))
    if not isinstance(match, ConvHalo):
        said = (f"the spec declares modules '{declared}' causal, but the graph shows {match}" if declared
                else f"it convolves along the sequence and is not causal in a form cp_passes reads ({match})")
        ctx.refuse(
            said,
            "write the causal convolution as F.pad(x, ((k-1)*dilation, 0)) then conv1d(padding=0), or "
            "conv1d(padding=(k-1)*dilation)[..., :seq]; a non-causal convolution needs both neighbours (not "
            "supported)",
        )
    form = "pad" if match.pad is not None else "slice"
    note = f"halo (k-1)*dilation = {match.halo}" + (f"; declared by '{declared}'" if declared else
                                                    "; causal form read from the graph")
    return Rewrite(f"causal_conv_{form}", "halo", match, note=note)


@register_rule(aten.unfold)
def unfold_rule(ctx: RuleContext):
    src, dim = ctx.arg("self"), ctx.arg("dimension")
    if dim % max(ctx.ndim(src), 1) not in ctx.seq_dims(src):
        return None
    match = ctx.matches.convs.get(ctx.node)
    if match is None:
        ctx.refuse("it unfolds windows along the sequence, and not as a causal window cp_passes reads",
                   "write causal windows as F.pad(x, (k - 1, 0)).unfold(seq_dim, k, 1), or unfold outside the "
                   "compiled module")
    return Rewrite("causal_window_unfold", "halo", match, note=f"halo k - 1 = {match.halo}; the pad's zeros at the "
                                                                f"sequence start")
