"""Fills of a fresh tensor through views, written out of place before anything is planned.

Models assemble a tensor by copying into slices of an empty one (MLA's ``expand_kv``: ``k =
x.new_empty(...); k[..., :a].copy_(k_nope); k[..., a:].copy_(k_rope)``). Every later op reads the base,
which the copies changed through views: a graph cp_passes reads as values cannot follow that. Where the
base is fresh and its views serve only the copies, each copy becomes its functional form (the source broadcast
to the view's value, then ``slice_scatter`` / ``select_scatter`` back up the chain of views) and the base's
later readers read the result. Any other mutation through a view is left alone (and refused by the
planner, naming it).
"""

from __future__ import annotations

import torch
import torch.fx

aten = torch.ops.aten

_FRESH = {aten.new_empty.default, aten.empty.memory_format, aten.new_zeros.default, aten.zeros.default,
          aten.new_full.default, aten.full.default, aten.empty_like.default, aten.zeros_like.default}
_SCATTER = {aten.slice.Tensor: aten.slice_scatter.default, aten.select.int: aten.select_scatter.default,
            aten.alias.default: None}
"""A view op -> the op that writes a value back through it (None: the view is the whole tensor)."""


def _uses(base: torch.fx.Node):
    """``(copies, reads)``: every ``copy_`` into a chain of views of ``base`` with that chain, and every other
    use of ``base`` or of a view of it, with the first node on its way from ``base``."""
    copies, reads, stack = [], [], [(base, [])]
    while stack:
        node, chain = stack.pop()
        for user in node.users:
            if user.target is aten.copy_.default and user.args[0] is node and chain and not user.users:
                copies.append((user, chain))
            elif user.target in _SCATTER and user.args[0] is node:
                stack.append((user, chain + [user]))
            else:
                reads.append((user, (chain + [user])[0]))
    return copies, reads


def _rewrite(graph: torch.fx.Graph, base: torch.fx.Node, copies, reads) -> None:
    order = {n: i for i, n in enumerate(graph.nodes)}
    copies.sort(key=lambda c: order[c[0]])
    current = base
    for copy, chain in copies:
        with graph.inserting_before(copy):
            values = [current]
            for view in chain:  # the view's value, read from the current base
                values.append(graph.call_function(view.target, (values[-1], *view.args[1:]), dict(view.kwargs)))
            # copy_'s value: the source broadcast to the view's shape, in its dtype.
            written = graph.call_function(aten.expand_as.default, (copy.args[1], values[-1]))
            written = graph.call_function(aten.type_as.default, (written, values[-1]))
            if all(_SCATTER[view.target] is None for view in chain):  # the whole tensor: a copy, not the source
                written = graph.call_function(aten.clone.default, (written,))
            for view, below in zip(reversed(chain), reversed(values[:-1])):
                scatter = _SCATTER[view.target]
                written = written if scatter is None else graph.call_function(scatter, (below, written,
                                                                                       *view.args[1:]))
        for new in graph.nodes:
            if new not in order:
                new.meta.update({k: v for k, v in copy.meta.items() if k != "val"})
                args, kwargs = torch.fx.map_arg((new.args, new.kwargs), lambda n: n.meta["val"])
                new.meta["val"] = new.target(*args, **kwargs)
                order[new] = order[copy]
        current = written
        graph.erase_node(copy)
        for view in reversed(chain):
            if not view.users:
                graph.erase_node(view)
    for _, first in reads:  # each later read (of the base, or through a view taken after the copies)
        first.replace_input_with(base, current)


def fills_out_of_place(gm: torch.fx.GraphModule) -> int:
    """Rewrite the copies into views of fresh tensors as out-of-place ops (see the module doc); returns
    how many fresh tensors were rewritten."""
    graph, rewritten = gm.graph, 0
    for base in list(graph.nodes):
        if base.op != "call_function" or base.target not in _FRESH:
            continue
        copies, reads = _uses(base)
        if not copies:
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        last = max(order[c] for c, _ in copies)
        # A read before the last copy (or through a view taken before it) would see the tensor half filled:
        # leave such graphs to the planner, which refuses the copies.
        if any(order[first] < last for _, first in reads):
            continue
        _rewrite(graph, base, copies, reads)
        rewritten += 1
    gm.recompile()
    return rewritten
