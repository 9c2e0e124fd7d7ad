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

from ..errors import node_ref
from ..graph.analysis import expr_of, meta_val, seq_dims, seq_multiple, window
from ..transports.masks import MetadataMask
from .head_repeat import is_whole_slice, match_head_repeat
from .masks import PositionMask, model_mask

aten = torch.ops.aten
SCORES = (aten.matmul.default, aten.bmm.default)


@dataclass
class Blocks:
    keys: dict = field(default_factory=dict)
    """Block node -> its key dim."""
    masks: dict = field(default_factory=dict)
    """A model-built mask combined with a block -> how it is built (:class:`MetadataMask`)."""
    anchors: set = field(default_factory=set)
    """``(block op, mask)``: a block op that reads a matched mask (for claiming the mask's nodes)."""
    conflicts: dict = field(default_factory=dict)
    """Block node -> why its key axis is ambiguous."""
    concats: set = field(default_factory=set)
    """Key operands concatenated from positions and windows (:func:`key_concat`): brought part by part."""


def _ndim(node) -> int:
    return meta_val(node).dim()


def is_scores(node: torch.fx.Node, sym, multiple: int = 1) -> bool:
    """``a @ b`` with the sequence on ``a``'s rows and ``b``'s columns only (the columns whole positions, or
    a :func:`key_concat` of positions and windows of them)."""
    if node.op != "call_function" or node.target not in SCORES:
        return False
    a, b = node.args[:2]
    nd = _ndim(node)
    return (seq_dims(a, sym) == (_ndim(a) - 2,) and seq_dims(b, sym) == (_ndim(b) - 1,)
            and seq_dims(node, sym) == (nd - 2, nd - 1) and _unmerged(node, (nd - 2,), sym)
            and (_unmerged(node, (nd - 1,), sym) or key_concat(b, _ndim(b) - 1, sym, multiple) is not None))


TO_SOURCE = {aten.transpose.int, aten.permute.default, aten.unsqueeze.default, aten.contiguous.default,
             aten.clone.default, aten.alias.default, aten.detach.default, aten.to.dtype, aten._to_copy.default}
"""Size-free ops between where a key operand is brought and where a block reads it (replayed on what
arrives)."""

_HEAD_REPEAT_OPS = {aten.expand.default, aten.reshape.default, aten.view.default, aten._unsafe_view.default,
                    aten.repeat_interleave.self_int}


def concat_reads(cat: torch.fx.Node, keys: dict) -> str | None:
    """Why the local value of a key concatenation would be read as it is (None: it never is). Each rank's
    ``cat`` holds ``[its positions | its windows]``, no slice of the one-device value: only a key operand
    brought from the cat's parts (K in ``q @ k^T``, V in ``probs @ v``, through size-free ops and a head
    repeat) may read it, and the planner checks that those are brought from this very cat."""
    stack, seen = [cat], set()
    while stack:
        node = stack.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if user.target in TO_SOURCE or user.target in _HEAD_REPEAT_OPS or is_whole_slice(user):
                stack.append(user)
            elif not (user.target in SCORES and user.args[1] is node
                      and (user in keys or user.args[0] in keys)):
                return f"{user.target} reads it as it is (only K in q @ k^T and V in probs @ v may)"
    return None


def key_concat(node: torch.fx.Node, dim: int, sym, multiple: int) -> torch.fx.Node | None:
    """The ``cat`` along the key axis that ``node``'s ``dim`` comes from, when its parts are positions and
    windows of positions (compressed attention's ``[raw K | compressed K]``): each part is brought along its
    own axis, then concatenated as on one device. None otherwise."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function":
        if node.target is aten.cat.default:
            parts = node.args[0]
            cat_dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % _ndim(node)
            rows = [window(meta_val(p).shape[dim], sym, multiple) for p in parts if seq_dims(p, sym) == (dim,)]
            whole = len(rows) == len(parts) >= 2 and None not in rows
            return node if cat_dim == dim and whole else None
        repeat = match_head_repeat(node)
        if repeat is not None:
            node = repeat.small
            continue
        if node.target not in TO_SOURCE or len(seq_dims(node, sym)) != 1:
            return None
        source = node.args[0]
        dim = map_dim(node, source, dim, sym, forward=False) if node.target in _REORDERING else seq_dims(source, sym)[0]
        node = source
    return None


_REORDERING = {aten.transpose.int, aten.permute.default, aten.t.default, aten.movedim.int, aten.swapaxes.default,
               aten.swapdims.default}
_KEEPS_ORDER = {aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default,
                aten.dropout.default, aten.clone.default, aten.contiguous.default, aten.to.dtype, aten.to.dtype_layout,
                aten._to_copy.default, aten.type_as.default, aten.alias.default, aten.detach.default,
                aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim, aten.slice.Tensor,
                aten.narrow.default, aten.select.int, aten.gather.default, aten.cat.default, aten.where.self,
                aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar, aten.masked_fill.Scalar,
                aten.masked_fill.Tensor, aten.sum.dim_IntList, aten.amax.default, aten.amin.default,
                aten.mean.dim, aten.logsumexp.default, aten.flip.default}
"""Ops that keep a block's two sequence dims in the same order (besides pointwise ops)."""


RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
"""Reshapes a block may go through when they split or merge only the dims before its first sequence dim
(Bloom's ``[batch * heads, q, k]`` and ``[batch, heads, q, k]``): each key column stays one column."""


def _leading_reshape(node: torch.fx.Node, source: torch.fx.Node, sym) -> int | None:
    """How many dims a reshape from ``source`` to ``node`` adds before the first sequence dim, when the dims
    from there on are the same sizes in both (so every entry keeps its index in them); else None."""
    here, there = seq_dims(node, sym), seq_dims(source, sym)
    if not here or not there:
        return None
    out, inp = meta_val(node).shape[here[0]:], meta_val(source).shape[there[0]:]
    if len(out) != len(inp) or any(expr_of(a) != expr_of(b) for a, b in zip(out, inp)):
        return None
    return here[0] - there[0]


def _permutation(node: torch.fx.Node) -> list[int]:
    """Output dim i of a reordering op is input dim perm[i]."""
    nd = _ndim(node)
    if node.target is aten.permute.default:
        return [d % nd for d in node.args[1]]
    if node.target is aten.movedim.int:
        src, dst = node.args[1] % nd, node.args[2] % nd
        rest = [d for d in range(nd) if d != src]
        rest.insert(dst, src)
        return rest
    a, b = (0, 1) if node.target is aten.t.default else (d % nd for d in node.args[1:3])
    perm = list(range(nd))
    perm[a], perm[b] = perm[b], perm[a]
    return perm


def map_dim(node: torch.fx.Node, source: torch.fx.Node, dim: int, sym, forward: bool = True) -> int | None:
    """The dim of ``node`` that ``source``'s (an input's) sequence dim ``dim`` becomes (``forward``), or the
    dim of ``source`` that ``node``'s dim ``dim`` came from; None where cp_passes cannot tell."""
    if node.target in _REORDERING:
        perm = _permutation(node)
        return perm.index(dim) if forward else perm[dim]
    if node.target in RESHAPES:
        shift = _leading_reshape(node, source, sym)
        return None if shift is None else dim + shift if forward else dim - shift
    if not (node.target in _KEEPS_ORDER or torch.Tag.pointwise in getattr(node.target, "tags", ())):
        return None
    here, there = seq_dims(node, sym), seq_dims(source, sym)
    return here[there.index(dim)] if forward else there[here.index(dim)]


def _unmerged(node, dims, sym) -> bool:
    return all(seq_multiple(meta_val(node).shape[d], sym) == 1 for d in dims)


def match_blocks(gm: torch.fx.GraphModule, sym, carry: set | None = None, multiple: int = 1) -> Blocks:
    found = Blocks()
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]

    def give(node, key, why) -> None:
        if key is None:
            found.conflicts[node] = why
        elif found.keys.setdefault(node, key) != key:
            found.conflicts[node] = "it is used as attention scores with two different key axes"

    for node in nodes:
        if is_scores(node, sym, multiple):
            found.keys[node] = _ndim(node) - 1
            concat = key_concat(node.args[1], _ndim(node.args[1]) - 1, sym, multiple)
            if concat is not None:
                found.concats.add(concat)
            continue
        if len(seq_dims(node, sym)) != 2:
            continue
        for x in node.all_input_nodes:
            if x in found.keys and len(seq_dims(x, sym)) == 2:
                give(node, map_dim(node, x, found.keys[x], sym),
                     f"cp_passes cannot tell where {node.target} puts the key axis of {node_ref(x)}")
    inside: set = set()  # the nodes of matched masks: evaluated whole, never given a key axis of their own
    for node in reversed(nodes):
        if node not in found.keys or node in inside or node in found.conflicts:
            continue
        for x in node.all_input_nodes:
            if len(seq_dims(x, sym)) != 2 or x.op != "call_function":
                continue
            key = map_dim(node, x, found.keys[node], sym, forward=False)
            if x in found.masks:
                found.anchors.add((node, x))
            if x in found.keys:
                if key != found.keys[x]:
                    found.conflicts[node] = f"it combines {node_ref(x)} with a block whose key axis is another dim"
                continue
            give(x, key, f"cp_passes cannot tell which dim of {node_ref(x)} {node.target} reads as the key axis")
            if key is None or not _unmerged(x, [d for d in seq_dims(x, sym) if d != key], sym):
                continue
            mask = model_mask(x, sym, carry, multiple, learned=True)
            if isinstance(mask, PositionMask):
                mask = MetadataMask(x, mask.nodes, [], mask.size_leaves, [])
            if isinstance(mask, MetadataMask):
                found.masks[x] = mask
                found.anchors.add((node, x))
                inside.update(mask.nodes)
    return found
