"""K/V head repetition (grouped-query attention), however the model spelled it."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.fx

from ..graph.analysis import expr_of, meta_val

aten = torch.ops.aten


@dataclass
class HeadRepeat:
    """``expanded = repeat_interleave(small, n_rep, dim=-3)`` on ``[B, H, S, D]``."""

    small: torch.fx.Node
    n_rep: int


def same_size(a, b) -> bool:
    return expr_of(a) == expr_of(b)


def is_whole_slice(node) -> bool:
    """``x[:, :, 0:]``: a slice that keeps every element."""
    return (isinstance(node, torch.fx.Node) and node.target is aten.slice.Tensor
            and tuple(node.args[2:]) in ((), (None,), (0,), (0, None), (0, sys.maxsize), (None, None))
            and not node.kwargs)


def match_head_repeat(node: torch.fx.Node) -> HeadRepeat | None:
    """Match ``repeat_interleave(x, n, dim=1)`` or ``x[:, :, None].expand(...).reshape(...)`` on [B, H, S, D]."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    if node.target is aten.repeat_interleave.self_int:
        x, reps = node.args[0], node.args[1]
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        if isinstance(reps, int) and dim is not None and meta_val(x).dim() == 4 and dim % 4 == 1:
            return HeadRepeat(x, reps)
        return None
    if node.target not in (aten.reshape.default, aten.view.default, aten._unsafe_view.default):
        return None
    cur = node.args[0]
    while isinstance(cur, torch.fx.Node) and cur.target in (aten.clone.default, aten.contiguous.default):
        cur = cur.args[0]
    if not (isinstance(cur, torch.fx.Node) and cur.target is aten.expand.default):
        return None
    expanded = cur
    unsq = expanded.args[0]
    while is_whole_slice(unsq):
        unsq = unsq.args[0]
    if not (isinstance(unsq, torch.fx.Node) and unsq.target is aten.unsqueeze.default and unsq.args[1] % 5 == 2):
        return None
    x = unsq.args[0]
    xs, es, out = meta_val(x).shape, meta_val(expanded).shape, meta_val(node).shape
    if len(xs) != 4 or len(es) != 5 or len(out) != 4 or not isinstance(es[2], int):
        return None
    n_rep = es[2]
    if not all(same_size(es[i], xs[j]) for i, j in ((0, 0), (1, 1), (3, 2), (4, 3))):
        return None
    if not (all(same_size(out[i], xs[i]) for i in (0, 2, 3)) and same_size(out[1], xs[1] * n_rep)):
        return None
    return HeadRepeat(x, n_rep)
