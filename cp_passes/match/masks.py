"""Attention masks the model builds itself: from positions only, or from sequence metadata too.

Either way the attention rule replaces the mask with one at the rank's global positions, so the nodes
that only build it are claimed here and no per-op rule sees them (a cumsum over position ids, a
``[seq, seq]`` comparison).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from ..graph.analysis import meta_val, seq_dims, seq_multiple
from ..transports.masks import MetadataMask


@dataclass
class PositionMask:
    """A mask computed from positions and constants only: a pure function of the sequence length, which
    the attention rule evaluates as the single device would to read its window."""

    mask: torch.fx.Node
    nodes: list[torch.fx.Node]
    size_leaves: list[torch.fx.Node] = field(default_factory=list)
    """The lengths it reads (made global where the mask is evaluated over the whole sequence)."""


def model_mask(mask: torch.fx.Node, sym) -> MetadataMask | PositionMask | str:
    """What builds ``mask``, or why it cannot be rebuilt per rank (a reason)."""
    nodes, tensor_leaves, size_leaves, seen, stack = [], [], [], set(), [mask]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        val = meta_val(n)
        if isinstance(val, (torch.SymInt, torch.SymFloat)):
            if sym in val.node.expr.free_symbols:
                if seq_multiple(val, sym) is None:
                    return f"its mask uses the length expression {val}, which cp_passes cannot rescale"
                size_leaves.append(n)
            else:
                stack.extend(n.all_input_nodes)
                nodes.append(n)
        elif n.op == "placeholder":
            if not isinstance(val, torch.Tensor) or not seq_dims(n, sym) or val.is_floating_point() or val.requires_grad:
                return (f"its mask reads input '{n.name}' {tuple(getattr(val, 'shape', ()))}, which is not integer "
                        f"sequence metadata (doc ids, positions)")
            tensor_leaves.append(n)
        elif n.op in ("call_function", "get_attr"):
            if isinstance(val, torch.Tensor) and val.requires_grad:
                return f"its mask depends on '{n.name}', a value with gradients (activations are not metadata)"
            nodes.append(n)
            stack.extend(n.all_input_nodes)
        else:
            return f"its mask reads {n.op} '{n.name}'"
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    nodes.sort(key=order.__getitem__)
    size_leaves.sort(key=order.__getitem__)
    if not tensor_leaves:
        return PositionMask(mask, nodes, size_leaves)
    leaves = sorted(tensor_leaves, key=order.__getitem__)
    return MetadataMask(mask, nodes, leaves, size_leaves,
                        [seq_dims(leaf, sym)[0] for leaf in leaves])


class NotPositional(Exception):
    """The mask reads something other than positions: the node that does."""


def evaluate_position_mask(found: PositionMask, sym, length: int, leaves: dict | None = None) -> torch.Tensor:
    """Evaluate a position mask as the single-device model would at sequence ``length`` (a mask that reads
    inputs too, given their values in ``leaves``)."""
    leaves = leaves or {}
    env: dict[torch.fx.Node, object] = {}
    order: list[torch.fx.Node] = []
    stack, seen = [found.mask], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        order.append(n)
        if not isinstance(meta_val(n), (torch.SymInt, torch.SymFloat, int, float)) and n not in leaves:
            stack.extend(n.all_input_nodes)
    position = {n: i for i, n in enumerate(found.mask.graph.nodes)}
    for n in sorted(order, key=position.__getitem__):
        val = meta_val(n)
        if isinstance(val, (torch.SymInt, torch.SymFloat)):
            value = val.node.expr.subs(sym, length)
            env[n] = int(value) if isinstance(val, torch.SymInt) else float(value)
        elif isinstance(val, (int, float)):
            env[n] = val
        elif n in leaves:
            env[n] = leaves[n]
        elif n.op == "get_attr":
            env[n] = getattr(n.graph.owning_module, n.target)
        elif n.op == "call_function":
            args, kwargs = torch.fx.map_arg((n.args, n.kwargs), env.__getitem__)
            env[n] = n.target(*args, **kwargs)
        else:
            raise NotPositional(n)
    return env[found.mask]
