"""The key axis of hand-written attention: which operands the planner brings, before any rule runs.

As in DTensor's sharding propagation, the redistribution is decided here, not by the op's rule: for every
op on a ``[q, k]`` block (see :mod:`cp_passes.match.blocks`), an input whose sequence dim lands on the
block's key axis is brought from the other ranks (the ``key_gather`` transport), and a mask the model built
from metadata is evaluated over the whole sequence. The op's rule then sees the key axis as not sharded:
softmax over keys, soft-capping and ``probs @ v`` are correct on ``[local queries, keys brought]``.

Which keys: every key, unless the model's masks provably give the others zero probability
(:mod:`cp_passes.match.key_cuts`). Then the masks are evaluated here, as the single device would at the
compile-time length (capped at ``PROBE_MAX_LEN``) for one unpadded document (positions ``0..S-1``, one doc
id), to read what they let a query see (:func:`~cp_passes.key_plan.read_reach`), and the
:class:`~cp_passes.key_plan.KeyPlan` decided as for SDPA: a window of ``w`` keys takes a halo of ``w - 1`` rows
(a two-sided band, an encoder's, rows from both sides), causal attention the causal prefix of a gather. The
run-time check in the transport holds the model to it.

Keys concatenated from positions and windows of them (compressed attention's ``[raw K | compressed K]``)
are cut in their first part, the positions, by the masks' first part along the key axis; the windows come
whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from ..errors import node_ref
from ..graph.analysis import has_symbol, meta_val, seq_dims
from ..graph.analysis import window as positions_per_row
from ..match.blocks import RESHAPES, SCORES, TO_SOURCE, key_concat
from ..match.head_repeat import is_whole_slice, match_head_repeat
from ..match.key_cuts import KeyCut, Masking, key_cuts
from ..match.masks import NotPositional, PositionMask, evaluate_position_mask, one_document
from ..key_plan import PROBE_MAX_LEN, KeyPlan, Move, Reach, mask_reach, read_reach
from ..transports.keys import BroughtKeys, KeyMask, KeyOperand, KeySize
from ..transports.mask_program import hidden_together
from .registry import NO_RULE_FIX, Rewrite, RuleContext

aten = torch.ops.aten


_ALIGNED = {aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar, aten.masked_fill.Scalar,
            aten.masked_fill.Tensor, aten.gather.default, aten.cat.default}
"""Ops whose inputs' dims line up with the output's from the right, as pointwise ops broadcast (gather's
input and index, cat's inputs, have the output's rank)."""


@dataclass
class KeyState:
    """What the planner has decided about hand-written attention's key axis so far, node by node: one request
    per operand or mask, one :class:`BroughtKeys` per softmax."""

    operands: dict = field(default_factory=dict)
    """``(operand node, its dim, keys)`` -> its :class:`KeyOperand` request (one transport, however many blocks read
    it)."""
    masks: dict = field(default_factory=dict)
    """``(mask node, keys)`` -> its :class:`KeyMask` request."""
    cuts: dict | None = None
    """Block node -> its :class:`KeyCut` (found on the first call)."""
    ranges: dict = field(default_factory=dict)
    """Softmax -> ``(BroughtKeys or None, why)``."""
    later: dict = field(default_factory=dict)
    """Softmax -> whether a query may read a later key (its masks show no causal window)."""
    probes: dict = field(default_factory=dict)
    """``((masks that hide keys, over a concatenation's first part), length)`` -> what they show (layers
    sharing a mask evaluate it once)."""


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
    for x in ctx.tensor_inputs():
        dims = seq_dims(x, sym)
        if x in keys or not dims:
            continue
        if torch.Tag.pointwise not in node.target.tags and node.target not in _ALIGNED:
            ctx.refuse(f"it makes the [q, k] block {node_ref(node)} from {node_ref(x)}, whose sequence axis cp_passes "
                       f"cannot place on the query or the key axis",
                       "build scores as q @ k.transpose(-2, -1) and combine them with pointwise ops, gather or "
                       "cat only")
        found += [(x, d) for d in _on_key_axis(node, x, keys, sym)]
    return found


def _on_key_axis(node: torch.fx.Node, x: torch.fx.Node, keys: dict, sym) -> list[int]:
    """The sequence dims of ``x`` that land on block ``node``'s key axis (dims line up from the right, as
    pointwise ops broadcast)."""
    out_nd = meta_val(node).dim()
    return [d for d in seq_dims(x, sym) if d + out_nd - meta_val(x).dim() == keys[node]]


def _gather_point(operand: torch.fx.Node, dim: int, sym):
    """Where to gather ``operand``: back through size-free layout ops and a head repeat to its smallest form."""
    steps, source = [], operand
    while True:
        repeat = match_head_repeat(source)
        if repeat is not None and dim == 2 and seq_dims(repeat.small, sym) == (2,):
            steps.append(repeat.n_rep)
            source = repeat.small
            continue
        if not (isinstance(source, torch.fx.Node) and (source.target in TO_SOURCE or is_whole_slice(source))):
            break
        prev = source.args[0]
        prev_dims = seq_dims(prev, sym)
        if len(prev_dims) != 1:
            break
        steps.append(source)
        dim, source = prev_dims[0], prev
    return source, dim, steps[::-1]


def _side_operand(cut: KeyCut, blocks, sym) -> torch.fx.Node | None:
    """A sequence-sharded input that lands on the key axis of an op of ``cut`` other than K in the scores and
    V in ``probs @ v`` (a key-side bias): a halo's zero rows would reach it (``x / 0``), a prefix's would not."""
    for node in cut.nodes:
        if node.target in SCORES or node not in blocks.keys:
            continue
        for x in node.all_input_nodes:
            if x not in blocks.keys and _on_key_axis(node, x, blocks.keys, sym):
                return x
    return None


def _read_keys(ctx: RuleContext, cut: KeyCut, probes: dict) -> tuple[BroughtKeys | None, str]:
    """The keys ``cut``'s masks let a query see at the compile-time length (and about half of it), or None
    and why every key."""
    concat = _concat(ctx, cut)
    reach = read_reach(lambda length: _probe(ctx, cut, length, concat, probes), _probe_length(ctx))
    if isinstance(reach, str):
        return None, reach
    masking, first = tuple(cut.masking), concat is not None
    side = _side_operand(cut, ctx.matches.blocks, ctx.sym) if reach.before is not None else None
    halo = ctx.spec.window_transport == "halo" and side is None
    plan = KeyPlan.decide(reach, halo)
    if plan.move == Move.HALO:
        return BroughtKeys(plan, masking, first), f"{reach.describe()} read from the model's mask"
    if not reach.causal:
        return None, reach.describe() + (f"; {node_ref(side)} is read on the key axis besides K and V"
                                         if side is not None else ", by gather as the spec asks")
    if side is not None:
        return BroughtKeys(plan, masking, first), (f"{reach.describe()}; {node_ref(side)} is read on the key axis "
                                                f"besides K and V, so the prefix of a gather rather than a halo "
                                                f"with zero rows")
    return BroughtKeys(plan, masking, first), ("causal, read from the model's mask" if reach.before is None
                                            else f"{reach.describe()}, by gather as the spec asks")


def _probe_length(ctx: RuleContext) -> int:
    return min(ctx.layout.global_len(ctx.local_len()), PROBE_MAX_LEN)


def _probe(ctx: RuleContext, cut: KeyCut, length: int, concat, probes: dict) -> Reach | str:
    """:func:`_probe_window` at ``length``, once for every cut with the same masks (layers sharing a mask)."""
    seen = (cut.masking, concat is not None, length)  # the same masks over positions alone, or over a first part
    if seen not in probes:
        probes[seen] = _probe_window(ctx, cut, length, concat)
    return probes[seen]


def _concat(ctx: RuleContext, cut: KeyCut) -> torch.fx.Node | None:
    """The :func:`key_concat` the scores of ``cut`` take their keys from, or None."""
    blocks = ctx.matches.blocks
    for n in cut.nodes:
        if n.target in SCORES and n in blocks.keys:
            b = n.args[1]
            return key_concat(b, meta_val(b).dim() - 1, ctx.sym, ctx.spec.pad_multiple)
    return None


def _positions_first(cat: torch.fx.Node, sym, multiple: int) -> bool:
    """Whether a key concatenation's first part holds positions (not windows of them)."""
    first = cat.args[0][0]
    return positions_per_row(meta_val(first).shape[seq_dims(first, sym)[0]], sym, multiple) == 1


def _first_part(mask: torch.fx.Node, key_dim: int) -> torch.fx.Node | None:
    """The first part of a mask concatenated along the key axis (the one over the raw positions), or None."""
    if mask.target is not aten.cat.default:
        return None
    dim = (mask.args[1] if len(mask.args) > 1 else mask.kwargs.get("dim", 0)) % meta_val(mask).dim()
    return mask.args[0][0] if dim == key_dim else None


def _probe_window(ctx: RuleContext, cut: KeyCut, length: int, concat: torch.fx.Node | None) -> Reach | str:
    """The keys the masks let a query see for one document of ``length``: the smallest causal band holding
    them, or the two-sided band they are; or why cp_passes cannot say. On keys concatenated by ``concat``, the
    band over its first part (causal only)."""
    blocks, spec = ctx.matches.blocks, ctx.spec
    if concat is not None and not _positions_first(concat, ctx.sym, spec.pad_multiple):
        return f"its keys concatenate windows of positions first ({node_ref(concat)}), which cp_passes does not cut"
    masks, steps, dims = [], [], []
    for masking in cut.masking:
        found = blocks.masks[masking.mask]
        target = _first_part(found.mask, blocks.keys[found.mask]) if concat is not None else found.mask
        if target is None:
            continue
        leaves = {leaf: one_document(leaf, d, spec, length) for leaf, d in zip(found.tensor_leaves, found.leaf_dims)}
        if concat is None and any(v is None for v in leaves.values()):
            continue  # reads an input that is neither positions nor doc ids: the run-time check replays it
        try:  # a first part that reads an activation walks up to the model's inputs: NotPositional
            value = evaluate_position_mask(PositionMask(target, found.nodes, found.size_leaves), ctx.sym, length,
                                           {leaf: v for leaf, v in leaves.items() if v is not None})
        except NotPositional:
            continue
        masks.append(value)
        steps.append(_step(masking))
        dims.append(_dims(found.mask, blocks, ctx.sym))
    together = hidden_together(masks, tuple(steps), tuple(dims)) if masks else None
    if together is None or tuple(together.shape[-2:]) != (length, length):
        return "cp_passes could not evaluate the masks that hide keys for one document"
    seen = (~together).reshape(-1, length, length)
    if not bool(seen.any(-1).all()):
        return "its masks hide every key from some query (checked for one document)"
    seen = seen.any(0)
    envelope = mask_reach(seen, exact=False)
    if isinstance(envelope, str) or envelope.causal:
        return envelope
    sides = mask_reach(seen) if concat is None else None  # later keys: only an exact two-sided band is cut
    if sides is None or isinstance(sides, str) or not sides.banded or sides.before < 0:
        return "its masks let a query see later keys (not causal)"
    return sides


def _keys_for(ctx: RuleContext, state: KeyState, node: torch.fx.Node) -> tuple[BroughtKeys | None, str]:
    if state.cuts is None:
        state.cuts = key_cuts(ctx.matches.blocks)
    cut = state.cuts.get(node)
    if cut is None:
        return None, "no softmax over these keys"
    if cut.why is not None:
        return None, cut.why
    if ctx.spec.attention_keys == "all":
        return None, "the spec asks for every key (attention_keys='all')"
    if cut.softmax not in state.ranges:
        state.ranges[cut.softmax] = _read_keys(ctx, cut, state.probes)
    return state.ranges[cut.softmax]


def _reads_later(ctx: RuleContext, state: KeyState, node: torch.fx.Node) -> bool:
    """Whether a query of ``node``'s attention may read a later key: False only where its masks show causal
    attention or a causal window, read even where every key is brought (``attention_keys="all"``)."""
    cut = state.cuts.get(node) if state.cuts is not None else None
    if cut is None or cut.why is not None:
        return True
    if cut.softmax not in state.later:
        found = _probe(ctx, cut, _probe_length(ctx), _concat(ctx, cut), state.probes)
        state.later[cut.softmax] = isinstance(found, str) or not found.causal
    return state.later[cut.softmax]


def plan_keys(ctx: RuleContext, state: KeyState) -> list[tuple[torch.fx.Node, Rewrite]]:
    """The key-axis rewrites ``ctx.node`` needs (new ones only), and marks its brought inputs in ``ctx``."""
    blocks = ctx.matches.blocks
    node = ctx.node
    if node in blocks.conflicts:
        ctx.refuse(blocks.conflicts[node], "compute each attention's scores from one q @ k^T")
    rewrites = []
    if node in blocks.keys:
        reshape = _reshape_sizes(node, blocks.keys[node], ctx.sym)
        sizes = [a for a in torch.utils._pytree.tree_leaves(node.args if reshape is None else reshape[0])
                 if has_symbol(a, ctx.sym)]
        if sizes:
            ctx.refuse(f"it sizes the [q, k] block {node_ref(node)} with the local length ({sizes[0].name}), and "
                       f"cp_passes makes its key axis whole",
                       "size attention scores from the query and key tensors' own shapes (expand_as, or no size)")
        if reshape is not None and reshape[1]:
            note = f"{node_ref(node)} sized -1 on its key axis, which cp_passes makes whole"
            rewrites.append((node, Rewrite("key_size", "key_gather", KeySize(node, blocks.keys[node]), note=note)))
    landings = _landings(ctx)
    masks = [x for x in ctx.tensor_inputs() if x in blocks.masks]
    if not landings and not masks:
        return rewrites
    keys, why = _keys_for(ctx, state, node)
    for operand, dim in landings:
        ctx.brought.add(operand)
        request = state.operands.get((operand, dim, keys))
        if request is None:
            source, gather_dim, steps = _gather_point(operand, dim, ctx.sym)
            concat = source in blocks.concats
            behind = key_concat(operand, dim, ctx.sym, ctx.spec.pad_multiple)
            if behind is not None and behind is not source:
                ctx.refuse(f"its keys concatenate positions and windows of them ({node_ref(behind)}), and cp_passes "
                           f"would bring {node_ref(source)} instead, whose rows interleave the ranks' parts",
                           "read the concatenated keys through transposes and a head repeat on dim 1 only")
            if keys is not None and concat and not keys.first_part:
                ctx.refuse(f"its keys concatenate positions and windows of them ({node_ref(source)}), but cp_passes "
                           f"read its masks as {keys.describe()} over the whole key axis", NO_RULE_FIX)
            if keys is not None and keys.first_part and not concat:
                ctx.refuse(f"its key axis concatenates positions and windows of them, but {node_ref(source)} is not "
                           f"that concatenation (a value concatenated on its own, say), which cp_passes would have to "
                           f"cut part by part as well", "concatenate once and read the result as both K and V (as "
                           "DeepSeek V4 does)")
            later = _reads_later(ctx, state, node) if keys is None else keys.plan.after > 0
            request = KeyOperand(operand, source, gather_dim, steps, brought=keys, reads_later=later, concat=concat)
            state.operands[(operand, dim, keys)] = request
            brings = keys.describe() if keys is not None else "every key"
            note = f"{request.describe()}, brought to the key axis at {node_ref(node, code=False)}: {brings} ({why})"
            rewrites.append((node, Rewrite("key_operand", "key_gather", request, note=note)))
        request.consumers.append(node)
    for x in masks:
        request = state.masks.get((x, keys))
        if request is None:
            mask, key_dim = blocks.masks[x], blocks.keys[x]
            query_dim = next(d for d in seq_dims(x, ctx.sym) if d != key_dim)
            checks = ()
            if keys is not None and x is keys.masking[0].mask:  # one check per cut, with its first hiding mask
                checks = tuple((blocks.masks[m.mask], _step(m), _dims(m.mask, blocks, ctx.sym)) for m in keys.masking)
            request = state.masks[(x, keys)] = KeyMask(mask, query_dim, key_dim, keys, checks)
            rewrites.append((x, Rewrite("key_mask", "key_gather", request, note=request.describe())))
        request.consumers.append(node)
    return rewrites


def _reshape_sizes(node: torch.fx.Node, key: int, sym) -> tuple[list, bool] | None:
    """For a reshape of a block (:data:`~cp_passes.match.blocks.RESHAPES`): its sizes other than the query axis
    (which stays this rank's) and the key axis, and whether the key axis is sized by the local length (then
    sized -1 instead, as Bloom writes it); None for any other op or where another size is -1."""
    if node.target not in RESHAPES:
        return None
    sizes = list(node.args[1])
    query = next(d for d in seq_dims(node, sym) if d != key)
    if any(isinstance(a, int) and a == -1 for d, a in enumerate(sizes) if d != key):
        return None
    return [a for d, a in enumerate(sizes) if d not in (query, key)], has_symbol(sizes[key], sym)


def _dims(mask: torch.fx.Node, blocks, sym) -> tuple[int, int]:
    """``(query dim, key dim)`` of a matched mask."""
    key = blocks.keys[mask]
    return next(d for d in seq_dims(mask, sym) if d != key), key


def _step(masking: Masking) -> tuple:
    """How ``masking`` is replayed (:func:`~cp_passes.transports.mask_program.hidden_together`)."""
    return masking.hides, masking.fill, masking.dtype
