"""Which planned rewrites would tell a row of interleaved documents from the packed row it came from.

``shard_batch(..., balance="documents")`` cuts every packed document into ``2P`` pieces and interleaves them
(:func:`~cp_passes.data.packing.interleaved_order`), so that the balanced layout deals each rank a head and a tail
of every document. Every per-token value is kept (tokens, per-document positions, labels shifted inside each
document, doc ids), and so is the order of the positions inside each document; what changes is which positions
neighbour which, how far apart two are, and the order of positions of different documents.

A model computes the same on both rows, token for token, when every op is equivariant under that permutation:
per-token ops are; attention is when its mask is. So a batch interleaved this way is accepted when

- every attention is SDPA whose keys come by a gather (a halo brings the row's neighbours) and whose mask
  :func:`~cp_passes.transports.mask_program.split_mask` writes as a program of per-position terms, each term a
  per-token function of the model's tensors picked at a query's or key's position, or the position itself; the
  positions enter the program only through comparisons of a query's with a key's (``q >= k``, ``q - k >= 0``),
  and a mask that compares them is ``... & (doc[q] == doc[k])`` over the batch's doc ids (``spec.doc_key``) as
  they are: documents apart, the only pairs whose order the interleaving changes never meet;
- nothing else reads across rows but losses over the batch's labels that ignore ``ignore_index`` (the
  interleaved row pads every document, shard_batch writes ``ignore_index`` to its labels there, and padding rows
  see one another): no ``arange`` over the sequence outside such masks, no halos, shifts, scans, carries,
  hand-written attention, other sums (every sum a partial output or an all-reduce adds, not only the first);
- the batch has one row order: shard_batch interleaves a batch only when its rows share their documents'
  lengths (one row, in long-context training), since an op across the batch would mix rows ordered alike on
  one side and differently on the other.

Anything not shown to fit is listed (op, source line, why); the refusal is per call
(:meth:`~cp_passes.compiler.backend.CPModule._refuse_interleaved`), the same on every rank. The analysis runs on
the planned graph, before the transports rewrite it.
"""

from __future__ import annotations

import types

import torch

from ..errors import CPCompileError, op_name, source_line
from ..graph.analysis import INPUT_NAME, bind_args, meta_val
from ..key_plan import Move
from ..match.head_repeat import is_whole_slice
from ..spec import CPSpec
from ..transports.rank_masks import mask_module
from ..transports.mask_program import KEY, QUERY, parsed_program, split_mask
from ..transports.reductions import GlobalMean, GlobalSum
from .padding import end_fill, ignores_padding, partial_output_sources, sum_sources
from .planner import Plan

aten = torch.ops.aten

_VIEW = {aten.unsqueeze, aten.expand, aten.alias, aten.clone, aten.detach, aten.slice}
"""Ops that keep which position each element is about (a slice only when whole)."""
_RESHAPES = {aten.view, aten._unsafe_view, aten.reshape, aten.flatten, aten.squeeze, aten.unsqueeze, aten.clone,
             aten.contiguous, aten.alias, aten.detach, aten._to_copy, aten.to}
"""What a loss's targets may go through: every label keeps its value (a padding row's ``ignore_index`` too)."""
_ORDER = {aten.ge, aten.gt, aten.le, aten.lt, aten.eq, aten.ne}
_AND = {aten.__and__, aten.bitwise_and, aten.logical_and}
_OR = {aten.__or__, aten.bitwise_or, aten.logical_or}
_NOT = {aten.logical_not, aten.bitwise_not}
_EXACT = (torch.int32, torch.int64)
"""Dtypes a position keeps its value in (a narrower one can make two positions equal in one row only)."""

POSITIONS, ROWS, DOCS, TOKENS = "positions", "rows", "doc ids", "tokens"
"""What a term of a mask holds: the position of each query or key; every row's position (an arange over the
sequence, before the picks); the batch's doc ids as they are; a per-token function of the model's tensors."""


def _packet(node) -> object:
    return getattr(getattr(node, "target", None), "overloadpacket", None)


def _view(node: torch.fx.Node) -> bool:
    return _packet(node) in _VIEW and (_packet(node) is not aten.slice or is_whole_slice(node))


def _dtype(node: torch.fx.Node):
    """The dtype a node makes (its value's, or a cast's argument where the picks made it without one)."""
    value = meta_val(node)
    if isinstance(value, torch.Tensor):
        return value.dtype
    return next((a for a in node.args if isinstance(a, torch.dtype)), node.kwargs.get("dtype"))


class _Terms:
    """What each node of a mask's term module holds (:data:`POSITIONS`, ...), with its side (``"Q"``, ``"K"`` or
    None), or why it holds something the interleaving changes."""

    def __init__(self, found, spec: CPSpec):
        self.kinds: dict = {}
        tensors = {leaf.name: leaf for leaf in found.tensor_leaves + found.inputs}
        self.sizes = {leaf.name for leaf in found.size_leaves}
        self.docs = {name for name, leaf in tensors.items()
                     if leaf.op == "placeholder" and leaf.meta.get(INPUT_NAME) == spec.doc_key}
        self.tensors = set(tensors)

    def of(self, node) -> tuple[str, str | None] | str:
        if not isinstance(node, torch.fx.Node):
            return TOKENS, None
        if node not in self.kinds:
            self.kinds[node] = self._kind(node)
        return self.kinds[node]

    def _kind(self, node: torch.fx.Node) -> tuple[str, str | None] | str:
        if node.op == "placeholder":
            if node.target in (QUERY, KEY):
                return POSITIONS, "Q" if node.target == QUERY else "K"
            if node.target in self.docs:
                return DOCS, None
            if node.target in self.tensors:
                return TOKENS, None
            return "a length of the sequence" if node.target in self.sizes else f"'{node.target}'"
        packet = _packet(node)
        if packet is aten.arange:
            args = bind_args(node)
            if args.get("start", 0) == 0 and args.get("step", 1) == 1 and (_dtype(node) or torch.int64) in _EXACT \
                    and self.of(args.get("end")) == "a length of the sequence":
                return ROWS, None
            return "an arange other than the sequence's positions (int32 or int64, 0 .. S - 1)"
        if packet is aten.index_select:
            source, positions = self.of(node.args[0]), self.of(node.args[2])
            if isinstance(source, str):
                return source
            if isinstance(positions, tuple) and positions[0] == POSITIONS and isinstance(source, tuple):
                picked = {ROWS: POSITIONS, DOCS: DOCS, TOKENS: TOKENS}.get(source[0])
                if picked is not None and source[1] is None:
                    return picked, positions[1]
            return "a pick the interleaving moves"
        if _view(node):
            return self.of(node.args[0])
        inputs = [self.of(a) for a in node.args if isinstance(a, torch.fx.Node)]
        for kind in inputs:
            if isinstance(kind, str):
                return kind
        if packet in (aten.add, aten.sub) and len(inputs) == 1 and inputs[0][0] in (POSITIONS, ROWS) \
                and node.args[1] == 0 \
                and node.args[0] in node.all_input_nodes and not node.kwargs:
            return inputs[0]
        if packet in (aten._to_copy, aten.to) and inputs and inputs[0][0] in (POSITIONS, ROWS) \
                and _dtype(node) in _EXACT:
            return inputs[0]
        cast = packet in (aten._to_copy, aten.to)
        if not cast and (not isinstance(packet, torch._ops.OpOverloadPacket)
                         or torch.Tag.pointwise not in node.target.tags):
            return f"{op_name(node)} (not elementwise)"
        if any(kind[0] in (POSITIONS, ROWS) for kind in inputs):
            return f"{op_name(node)} on positions"
        sides = {kind[1] for kind in inputs} - {None}
        return (TOKENS, sides.pop()) if len(sides) == 1 else (TOKENS, None)


def _mask_cannot_tell(found, spec: CPSpec) -> str | None:
    """Why the mask ``found`` could differ between the two rows (see the module's docstring), or None."""
    module = mask_module(types.SimpleNamespace(gm=torch.nn.Module(), planned=lambda n: n), found, picked=True)
    split = split_mask(module)
    if split is None:
        return "its mask is not an elementwise combination of per-position terms"
    terms_module, program = split
    terms = _Terms(found, spec)
    (output,) = terms_module.graph.find_nodes(op="output")
    leaves = []
    for leaf in output.args[0]:
        kind = terms.of(leaf)
        if isinstance(kind, str):
            return f"a term of its mask computes {kind}"
        leaves.append(kind)
    registers: list[tuple[bool, bool]] = []  # per register: (reads the row's order, false across documents)

    def term(token: str):
        if token[0] == "R":
            return registers[int(token[1:])]
        if token[0] in "QKC" and token[1:].isdigit():
            return leaves[int(token[1:])]
        return None

    for op, tokens, _ in parsed_program(program):
        values = [v for v in map(term, tokens) if v is not None]
        kinds = [v for v in values if isinstance(v[0], str)]
        flags = [v for v in values if isinstance(v[0], bool)]
        packet = op.overloadpacket
        if any(kind[0] == ROWS for kind in kinds):
            return "a term of its mask holds every row's position, not a query's or a key's"
        if any(kind[0] == POSITIONS for kind in kinds):
            if not (packet in _ORDER and len(values) == 2 and len(kinds) == 2 and kinds[0][0] == kinds[1][0]
                    and {kinds[0][1], kinds[1][1]} == {"Q", "K"}):
                return f"its mask computes with positions other than comparing a query's with a key's ({op})"
            registers.append((True, False))
        elif packet is aten.eq and len(kinds) == 2 and not flags and all(k[0] == DOCS for k in kinds) \
                and {kinds[0][1], kinds[1][1]} == {"Q", "K"}:
            registers.append((False, True))
        elif packet in _AND:
            registers.append((any(f[0] for f in flags), any(f[1] for f in flags)))
        elif packet in _OR:
            registers.append((any(f[0] for f in flags), len(flags) == len(values) and all(f[1] for f in flags)))
        elif packet in _NOT:
            registers.append((any(f[0] for f in flags), False))
        elif packet in _VIEW and flags:
            registers.append(flags[0])
        elif any(f[0] for f in flags):
            return f"its mask computes with a comparison of positions ({op})"
        else:
            registers.append((False, False))
    order, apart = registers[-1] if registers else (False, False)
    if order and not apart:
        return (f"its mask compares positions without keeping documents apart (it needs '& ({spec.doc_key}[q] == "
                f"{spec.doc_key}[k])' over the batch's {spec.doc_key})")
    return None


def _ignores_padding_labels(target, ignore_index, spec: CPSpec) -> bool:
    """A loss's targets are a label input that shard_batch fills with ``ignore_index`` on padding rows, and the
    loss ignores that index."""
    while isinstance(target, torch.fx.Node) and _packet(target) in _RESHAPES:
        target = target.args[0]  # the same values, laid out for the loss
    return ignore_index == spec.ignore_index and isinstance(target, torch.fx.Node) \
        and end_fill(target, spec) == spec.ignore_index


def _check_losses(sources, spec: CPSpec, add) -> None:
    """Every sum over the sequence in ``sources`` must be a loss over the batch's labels that ignores the padding
    rows: padding rows see one another, in another order once interleaved."""
    for origin in sorted(sources, key=lambda n: n.name):
        if not (ignores_padding(origin, spec) and _ignores_padding_labels(bind_args(origin).get("target"),
                                                                          spec.ignore_index, spec)):
            add(origin, "a sum over the sequence other than a loss over the batch's labels that ignores "
                        f"ignore_index={spec.ignore_index}: it counts the padding rows")


def interleave_readers(plan: Plan, spec: CPSpec) -> list[str]:
    """One line per planned rewrite that a row of interleaved documents could change; run on the graph as planned,
    before the transports rewrite it."""
    found: list[str] = []

    def add(node: torch.fx.Node, what: str) -> None:
        line = f"{op_name(node)} at {source_line(node)}: {what}"
        if line not in found:
            found.append(line)

    for node, rw, _ in plan.rewrites:
        request = rw.request
        if rw.rule in ("sdpa_data_mask", "sdpa_bidirectional"):
            if request.plan.move == Move.HALO:
                add(node, "its keys come by a halo: the rows next to its own, other documents' pieces once "
                          "interleaved")
            elif request.mask.mask is not bind_args(node).get("attn_mask"):
                add(node, "its mask is not the one the matcher read")
            else:
                why = _mask_cannot_tell(request.mask, spec)
                if why is not None:
                    add(node, why)
        elif rw.rule.startswith("sdpa_") and request.plan.reach.banded:
            add(node, f"attention over a window ({rw.rule}): distances between positions, which the interleaving "
                      f"changes")
        elif rw.rule.startswith("sdpa_"):
            add(node, f"attention ({rw.rule}) with no mask over {spec.doc_key} to keep documents apart")
        elif isinstance(request, GlobalMean):
            if not _ignores_padding_labels(bind_args(node).get(request.target_name), request.ignore_index, spec):
                add(node, "a mean over the sequence whose targets are not the batch's labels with ignore_index "
                          "(padding rows would count)")
        elif isinstance(request, GlobalSum) and not request.lengths:
            _check_losses(sum_sources(plan, request), spec, add)
        elif rw.rule == "share":
            _check_losses(frozenset().union(*(plan.partial_sources.get(t, frozenset())
                                              for t in node.all_input_nodes)), spec, add)
        elif rw.rule == "whole_output":
            continue
        elif rw.rule == "arange_positions":
            if node.users:  # one that only fed a mask the attention evaluates itself is gone by then
                add(node, "positions from an arange over the sequence, outside an attention mask")
        else:
            add(node, f"{rw.rule} ({rw.transport}): not shown to read only what the interleaving keeps")
    _check_losses(partial_output_sources(plan), spec, add)
    for node in plan.keys:
        add(node, "attention written by hand (its keys gathered as they are)")
    return found


def interleaved_refusal(readers: list[str], spec: CPSpec) -> CPCompileError:
    """The refusal of an interleaved batch for a model with ``readers``."""
    listed = "\n".join(f"  - {line}" for line in readers)
    return CPCompileError(
        f"this batch's documents were interleaved to balance their work (shard_batch(..., balance='documents')), "
        f"and the model could tell: its results could differ from the single-device model's on the packed row:\n"
        f"{listed}\nfix: shard the batch without balance= (documents then stay whole, in row order), or keep every "
        f"document apart in the model's attention masks with the batch's {spec.doc_key} and take positions from "
        f"{spec.position_keys[0] if spec.position_keys else 'position_ids'}")
