"""Call nodes every layer reads: a nested compile region's call (``invoke_subgraph``) and its operands, and a
functional collective's start (the node whose ``wait_tensor`` waits for its data).

The compiler plans and rewrites region calls (:mod:`cp_passes.compiler.regions`) and orders collectives
(:mod:`cp_passes.compiler.schedule`); the memory and overlap reports read the same calls in AOTAutograd's graphs.
"""

from __future__ import annotations

import torch
import torch.fx

from .analysis import INPUT_NAME, meta_val

INVOKE = torch.ops.higher_order.invoke_subgraph
WAIT = torch.ops._c10d_functional.wait_tensor.default
_FUNCTIONAL = ("_c10d_functional", "_c10d_functional_autograd")


def calls_by_subgraph(gm: torch.fx.GraphModule) -> dict[str, list[torch.fx.Node]]:
    """Each subgraph's name -> the ``invoke_subgraph`` nodes that call it, in graph order."""
    found: dict[str, list[torch.fx.Node]] = {}
    for node in gm.graph.find_nodes(op="call_function", target=INVOKE):
        found.setdefault(node.args[0].target, []).append(node)
    return found


def operands(call: torch.fx.Node) -> tuple:
    return call.args[2:]


def _describe(value) -> str:
    if isinstance(value, torch.fx.Node):
        name = value.meta.get(INPUT_NAME) if value.op == "placeholder" else None
        val = meta_val(value)
        if isinstance(val, torch.Tensor):
            return f"{val.dtype}{list(val.shape)} grad={val.requires_grad} input={name}"
        return f"{type(val).__name__}({val}) input={name}"
    return repr(value)


def call_signature(call: torch.fx.Node) -> list[str]:
    """What the subgraph's plan may depend on at this call: each operand's shape, dtype, whether it needs a
    gradient, and which model input it is (a ``doc_ids`` placeholder reads differently from any tensor)."""
    return [_describe(v) for v in operands(call)]


def is_start(node: torch.fx.Node) -> bool:
    """A functional collective that returns before its data arrived (its ``wait_tensor`` waits)."""
    return (node.op == "call_function" and getattr(node.target, "namespace", None) in _FUNCTIONAL
            and node.target is not WAIT)
