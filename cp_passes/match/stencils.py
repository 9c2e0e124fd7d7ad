"""Constant-offset reads along the sequence: ``pad(x, (a, b), value)[..., start:start + s]``.

Each slice that keeps exactly the sequence length reads ``x[t + start - a]`` (``value`` outside the
sequence): a shift the shift transport serves. The pad is claimed when every user is such a slice.
"""

from __future__ import annotations

import torch
import torch.fx

from ..graph.analysis import bind_args, expr_of, meta_val, seq_dims, seq_multiple
from ..transports.shift import Shift

aten = torch.ops.aten

PADS = (aten.constant_pad_nd.default, aten.pad.default)


def match_shifts(pad: torch.fx.Node, sym) -> list[Shift]:
    """The shifts ``pad``'s users read, or ``[]`` unless every user is one."""
    args = bind_args(pad)
    if args.get("mode", "constant") != "constant":
        return []
    source, widths = args["self"], list(args["pad"])
    value = args.get("value") or 0
    ndim = meta_val(source).dim()
    padded = {ndim - 1 - i: (widths[2 * i], widths[2 * i + 1]) for i in range(len(widths) // 2)
              if widths[2 * i] or widths[2 * i + 1]}
    dims = seq_dims(source, sym)
    if len(padded) != 1 or len(dims) != 1:
        return []
    ((dim, (before, after)),) = padded.items()
    if dim != dims[0] or seq_multiple(meta_val(source).shape[dim], sym) != 1 or before < 0 or after < 0:
        return []
    length = expr_of(meta_val(source).shape[dim])
    shifts = []
    for user in pad.users:
        if user.target is not aten.slice.Tensor:
            return []
        sl = bind_args(user)
        start = sl["start"] or 0
        if sl["dim"] % ndim != dim or sl["step"] != 1 or not isinstance(start, int) or start < 0:
            return []
        if expr_of(meta_val(user).shape[dim]) != length:
            return []
        shifts.append(Shift(user, source, dim, start - before, value, pad))
    return shifts
