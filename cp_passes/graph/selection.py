"""Select rows of a graph's value at its inputs: ``f(x)[..., rows, :]`` computed as ``f(x[rows])``.

A mask the model builds over the whole sequence (``doc[:, :, None] == doc[:, None, :]``, transformers'
``index`` by ``arange`` positions) is a broadcast of per-query and per-key terms. Picking this rank's query
rows and the keys its transport brings commutes with elementwise ops, ``unsqueeze``, ``expand``, whole-range
``slice``, ``index`` by broadcast index tensors, ``cat`` along another dim and ``zeros``/``ones``/``full`` (the
picked sizes), so the picks move back to where those terms are still
one-dimensional (an ``arange``, the gathered doc ids) and nothing ``[S, S]`` is computed. At any other op the
pick stays where it is (the value is computed whole, then picked): still exact, only not smaller.
"""

from __future__ import annotations

import torch
import torch.fx

from .analysis import meta_val

aten = torch.ops.aten

_ELEMENTWISE = {aten.to, aten._to_copy, aten.clone, aten.detach, aten.alias, aten.lift_fresh_copy, aten.__and__,
                aten.__or__, aten.__xor__, aten.where, aten.floor_divide}
"""Elementwise (broadcasting) ops without ATen's pointwise tag."""


FACTORIES = {aten.zeros.default: 0, aten.ones.default: 0, aten.full.default: 0, aten.new_zeros.default: 1,
             aten.new_ones.default: 1, aten.new_full.default: 1}
"""Ops that fill a tensor of the sizes they are given (the argument at this index) with one value: picked, the
same value at the picked sizes."""


def _elementwise(target) -> bool:
    return isinstance(target, torch._ops.OpOverload) and (
        torch.Tag.pointwise in target.tags or target.overloadpacket in _ELEMENTWISE)


def _broadcast_size_one(val, dim: int) -> bool:
    size = val.shape[dim]
    return isinstance(size, int) and size == 1


def _whole_slice(node: torch.fx.Node) -> bool:
    """``x[..., :]``: a ``slice`` over a whole dim (what indexing with ``None`` leaves in the graph)."""
    if node.target is not aten.slice.Tensor:
        return False
    args = list(node.args) + [None] * (5 - len(node.args))
    start, end, step = args[2], args[3], args[4]
    return start in (None, 0) and (step in (None, 1)) and isinstance(end, int) and end >= 2 ** 62


class Selector:
    """Builds, in ``graph``, nodes that equal an existing node's value with some dims picked by index nodes.
    ``picks`` are ``((dim, index node), ...)`` in the node's own dims; results are memoised."""

    def __init__(self, graph: torch.fx.Graph):
        self.graph = graph
        self.memo: dict = {}
        self.stopped: list[torch.fx.Node] = []
        """The nodes computed whole and then picked (where no rule moved the pick further)."""

    def __call__(self, node, picks: tuple):
        if not picks or not isinstance(node, torch.fx.Node):
            return node
        key = (node, picks)
        if key not in self.memo:
            self.memo[key] = self._select(node, picks)
        return self.memo[key]

    def _pick_at(self, node, picks):
        for dim, index in picks:
            node = self.graph.call_function(aten.index_select.default, (node, dim, index))
        return node

    def _call(self, node, args, kwargs=None):
        return self.graph.call_function(node.target, tuple(args), dict(node.kwargs if kwargs is None else kwargs))

    def _aligned(self, arg, out_rank: int, picks):
        """The picks of a broadcast operand: right-aligned dims, none where it has size 1 (or no such dim)."""
        val = meta_val(arg)
        if not isinstance(val, torch.Tensor):
            return ()
        shift = out_rank - val.dim()
        return tuple((d - shift, i) for d, i in picks if d - shift >= 0 and not _broadcast_size_one(val, d - shift))

    def _select(self, node, picks):
        val, target = meta_val(node), node.target
        if node.op != "call_function" or not isinstance(val, torch.Tensor):
            return self._stop(node, picks)
        rank = val.dim()
        if _elementwise(target):
            args = [self(a, self._aligned(a, rank, picks)) for a in node.args]
            kwargs = {k: self(a, self._aligned(a, rank, picks)) for k, a in node.kwargs.items()}
            return self._call(node, args, kwargs)
        if target is aten.unsqueeze.default:
            at = node.args[1] % rank
            inner = tuple((d if d < at else d - 1, i) for d, i in picks if d != at)
            return self._call(node, [self(node.args[0], inner), node.args[1]])
        if _whole_slice(node):
            return self._call(node, [self(node.args[0], picks), *node.args[1:]])
        if target is aten.expand.default:
            source, sizes = node.args[0], list(node.args[1])
            inner = self._aligned(source, rank, picks)
            moved = {d + rank - meta_val(source).dim() for d, _ in inner}
            for d, index in picks:  # a broadcast dim takes the picked length; the others follow the source
                sizes[d] = -1 if d in moved else self.graph.call_function(aten.sym_size.int, (index, 0))
            return self._call(node, [self(source, inner), sizes])
        if target is aten.cat.default:
            parts, dim = node.args[0], (node.args[1] if len(node.args) > 1 else 0) % rank
            if all(d != dim for d, _ in picks):  # picks along other dims pick each part
                return self._call(node, [[self(p, self._aligned(p, rank, picks)) for p in parts], *node.args[1:]])
        if target in FACTORIES:
            args, at = list(node.args), FACTORIES[target]
            args[at] = list(args[at])
            for d, index in picks:
                args[at][d] = self.graph.call_function(aten.sym_size.int, (index, 0))
            return self._call(node, args)
        if target is aten.index.Tensor:
            source, indices = node.args[0], list(node.args[1])
            if all(isinstance(i, torch.fx.Node) for i in indices) and len(indices) == meta_val(source).dim():
                return self._call(node, [source, [self(i, self._aligned(i, rank, picks)) for i in indices]])
        return self._stop(node, picks)

    def _stop(self, node, picks):
        self.stopped.append(node)
        return self._pick_at(node, picks)


_COMPARE = {aten.ge.Scalar: aten.ge.Tensor, aten.gt.Scalar: aten.gt.Tensor, aten.le.Scalar: aten.le.Tensor,
            aten.lt.Scalar: aten.lt.Tensor, aten.eq.Scalar: aten.eq.Tensor, aten.ne.Scalar: aten.ne.Tensor}


def compare_without_differences(graph: torch.fx.Graph) -> dict[torch.fx.Node, torch.fx.Node]:
    """Rewrite ``(x - y) <op> c`` on integers as ``x <op> (y + c)``: a mask's ``q - k >= 0`` then compares the
    positions by broadcasting, and no integer ``[queries, keys]`` difference is computed (the difference goes
    with its last user). Integers only: the two forms agree exactly there, not under float rounding. Returns the
    comparisons replaced, each with its replacement."""
    replaced = {}
    for node in list(graph.nodes):
        difference = node.args[0] if node.op == "call_function" and node.target in _COMPARE else None
        if not (isinstance(difference, torch.fx.Node) and difference.target is aten.sub.Tensor
                and not difference.kwargs and len(difference.args) == 2 and isinstance(node.args[1], int)):
            continue
        x, y = difference.args
        values = [meta_val(n) for n in (difference, x, y)]
        if not all(isinstance(v, torch.Tensor) and not v.is_floating_point() and v.dtype != torch.bool
                   for v in values):
            continue
        with graph.inserting_before(node):
            shifted = graph.call_function(aten.add.Scalar, (y, node.args[1]))
            shifted.meta["val"] = values[2]  # y's shape and dtype: an integer plus an int
            compared = graph.call_function(_COMPARE[node.target], (x, shifted))
        compared.meta.update(node.meta)
        node.replace_all_uses_with(compared)
        graph.erase_node(node)
        replaced[node] = compared
    return replaced
