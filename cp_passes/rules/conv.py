"""Convolutions along the sequence: causal ones (found by :mod:`cp_passes.match.causal_conv`) take a halo."""

from __future__ import annotations

import torch

from ..errors import module_path
from ..transports.halo import ConvHalo
from .registry import Rewrite, RuleContext, register_rule

aten = torch.ops.aten


@register_rule(aten.conv1d, aten.convolution, aten.conv2d, aten.conv3d, aten._convolution,
               aten.conv_transpose1d, aten.conv_transpose2d)
def conv_rule(ctx: RuleContext):
    if not ctx.is_seq(ctx.arg("input")):
        return None
    match = ctx.matches.convs.get(ctx.node, f"{ctx.node.target} is not a 1-D convolution cp_passes reads")
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
