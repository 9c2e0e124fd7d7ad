"""Fake-tensor propagation of the nodes a rewrite changed, and of what their new values reach.

Verifying a rewritten graph means propagating fake tensors through it. A rewrite changes a few nodes per layer
(a gather, a mask, the attention it feeds), and the attention's output keeps its shape: the nodes after it would
get the values they already hold. So a node is propagated again when it is new, its target or inputs changed
since :func:`snapshot`, or an input's value changed shape, stride, dtype or device; every other node keeps the
value it has. Higher-order ops (a region's ``invoke_subgraph``, whose graph a rewrite may have changed) and
module calls are always propagated.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

Snapshot = dict[torch.fx.Node, tuple]


def snapshot(gm: torch.fx.GraphModule) -> Snapshot:
    """Each node's target and arguments as they stand (the argument tuples themselves: a changed input
    replaces the tuple)."""
    return {node: (node.target, node.args, node.kwargs) for node in gm.graph.nodes}


def propagate_changed(gm: torch.fx.GraphModule, mode, fakes: list, before: Snapshot) -> int:
    """Propagate ``fakes`` through ``gm`` under ``mode`` as :class:`FakeTensorProp` does, running only the nodes
    that changed since ``before`` or read a value that did; the others keep their ``meta["val"]``. Returns how
    many nodes ran."""
    prop = FakeTensorProp(gm, mode)
    changed: set[torch.fx.Node] = set()
    inputs = iter(fakes)
    ran = 0
    with mode:
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                prop.env[node] = next(inputs)
                continue
            if node.op == "output":
                break
            if _kept(node, before, changed):
                prop.env[node] = node.meta["val"]
                continue
            old = node.meta.get("val")
            prop.env[node] = prop.run_node(node)
            ran += 1
            if not same_value(old, node.meta.get("val")):
                changed.add(node)
    return ran


def _kept(node: torch.fx.Node, before: Snapshot, changed: set) -> bool:
    was = before.get(node)
    return (was is not None and node.op == "call_function" and "val" in node.meta
            and not isinstance(node.target, torch._ops.HigherOrderOperator)
            and was[0] is node.target and was[1] is node.args and was[2] is node.kwargs
            and not any(arg in changed for arg in node.all_input_nodes))


def same_value(a, b) -> bool:
    """Whether two propagated values have the same metadata: sizes and strides compared as expressions (no
    guard is added), dtype, device, requires_grad; containers element by element."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.device == b.device and a.requires_grad == b.requires_grad and a.dim() == b.dim()
                and _same_ints(a.shape, b.shape) and _same_ints(a.stride(), b.stride())
                and _same_ints([a.storage_offset()], [b.storage_offset()]))
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(same_value(x, y) for x, y in zip(a, b)))
    if isinstance(a, torch.SymInt | torch.SymFloat | torch.SymBool) or \
            isinstance(b, torch.SymInt | torch.SymFloat | torch.SymBool):
        return _expr(a) == _expr(b)
    return type(a) is type(b) and a == b


def _expr(value):
    return value.node.expr if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool) else value


def _same_ints(xs, ys) -> bool:
    return len(xs) == len(ys) and all(_expr(x) == _expr(y) for x, y in zip(xs, ys))
