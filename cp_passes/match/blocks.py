"""Attention written by hand: ``[q, k]`` blocks and which of their two sequence dims is the key axis.

A product ``a @ b`` whose left operand carries the sequence on its rows and whose right operand carries it
on its columns (``q @ k.transpose(-2, -1)``) makes a *block*: a tensor with two sequence dims, the query
axis (this rank's positions) and the key axis. Under CP the key axis is made whole: the planner brings
every operand that lands on it (K, V, key-side biases) from the other ranks, so ops on a block (softmax over
keys, soft-capping, masks, ``probs @ v``) run on ``[local queries, every key]`` as written.

The key axis is followed forward from each such product and backward into the blocks it is combined with.
A block fed in whole from sequence metadata (a mask built from position ids or doc ids) is matched as a
model-built mask and claimed: it is evaluated over the whole sequence and this rank's rows taken.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from ..graph.analysis import meta_val, seq_dims
from ..transports.masks import MetadataMask
from .masks import PositionMask, model_mask

aten = torch.ops.aten
SCORES = (aten.matmul.default, aten.bmm.default)


@dataclass
class Blocks:
    keys: dict = field(default_factory=dict)
    """Block node -> its key dim."""
    masks: dict = field(default_factory=dict)
    """A model-built mask combined with a block -> how it is built (:class:`MetadataMask`)."""
    anchors: dict = field(default_factory=dict)
    """A block op that reads a matched mask -> that mask (for claiming the mask's nodes)."""
    conflicts: dict = field(default_factory=dict)
    """Block node -> why its key axis is ambiguous."""


def _ndim(node) -> int:
    return meta_val(node).dim()


def is_scores(node: torch.fx.Node, sym) -> bool:
    """``a @ b`` with the sequence on ``a``'s rows and ``b``'s columns only."""
    if node.op != "call_function" or node.target not in SCORES:
        return False
    a, b = node.args[:2]
    return (seq_dims(a, sym) == (_ndim(a) - 2,) and seq_dims(b, sym) == (_ndim(b) - 1,)
            and seq_dims(node, sym) == (_ndim(node) - 2, _ndim(node) - 1))


def map_dim(node: torch.fx.Node, source: torch.fx.Node, dim: int, sym, forward: bool = True) -> int:
    """The dim of ``node`` that ``source``'s (an input's) sequence dim ``dim`` becomes (``forward``), or the
    dim of ``source`` that ``node``'s dim ``dim`` came from."""
    if node.target is aten.transpose.int:
        a, b = (d % _ndim(node) for d in node.args[1:3])
        return b if dim == a else a if dim == b else dim
    if node.target is aten.permute.default:
        perm = [d % _ndim(node) for d in node.args[1]]
        return perm.index(dim) if forward else perm[dim]
    here, there = seq_dims(node, sym), seq_dims(source, sym)
    if forward:
        return here[there.index(dim)]
    return there[here.index(dim)]


def match_blocks(gm: torch.fx.GraphModule, sym) -> Blocks:
    found = Blocks()
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    for node in nodes:
        if is_scores(node, sym):
            found.keys[node] = _ndim(node) - 1
            continue
        if len(seq_dims(node, sym)) != 2:
            continue
        keyed = {map_dim(node, x, found.keys[x], sym) for x in node.all_input_nodes
                 if x in found.keys and len(seq_dims(x, sym)) == 2}
        if len(keyed) == 1:
            found.keys[node] = keyed.pop()
        elif keyed:
            found.conflicts[node] = "it combines [q, k] blocks whose key axes disagree"
    inside: set = set()  # the nodes of matched masks: evaluated whole, never given a key axis of their own
    for node in reversed(nodes):
        if node not in found.keys or node in inside:
            continue
        for x in node.all_input_nodes:
            if x in found.keys or len(seq_dims(x, sym)) != 2 or x.op != "call_function":
                continue
            found.keys[x] = map_dim(node, x, found.keys[node], sym, forward=False)
            mask = model_mask(x, sym)
            if isinstance(mask, PositionMask):
                mask = MetadataMask(x, mask.nodes, [], mask.size_leaves, [])
            if isinstance(mask, MetadataMask):
                found.masks[x] = mask
                found.anchors[node] = x
                inside.update(mask.nodes)
    return found
