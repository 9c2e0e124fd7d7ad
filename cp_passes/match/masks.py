"""Attention masks the model builds itself: from positions only, or from sequence metadata too.

Either way the attention rule replaces the mask with one at the rank's global positions, so the nodes
that only build it are claimed here and no per-op rule sees them (a cumsum over position ids, a
``[seq, seq]`` comparison).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from ..errors import node_ref
from ..graph.analysis import INPUT_NAME, SHAPE_ONLY, hint, meta_val, seq_dims, seq_multiple, window
from ..transports.masks import MetadataMask
from .failed import FailedMatch

aten = torch.ops.aten


@dataclass
class PositionMask:
    """A mask computed from positions and constants only: a pure function of the sequence length, which
    the attention rule evaluates as the single device would to read its window."""

    mask: torch.fx.Node
    nodes: list[torch.fx.Node]
    size_leaves: list[torch.fx.Node] = field(default_factory=list)
    """The lengths it reads (made global where the mask is evaluated over the whole sequence)."""


def _float(val) -> bool:
    return isinstance(val, torch.Tensor) and (val.is_floating_point() or val.is_complex())


def may_carry_gradient(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes whose value may carry a gradient: floating-point values computed from a floating-point
    input (a parameter, embeddings). Integer and boolean values (indices, comparisons, masks) never do."""
    found, module = set(), graph.owning_module
    for n in graph.nodes:
        val = meta_val(n)
        if n.op == "placeholder":  # the graph's fake values say nothing of requires_grad: any float may
            if _float(val):
                found.add(n)
        elif n.op == "get_attr":  # a parameter held by the graph module: its own flag
            attr = torch.fx.graph_module._get_attr(module, n.target) if module is not None else None
            if _float(attr) and attr.requires_grad:
                found.add(n)
        elif n.op == "call_function" and n.target not in SHAPE_ONLY and any(a in found for a in n.all_input_nodes):
            if _float(val) or isinstance(val, (tuple, list)):
                found.add(n)
    return found


def _own(mask: torch.fx.Node, masks: set) -> set[torch.fx.Node]:
    """The nodes computed only for ``mask`` and the other attention masks ``masks``: every use leads to one of
    them (a value nothing reads, or a size check, does not count). An indexer whose top-k feeds the next layers'
    masks too (Glm5Next's shared indexers) is computed only for masks."""
    ancestors, stack = set(), [mask, *masks]
    while stack:
        n = stack.pop()
        if n not in ancestors:
            ancestors.add(n)
            stack.extend(n.all_input_nodes)
    own, checks = {mask, *masks}, set()
    for n in reversed(list(mask.graph.nodes)):
        if n in ancestors and n.users and all(u in own or u in checks or (not u.users and not u.is_impure())
                                              for u in n.users):
            own.add(n)
        elif n.target is aten._assert_scalar.default or (
                isinstance(meta_val(n), (torch.SymInt, torch.SymBool)) and n.users
                and all(u in checks for u in n.users)):
            checks.add(n)  # a size check (torch._check on a top-k width): no value of its own
    return own


def model_mask(mask: torch.fx.Node, sym, carry: set | None = None, multiple: int = 1,
               masks: set = frozenset(), learned: bool = False) -> MetadataMask | PositionMask | FailedMatch:
    """What builds ``mask``, or why it cannot be rebuilt per rank (a reason).

    Its leaves are sharded integer inputs (doc ids, positions) and the lengths it reads. A mask no gradient
    flows through (an indexer's top-k selection: activations become indices, then a boolean mask) may read
    activations too: those the model also uses elsewhere (so the plan computes them right on each rank) are
    leaves like metadata, gathered without an autograd edge; what is computed only for the mask is replayed
    over the whole sequence, and the parameters it reads are passed in. ``carry`` is
    :func:`may_carry_gradient` of the graph (computed here when not given); ``multiple`` is the spec's
    ``pad_multiple`` (activations in windows of positions are leaves too); ``masks`` are the graph's other
    attention masks, whose inputs are computed for masks as well.

    With ``learned``, a mask that carries a gradient back to parameters alone is taken too: a learned bias of
    positions (T5's bucketed relative-position bias, ``table[bucket(j - i)]``), which is evaluated in the graph at
    the positions a rank needs, so that autograd brings each rank's part of the parameters' gradient. Where an
    activation reaches it, it stays a data-dependent bias and is refused."""
    carry = may_carry_gradient(mask.graph) if carry is None else carry
    if mask in carry and not (learned and _learned_from_whole_inputs(mask, carry, sym)):
        what = ("a data-dependent bias" if learned else "a learned or data-dependent bias, which SDPA takes only "
                "where cp_passes writes it out: without dropout or is_causal")
        return FailedMatch(f"its mask {node_ref(mask)} carries a gradient back to what it is computed from ({what}, "
                           f"not a mask); masks without one (boolean, or from metadata or indices) and biases learned "
                           f"from positions alone (a relative-position table read at j - i) are evaluated over the "
                           f"whole sequence")
    own = _own(mask, masks)
    nodes, tensor_leaves, size_leaves, inputs, seen, stack = [], [], [], [], set(), [mask]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        val = meta_val(n)
        if isinstance(val, (torch.SymInt, torch.SymFloat)):
            if sym in val.node.expr.free_symbols and seq_multiple(val, sym) is not None:
                size_leaves.append(n)
            elif sym in val.node.expr.free_symbols and n.op != "call_function":
                return FailedMatch(f"its mask uses the length expression {val}, which cp_passes cannot rescale")
            else:  # arithmetic on lengths (``seq_len - 1``) is replayed on the global ones
                stack.extend(n.all_input_nodes)
                nodes.append(n)
            continue
        tensor = isinstance(val, torch.Tensor)
        dims = seq_dims(n, sym) if tensor else ()
        if n.op == "placeholder" and tensor and not dims:
            inputs.append(n)  # a parameter, or an input every rank holds whole
        elif (n in carry and n not in own and tensor and len(dims) == 1
              and window(val.shape[dims[0]], sym, multiple) is not None):
            tensor_leaves.append(n)  # an activation the model uses elsewhere, read here without its gradient
        elif n.op == "placeholder":
            if not tensor:
                return FailedMatch(f"its mask reads input {node_ref(n)}, which is not a tensor")
            if len(dims) != 1 or seq_multiple(val.shape[dims[0]], sym) != 1:
                return FailedMatch(f"its mask reads input {node_ref(n)}, whose sequence axis is not one whole dim")
            tensor_leaves.append(n)
        elif n.op in ("call_function", "get_attr"):
            nodes.append(n)
            stack.extend(n.all_input_nodes)
        else:
            return FailedMatch(f"its mask reads {n.op} {node_ref(n)}")
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    nodes.sort(key=order.__getitem__)
    size_leaves.sort(key=order.__getitem__)
    inputs.sort(key=order.__getitem__)
    read = next((leaf for leaf in tensor_leaves if leaf in carry), None)
    if mask in carry and read is not None:
        return FailedMatch(f"its mask {node_ref(mask)} carries a gradient back to {node_ref(read)}, an activation (a "
                           f"data-dependent bias, not a mask): evaluated at other ranks' keys it would read that "
                           f"activation without its gradient. Masks without a gradient (boolean, or from metadata or "
                           f"indices) and biases learned from positions and parameters alone (a relative-position "
                           f"table read at j - i) are evaluated over the whole sequence")
    if not tensor_leaves and not inputs:
        return PositionMask(mask, nodes, size_leaves)
    leaves = sorted(tensor_leaves, key=order.__getitem__)
    return MetadataMask(mask, nodes, leaves, size_leaves,
                        [seq_dims(leaf, sym)[0] for leaf in leaves], inputs, learned=mask in carry)


def _learned_from_whole_inputs(mask: torch.fx.Node, carry: set, sym) -> bool:
    """Whether every gradient ``mask`` carries comes from inputs every rank holds whole (parameters): the
    floating-point values it is computed from, walked back, start at placeholders without a sequence dim."""
    stack, seen = [mask], set()
    while stack:
        n = stack.pop()
        if n in seen or n not in carry:
            continue
        seen.add(n)
        if n.op == "placeholder":
            if seq_dims(n, sym):
                return False
        elif n.op != "get_attr":
            stack.extend(n.all_input_nodes)
    return True


class NotPositional(Exception):
    """The mask reads something other than positions: the node that does."""


def one_document(leaf: torch.fx.Node, dim: int, spec, length: int, padding: bool = False) -> torch.Tensor | None:
    """A sharded input's value for one unpadded document of ``length`` (the spec's positions ``0..S-1``, its
    doc ids one document, and with ``padding`` an ``attention_mask`` of ones), or None for an input of another
    role: what a mask is probed with to read which keys it lets a query see."""
    val, name = meta_val(leaf), leaf.meta.get(INPUT_NAME)
    shape = [length if d == dim else hint(s) for d, s in enumerate(val.shape)]
    if padding and name == "attention_mask":
        return torch.ones(shape, dtype=val.dtype)
    if name in spec.position_keys:
        view = [-1 if d == dim else 1 for d in range(len(shape))]
        return torch.arange(length).reshape(view).expand(shape).to(val.dtype)
    if name == spec.doc_key:
        return torch.zeros(shape, dtype=val.dtype)
    return None


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
