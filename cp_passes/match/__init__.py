"""Matchers: patterns that span several nodes, found in one phase before the per-op rules run.

Each matcher reads the graph and returns what it found, keyed by the node whose rule uses it; the nodes
that only exist to build a matched pattern (a causal convolution's left pad, a model-built attention
mask) are *claimed*: the planner gives them to no per-op rule, because the rule of the pattern's anchor
replaces them as a whole.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from ..graph.analysis import bind_args, meta_val, seq_dims
from ..transports.halo import ConvHalo
from ..transports.masks import MetadataMask
from .blocks import Blocks, match_blocks
from .causal_conv import CONVS, match_causal_conv
from .failed import FailedMatch
from .head_repeat import HeadRepeat, match_head_repeat, same_size
from .masks import NotPositional, PositionMask, evaluate_position_mask, may_carry_gradient, model_mask, one_document
from .stencils import PADS, match_shifts, match_unfold_window

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default

__all__ = ["Blocks", "FailedMatch", "HeadRepeat", "Matches", "MetadataMask", "NotPositional", "PositionMask",
           "evaluate_position_mask", "match_graph", "one_document", "same_size"]


@dataclass
class Matches:
    claimed: set = field(default_factory=set)
    """Nodes no per-op rule sees."""
    convs: dict = field(default_factory=dict)
    """Convolution (or window ``unfold``) node -> its causal form (:class:`ConvHalo`) or why it has none
    (:class:`FailedMatch`)."""
    masks: dict = field(default_factory=dict)
    """Attention node -> its model-built mask (:class:`MetadataMask`, :class:`PositionMask`) or why it cannot
    be rebuilt per rank (:class:`FailedMatch`)."""
    head_repeats: dict = field(default_factory=dict)
    """A head-repeated K or V node -> the :class:`HeadRepeat` that made it."""
    shifts: dict = field(default_factory=dict)
    """A slice of a padded tensor -> the :class:`~cp_passes.transports.shift.Shift` it reads."""
    blocks: Blocks = field(default_factory=Blocks)
    """Attention written by hand: each ``[q, k]`` block's key dim, and the masks combined with them."""


_CHECKS = (aten._assert_tensor_metadata.default, aten._assert_async.default, aten._assert_async.msg,
           aten._assert_scalar.default)
"""Ops that only check a value (torch.export leaves them in): they belong to the pattern they check."""


def _claim(matches: Matches, graph: torch.fx.Graph, nodes: set, anchors: set) -> None:
    """Claim the nodes of ``nodes`` whose every use is claimed or is an anchor's own use (``anchors`` holds
    ``(anchor node, the pattern node it consumes)``), and the checks that read only such nodes (with the
    size arithmetic they test: ``torch._check`` on a count the pattern computed, and the parts of its tuples)."""
    nodes = set(nodes)
    for n in graph.nodes:
        if (n not in nodes and n.all_input_nodes and all(a in nodes for a in n.all_input_nodes)
                and (isinstance(meta_val(n), (torch.SymInt, torch.SymBool)) or n.target is operator.getitem)):
            nodes.add(n)
    for n in reversed(list(graph.nodes)):  # users before producers
        if n.target in _CHECKS and n.all_input_nodes and all(a in nodes for a in n.all_input_nodes):
            matches.claimed.add(n)
        elif n in nodes and all(u in matches.claimed or (u, n) in anchors for u in n.users):
            matches.claimed.add(n)


def match_graph(gm: torch.fx.GraphModule, sym, multiple: int = 1) -> Matches:
    matches = Matches()
    mask_nodes, mask_anchors = set(), set()
    carry = may_carry_gradient(gm.graph)
    masks = {bind_args(n)["attn_mask"] for n in gm.graph.find_nodes(op="call_function", target=SDPA)} - {None}
    for node in gm.graph.find_nodes(op="call_function", target=SDPA):
        args = bind_args(node)
        for name in ("key", "value"):
            found = match_head_repeat(args[name])
            if found is not None:
                matches.head_repeats[args[name]] = found
        mask = args["attn_mask"]
        sharded = seq_dims(args["query"], sym) and (seq_dims(args["key"], sym) or seq_dims(args["value"], sym))
        if isinstance(mask, torch.fx.Node) and sharded:  # the attention rule replaces this mask
            found = model_mask(mask, sym, carry, multiple, masks)
            matches.masks[node] = found
            if isinstance(found, (MetadataMask, PositionMask)):
                mask_nodes.update(found.nodes)
                mask_anchors.add((node, mask))
    matches.blocks = match_blocks(gm, sym, carry, multiple)
    for mask in matches.blocks.masks.values():
        mask_nodes.update(mask.nodes)
    mask_anchors |= matches.blocks.anchors
    _claim(matches, gm.graph, mask_nodes, mask_anchors)
    for target in CONVS:
        for node in gm.graph.find_nodes(op="call_function", target=target):
            if not seq_dims(bind_args(node)["input"], sym):
                continue
            found = match_causal_conv(node, sym)
            matches.convs[node] = found
            if isinstance(found, ConvHalo):
                matches.claimed.add(found.pad if found.pad is not None else found.slice)
    for target in PADS:
        for pad in gm.graph.find_nodes(op="call_function", target=target):
            if pad in matches.claimed:
                continue
            shifts = match_shifts(pad, sym, multiple)
            if shifts:
                matches.claimed.add(pad)
                matches.shifts.update((s.node, s) for s in shifts)
                continue
            window = match_unfold_window(pad, sym)
            if window is not None:
                found, slices = window
                matches.claimed.update([pad, *slices])
                matches.convs[found.conv] = found
    return matches
