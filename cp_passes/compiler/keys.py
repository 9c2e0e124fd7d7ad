"""The key axis of hand-written attention: which operands the planner brings, before any rule runs.

As in DTensor's sharding propagation, the redistribution is decided here, not by the op's rule: for every
op on a ``[q, k]`` block (see :mod:`cp_passes.match.blocks`), an input whose sequence dim lands on the
block's key axis is brought whole from every rank (the ``key_gather`` transport), and a mask the model built
from metadata is evaluated over the whole sequence. The op's rule then sees the key axis as not sharded:
softmax over keys, soft-capping and ``probs @ v`` are correct on ``[local queries, every key]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from ..graph.analysis import has_symbol, meta_val, seq_dims
from ..match.blocks import SCORES
from ..match.head_repeat import is_whole_slice, match_head_repeat
from ..rules import Rewrite, RuleContext
from ..transports.keys import KeyMask, KeyOperand

aten = torch.ops.aten

_REPLAYABLE = {aten.transpose.int, aten.permute.default, aten.unsqueeze.default, aten.contiguous.default,
               aten.clone.default, aten.alias.default, aten.detach.default, aten.to.dtype, aten._to_copy.default}
"""Ops with no size arguments that may sit between where an operand is gathered and where it is read."""

_ALIGNED = {aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar, aten.masked_fill.Scalar,
            aten.masked_fill.Tensor, aten.gather.default, aten.cat.default}
"""Ops whose inputs' dims line up with the output's from the right, as pointwise ops broadcast (gather's
input and index, cat's inputs, have the output's rank)."""


@dataclass
class KeyPlan:
    operands: dict = field(default_factory=dict)
    """Operand node -> its :class:`KeyOperand` request (one gather, however many blocks read it)."""
    masks: set = field(default_factory=set)


def _landings(ctx: RuleContext) -> list[tuple[torch.fx.Node, int]]:
    """The inputs of ``ctx.node`` whose sequence dim lands on a block's key axis, with that dim."""
    node, keys, sym = ctx.node, ctx.matches.blocks.keys, ctx.sym
    if node.target in SCORES:
        a, b = node.args[:2]
        nd = meta_val(b).dim()
        if node in keys:  # scores = q @ k^T: k's sequence becomes the key axis
            return [(b, nd - 1)]
        if a in keys and keys[a] == meta_val(a).dim() - 1 and nd >= 2 and seq_dims(b, sym) == (nd - 2,):
            return [(b, nd - 2)]  # probs @ v: contracted over the key axis
        return []
    if node not in keys:
        return []
    found = []
    out_nd = meta_val(node).dim()
    for x in ctx.tensor_inputs():
        dims = seq_dims(x, sym)
        if x in keys or not dims:
            continue
        if torch.Tag.pointwise not in node.target.tags and node.target not in _ALIGNED:
            ctx.refuse(f"it makes the [q, k] block '{node.name}' from '{x.name}', whose sequence axis cp_passes "
                       f"cannot place on the query or the key axis",
                       "build scores as q @ k.transpose(-2, -1) and combine them with pointwise ops, gather or "
                       "cat only")
        found += [(x, d) for d in dims if d + out_nd - meta_val(x).dim() == keys[node]]
    return found


def _gather_point(operand: torch.fx.Node, dim: int, sym):
    """Where to gather ``operand``: back through size-free layout ops and a head repeat to its smallest form."""
    steps, source = [], operand
    while True:
        repeat = match_head_repeat(source)
        if repeat is not None and dim == 2 and seq_dims(repeat.small, sym) == (2,):
            steps.append(repeat.n_rep)
            source = repeat.small
            continue
        if not (isinstance(source, torch.fx.Node) and (source.target in _REPLAYABLE or is_whole_slice(source))):
            break
        prev = source.args[0]
        prev_dims = seq_dims(prev, sym)
        if len(prev_dims) != 1:
            break
        steps.append(source)
        dim, source = prev_dims[0], prev
    return source, dim, steps[::-1]


def plan_keys(ctx: RuleContext, state: KeyPlan) -> list[tuple[torch.fx.Node, Rewrite]]:
    """The key-axis rewrites ``ctx.node`` needs (new ones only), and marks its brought inputs in ``ctx``."""
    blocks = ctx.matches.blocks
    node = ctx.node
    if node in blocks.conflicts:
        ctx.refuse(blocks.conflicts[node], "compute each attention's scores from one q @ k^T")
    if node in blocks.keys:
        sizes = [a for a in torch.utils._pytree.tree_leaves(node.args) if has_symbol(a, ctx.sym)]
        if sizes:
            ctx.refuse(f"it sizes the [q, k] block '{node.name}' with the local length ({sizes[0].name}), and "
                       f"cp_passes makes its key axis whole",
                       "size attention scores from the query and key tensors' own shapes (expand_as, or no size)")
    rewrites = []
    for operand, dim in _landings(ctx):
        ctx.brought.add(operand)
        request = state.operands.get(operand)
        if request is None:
            source, gather_dim, steps = _gather_point(operand, dim, ctx.sym)
            request = state.operands[operand] = KeyOperand(operand, source, gather_dim, steps)
            note = (f"{request.describe()} brought to the key axis of '{node.name}': every key (the mask is not "
                    f"read for a causal prefix or a window)")
            rewrites.append((node, Rewrite("key_operand", "key_gather", request, note=note)))
        request.consumers.append(node)
    for x in ctx.tensor_inputs():
        mask = blocks.masks.get(x)
        if mask is not None and x not in state.masks:
            state.masks.add(x)
            query_dim = next(d for d in seq_dims(x, ctx.sym) if d != blocks.keys[x])
            names = ", ".join(leaf.name for leaf in mask.tensor_leaves) or "positions"
            rewrites.append((x, Rewrite("key_mask", "key_gather", KeyMask(mask, query_dim),
                                        note=f"the model's mask from {names}, evaluated over the whole sequence")))
    return rewrites

