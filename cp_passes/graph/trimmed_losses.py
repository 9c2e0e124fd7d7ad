"""Losses over a sequence trimmed at its ends, spelled over the whole sequence with the trimmed rows ignored.

GPT-2, nanoGPT and transformers 4.x pair each position with the next token by trimming both sides:
``cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))``. On a shard each slice would drop this
rank's last row, not the sequence's. The same loss is ``cross_entropy(logits.reshape(-1, V), t.reshape(-1))``
where row ``p`` of ``t`` holds the target the trimmed loss pairs with logits row ``p`` (``ids`` shifted:
``pad(ids, (0, 1), ignore_index)[:, 1:]``, the form the shift transport serves) and ``ignore_index`` where the
trim dropped the row: an ignored row adds nothing to a sum, to a mean's count, to a weighted mean or to label
smoothing. So every reduction but ``'none'`` (whose output has the trimmed length) is rewritten.

It applies where one side is cut as ``[:, :-k]`` and the other as ``[:, k:]`` (the shift's padding then covers
the trimmed rows) along the same sequence dim with the same batch dims in front; where the logits' slice
reaches the loss through row-wise ops (a linear head, casts, copies, a log-softmax over the classes) and reshapes
that merge the rows (``-1``), and the target's through reshapes and copies. Any other trim is left to the
planner, which refuses it naming the slice.
"""

from __future__ import annotations

import torch
import torch.fx

from .analysis import bind_args, expr_of, has_symbol, meta_val
from .emit import emit

aten = torch.ops.aten

_LOSSES = (aten.cross_entropy_loss.default, aten.nll_loss_nd.default, aten.nll_loss.default)
_COPIES = {aten.contiguous.default, aten.clone.default, aten._to_copy.default, aten.to.dtype}
_RESHAPES = {aten.reshape.default, aten.view.default}
_TO_END = 2 ** 63 - 1


def _carries(node: torch.fx.Node, sym) -> bool:
    """Whether ``node`` keeps its first input's rows as rows, one by one, in order."""
    if node.op != "call_function":
        return False
    if node.target in _COPIES:
        return True
    if node.target in _RESHAPES:  # merging the rows with the batch dims: only a -1 survives a new length
        shape = node.args[1]
        return all(isinstance(s, int) for s in shape) and shape.count(-1) == 1
    if node.target is aten.flatten.using_ints:
        return True
    if node.target in (aten.log_softmax.int, aten._log_softmax.default):
        dim = bind_args(node)["dim"]
        return dim % meta_val(node).dim() == meta_val(node).dim() - 1
    if node.target is aten.linear.default:
        return not any(has_symbol(size, sym) for arg in node.args[1:] if isinstance(arg, torch.fx.Node)
                       for size in meta_val(arg).shape)
    return False


def _trimmed(node: torch.fx.Node, sym):
    """``(ops from the slice to node, in order; the sliced tensor; dim; rows cut at the start; at the end)`` when
    ``node`` is a slice along a sequence dim (a fixed number of rows cut) reached through :func:`_carries` ops."""
    chain = []
    while _carries(node, sym) and isinstance(node.args[0], torch.fx.Node):
        chain.append(node)
        node = node.args[0]
    if node.op != "call_function" or node.target is not aten.slice.Tensor:
        return None
    args = bind_args(node)
    x = args["self"]
    dim = args["dim"] % meta_val(x).dim()
    full, part = expr_of(meta_val(x).shape[dim]), expr_of(meta_val(node).shape[dim])
    start = args["start"] or 0
    if sym not in full.free_symbols or args["step"] != 1 or not isinstance(start, int) or start < 0:
        return None
    cut = full - part
    if not cut.is_Integer or int(cut) <= 0:
        return None
    return chain[::-1], x, dim, start, int(cut) - start


def _target(graph: torch.fx.Graph, like: torch.fx.Node, y: torch.fx.Node, dim: int, shift: int, ignore: int):
    """``y`` read ``shift`` rows later (earlier where negative) along ``dim``, ``ignore`` past its ends."""
    before, after = (0, shift) if shift > 0 else (-shift, 0)
    widths = [0, 0] * (meta_val(y).dim() - dim - 1) + [before, after]
    padded = emit(graph, like, aten.constant_pad_nd.default, (y, widths, ignore))
    if shift > 0:
        return emit(graph, like, aten.slice.Tensor, (padded, dim, shift, _TO_END))
    rows = emit(graph, like, aten.sym_size.int, (y, dim))
    return emit(graph, like, aten.slice.Tensor, (padded, dim, 0, rows))


def _replay(graph: torch.fx.Graph, chain: list[torch.fx.Node], start: torch.fx.Node) -> torch.fx.Node:
    out = start
    for node in chain:
        out = emit(graph, node, node.target, (out, *node.args[1:]), dict(node.kwargs))
    return out


def trimmed_losses_as_ignored_rows(gm: torch.fx.GraphModule, sym) -> int:
    """Rewrite the losses described in the module doc; returns how many were rewritten."""
    rewritten = 0
    for loss in [n for target in _LOSSES for n in gm.graph.find_nodes(op="call_function", target=target)]:
        args = bind_args(loss)
        if args["reduction"] == 0 or not all(isinstance(args[k], torch.fx.Node) for k in ("self", "target")):
            continue
        scores, target = _trimmed(args["self"], sym), _trimmed(args["target"], sym)
        if scores is None or target is None:
            continue
        (x_chain, x, dim, x_start, x_end), (y_chain, y, y_dim, y_start, y_end) = scores, target
        x_val, y_val = meta_val(x), meta_val(y)
        if (dim != y_dim or x_start + x_end != y_start + y_end or {x_start, y_start} != {0, x_start + x_end}
                or x_val.dim() != dim + 2 or y_val.dim() != dim + 1
                or [expr_of(s) for s in x_val.shape[:dim]] != [expr_of(s) for s in y_val.shape[:dim]]):
            continue
        graph = gm.graph
        with graph.inserting_before(loss):
            new_scores = _replay(graph, x_chain, x)
            shifted = _target(graph, loss, y, dim, y_start - x_start, args["ignore_index"])
            new_target = _replay(graph, y_chain, shifted)
        old = [args["self"], args["target"]]
        loss.replace_input_with(args["self"], new_scores)
        loss.replace_input_with(args["target"], new_target)
        for node in old:  # the trimmed chains, users first
            while node is not None and not node.users and node.op == "call_function":
                source = node.args[0] if isinstance(node.args[0], torch.fx.Node) else None
                graph.erase_node(node)
                node = source
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten
