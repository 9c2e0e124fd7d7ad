"""Which keys a hand-written attention can do without: the proof that masked keys get zero probability.

A softmax over a block's key axis whose input was masked by the model (``scores + mask`` with ``finfo.min``
or ``-inf`` where a key is hidden, ``masked_fill(scores, mask, -inf)``, ``where(mask, scores, -inf)``) gives
every hidden key a probability of exactly zero: dropping the key changes no other probability, no output
of ``probs @ v`` and no gradient. That holds when

- every op between the scores and the softmax acts on each key column alone (pointwise ops, masks, a
  ``gather`` that does not read across keys, sink logits concatenated after or before the keys), except
  the overflow guard ``x - x.max(-1, keepdim=True)`` right before the softmax: a softmax is unchanged by a
  constant per row, and the maximum is the same over fewer keys as long as a visible key (or a sink) holds
  it, which a hidden key at ``finfo.min`` never does while its row sees one;
- nothing between the masking and the softmax can lift a hidden score (casts, copies, concatenation; any
  other op, a product, a clamp, a ``where`` with a tensor or a fill that is not very negative, ends the
  masking, and what it reads keeps every key unless masked again after it);
- masks applied in turn hide what they hide *together*, replayed in order on a score of zero: an
  additive mask after another may lift a hidden score back (``+finfo.max`` on ``finfo.min``), so the keys
  a cut leaves out are those the replay still finds at or below half of ``finfo.min``, at compile time and
  in the run-time check alike;
- after the softmax only ops that keep a zero probability zero (casts, dropout, products, the slice that
  drops the sinks) lead to the contraction with V, and no block is read anywhere else.

:func:`key_cuts` finds each such softmax with the blocks it reads and feeds and the masks that hide keys.
Which keys the masks hide (causal, or a window) is read where the planner knows the length
(:mod:`cp_passes.rules.key_axis`), and checked at run time against the masks the model really computes.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from ..errors import node_ref
from ..graph.analysis import meta_val
from .blocks import _REORDERING, RESHAPES, SCORES, Blocks

aten = torch.ops.aten

_COPIES = {aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.clone.default, aten.contiguous.default,
           aten.alias.default, aten.detach.default, aten.type_as.default, aten.expand.default,
           aten.unsqueeze.default} | _REORDERING
"""Ops that move or cast a block's entries without combining them."""
_ZERO_KEEPING = _COPIES | RESHAPES | {aten.dropout.default, aten.mul.Tensor, aten.mul.Scalar, aten.div.Scalar}
"""After the softmax: ops under which a zero probability stays zero (``div.Tensor`` by a block is not one)."""
_COLUMNWISE = _COPIES | RESHAPES | {aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.where.self,
                                    aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar,
                                    aten.cat.default, aten.gather.default}
"""Before the softmax, besides pointwise ops: ops whose output column for a key reads that key's column only
(``gather`` and ``cat`` with the conditions :func:`_columnwise` checks; a reshape is a block only where it
keeps the key columns, :data:`~cp_passes.match.blocks.RESHAPES`)."""
_SOFTMAX = {aten.softmax.int, aten._softmax.default}
_ROW_MAX = {aten.max.dim, aten.amax.default}
_IGNORED = {aten._assert_tensor_metadata.default}


@dataclass(frozen=True)
class Masking:
    """A matched mask that hides keys from a softmax: ``hides`` says which of its entries do."""

    mask: torch.fx.Node
    hides: str
    """``"additive"`` (added: entries at or below half of ``finfo.min``), ``"true"`` (True entries) or
    ``"false"`` (False entries)."""
    fill: float | None = None
    """The value a ``"true"`` or ``"false"`` mask writes where it hides (None for an additive mask)."""
    dtype: torch.dtype | None = None
    """The dtype of the scores once masked: masks applied in turn are replayed in it (:func:`~cp_passes.
    transports.keys.hidden_together`), since a later addition may lift what an earlier mask hid."""


@dataclass
class KeyCut:
    """One softmax over a key axis, what it reads and feeds up to ``probs @ v``, and the masks that hide keys
    from it: a hidden key may be left out of every block here."""

    softmax: torch.fx.Node
    masking: tuple[Masking, ...] = ()
    nodes: set = field(default_factory=set)
    """The blocks before and after the softmax and the contractions with V (those found, when ``why``)."""
    why: str | None = None
    """Why no key may be left out, or None."""


def _very_negative(value, like: torch.fx.Node) -> bool:
    dtype = meta_val(like).dtype
    return isinstance(value, (int, float)) and dtype.is_floating_point and (
        value == -math.inf or value <= torch.finfo(dtype).min / 2)


def _masking(node: torch.fx.Node, blocks: Blocks) -> tuple[Masking, torch.fx.Node] | None:
    """``(how node hides keys, the block it masks)`` when ``node`` applies a matched mask to a block."""
    args, t, dtype = node.args, node.target, meta_val(node).dtype
    if (t is aten.add.Tensor and len(args) == 2 and all(isinstance(a, torch.fx.Node) for a in args)
            and node.kwargs.get("alpha", 1) == 1):
        for mask, x in (args, args[::-1]):
            if mask in blocks.masks and x not in blocks.masks and meta_val(mask).is_floating_point():
                return Masking(mask, "additive", None, dtype), x
    if t is aten.masked_fill.Scalar and args[1] in blocks.masks and _very_negative(args[2], node):
        return Masking(args[1], "true", float(args[2]), dtype), args[0]
    if t is aten.where.ScalarOther and args[0] in blocks.masks and _very_negative(args[2], node):
        return Masking(args[0], "false", float(args[2]), dtype), args[1]
    if t is aten.where.ScalarSelf and args[0] in blocks.masks and _very_negative(args[1], node):
        return Masking(args[0], "true", float(args[1]), dtype), args[2]
    return None


def _key_dim_of_cat(node: torch.fx.Node) -> int:
    return node.args[1] % meta_val(node).dim() if len(node.args) > 1 else 0


def _columnwise(node: torch.fx.Node, blocks: Blocks) -> bool:
    if torch.Tag.pointwise in getattr(node.target, "tags", ()):
        return True
    if node.target not in _COLUMNWISE:
        return False
    if node.target is aten.gather.default:  # reads across the gathered dim of its input
        source, dim = node.args[0], node.args[1] % meta_val(node).dim()
        return source not in blocks.keys or dim != blocks.keys[source]
    if node.target is aten.cat.default and _key_dim_of_cat(node) == blocks.keys[node]:
        inputs = node.args[0]  # one block and sinks (no key axis) beside it
        return sum(x in blocks.keys for x in inputs) == 1 and all(
            x in blocks.keys or isinstance(meta_val(x).shape[_key_dim_of_cat(node)], int) for x in inputs)
    return True


def _extra_columns(node: torch.fx.Node, blocks: Blocks) -> tuple[int, int]:
    """Columns a ``cat`` along the key axis adds before and after the keys (sinks)."""
    dim, inputs = _key_dim_of_cat(node), node.args[0]
    at = next(i for i, x in enumerate(inputs) if x in blocks.keys)
    return (sum(meta_val(x).shape[dim] for x in inputs[:at]),
            sum(meta_val(x).shape[dim] for x in inputs[at + 1:]))


def _slice_drops(node: torch.fx.Node) -> tuple[int, int] | None:
    """``(from the front, from the back)`` a unit-step slice with constant bounds drops, else None."""
    args = list(node.args) + [None] * (5 - len(node.args))
    start, end, step = args[2] or 0, args[3], 1 if args[4] is None else args[4]
    if step != 1 or not isinstance(start, int) or start < 0:
        return None
    if end is None or (isinstance(end, int) and end >= 2 ** 62):
        return start, 0
    return (start, -end) if isinstance(end, int) and end < 0 else None


def _row_max_shift(node: torch.fx.Node, keys: dict) -> torch.fx.Node | None:
    """The reduction when ``node`` is ``x - max(x over the key axis, keepdim)`` (``.values`` of ``max.dim``,
    or ``amax``, possibly detached), else None."""
    if node.target is not aten.sub.Tensor or node.kwargs.get("alpha", 1) != 1 or len(node.args) != 2:
        return None
    x, shift = node.args
    while isinstance(shift, torch.fx.Node) and shift.target is aten.detach.default:
        shift = shift.args[0]
    if not isinstance(shift, torch.fx.Node) or x not in keys:
        return None
    if shift.target is operator.getitem and shift.args[1] == 0:
        shift = shift.args[0]
        # max.dim's indices count the keys brought, not the sequence's: nothing may read them.
        if not all(u.target is operator.getitem and (u.args[1] == 0 or not u.users) for u in shift.users):
            return None
    elif shift.target is not aten.amax.default:
        return None
    if shift.target not in _ROW_MAX or shift.args[0] is not x or len(shift.args) < 2:
        return None
    dims = shift.args[1] if shift.target is aten.amax.default else [shift.args[1]]
    keepdim = shift.args[2] if len(shift.args) > 2 else shift.kwargs.get("keepdim", False)
    nd = meta_val(x).dim()
    return shift if keepdim and [d % nd for d in dims] == [keys[x]] else None


def _cut(softmax: torch.fx.Node, blocks: Blocks) -> KeyCut:
    cut = KeyCut(softmax)
    cut.why = _prove(cut, blocks)
    return cut


def _prove(cut: KeyCut, blocks: Blocks) -> str | None:
    """Fill ``cut`` in; None when its masked keys provably get zero probability, else why not."""
    keys, softmax = blocks.keys, cut.softmax
    if softmax.args[1] % meta_val(softmax).dim() != keys[softmax]:
        return "its softmax is not over the key axis"
    # The masking: back from the softmax through copies and one concatenation of sinks, then the ops that
    # apply masks.
    masking, sinks, x, reductions = [], None, softmax.args[0], set()
    while x in keys:
        found = _masking(x, blocks)
        if found is not None:
            masking.append(found[0])
            x = found[1]
        elif not masking and x.target in _COPIES:
            x = x.args[0]
        elif not masking and not reductions and (row_max := _row_max_shift(x, keys)) is not None:
            reductions.add(row_max)
            x = x.args[0]
        elif not masking and sinks is None and x.target is aten.cat.default and _columnwise(x, blocks):
            sinks = x
            x = next(a for a in x.args[0] if a in keys)
        else:
            break
    if not masking:
        return "no mask the model applies right before its softmax hides keys (finfo.min, -inf)"
    cut.masking = tuple(masking)

    stack = [softmax.args[0]]  # before: every block the softmax reads, each key column on its own
    while stack:
        n = stack.pop()
        if n in cut.nodes or n in blocks.masks:
            continue
        cut.nodes.add(n)
        if n.op != "call_function" or not (n.target in SCORES or _columnwise(n, blocks)):
            return f"{node_ref(n)} ({n.target}) combines key columns before the softmax"
        if n.target is aten.cat.default and n is not sinks and _key_dim_of_cat(n) == keys[n]:
            return f"{node_ref(n)} concatenates along the key axis before the mask is applied"
        if n.target not in SCORES:
            stack.extend(a for a in n.all_input_nodes if a in keys)
    for n in list(cut.nodes):
        for user in n.users:
            if user not in cut.nodes and user is not softmax and user.target not in _IGNORED \
                    and user not in reductions:
                return f"{node_ref(n)} is also read by {node_ref(user)} ({user.target})"

    stack = [(softmax, *(_extra_columns(sinks, blocks) if sinks is not None else (0, 0)))]
    while stack:  # after: to the contractions with V, a zero probability kept zero
        n, front, back = stack.pop()
        cut.nodes.add(n)
        for user in n.users:
            if user.target in _IGNORED:
                continue
            if user.target in SCORES and user.args[0] is n and user.args[1] not in keys:
                if front or back or keys[n] != meta_val(n).dim() - 1:
                    return f"{node_ref(user)} contracts {node_ref(n)} with sink columns or not over the keys"
                cut.nodes.add(user)
            elif user not in keys or any(a in keys and a is not n and a not in blocks.masks
                                         for a in user.all_input_nodes):
                return f"{node_ref(user)} ({user.target}) reads the probabilities with something else"
            elif user.target is aten.slice.Tensor and user.args[1] % meta_val(n).dim() == keys[n]:
                drops = _slice_drops(user)
                if drops is None or drops[0] > front or drops[1] > back:
                    return f"{node_ref(user)} slices the key axis of {node_ref(n)} by more than its sink columns"
                stack.append((user, front - drops[0], back - drops[1]))
            elif user.target in _ZERO_KEEPING:
                stack.append((user, front, back))
            else:
                return f"{node_ref(user)} ({user.target}) may not keep a zero probability zero"
    return None


def key_cuts(blocks: Blocks) -> dict[torch.fx.Node, KeyCut]:
    """Each block node around a softmax over its key axis -> that softmax's :class:`KeyCut` (``why`` set
    where every key must stay)."""
    cuts: dict[torch.fx.Node, KeyCut] = {}
    for node in blocks.keys:
        if node.target not in _SOFTMAX:
            continue
        found = _cut(node, blocks)
        found.nodes.add(node)
        shared = [n for n in found.nodes if n in cuts]
        if shared and found.why is None:  # two softmaxes read one block: every key for both
            found.why = f"{node_ref(shared[0])} is read by another softmax too"
        for other in {id(cuts[n]): cuts[n] for n in shared}.values():
            other.why = other.why or f"{node_ref(shared[0])} is read by another softmax too"
        cuts.update((n, found) for n in found.nodes if n not in cuts)
    return cuts
