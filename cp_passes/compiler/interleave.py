"""Which planned rewrites would tell a row of interleaved documents from the packed row it came from.

``shard_batch(..., balance="documents")`` cuts every packed document into ``2P`` pieces and interleaves them
(:func:`~cp_passes.data.packing.interleaved_order`), so that the balanced layout deals each rank a head and a tail
of every document. Every per-token value is kept (tokens, per-document positions, labels shifted inside each
document, doc ids) and so is the order of the positions inside each document. What changes is which positions
neighbour which, how far apart two positions of a document are, and the order of positions of different
documents. A model computes the same on both rows when:

- every attention keeps documents apart: its mask is ``... & (doc[q] == doc[k])``, one side of the equality the
  queries', the other the keys', both the batch's doc ids (``spec.doc_key``) as they are;
- the row's own positions (an ``arange`` over the sequence) are only compared with each other (``q >= k``, or
  ``q - k >= 0``), and what the comparisons give reaches nothing but such masks, through logic ops;
- nothing else reads across rows but sums over the sequence (losses, counts).

Halos, shifts, scans, carries, convolutions, table slices and attention written by hand read neighbours or
distances: a plan with any of them refuses interleaved batches. The analysis runs on the planned graph before
the transports rewrite it; the refusal is per call (:meth:`~cp_passes.compiler.backend.CPModule._refuse_interleaved`),
the same on every rank (the batch's cut and the graph are).
"""

from __future__ import annotations

import torch

from ..errors import CPCompileError, op_name, source_line
from ..graph.analysis import INPUT_NAME, bind_args, meta_val
from ..spec import CPSpec
from .planner import Plan

aten = torch.ops.aten

SEPARATING_ATTENTION = ("sdpa_data_mask", "sdpa_bidirectional")
ORDER_FREE = ("global_sum", "global_mean", "masked_count")
"""Rules whose results do not depend on the order of the rows: sums and counts over the sequence."""

_PASS = {aten.view, aten._unsafe_view, aten.reshape, aten.expand, aten.expand_as, aten.broadcast_to, aten.unsqueeze,
         aten.squeeze, aten.transpose, aten.permute, aten.alias, aten.clone, aten.detach, aten.contiguous,
         aten._to_copy, aten.to, aten.slice}
"""Ops that keep which position (or which pair) each element is about."""
_METADATA = {aten._assert_tensor_metadata, aten.sym_size, aten.sym_numel, aten.sym_stride}
"""Ops that read a tensor's shape or dtype only."""
_ORDER = {aten.ge, aten.gt, aten.le, aten.lt, aten.eq, aten.ne}
_AND = {aten.__and__, aten.bitwise_and, aten.logical_and}
_LOGIC = _AND | {aten.__or__, aten.bitwise_or, aten.logical_or, aten.logical_not, aten.bitwise_not}


def _packet(node: torch.fx.Node):
    return getattr(node.target, "overloadpacket", None)


def _passes(node: torch.fx.Node) -> bool:
    """A pass-through op; a slice only when it keeps every element (a partial one moves rows)."""
    if _packet(node) is not aten.slice:
        return _packet(node) in _PASS
    args = list(node.args) + [None] * (5 - len(node.args))
    return args[2] in (None, 0) and args[4] in (None, 1) and isinstance(args[3], int) and args[3] >= 2 ** 62


def _source(node: torch.fx.Node) -> torch.fx.Node:
    while isinstance(node, torch.fx.Node) and _passes(node):
        node = node.args[0]
    return node


def _is_one(size) -> bool:
    return isinstance(size, int) and size == 1


def _keeps_documents_apart(mask, spec: CPSpec) -> bool:
    """Whether ``mask`` is a conjunction with ``doc[q] == doc[k]`` over the batch's doc ids."""
    node = _source(mask)
    if not isinstance(node, torch.fx.Node):
        return False
    if _packet(node) in _AND:
        return any(_keeps_documents_apart(arg, spec) for arg in node.args if isinstance(arg, torch.fx.Node))
    if node.target is not aten.eq.Tensor:
        return False
    sides = [arg for arg in node.args if isinstance(arg, torch.fx.Node)]
    if len(sides) != 2 or not all(_is_doc_ids(_source(side), spec) for side in sides):
        return False
    a, b = (list(meta_val(side).shape) for side in sides)
    out = list(meta_val(node).shape)
    if len(out) < 2 or _is_one(out[-1]) or _is_one(out[-2]):
        return False
    a, b = [1] * (len(out) - len(a)) + a, [1] * (len(out) - len(b)) + b
    return (_is_one(a[-1]) and _is_one(b[-2]) and not _is_one(a[-2]) and not _is_one(b[-1])) or \
        (_is_one(a[-2]) and _is_one(b[-1]) and not _is_one(a[-1]) and not _is_one(b[-2]))


def _is_doc_ids(node, spec: CPSpec) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "placeholder" and node.meta.get(INPUT_NAME) == spec.doc_key


_EXACT = (torch.int32, torch.int64, torch.float32, torch.float64)
"""Dtypes that hold a position exactly (float32 up to 2**24): a cast to a narrower one can make two positions equal
in one row and not in the other."""


def _closure(nodes: set) -> set:
    """``nodes`` and every value passed through from them, in a dtype that keeps every position apart."""
    todo = list(nodes)
    while todo:
        for user in todo.pop().users:
            if user not in nodes and _passes(user) and meta_val(user).dtype in _EXACT:
                nodes.add(user)
                todo.append(user)
    return nodes


def _order_only(aranges: list, masks: set) -> tuple[torch.fx.Node, str] | None:
    """Where and why the row positions of ``aranges`` are read other than by comparing two of them into the mask
    of one of ``masks`` (attentions that keep documents apart), or None."""
    positions = _closure(set(aranges))
    differences = _closure({user for node in positions for user in node.users
                            if user.target is aten.sub.Tensor and all(a in positions for a in user.args)})
    orders = set()
    for node in positions | differences:
        for user in node.users:
            if user in positions or user in differences or _packet(user) in _METADATA:
                continue
            inputs = [a for a in user.args if isinstance(a, torch.fx.Node)]
            if _packet(user) in _ORDER and len(inputs) == 2 and all(a in positions for a in inputs):
                orders.add(user)
            elif (_packet(user) in _ORDER and inputs == [user.args[0]] and user.args[0] in differences
                  and user.args[1] == 0):
                orders.add(user)
            else:
                return user, "computes with the row's positions (an arange over the sequence)"
    seen, todo = set(orders), list(orders)
    while todo:
        for user in todo.pop().users:
            if user in seen or _packet(user) in _METADATA:
                continue
            if user in masks and bind_args(user).get("attn_mask") in seen:
                continue
            if _passes(user) or _packet(user) in _LOGIC:
                seen.add(user)
                todo.append(user)
            else:
                return user, ("reads an order of the row's positions outside an attention mask that keeps documents "
                              "apart")
    return None


def _row_positions(graph: torch.fx.Graph, sym) -> list[torch.fx.Node]:
    """Every ``arange`` over the sequence (its length has the sequence symbol): planned as positions, or picked
    into a mask that the attention evaluates itself."""
    found = []
    for node in graph.nodes:
        if _packet(node) is aten.arange:
            size = meta_val(node).shape[0]
            if isinstance(size, torch.SymInt) and sym in size.node.expr.free_symbols:
                found.append(node)
    return found


def interleave_readers(graph: torch.fx.Graph, sym, plan: Plan, spec: CPSpec) -> list[str]:
    """One line per planned rewrite (or read of the row's positions) that a row of interleaved documents would
    change; run on the graph as planned, before the transports rewrite it."""
    found: list[str] = []

    def add(node: torch.fx.Node, what: str) -> None:
        line = f"{op_name(node)} at {source_line(node)}: {what}"
        if line not in found:
            found.append(line)

    masks = set()
    for node, rw, _ in plan.rewrites:
        if rw.rule in SEPARATING_ATTENTION and _keeps_documents_apart(bind_args(node).get("attn_mask"), spec):
            masks.add(node)
        elif rw.rule in SEPARATING_ATTENTION:
            add(node, f"its mask does not keep documents apart (it needs '& ({spec.doc_key}[q] == {spec.doc_key}[k])' "
                      f"over the batch's {spec.doc_key})")
        elif rw.rule.startswith("sdpa_"):
            add(node, f"attention ({rw.rule}) that does not keep documents apart by a mask over {spec.doc_key}")
        elif rw.rule not in ORDER_FREE + ("arange_positions",):
            add(node, f"{rw.rule} ({rw.transport}) reads neighbouring rows or their distances")
    read = _order_only(_row_positions(graph, sym), masks)
    if read is not None:
        add(*read)
    for node in plan.keys:
        add(node, "attention written by hand (its keys gathered as they are)")
    return found


def interleaved_refusal(readers: list[str], spec: CPSpec) -> CPCompileError:
    """The refusal of an interleaved batch for a model with ``readers``."""
    listed = "\n".join(f"  - {line}" for line in readers)
    return CPCompileError(
        f"this batch's documents were interleaved to balance their work (shard_batch(..., balance='documents')), "
        f"and the model would tell: its results would differ from the single-device model's on the packed row:\n"
        f"{listed}\nfix: shard the batch without balance= (documents then stay whole, in row order), or keep every "
        f"document apart in the model's attention masks with the batch's {spec.doc_key} and take positions from "
        f"{spec.position_keys[0] if spec.position_keys else 'position_ids'}")
