"""The narrowest tensors a set of values derives from position by position: a minimum vertex cut.

Attention's keys and values are moved between ranks; what they are computed from, row by row, could be moved in
their place and the rows recomputed where they arrive. Multi-head latent attention (DeepSeek V3, Kimi K2)
decompresses a latent of 576 numbers a position into K and V of 40,960: the bytes that must move are bounded by
the latent's, not by K and V's. :func:`narrowest_rows` finds that bound: among the position-wise ancestors of the
targets (``positionwise``: the ops that run on a shard as they are), the set of tensors with the fewest bytes a
position that every path from elsewhere into the targets crosses. Values the graph holds whole (weights) are free:
every rank has them; so are values every rank can compute for any rank's rows (``free``: positions from the
layout).

:func:`recompute_path` says how the targets are computed again from the cut's rows where they arrive: the
position-wise ops between them (and the size arithmetic their shapes read), the cut's and the free values' sequence
dims, and what the copies cost a row.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import torch.fx

from .analysis import expr_of, has_symbol, meta_val, numel_hint, seq_dims


@dataclass(frozen=True)
class Narrowest:
    """The cut: its tensors and their bytes a position, summed."""

    nodes: tuple[torch.fx.Node, ...]
    row_bytes: int


def _tensors(node: torch.fx.Node) -> list[torch.Tensor]:
    """The tensors ``node`` makes: its value, or those of the tuple it returns (a split)."""
    value = meta_val(node)
    items = value if isinstance(value, (tuple, list)) else [value]
    return [t for t in items if isinstance(t, torch.Tensor)]


def row_bytes(node: torch.fx.Node, local_len: int) -> int:
    """Bytes a position of ``node``'s values (tensors with the sequence on some dim)."""
    return sum(numel_hint(t) * t.dtype.itemsize for t in _tensors(node)) // max(local_len, 1)


def _sharded(node, sym) -> bool:
    return isinstance(node, torch.fx.Node) and any(seq_dims(t, sym) for t in _tensors(node))


def _row_dim(node: torch.fx.Node, sym) -> int | str:
    value = meta_val(node)
    dims = seq_dims(node, sym) if isinstance(value, torch.Tensor) else ()
    if len(dims) != 1 or expr_of(value.shape[dims[0]]) != sym:
        return f"{node.name} is not one tensor with one sequence dim of the local length"
    return dims[0]


def _region(targets, sym, positionwise, free) -> set:
    """The sharded ancestors of ``targets`` reached through position-wise ops, the targets and the first
    non-position-wise ones (where the cut may start) included; ``free`` ones left out."""
    seen, todo = set(), list(targets)
    while todo:
        node = todo.pop()
        if node in seen or node in free:
            continue
        seen.add(node)
        if positionwise(node):
            todo.extend(a for a in node.all_input_nodes if _sharded(a, sym))
    return seen


def narrowest_rows(targets: list[torch.fx.Node], sym, local_len: int, positionwise, free=frozenset()) -> Narrowest:
    """The set of sharded tensors (each with its sequence on one dim of its own) with the fewest bytes a position
    that separates ``targets`` from everything they derive from other than position by position
    (``positionwise(node)``: whether a node runs on a shard as it is, each output row from the same input rows).
    The targets themselves are a cut, so the answer is never wider than they are. ``free``: sharded values every
    rank can compute for any rank's rows."""
    region = _region(targets, sym, positionwise, free)
    # Each node is split into an inner and an outer vertex joined by its row bytes; the source feeds every node
    # that does not derive position by position, the targets feed the sink.
    source, sink = ("source",), ("sink",)
    capacity: dict = {}
    edges: dict = {}

    def add(u, v, c):
        capacity[(u, v)] = capacity.get((u, v), 0) + c
        capacity.setdefault((v, u), 0)
        edges.setdefault(u, set()).add(v)
        edges.setdefault(v, set()).add(u)

    unbounded = 1 << 62
    for node in region:
        # A tensor whose rows cannot move as they are (positions merged with another dim) is not cut through: an
        # equal cut next to it can be.
        movable = node in targets or isinstance(_row_dim(node, sym), int)
        add(("in", node), ("out", node), row_bytes(node, local_len) if movable else unbounded)
        if not positionwise(node):
            add(source, ("in", node), unbounded)
        else:
            for arg in node.all_input_nodes:
                if arg in region:
                    add(("out", arg), ("in", node), unbounded)
    for target in targets:
        add(("out", target), sink, unbounded)
    while True:
        parent = {source: None}
        queue = deque([source])
        while queue and sink not in parent:
            u = queue.popleft()
            for v in edges.get(u, ()):
                if v not in parent and capacity[(u, v)] > 0:
                    parent[v] = u
                    queue.append(v)
        if sink not in parent:
            break
        path, v = [], sink
        while parent[v] is not None:
            path.append((parent[v], v))
            v = parent[v]
        flow = min(capacity[e] for e in path)
        for u, v in path:
            capacity[(u, v)] -= flow
            capacity[(v, u)] += flow
    # Of the minimum cuts, the one nearest the source and the one nearest the targets: the fewer tensors (fewer
    # collectives), then the one nearest the targets (fewer ops computed again where the rows arrive).
    near_source = set(parent)
    near_targets, todo = {sink}, [sink]
    while todo:
        v = todo.pop()
        for u in edges.get(v, ()):
            if u not in near_targets and capacity[(u, v)] > 0:
                near_targets.add(u)
                todo.append(u)
    first = [n for n in region if ("in", n) in near_source and ("out", n) not in near_source]
    last = [n for n in region if ("in", n) not in near_targets and ("out", n) in near_targets]
    order = {n: i for i, n in enumerate(targets[0].graph.nodes)}
    cut = tuple(sorted(last if len(last) <= len(first) else first, key=order.__getitem__))
    return Narrowest(cut, sum(row_bytes(n, local_len) for n in cut))


@dataclass(frozen=True)
class Recompute:
    """The targets computed again from moved rows: bring the rows of ``moved`` (the cut) and of ``free`` (positions,
    or a table's rows) along their sequence dims, read ``lengths`` (the local length) as the rows brought, and copy
    ``nodes`` in graph order. ``row_flops``: what the copies compute a row (a matmul's multiply-adds counted
    twice)."""

    moved: tuple[tuple[torch.fx.Node, int], ...]
    free: tuple[tuple[torch.fx.Node, int], ...]
    lengths: tuple[torch.fx.Node, ...]
    nodes: tuple[torch.fx.Node, ...]
    row_flops: int


_MATMULS = {torch.ops.aten.linear.default, torch.ops.aten.mm.default, torch.ops.aten.matmul.default,
            torch.ops.aten.bmm.default, torch.ops.aten.addmm.default}


def _flops(node: torch.fx.Node, local_len: int) -> int:
    out = sum(numel_hint(t) for t in _tensors(node)) // max(local_len, 1)
    if node.target in _MATMULS:
        inner = meta_val(node.args[0]).shape[-1]
        return 2 * out * int(inner)
    return out


def recompute_path(targets: list[torch.fx.Node], cut: Narrowest, sym, local_len: int, positionwise,
                   free=frozenset()) -> Recompute | str:
    """How ``targets`` are computed again from ``cut``'s rows (and ``free`` values' rows), or why they cannot be:
    a value on the way that is neither position-wise nor whole, an op that draws random numbers (a copy would draw
    others), a size computed from the length other than by arithmetic on it."""
    cut_nodes = set(cut.nodes)
    nodes, lengths, moved, freed = set(), set(), set(), set()
    todo = list(targets)
    while todo:
        node = todo.pop()
        if node in nodes or node in lengths or node in moved or node in freed:
            continue
        value = meta_val(node)
        if isinstance(value, torch.SymInt):
            if not has_symbol(node, sym):
                continue
            if expr_of(value) == sym:
                lengths.add(node)
            elif node.op == "call_function" and (node.target.__module__ in ("_operator", "math")
                                                 or getattr(node.target, "__name__", "").startswith("sym_")):
                nodes.add(node)
                todo.extend(node.all_input_nodes)
            else:
                return f"{node.name} computes a size from the sequence length"
            continue
        if node in cut_nodes:
            moved.add(node)
        elif node in free:
            freed.add(node)
        elif not _sharded(node, sym):
            continue  # weights and buffers: every rank holds them whole
        elif node.op != "call_function" or not positionwise(node):
            return f"{node.name} ({node.op} {node.target}) is not computed position by position"
        elif isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags:
            return f"{node.name} draws random numbers: a copy would draw others"
        else:
            nodes.add(node)
            todo.extend(node.all_input_nodes)
    dims = {}
    for node in moved | freed:
        dims[node] = _row_dim(node, sym)
        if isinstance(dims[node], str):
            return dims[node]
    if not moved:
        return "the keys derive from no moved rows"
    order = {n: i for i, n in enumerate(targets[0].graph.nodes)}

    def ordered(group):
        return tuple(sorted(group, key=order.__getitem__))

    copies = ordered(nodes)
    flops = sum(_flops(n, local_len) for n in copies if isinstance(n.target, torch._ops.OpOverload))
    return Recompute(tuple((n, dims[n]) for n in ordered(moved)), tuple((n, dims[n]) for n in ordered(freed)),
                     ordered(lengths), copies, flops)
