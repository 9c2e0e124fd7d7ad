"""Reads of neighbouring positions along the sequence, spelled with a pad.

- Constant-offset reads: ``pad(x, (a, b), value)[..., start:start + s]``. Each slice that keeps exactly the
  sequence length reads ``x[t + start - a]`` (``value`` outside the sequence): a shift the shift transport
  serves. The pad is claimed when every user is such a slice.
- Causal windows: ``pad(x, (k - 1, 0)).unfold(seq, k, 1)`` (a slice keeping every padded position may sit
  between): window ``t`` reads ``x[t - k + 1 .. t]``, the ``k - 1`` positions before a shard come from a halo.
"""

from __future__ import annotations

import torch
import torch.fx

from ..graph.analysis import bind_args, expr_of, meta_val, seq_dims, static_int, window
from ..transports.halo import ConvHalo
from ..transports.shift import Shift

aten = torch.ops.aten

PADS = (aten.constant_pad_nd.default, aten.pad.default)


def match_shifts(pad: torch.fx.Node, sym, multiple: int = 1) -> list[Shift]:
    """The shifts ``pad``'s users read, or ``[]`` unless every user is one. Along windows of positions (a dim
    of size ``s // m``, ``m`` dividing ``multiple``) a shift reads whole windows."""
    found = _padded_dim(pad, sym, multiple)
    if found is None:
        return []
    source, dim, before, after, value = found
    ndim = meta_val(source).dim()
    length = expr_of(meta_val(source).shape[dim])
    shifts = []
    for user in pad.users:
        if user.target is not aten.slice.Tensor:
            return []
        sl = bind_args(user)
        start = static_int(sl["start"] or 0, sym, multiple)
        if sl["dim"] % ndim != dim or sl["step"] != 1 or start is None or start < 0:
            return []
        if expr_of(meta_val(user).shape[dim]) != length:
            return []
        shifts.append(Shift(user, source, dim, start - before, value, pad))
    return shifts


def _padded_dim(pad: torch.fx.Node, sym, multiple: int = 1):
    """``(source, dim, before, after, value)`` when ``pad`` pads one dim, the unsplit sequence axis (or its
    windows, ``s // m`` with ``m`` dividing ``multiple``), else None."""
    args = bind_args(pad)
    if args.get("mode", "constant") != "constant":
        return None
    source, widths = args["self"], list(args["pad"])
    ndim = meta_val(source).dim()
    widths = [static_int(w, sym, multiple) for w in widths]  # a width that varies with the length (S // 2): None
    if None in widths:
        return None
    padded = {ndim - 1 - i: (widths[2 * i], widths[2 * i + 1]) for i in range(len(widths) // 2)
              if widths[2 * i] or widths[2 * i + 1]}
    dims = seq_dims(source, sym)
    if len(padded) != 1 or len(dims) != 1:
        return None
    ((dim, (before, after)),) = padded.items()
    if dim != dims[0] or window(meta_val(source).shape[dim], sym, multiple) is None or before < 0 or after < 0:
        return None
    return source, dim, before, after, args.get("value") or 0


def match_unfold_window(pad: torch.fx.Node, sym) -> tuple[ConvHalo, list[torch.fx.Node]] | None:
    """``pad(x, (k - 1, 0)).unfold(seq, k, 1)`` (through slices that keep every padded position): the window
    as a halo of ``k - 1`` rows, and the slices between."""
    found = _padded_dim(pad, sym)
    if found is None:
        return None
    source, dim, before, after, value = found
    if after or value != 0 or not before:
        return None
    ndim = meta_val(source).dim()
    slices, current = [], pad
    while len(current.users) == 1:
        (user,) = current.users
        if user.target is aten.slice.Tensor and bind_args(user)["dim"] % ndim == dim and bind_args(user)["step"] == 1 \
                and expr_of(meta_val(user).shape[dim]) == expr_of(meta_val(pad).shape[dim]):
            slices.append(user)
            current = user
            continue
        if user.target is aten.unfold.default:
            _, unfold_dim, size, step = user.args
            if unfold_dim % ndim == dim and step == 1 and size == before + 1:
                return ConvHalo(user, source, before, pad=pad, dim=dim), slices
        return None
    return None
