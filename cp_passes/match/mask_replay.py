"""A model-built mask replayed on symbolic values: the mask as a formula over the indices of its dims.

The nodes that build a mask are run again on :class:`Sym` values rather than tensors: an integer tensor is an
expression affine in the index of each of its dims (``arange(n)`` is ``k``, ``q[:, None] - k[None, :]`` is
``i - j``), a boolean tensor a formula over comparisons of such expressions, a length the graph's own symbol, a
constant tensor its value. :func:`replay` returns the mask as one formula in the index of its query and key dims,
for every sequence length at once; :mod:`.mask_bands` reads the keys it shows from it.

An op this module does not model makes its value opaque: a boolean of unknown value (each use its own unknown),
or, for any other value, nothing, which makes every value computed from it opaque too. Nothing is guessed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import sympy
import torch
import torch.fx

from ..graph.analysis import meta_val

aten = torch.ops.aten

OPAQUE = "cp_opaque_"
"""The name prefix of the boolean symbols that stand for values the replay does not model."""


@dataclass(frozen=True)
class Sym:
    """A symbolic tensor: its shape, the index symbol of each dim (None where the value does not vary along it)
    and its elements as one sympy expression in those symbols (an integer, or a boolean formula); ``floating``
    values are kept as ``(allowed, hidden)``: the formula where the value is ``allowed`` (0 in an additive
    mask) and the value elsewhere."""

    shape: tuple
    dims: tuple
    expr: object
    boolean: bool = False
    hidden: object = None


class _Opaque(Exception):
    """A value the reader does not model."""


_counter = itertools.count()


def _index() -> sympy.Symbol:
    """A fresh index symbol (of one dim of one value)."""
    return sympy.Symbol(f"cp_index_{next(_counter)}", integer=True, nonnegative=True)


def _unknown_bool() -> sympy.Symbol:
    """A fresh boolean nothing is known of."""
    return sympy.Symbol(f"{OPAQUE}{next(_counter)}")


def _size(value):
    if isinstance(value, torch.SymInt):
        return value.node.expr
    return sympy.Integer(value) if isinstance(value, int) else value


def constant(value, shape=()) -> Sym:
    """A tensor of ``shape`` holding ``value`` everywhere."""
    shape = tuple(_size(s) for s in shape)
    if isinstance(value, bool):
        return Sym(tuple(shape), (None,) * len(shape), sympy.true if value else sympy.false, boolean=True)
    return Sym(tuple(shape), (None,) * len(shape), sympy.sympify(value))


def _as_sym(value) -> Sym:
    if isinstance(value, Sym):
        return value
    if isinstance(value, (bool, int, float, sympy.Basic)):
        return constant(value)
    if isinstance(value, (torch.SymInt, torch.SymFloat)):
        return constant(value.node.expr)
    raise _Opaque(value)


def _broadcast(*values: Sym) -> tuple[tuple, tuple, list]:
    """The broadcast shape and dims of ``values``, and their expressions over one index symbol per broadcast dim
    (two ``arange`` along the same dim index the same element; one along dim 0 and one along dim 1, two)."""
    nd = max(len(v.shape) for v in values)
    shape = [sympy.Integer(1)] * nd
    for v in values:
        for d, size in enumerate(v.shape):
            if size != 1 and shape[d + nd - len(v.shape)] == 1:
                shape[d + nd - len(v.shape)] = size
    dims = [None] * nd
    exprs = []
    for v in values:
        mapping, pad = {}, nd - len(v.shape)
        for d, (size, index) in enumerate(zip(v.shape, v.dims)):
            if index is None:
                continue
            if size == 1:  # broadcast from one element: its index is 0
                mapping[index] = sympy.Integer(0)
                continue
            if dims[d + pad] is None:
                dims[d + pad] = _index()
            mapping[index] = dims[d + pad]
        exprs.append(substitute(_fresh_opaque(v.expr), mapping))
    return tuple(shape), tuple(dims), exprs


def _fresh_opaque(expr):
    """``expr`` with each opaque boolean renamed: every use of an unknown value is unknown on its own (the same
    opaque tensor read at two positions is two unknowns, never one that equals itself)."""
    if not isinstance(expr, sympy.Basic):
        return expr
    return expr.xreplace({s: _unknown_bool() for s in expr.free_symbols if s.name.startswith(OPAQUE)})


def positions(shape, dim: int) -> Sym:
    """Positions ``0..n-1`` along ``dim`` of a tensor of ``shape``, the same along every other dim."""
    index = _index()
    shape = tuple(_size(s) for s in shape)
    return Sym(shape, tuple(index if d == dim % len(shape) else None for d in range(len(shape))), index)


def substitute(expr, mapping):
    if isinstance(expr, tuple):
        return tuple(substitute(e, mapping) for e in expr)
    return expr.xreplace(mapping) if isinstance(expr, sympy.Basic) else expr


def _pointwise(fn, *args, boolean: bool = False) -> Sym:
    values = [_as_sym(a) for a in args]
    if any(v.hidden is not None for v in values):
        raise _Opaque("arithmetic on an additive mask")
    shape, dims, exprs = _broadcast(*values)
    return Sym(shape, dims, fn(*exprs), boolean=boolean)


def _compare(op):
    def compare(a, b):
        values = [_as_sym(a), _as_sym(b)]
        if any(v.boolean for v in values):
            if op not in (sympy.Eq, sympy.Ne):
                raise _Opaque("an order comparison of booleans")
            shape, dims, (x, y) = _broadcast(*values)
            same = sympy.Equivalent(x, y) if all(v.boolean for v in values) else _bool_equals(x, y)
            return Sym(shape, dims, same if op is sympy.Eq else sympy.Not(same), boolean=True)
        return _pointwise(lambda x, y: _relate(op, x, y), *values, boolean=True)
    return compare


def _bool_equals(x, y):
    """A boolean compared with a number: itself against 1, its negation against 0, else unknown."""
    flag, number = (x, y) if isinstance(x, sympy.logic.boolalg.Boolean) else (y, x)
    if number == 1:
        return flag
    return sympy.Not(flag) if number == 0 else _unknown_bool()


def _relate(op, x, y):
    """``op(x, y)`` kept as written (no rewriting by sympy), decided where both sides are numbers."""
    rel = op(x, y, evaluate=False)
    if not rel.free_symbols:
        return sympy.true if bool(op(x, y)) else sympy.false
    return rel


def _logic(op):
    def logic(a, b):
        values = [_as_sym(a), _as_sym(b)]
        if not all(v.boolean for v in values):
            raise _Opaque("bitwise arithmetic on integers")
        return _pointwise(op, *values, boolean=True)
    return logic


def _not(a):
    a = _as_sym(a)
    if not a.boolean:
        raise _Opaque("bitwise not of an integer")
    return Sym(a.shape, a.dims, sympy.Not(a.expr), boolean=True)


def _floordiv(a, b):
    return _pointwise(lambda x, y: sympy.floor(x / y), a, b)


def _div(a, b, rounding_mode=None):
    if rounding_mode != "floor":
        raise _Opaque("a division that is not floor division")
    return _floordiv(a, b)


def _arange(*args, **kwargs):
    dtype = kwargs.get("dtype")
    if dtype is not None and dtype.is_floating_point:
        raise _Opaque("a floating-point arange")
    start, end, step = (0, args[0], 1) if len(args) == 1 else (args[0], args[1], args[2] if len(args) > 2 else 1)
    start, end, step = (_size(x) for x in (start, end, step))
    if not (isinstance(step, sympy.Integer) and step > 0):
        raise _Opaque("an arange without a positive constant step")
    index = _index()
    return Sym((sympy.ceiling((end - start) / step),), (index,), start + step * index)


def _factory(value):
    def make(size, *args, **kwargs):
        dtype = kwargs.get("dtype")
        fill = value if value is not None else args[0]
        return constant(bool(fill) if dtype is torch.bool else fill, [_size(s) for s in size])
    return make


def _full_like(value):
    def make(x, *args, **kwargs):
        x = _as_sym(x) if not isinstance(x, Sym) else x
        dtype = kwargs.get("dtype")
        fill = value if value is not None else args[0]
        boolean = dtype is torch.bool or (dtype is None and x.boolean)
        return constant(bool(fill) if boolean else fill, x.shape)
    return make


def _new_factory(value):
    def make(x, size, *args, **kwargs):
        dtype = kwargs.get("dtype")
        fill = value if value is not None else args[0]
        boolean = dtype is torch.bool or (dtype is None and x.boolean)
        return constant(bool(fill) if boolean else fill, [_size(s) for s in size])
    return make


def _same(x, *args, **kwargs):
    x = _as_sym(x)
    dtype = kwargs.get("dtype", args[0] if args and isinstance(args[0], torch.dtype) else None)
    if dtype is torch.bool and not x.boolean:
        return Sym(x.shape, x.dims, _relate(sympy.Ne, x.expr, 0), boolean=True)
    if dtype is not None and dtype.is_floating_point and x.boolean:
        raise _Opaque("a boolean cast to floating point")
    return x


def _unsqueeze(x, dim):
    x = _as_sym(x)
    dim = dim % (len(x.shape) + 1)
    return Sym(x.shape[:dim] + (sympy.Integer(1),) + x.shape[dim:], x.dims[:dim] + (None,) + x.dims[dim:], x.expr,
               x.boolean, x.hidden)


def _squeeze(x, dims=None):
    x = _as_sym(x)
    dims = range(len(x.shape)) if dims is None else [dims] if isinstance(dims, int) else dims
    drop = {d % len(x.shape) for d in dims if x.shape[d % len(x.shape)] == 1}
    keep = [d for d in range(len(x.shape)) if d not in drop]
    return Sym(tuple(x.shape[d] for d in keep), tuple(x.dims[d] for d in keep), x.expr, x.boolean, x.hidden)


def _expand(x, size, implicit=False):
    x = _as_sym(x)
    pad = len(size) - len(x.shape)
    shape = [_size(s) for s in size]
    dims = [None] * pad + list(x.dims)
    for d, s in enumerate(size):
        if isinstance(s, int) and s == -1:
            shape[d] = x.shape[d - pad]
    return Sym(tuple(shape), tuple(dims), x.expr, x.boolean, x.hidden)


def _view(x, size):
    """A view that only adds or drops dims of size 1 (anything else regroups elements: opaque)."""
    x = _as_sym(x)
    shape = [_size(s) for s in size]
    if any(s == -1 for s in shape):
        known = [s for s in shape if s != -1]
        if len(known) + 1 != len(shape):
            raise _Opaque("a view with several -1")
        rest = sympy.Mul(*[s for s in x.shape]) / sympy.Mul(*known)
        shape = [rest if s == -1 else s for s in shape]
    old = [(s, d) for s, d in zip(x.shape, x.dims) if s != 1]
    new = [s for s in shape if s != 1]
    if [s for s, _ in old] != new:
        raise _Opaque("a view that regroups elements")
    it = iter(d for _, d in old)
    dims = tuple(next(it) if s != 1 else None for s in shape)
    return Sym(tuple(shape), dims, x.expr, x.boolean, x.hidden)


def _slice(x, dim=0, start=None, end=None, step=1):
    x = _as_sym(x)
    dim = dim % len(x.shape)
    size = x.shape[dim]
    start = 0 if start is None else _size(start)
    end = size if end is None or (isinstance(end, int) and end >= 2 ** 62) else _size(end)
    if start == 0 and end == size and step == 1:
        return x
    if not (isinstance(start, (int, sympy.Integer)) and step == 1) or start < 0:
        raise _Opaque("a slice with a negative or symbolic start")
    index = x.dims[dim]
    length = sympy.Min(end, size) - start
    if index is None:
        return Sym(x.shape[:dim] + (length,) + x.shape[dim + 1:], x.dims, x.expr, x.boolean, x.hidden)
    fresh = _index()
    return Sym(x.shape[:dim] + (length,) + x.shape[dim + 1:], x.dims[:dim] + (fresh,) + x.dims[dim + 1:],
               substitute(x.expr, {index: fresh + start}), x.boolean,
               substitute(x.hidden, {index: fresh + start}))


def _select(x, dim, index):
    x = _as_sym(x)
    dim = dim % len(x.shape)
    var = x.dims[dim]
    index = _size(index)
    if var is not None:
        if index < 0:
            index = x.shape[dim] + index
        x = Sym(x.shape, x.dims, substitute(x.expr, {var: index}), x.boolean, substitute(x.hidden, {var: index}))
    return Sym(x.shape[:dim] + x.shape[dim + 1:], x.dims[:dim] + x.dims[dim + 1:], x.expr, x.boolean, x.hidden)


def _index_tensor(x, indices):
    """Advanced indexing by tensors of the leading dims: the value at each indexed dim's symbol replaced by the
    index's expression (a position table looked up at positions, a constant looked up anywhere)."""
    x = _as_sym(x)
    given = [(d, _as_sym(i)) for d, i in enumerate(indices) if i is not None]
    if any(i.boolean for _, i in given):
        raise _Opaque("indexing by a boolean mask")
    shape, dims, exprs = _broadcast(*(i for _, i in given))
    mapping = {x.dims[d]: e for (d, _), e in zip(given, exprs) if x.dims[d] is not None}
    rest = [d for d in range(len(x.shape)) if d not in {d for d, _ in given}]
    positions = [d for d, _ in given]
    adjacent = positions == list(range(positions[0], positions[0] + len(positions)))
    kept = [(x.shape[d], x.dims[d]) for d in rest]
    if adjacent:
        before = [(x.shape[d], x.dims[d]) for d in rest if d < positions[0]]
        after = [(x.shape[d], x.dims[d]) for d in rest if d > positions[0]]
        parts = before + list(zip(shape, dims)) + after
    else:
        parts = list(zip(shape, dims)) + kept
    return Sym(tuple(s for s, _ in parts), tuple(d for _, d in parts), substitute(x.expr, mapping), x.boolean,
               substitute(x.hidden, mapping))


def _where(cond, a, b):
    cond, a, b = _as_sym(cond), _as_sym(a), _as_sym(b)
    if not cond.boolean:
        raise _Opaque("where on a non-boolean condition")
    if a.boolean and b.boolean:
        shape, dims, (c, x, y) = _broadcast(cond, a, b)
        return Sym(shape, dims, sympy.Or(sympy.And(c, x), sympy.And(sympy.Not(c), y)), boolean=True)
    shape, dims, (c, x, y) = _broadcast(cond, a, b)
    if x.is_zero and y.is_number and bool(y < -1e30):
        return Sym(shape, dims, c, boolean=False, hidden=y)
    if y.is_zero and x.is_number and bool(x < -1e30):
        return Sym(shape, dims, sympy.Not(c), boolean=False, hidden=x)
    raise _Opaque("a where that is not an additive mask of 0 and a large negative value")


def _cumsum(x, dim, **kwargs):
    x = _as_sym(x)
    dim = dim % len(x.shape)
    if x.boolean:
        if x.expr == sympy.false:
            return Sym(x.shape, x.dims, sympy.Integer(0))
        raise _Opaque("a cumulative sum of a boolean that varies")
    if x.expr.free_symbols & set(d for d in x.dims if d is not None):
        raise _Opaque("a cumulative sum of a value that varies")
    index = x.dims[dim] or _index()
    dims = x.dims[:dim] + (index,) + x.dims[dim + 1:]
    return Sym(x.shape, dims, x.expr * (index + 1))


def _sum(x, dims=None, keepdim=False, **kwargs):
    x = _as_sym(x)
    nd = len(x.shape)
    dims = list(range(nd)) if dims is None or dims == [] else [dims] if isinstance(dims, int) else list(dims)
    dims = sorted(d % nd for d in dims)
    value = x.expr
    if x.boolean:
        if value not in (sympy.true, sympy.false):
            raise _Opaque("a count of a boolean that varies")
        value = sympy.Integer(1 if value == sympy.true else 0)
    if value.free_symbols & {x.dims[d] for d in dims if x.dims[d] is not None}:
        raise _Opaque("a sum of a value that varies along the summed dims")
    count = sympy.Mul(*[x.shape[d] for d in dims])
    shape = [sympy.Integer(1) if d in dims else s for d, s in enumerate(x.shape)]
    out_dims = [None if d in dims else i for d, i in enumerate(x.dims)]
    if not keepdim:
        shape = [s for d, s in enumerate(shape) if d not in dims]
        out_dims = [i for d, i in enumerate(out_dims) if d not in dims]
    return Sym(tuple(shape), tuple(out_dims), value * count)


def _diff(x, n=1, dim=-1, prepend=None, append=None):
    """Differences along ``dim`` of a value affine in that dim's index: its slope everywhere (the first element
    against ``prepend`` too, where that continues the line)."""
    x = _as_sym(x)
    dim = dim % len(x.shape)
    index = x.dims[dim]
    if n != 1 or append is not None or index is None:
        raise _Opaque("a diff that is not one step along an indexed dim")
    slope = sympy.expand(x.expr.subs(index, index + 1) - x.expr)
    if slope.free_symbols & {d for d in x.dims if d is not None}:
        raise _Opaque("a diff of a value that is not affine in its index")
    if prepend is None:
        shape = x.shape[:dim] + (x.shape[dim] - 1,) + x.shape[dim + 1:]
        return Sym(shape, x.dims[:dim] + (None,) + x.dims[dim + 1:], slope)
    _, _, (head, before) = _broadcast(_select(x, dim, 0), _select(_as_sym(prepend), dim, 0))
    if sympy.expand(head - before - slope) != 0:
        raise _Opaque("a diff whose prepended value does not continue the line")
    return Sym(x.shape, tuple(None if d == index else d for d in x.dims), slope)


def _abs(x):
    return _pointwise(sympy.Abs, x)


def _cat(values, dim=0):
    """Pieces along ``dim`` that continue one line (``torch.diff``'s prepended row, decomposed): that line; any
    other concatenation is opaque."""
    values = [_as_sym(v) for v in values]
    nd = len(values[0].shape)
    dim = dim % nd
    if len(values) == 1:
        return values[0]
    if any(len(v.shape) != nd or v.hidden is not None or v.boolean for v in values):
        raise _Opaque("a concatenation of masks")
    index, offsets, at = _index(), [], sympy.Integer(0)
    for v in values:
        offsets.append(at)
        at = at + v.shape[dim]
    last, start = values[-1], offsets[-1]
    line = substitute(last.expr, {last.dims[dim]: index - start}) if last.dims[dim] is not None else last.expr
    for v, offset in zip(values, offsets):
        if v.dims[:dim] + v.dims[dim + 1:] != last.dims[:dim] + last.dims[dim + 1:]:
            raise _Opaque("a concatenation of pieces indexed differently")
        local = v.dims[dim] if v.dims[dim] is not None else _index()
        if sympy.expand(substitute(line, {index: local + offset}) - v.expr) != 0 and (  # one row: at its offset
                v.shape[dim] != 1 or sympy.expand(substitute(line, {index: offset}) - v.expr) != 0):
            raise _Opaque("a concatenation whose pieces do not continue one line")
    dims = last.dims[:dim] + (index,) + last.dims[dim + 1:]
    return Sym(last.shape[:dim] + (at,) + last.shape[dim + 1:], dims, line)


OPS = {
    aten.arange.default: _arange, aten.arange.start: _arange, aten.arange.start_step: _arange,
    aten.add.Tensor: lambda a, b, alpha=1: _pointwise(lambda x, y: x + alpha * y, a, b),
    aten.add.Scalar: lambda a, b, alpha=1: _pointwise(lambda x, y: x + alpha * y, a, b),
    aten.sub.Tensor: lambda a, b, alpha=1: _pointwise(lambda x, y: x - alpha * y, a, b),
    aten.sub.Scalar: lambda a, b, alpha=1: _pointwise(lambda x, y: x - alpha * y, a, b),
    aten.rsub.Scalar: lambda a, b, alpha=1: _pointwise(lambda x, y: y - alpha * x, a, b),
    aten.neg.default: lambda a: _pointwise(lambda x: -x, a),
    aten.mul.Tensor: lambda a, b: _pointwise(lambda x, y: x * y, a, b),
    aten.abs.default: _abs,
    aten.floor_divide.default: _floordiv, aten.div.Tensor_mode: _div, aten.div.Scalar_mode: _div,
    aten.lt.Tensor: _compare(sympy.Lt), aten.lt.Scalar: _compare(sympy.Lt),
    aten.le.Tensor: _compare(sympy.Le), aten.le.Scalar: _compare(sympy.Le),
    aten.gt.Tensor: _compare(sympy.Gt), aten.gt.Scalar: _compare(sympy.Gt),
    aten.ge.Tensor: _compare(sympy.Ge), aten.ge.Scalar: _compare(sympy.Ge),
    aten.eq.Tensor: _compare(sympy.Eq), aten.eq.Scalar: _compare(sympy.Eq),
    aten.ne.Tensor: _compare(sympy.Ne), aten.ne.Scalar: _compare(sympy.Ne),
    aten.bitwise_and.Tensor: _logic(sympy.And), aten.__and__.Tensor: _logic(sympy.And),
    aten.logical_and.default: _logic(sympy.And), aten.bitwise_or.Tensor: _logic(sympy.Or),
    aten.__or__.Tensor: _logic(sympy.Or), aten.logical_or.default: _logic(sympy.Or),
    aten.bitwise_not.default: _not, aten.logical_not.default: _not,
    aten.where.self: _where, aten.where.ScalarOther: _where, aten.where.ScalarSelf: _where,
    aten.where.Scalar: _where,
    aten.ones.default: _factory(1), aten.zeros.default: _factory(0), aten.full.default: _factory(None),
    aten.ones_like.default: _full_like(1), aten.zeros_like.default: _full_like(0),
    aten.full_like.default: _full_like(None),
    aten.new_ones.default: _new_factory(1), aten.new_zeros.default: _new_factory(0),
    aten.new_full.default: _new_factory(None),
    aten.scalar_tensor.default: lambda value, **kwargs: constant(bool(value) if kwargs.get("dtype") is torch.bool
                                                               else value),
    aten._to_copy.default: _same, aten.to.dtype: _same, aten.to.dtype_layout: _same, aten.clone.default: _same,
    aten.to.device: lambda x, device=None, dtype=None, *args, **kwargs: _same(x, dtype=dtype),
    aten.alias.default: _same, aten.detach.default: _same, aten.lift_fresh_copy.default: _same,
    aten.contiguous.default: _same,
    aten.unsqueeze.default: _unsqueeze, aten.squeeze.dim: _squeeze, aten.squeeze.dims: _squeeze,
    aten.squeeze.default: _squeeze,
    aten.expand.default: _expand, aten.view.default: _view, aten.reshape.default: _view,
    aten._unsafe_view.default: _view, aten.slice.Tensor: _slice, aten.select.int: _select,
    aten.index.Tensor: _index_tensor, aten.diff.default: _diff, aten.cumsum.default: _cumsum,
    aten.sum.dim_IntList: _sum, aten.sum.default: _sum, aten.cat.default: _cat,
}
"""The ops the replay models, by ATen overload; any other makes its value opaque."""


def _run(node: torch.fx.Node, env: dict):
    """``node``'s op on the symbolic values of its inputs (placement keywords dropped: a formula is nowhere)."""
    fn = OPS.get(node.target)
    if fn is None:
        raise _Opaque(node.target)

    def value(a):
        if isinstance(a, torch.fx.Node):
            return env[a]
        return a
    args, kwargs = torch.fx.map_arg((node.args, node.kwargs), value)
    kwargs = {k: v for k, v in kwargs.items() if k not in ("device", "layout", "pin_memory", "memory_format",
                                                           "non_blocking")}
    return fn(*args, **kwargs)


def replay(mask: torch.fx.Node, leaves: dict) -> Sym | None:
    """The symbolic value of ``mask``: the nodes it is computed from replayed in graph order, from ``leaves``
    (node -> :class:`Sym`, a number, or None for a value not modelled), lengths as their symbolic sizes. None
    where the mask is opaque as a whole."""
    env, order, stack = dict(leaves), [], [mask]
    while stack:
        n = stack.pop()
        if n in env or n in order:
            continue
        val = meta_val(n)
        if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            env[n] = val.node.expr
            continue
        if isinstance(val, (int, float, bool)):
            env[n] = val
            continue
        order.append(n)
        stack.extend(n.all_input_nodes)
    position = {n: i for i, n in enumerate(mask.graph.nodes)}
    for n in sorted(order, key=position.__getitem__):
        try:
            env[n] = _run(n, env)
        except (_Opaque, KeyError, TypeError, IndexError, ValueError, AttributeError):
            # an op outside the model, or arguments its model does not take (a symbolic slice start, a view
            # that regroups): the value is unknown, which only ever widens what the mask may show
            env[n] = _opaque_value(meta_val(n))
    result = env.get(mask)
    return result if isinstance(result, Sym) else None


def _opaque_value(val) -> Sym | None:
    """An opaque boolean tensor keeps its shape (its keys unknown); any other opaque value poisons its users."""
    if isinstance(val, torch.Tensor) and val.dtype == torch.bool:
        shape = tuple(_size(s) for s in val.shape)
        return Sym(shape, (None,) * len(shape), _unknown_bool(), boolean=True)
    return None
