"""Reorderings of the rank's own rows that are undone before anything reads positions: mixture-of-experts
dispatch (sort the (token, expert) pairs by expert, gather, count per expert, grouped matmul, put back).

Every step works on this rank's rows in another order, so the whole block is local; what must be proven is
that no reordered row meets a row in sequence order, a position, or another rank's row before the order is
undone. The planner tracks an :class:`Order` for each value that carries one:

- ``keys``: the values a ``sort`` along the sequence returned (the rows in the sort's order);
- ``rows``: any row-wise function of reordered rows, or of a table looked up with reordered keys;
- ``index``: the local row numbers the sort returned (its indices), possibly divided by a constant
  (``perm // top_k``: the token of each (token, expert) pair);
- ``inverse``: where the sort put each local row (``inv[perm] = arange(n)``, or ``argsort(perm)``);
- ``counts`` / ``offsets``: per-group counts of the sort's keys (``histc``, ``bincount``), and their
  cumulative sum: the rank's own, right for grouping the rank's own reordered rows and nothing else.

Rows return to sequence order by ``rows[inverse]`` or by scattering them through the index
(``out.index_add_(0, perm // k, rows)``, ``out[perm] = rows``). Rows a boolean mask picks (``x[mask]``,
``selected``: an unbacked number of them) pass through row-wise ops only until ``out[mask] = rows``. Anything
else that meets an ordered value is refused: a reordered row combined with a row in sequence order, a reordered
value returned, a count read as a number, a transport that moves rows by position.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace

import sympy
import torch
import torch.fx

from ..errors import node_ref, op_name, source_line
from ..graph.analysis import expr_of, meta_val, seq_dims
from .registry import NO_RULE_FIX, Rewrite, RuleContext, lookup_rule, out_of_place

aten = torch.ops.aten


@dataclass(frozen=True)
class Order:
    kind: str
    """``keys``, ``rows``, ``index``, ``inverse``, ``counts`` or ``offsets`` (see the module docstring)."""
    sort: torch.fx.Node
    """The sort whose order this is."""
    div: int = 1
    """For ``index``: the row numbers are divided by this (rows of a tensor ``div`` times shorter)."""

    @property
    def row_like(self) -> bool:
        return self.kind in ("keys", "rows")


SORTS = {aten.sort.default, aten.sort.stable, aten.argsort.default, aten.argsort.stable}
COUNTS = {aten.histc.default, aten.bincount.default}
GROUPED = {aten._grouped_mm.default}
"""Grouped matmuls ``(rows, weights, offs)``: each row multiplied by its group's weight, groups by ``offs``."""
FRESH = {aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
         aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default}
"""Ops whose values do not read their input's values: the result carries no order."""
_CASTS = {aten._to_copy.default, aten.to.dtype, aten.to.device, aten.to.dtype_layout, aten.to.other,
          aten.type_as.default, aten.clone.default, aten.alias.default, aten.detach.default}
_GATHERS = {aten.index.Tensor, aten.index_select.default}
_SCATTERS = {aten.index_add.default, aten.index_add_.default, aten.index_copy.default, aten.index_copy_.default,
             aten.index_put.default, aten.index_put_.default}
WRITE_BACKS = {aten.index_put.default, aten.index_add.default, aten.index_copy.default}


def writes_back(ctx: RuleContext) -> bool:
    """An in-place write of reordered rows (``out[mask] = rows`` in a loop over experts,
    ``out.index_add_(0, perm // k, rows)``): if its rule accepts it, the rows go back to their places and
    ``out`` stays rows in sequence order, so later readers of ``out`` and a chain of such writes are fine."""
    if out_of_place(ctx.node.target) not in WRITE_BACKS:
        return False
    source = ctx.args.get("values", ctx.args.get("source"))
    order = ctx.orders.get(source)
    return order is not None and order.kind in ("keys", "rows", "selected")
_ORDER_FREE_TRANSPORTS = {"reductions"}
"""Transports whose result does not depend on the order of the rows they reduce."""

UNDO_FIX = ("undo the reordering first (rows[inverse], or out.index_add_(0, perm, rows)) and combine the result "
            "with tensors in sequence order afterwards")


def grouped_ops() -> set:
    """The grouped matmuls known here: aten's and transformers' CPU fallback, when it is registered."""
    ops = set(GROUPED)
    fallback = getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None)
    if fallback is not None:
        try:
            ops.add(fallback.default)
        except AttributeError:
            pass
    return ops


def _describe(order: Order) -> str:
    return f"{op_name(order.sort)} at {source_line(order.sort)}"


def _length(node) -> sympy.Expr:
    return expr_of(meta_val(node).shape[0])


def _same_length(a, b) -> bool:
    return sympy.simplify(a - b) == 0


def involved(ctx: RuleContext) -> bool:
    """Whether this node is the permutation analysis's to plan: it reads an ordered value, starts an order
    (a sort of the rank's rows), or numbers the rows for an inverse."""
    node = ctx.node
    if any(a in ctx.orders for a in node.all_input_nodes):
        return True
    if node.target in SORTS:
        return _sortable(ctx)
    if node.target is aten.index.Tensor:
        return _selection(ctx) is not None
    return node.target is aten.arange.default and _inverse_numbering(ctx) is not None


_SIZES = {aten.sym_size.int, aten.sym_numel.default, aten.sym_size.default}
_METADATA = {*_SIZES, aten.sym_stride.int, aten._assert_tensor_metadata.default}


def _selection(ctx: RuleContext) -> torch.fx.Node | None:
    """The mask of ``x[mask]``: a boolean mask over x's leading dims, sharded as they are (an expert's tokens,
    ``x[ids == e]``), when the selected rows are read as values (``x[mask]`` only measured is a count)."""
    x, indices = ctx.arg("self"), ctx.arg("indices")
    if len(indices) != 1 or not isinstance(indices[0], torch.fx.Node) or x in ctx.orders:
        return None
    mask, val = indices[0], meta_val(indices[0])
    if val.dtype != torch.bool or not ctx.is_seq(mask) or mask in ctx.orders:
        return None
    if tuple(meta_val(x).shape[:val.dim()]) != tuple(val.shape) or ctx.seq_dims(x)[:1] != ctx.seq_dims(mask)[:1]:
        return None
    if all(u.target in _SIZES for u in ctx.node.users):
        return None
    return mask


def _sortable(ctx: RuleContext) -> bool:
    """A sort of a 1-D tensor along its sequence axis: it reorders the rank's rows as a whole."""
    src = ctx.arg("self")
    return ctx.ndim(src) == 1 and ctx.seq_dims(src) == (0,) and src not in ctx.orders


def _inverse_numbering(ctx: RuleContext) -> Order | None:
    """``arange(n)`` whose only use is as the values of ``inv[perm] = arange(n)`` with ``perm`` a sort's whole
    index of ``n`` rows: local row numbers, not positions."""
    users = list(ctx.node.users)
    if len(users) != 1 or users[0].target not in (aten.index_put.default, aten.index_put_.default):
        return None
    put = users[0]
    indices, values = put.args[1], put.args[2]
    order = ctx.orders.get(indices[0]) if len(indices) == 1 else None
    if values is not ctx.node or order is None or order.kind != "index" or order.div != 1:
        return None
    return order if _same_length(_length(ctx.node), _length(indices[0])) else None


def plan(ctx: RuleContext):
    """The decision for a node :func:`involved` says is ours; records the output's order in ``ctx.orders``."""
    node = ctx.node
    if node.target in SORTS:
        return _sort(ctx)
    if node.target is aten.arange.default:
        ctx.orders[node] = replace(_inverse_numbering(ctx), kind="numbers")
        return None
    ordered = {a: ctx.orders[a] for a in node.all_input_nodes if a in ctx.orders}
    if node.target in _METADATA:
        return None  # a size or dtype: the same whichever order the rows are in
    if node.target in _GATHERS:
        return _gather(ctx, ordered)
    if node.target in _SCATTERS:
        return _scatter(ctx, ordered)
    if node.target in COUNTS:
        return _count(ctx, ordered)
    if node.target in grouped_ops():
        return _grouped(ctx, ordered)
    if node.target in FRESH:
        return None
    if node.target is aten.cumsum.default and {o.kind for o in ordered.values()} == {"counts"}:
        ctx.orders[node] = replace(next(iter(ordered.values())), kind="offsets")
        return None
    if node.target in _CASTS and len(ordered) == 1:
        ctx.orders[node] = next(iter(ordered.values()))
        return None
    if node.target in (aten.floor_divide.default, aten.div.Tensor_mode, aten.div.Scalar_mode):
        return _divide(ctx, ordered)
    return _rowwise(ctx, ordered)


def _sort(ctx: RuleContext):
    sort = ctx.node
    if sort.target in (aten.argsort.default, aten.argsort.stable):
        src = ctx.orders.get(ctx.arg("self"))
        if src is not None and src.kind == "index" and src.div == 1:
            ctx.orders[sort] = replace(src, kind="inverse")  # argsort of a permutation is its inverse
            return None
        ctx.orders[sort] = Order("index", sort)
        return None
    ctx.orders[sort] = (Order("keys", sort), Order("index", sort))
    return None


def _gather(ctx: RuleContext, ordered: dict):
    """``x[perm]``, ``x[perm // k]``, ``index_select(x, 0, perm)``: x's rows in the sort's order;
    ``rows[inverse]``: back in sequence order; ``table[keys]``: a lookup per reordered row."""
    x = ctx.arg("self")
    mask = _selection(ctx) if ctx.node.target is aten.index.Tensor else None
    if mask is not None:
        ctx.orders[ctx.node] = Order("selected", mask)
        return None
    if ctx.node.target is aten.index.Tensor:
        indices = ctx.arg("indices")
        picked = [(d, i) for d, i in enumerate(indices) if i is not None]
        if len(picked) != 1:
            return _refuse_use(ctx, ordered, "it indexes with more than one index tensor")
        dim, index = picked[0]
    else:
        dim, index = ctx.arg("dim") % ctx.ndim(x), ctx.arg("index")
    order = ordered.get(index)
    if x in ordered or order is None:
        if order is None and ordered.get(x, Order("", x)).row_like and not ctx.is_seq(index):
            return _rowwise(ctx, ordered)  # rows[:, column ids]: a read within each reordered row
        if x in ordered and order is not None and ordered[x].row_like and order.kind == "inverse" and dim == 0 \
                and ordered[x].sort is order.sort and _same_length(_length(x), _length(index)):
            return None  # back in sequence order
        return _refuse_use(ctx, ordered, "it indexes reordered rows other than by the sort's inverse")
    if order.row_like and not ctx.is_seq(x):
        ctx.orders[ctx.node] = replace(order, kind="rows")  # a table looked up per reordered row
        return None
    if order.kind != "index" or dim not in ctx.seq_dims(x) or len(ctx.seq_dims(x)) != 1 or ctx.is_partial(x) \
            or meta_val(index).dim() != 1:
        return _refuse_use(ctx, ordered, "it reads rows by a sort's indices other than along the sorted rows' axis")
    if not _same_length(expr_of(meta_val(x).shape[dim]) * order.div, _length(index)):
        ctx.refuse(f"it reads rows of {node_ref(x)} ({meta_val(x).shape[dim]} along dim {dim}) by indices of "
                   f"{_describe(order)}, which numbers {meta_val(index).shape[0]} rows"
                   + (f" divided by {order.div}" if order.div > 1 else "")
                   + ": the sorted tensor is not these rows (or these rows repeated), so cp_passes cannot tell "
                     "that a row's indices stay on its rank",
                   "sort the rows themselves (or their flattened (row, k) pairs) and gather with perm // k")
    ctx.orders[ctx.node] = Order("rows", order.sort)
    return None


def _scatter(ctx: RuleContext, ordered: dict):
    """``out.index_add_(0, perm // k, rows)``, ``out[perm] = rows``: reordered rows back in sequence order;
    ``inv[perm] = arange(n)``: the sort's inverse."""
    target = ctx.node.target
    if target in (aten.index_put.default, aten.index_put_.default):
        indices, source = ctx.arg("indices"), ctx.arg("values")
        index, dim = (indices[0], 0) if len(indices) == 1 else (None, 0)
    else:
        index, source, dim = ctx.arg("index"), ctx.arg("source"), ctx.arg("dim") % ctx.ndim(ctx.node)
    out = ctx.arg("self")
    order = ordered.get(index)
    src = ordered.get(source)
    if src is not None and src.kind == "selected" and index is src.sort and order is None and out not in ordered:
        return None  # out[mask] = rows selected by the same mask: back in their places
    if order is None or order.kind != "index" or out in ordered or dim != 0:
        return _refuse_use(ctx, ordered, "it writes through an index that is not a sort's indices")
    if src is not None and src.kind == "numbers" and src.sort is order.sort:
        if out.target not in FRESH:
            return _refuse_use(ctx, ordered, "it writes row numbers into a tensor it did not create")
        ctx.orders[ctx.node] = replace(order, kind="inverse")
        return None
    if src is None or not src.row_like or src.sort is not order.sort or len(ctx.seq_dims(out)) != 1 \
            or ctx.seq_dims(out) != (0,):
        return _refuse_use(ctx, ordered, "it writes values that are not the sort's reordered rows")
    if not _same_length(_length(out) * order.div, _length(index)) or not _same_length(_length(source),
                                                                                        _length(index)):
        ctx.refuse(f"it writes {meta_val(source).shape[0]} reordered rows into the {meta_val(out).shape[0]} rows "
                   f"of {node_ref(out)} by indices of {_describe(order)}, whose lengths do not show that each row "
                   f"returns to its own place", UNDO_FIX)
    return None


def _count(ctx: RuleContext, ordered: dict):
    (order,) = ordered.values() if len(ordered) == 1 else (None,)
    if order is None or order.kind != "keys" or ctx.args.get("weights") is not None:
        return _refuse_use(ctx, ordered, "it counts values other than a sort's keys")
    ctx.orders[ctx.node] = replace(order, kind="counts")
    return None


def _grouped(ctx: RuleContext, ordered: dict):
    """A grouped matmul of reordered rows whose groups are the counts of the same sort's keys: each row meets
    its own group's weight, as on one device."""
    names = [a.name for a in ctx.node.target._schema.arguments]
    rows, offs = ctx.args.get(names[0]), ctx.args.get("offs")
    if rows is None or offs is None or set(ordered) - {rows, offs}:
        return _refuse_use(ctx, ordered, "it groups rows other than (rows, weights, offs)")
    r, o = ordered.get(rows), ordered.get(offs)
    if r is None or o is None or not r.row_like or o.kind != "offsets" or r.sort is not o.sort:
        return _refuse_use(ctx, ordered, "its groups are not the counts of the sort that ordered its rows")
    ctx.orders[ctx.node] = Order("rows", r.sort)
    return None


def _divide(ctx: RuleContext, ordered: dict):
    x, by = ctx.node.args[0], ctx.node.args[1]
    order = ordered.get(x)
    mode = ctx.args.get("rounding_mode", "floor")
    if order is None or order.kind != "index" or not isinstance(by, int) or by < 1 or mode != "floor" \
            or len(ordered) != 1:
        return _refuse_use(ctx, ordered, "it computes with a sort's indices")
    ctx.orders[ctx.node] = replace(order, div=order.div * by)
    return None


_ROWWISE_ON_SELECTIONS = {aten.linear.default, aten.mm.default, aten.matmul.default, aten.chunk.default,
                          aten.split.Tensor, aten.split_with_sizes.default, aten.unsqueeze.default}
"""Ops besides the pointwise ones that keep each selected row to itself (the row axis, dim 0, untouched when
they act on the last dims)."""


def _selected_rowwise(ctx: RuleContext, ordered: dict):
    """Rows picked by a boolean mask (``x[mask]``: an unbacked number of rows, no sequence dim in the shape,
    so the op rules cannot see the row axis): only ops that keep dim 0 row for row, until ``out[mask] = rows``
    puts them back."""
    (order,) = set(ordered.values())
    target = ctx.node.target
    pointwise = isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags
    dim = ctx.args.get("dim")
    rows = meta_val(next(iter(ordered))).shape[0]
    outputs = meta_val(ctx.node)
    outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    keeps_rows = all(isinstance(o, torch.Tensor) and o.dim() > 0 and _same_length(expr_of(o.shape[0]), expr_of(rows))
                     for o in outputs)
    first = ctx.node.args[0] if ctx.node.args else None
    along_rows = target is not aten.unsqueeze.default and isinstance(dim, int) and dim % ctx.ndim(first) == 0
    ok = (pointwise or target in _CASTS or target in _ROWWISE_ON_SELECTIONS) and keeps_rows and not along_rows \
        and not (target in (aten.mm.default, aten.matmul.default) and first not in ordered) \
        and not any(ctx.is_seq(t) or ctx.is_partial(t) for t in ctx.tensor_inputs())
    if not ok:
        ctx.refuse(f"it reads rows that the boolean mask '{order.sort.name}' picked ({op_name(order.sort)} at "
                   f"{source_line(order.sort)}) other than row by row; cp_passes follows such rows through "
                   f"row-wise ops only, until out[mask] = rows puts them back",
                   "use a form without boolean selection (transformers MoE: experts_implementation=\"grouped_mm\"), "
                   "or keep each selected row to itself until it is written back")
    ctx.orders[ctx.node] = order
    return None


def _rowwise(ctx: RuleContext, ordered: dict):
    """Any other op: row-wise on rows of one sort's order (and values free of the sequence), as its own rule
    decides; a reordered row never meets a row in sequence order."""
    kinds = {o.kind for o in ordered.values()}
    if kinds == {"selected"} and len({o.sort for o in ordered.values()}) == 1:
        return _selected_rowwise(ctx, ordered)
    if not kinds <= {"keys", "rows"}:
        return _refuse_use(ctx, ordered, f"it reads {_kind_words(ordered)} as data")
    sorts = {o.sort for o in ordered.values()}
    if len(sorts) > 1:
        return _refuse_use(ctx, ordered, "it combines rows reordered by two different sorts")
    plain = [t for t in ctx.seq_inputs() if t not in ordered]
    if plain:
        ctx.refuse(f"it combines rows that {_describe(next(iter(ordered.values())))} reordered with "
                   f"{node_ref(plain[0])}, "
                   f"rows in sequence order: on each rank the sort orders only its own rows, so the pairs differ "
                   f"from one device's", UNDO_FIX)
    if any(ctx.is_partial(t) for t in ctx.tensor_inputs()):
        return _refuse_use(ctx, ordered, "it combines reordered rows with a per-rank partial sum")
    rule = lookup_rule(ctx.node.target)
    if rule is None:
        return _refuse_use(ctx, ordered, "cp_passes has no rule for it")
    decision = rule(ctx)
    if isinstance(decision, Rewrite) and decision.transport not in _ORDER_FREE_TRANSPORTS:
        ctx.refuse(f"it needs the {decision.transport} transport, which moves rows by their positions, on rows "
                   f"that {_describe(next(iter(ordered.values())))} reordered", UNDO_FIX)
    if decision is None and _carries_rows(ctx):
        ctx.orders[ctx.node] = Order("rows", next(iter(sorts)))
    return decision


def _carries_rows(ctx: RuleContext) -> bool:
    val = meta_val(ctx.node)
    values = val if isinstance(val, (list, tuple)) else [val]
    return any(isinstance(v, torch.Tensor) and seq_dims(v, ctx.sym) for v in values)


def _kind_words(ordered: dict) -> str:
    words = {"selected": "rows a boolean mask picked", "index": "a sort's indices", "inverse": "a sort's inverse",
             "counts": "per-group counts of this rank's rows", "offsets": "per-group offsets of this rank's rows",
             "numbers": "local row numbers"}
    return " and ".join(sorted({words.get(o.kind, "reordered rows") for o in ordered.values()}))


def _refuse_use(ctx: RuleContext, ordered: dict, why: str):
    order = next(iter(ordered.values()), None)
    origin = f" ({_kind_words(ordered)}, from {_describe(order)})" if order is not None else ""
    ctx.refuse(f"{why}{origin}; cp_passes proves a reordering of the rank's rows local only when the rows are "
               f"gathered by the sort's indices, grouped by its keys' counts and put back by its inverse or "
               f"indices", f"{UNDO_FIX}; " + NO_RULE_FIX if ordered else NO_RULE_FIX)


def getitem(node: torch.fx.Node, orders: dict) -> None:
    """``values, perm = sort(x)``, ``a, b = rows.chunk(2, -1)``: each output's order."""
    if node.target is not operator.getitem or node.args[0] not in orders:
        return
    order = orders[node.args[0]]
    orders[node] = order[node.args[1]] if isinstance(order, tuple) else order


def returned(output: torch.fx.Node, orders: dict) -> list:
    """The compiled module's outputs that carry an order: they are never put back."""
    return [n for n in torch.utils._pytree.tree_leaves(output.args[0])
            if isinstance(n, torch.fx.Node) and n in orders]
