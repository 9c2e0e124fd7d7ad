"""Causal convolutions along the sequence: the pad (or the trailing slice) that makes them causal."""

from __future__ import annotations

import torch
import torch.fx

from ..graph.analysis import bind_args, expr_of, meta_val, seq_dims, seq_multiple
from ..transports.halo import ConvHalo
from .failed import FailedMatch

aten = torch.ops.aten

CONVS = (aten.conv1d.default, aten.convolution.default)


def match_causal_conv(conv: torch.fx.Node, sym) -> ConvHalo | FailedMatch:
    """The causal form of a 1-D convolution over [batch, channels, seq], or why it is not one:
    ``conv(pad(x, (halo, 0)))`` or ``conv(x, padding=halo)[..., :seq]`` with ``halo = (k - 1) * dilation``."""
    if conv.target not in CONVS:
        return FailedMatch(f"{conv.target} is not a 1-D convolution cp_passes reads")
    args = bind_args(conv)
    x, weight = args["input"], args["weight"]
    if args.get("transposed"):
        return FailedMatch("it is a transposed convolution")
    padded = isinstance(x, torch.fx.Node) and x.target in (aten.constant_pad_nd.default, aten.pad.default)
    src = bind_args(x)["self"] if padded else x
    if meta_val(src).dim() != 3 or seq_dims(src, sym) != (2,) or seq_multiple(meta_val(src).shape[2], sym) != 1:
        return FailedMatch(f"its input {tuple(meta_val(src).shape)} is not [batch, channels, seq] with the sequence "
                           f"last")
    kernel = meta_val(weight).shape[-1]
    stride, padding, dilation = list(args["stride"]), args["padding"], list(args["dilation"])
    if isinstance(padding, str) or stride != [1]:
        return FailedMatch(f"stride {stride}, padding {padding!r}: only stride 1 with numeric padding has a causal "
                           f"form")
    halo = (kernel - 1) * dilation[0]
    padding = list(padding)
    found = f"kernel {kernel}, dilation {dilation[0]}, padding {padding}"
    if padding == [0] and padded:
        pad_args = bind_args(x)
        pad = list(pad_args["pad"])
        value = pad_args.get("value") or 0
        if pad_args.get("mode", "constant") != "constant" or value != 0 or len(x.users) != 1:
            return FailedMatch(f"{found}, input padded with mode {pad_args.get('mode')!r} value {value}")
        if pad == [halo, 0]:
            return ConvHalo(conv, pad_args["self"], halo, pad=x)
        return FailedMatch(f"{found}, input padded by {pad} along the sequence; causal needs [{halo}, 0]")
    if padding == [halo] and len(conv.users) == 1:
        (user,) = conv.users
        if user.target is aten.slice.Tensor:
            sl = bind_args(user)
            same_len = expr_of(meta_val(user).shape[2]) == expr_of(meta_val(x).shape[2])
            if sl["dim"] % 3 == 2 and sl["start"] in (None, 0) and sl["step"] == 1 and same_len:
                return ConvHalo(conv, x, halo, slice=user)
    return FailedMatch(f"{found}: neither pad(x, ({halo}, 0)) then conv, nor conv(padding={halo})[..., :seq]")
