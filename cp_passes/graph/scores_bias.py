"""Attention scores computed with their bias in one op, written as the product and a sum before anything is
planned.

Bloom writes its scores as ``alibi.baddbmm(q, k^T, beta=1, alpha=1/sqrt(d))``: ``beta * alibi + alpha * (q
@ k^T)`` in one kernel. The product is the ``[q, k]`` block hand-written attention is matched by, and the
bias (ALiBi's ``slope * key position``, one value per key) lands on its key axis. Where the product of a
``baddbmm`` carries the sequence on its rows and its columns, it becomes ``bmm`` and pointwise ops (the same
math, the same gradients), so the block is matched and the bias is brought with the keys like any key-side
operand. Every other ``baddbmm`` is left to its contraction rule.
"""

from __future__ import annotations

import torch
import torch.fx

from .analysis import seq_dims
from .emit import emit

aten = torch.ops.aten


def _scaled(graph: torch.fx.Graph, like: torch.fx.Node, x: torch.fx.Node, factor) -> torch.fx.Node:
    return x if factor == 1 else emit(graph, like, aten.mul.Tensor, (x, factor))


def scores_bias_split(gm: torch.fx.GraphModule, sym) -> int:
    """Rewrite each ``baddbmm`` whose product is a ``[q, k]`` block as ``beta * bias + alpha * bmm`` (see the
    module doc); returns how many were rewritten."""
    graph, rewritten = gm.graph, 0
    for node in list(graph.find_nodes(op="call_function", target=aten.baddbmm.default)):
        bias, a, b = node.args[:3]
        if seq_dims(a, sym) != (1,) or seq_dims(b, sym) != (2,):
            continue
        beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
        with graph.inserting_before(node):
            product = _scaled(graph, node, emit(graph, node, aten.bmm.default, (a, b)), alpha)
            summed = product if beta == 0 else emit(graph, node, aten.add.Tensor,
                                                     (_scaled(graph, node, bias, beta), product))
        node.replace_all_uses_with(summed)
        graph.erase_node(node)
        rewritten += 1
    gm.recompile()
    return rewritten
